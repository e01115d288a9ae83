"""For the same batch, how far apart are the updates of different learner layouts, in `token` mode
and in the per-micro-batch mode? Run it on your own cluster to check a setup.

    python benchmarks/bench_layout_invariance.py [--zero-stages 0 2 3] [--sequences 8] [--model PATH]

Each layout is (learners, micro-batch size); the first is the reference. One SGD step, no clipping.
"""

from __future__ import annotations

import argparse

from common import model_folder, start_ray, table

from rltrain.diagnostics import (
    layout_config,
    relative_difference,
    synthetic_rollouts,
    update_after_one_step,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--zero-stages", type=int, nargs="+", default=[0, 2, 3])
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=["1x2", "2x2", "2x3", "2x1"],
        help="learners x micro_batch_size; the first is the reference",
    )
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--model", default=None, help="model folder (default: the built-in tiny model)")
    args = parser.parse_args()
    start_ray()
    path = model_folder(args.model)
    batch = synthetic_rollouts(n=args.sequences)
    layouts = [tuple(int(x) for x in spec.split("x")) for spec in args.layouts]
    rows = []
    for stage in args.zero_stages:
        for mode in ["token", None]:
            updates = [
                update_after_one_step(layout_config(n, m, stage, mode), path, batch) for n, m in layouts
            ]
            for (n, m), update in zip(layouts[1:], updates[1:]):
                diff = relative_difference(update, updates[0])
                rows.append(
                    [stage, f"{n} learners x mb {m}", "token" if mode else "per-micro-batch", f"{diff:.2e}"]
                )
    ref = f"{layouts[0][0]} learners x mb {layouts[0][1]}"
    print(f"relative update difference vs {ref}, {args.sequences} sequences, one SGD step")
    print(table(["ZeRO", "layout", "masked_mean_denominator", "||dW - dW_ref|| / ||dW_ref||"], rows))


if __name__ == "__main__":
    main()
