"""The mixture-of-experts demo (configs/cpu_moe.yaml) with the load-balancing loss over the whole
step, per micro-batch, and off, and at step scope with routing replay, one run each on the same
seed, one after another.

    python benchmarks/bench_moe.py [--seed 0] [--plot docs/moe_curves.png] [overrides ...]

It reports held-out accuracy after the warm start and at the end, the largest engine-learner
log-prob gap of the run (``rollout/mismatch_max``: the weight sync into vLLM's experts), the busiest
expert's share over an even share (``moe/expert_load_max``, the worst layer) at the first and last
steps, the router's entropy at the last step, the load-balancing loss, the learners' and the
generation's seconds a step (the step scope's count forward included), and with replay the share
of (token, layer) pairs the learner's own router would have sent elsewhere
(``moe/routing_mismatch``, mean and largest over the steps) and the routes' bytes a step.
``--plot`` draws held-out accuracy, ``moe/expert_load_max`` and ``moe/routing_mismatch`` over the
steps of every variant.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import table

from rltrain.run.tracking import held_out_score

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {
    "step": ["loss.moe_aux_scope=step"],
    "micro_batch": ["loss.moe_aux_scope=micro_batch"],
    "off": ["loss.moe_aux_coef=0"],
    "step+replay": ["loss.moe_aux_scope=step", "rollout.routing_replay=true"],
}


def run(variant: str, seed: int, overrides: list[str], out: Path) -> list[dict]:
    subprocess.run(
        [sys.executable, "-m", "rltrain.train", "--config", "configs/cpu_moe.yaml", f"run.seed={seed}",
         f"run.output_dir={out}", *VARIANTS[variant], *overrides],
        cwd=REPO, check=True, capture_output=True,
    )  # fmt: skip
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def score(row: dict) -> float:
    return row[held_out_score(row)]


def summary(variant: str, rows: list[dict]) -> list[object]:
    evals = [r for r in rows if held_out_score(r) is not None]
    steps = [r for r in rows if "moe/expert_load_max" in r]

    def mean(key: str) -> float:
        return sum(r[key] for r in steps) / len(steps)

    replay = "moe/routing_mismatch" in steps[0]
    routing = (f"{mean('moe/routing_mismatch'):.2%} / {max(r['moe/routing_mismatch'] for r in steps):.2%}"
               if replay else "-")  # fmt: skip
    return [variant, f"{score(evals[0]):.1%}", f"{score(evals[-1]):.1%}",
            f"{max(r['rollout/mismatch_max'] for r in steps):.1e}", f"{steps[0]['moe/expert_load_max']:.2f}",
            f"{steps[-1]['moe/expert_load_max']:.2f}", f"{steps[-1]['moe/router_entropy']:.3f}",
            f"{steps[-1].get('moe/aux_loss', float('nan')):.4f}", f"{mean('time/train_s'):.2f}",
            f"{mean('time/generate_s'):.2f}", routing,
            f"{mean('perf/routes_bytes') / 1024:.0f}" if replay else "-"]  # fmt: skip


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, load, routing) = plt.subplots(1, 3, figsize=(15, 3.5))
    for variant, rows in runs.items():
        evals = [r for r in rows if held_out_score(r) is not None]
        acc.plot([r["step"] for r in evals], [score(r) for r in evals], marker="o", label=variant)
        steps = [r for r in rows if "moe/expert_load_max" in r]
        load.plot([r["step"] for r in steps], [r["moe/expert_load_max"] for r in steps], label=variant)
        if "moe/routing_mismatch" in steps[0]:
            routing.plot(
                [r["step"] for r in steps], [r["moe/routing_mismatch"] for r in steps], label=variant
            )
            routing.plot([r["step"] for r in steps], [r["rollout/mismatch_max"] for r in steps],
                         linestyle="--", label=f"{variant}: rollout/mismatch_max")  # fmt: skip
    acc.set(title="held-out accuracy", xlabel="step")
    load.set(title="busiest expert's share / even share (worst layer)", xlabel="step")
    routing.set(title="replay: routes the learner would change", xlabel="step")
    for ax in (acc, load, routing):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--plot", type=Path)
    args, overrides = parser.parse_known_args()
    runs = {}
    with tempfile.TemporaryDirectory() as scratch:
        for variant in args.variants:
            runs[variant] = run(variant, args.seed, overrides, Path(scratch) / variant)
            print(summary(variant, runs[variant]), flush=True)
    print(table(["aux loss", "held-out after warm start", "held-out at end", "mismatch max",
                 "expert load max, first", "expert load max, last", "router entropy, last", "aux loss, last",
                 "train s / step", "generate s / step", "routing mismatch, mean / max", "routes KiB / step"],
                [summary(v, rows) for v, rows in runs.items()]))  # fmt: skip
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
