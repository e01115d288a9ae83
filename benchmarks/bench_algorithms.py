"""The policy losses and prompt sampling on the demo: PPO's ratio clip (the demo's loss), DPPO with
its Binary-TV and Binary-KL masks, and PPO with difficulty sampling, each over the same seeds, with
the demo's warm start, reward, generation budget and evaluation. Prints held-out accuracy after the
warm start, at the end and its best, the steps and RL seconds until it first reached 90%, the share of
tokens the trust region took out of the gradient, and the RL time; plots held-out accuracy against
the seconds since RL began (the step-0 evaluation).

    python benchmarks/bench_algorithms.py [--seeds 0 1 2] [--out docs/algorithms_demo.png] [overrides ...]

Each run is `python -m rltrain.train --config configs/cpu_demo.yaml run.seed=S learner.num_mini_batches=4
<the variant's keys>`, one after another; a seed's first variant warms up as the demo does and the
others start from that warm start (`model.name_or_path=<its sft_model/>`, `sft_warmup.steps=0`), so
every variant of a seed starts from the same model. Four optimizer steps a batch (PPO's usual setting) let the
losses differ: with the demo's one step a batch the policy is exactly the one that sampled when the
gradient is taken (the ratio is 1 up to the engine's rounding), and the clip and DPPO's mask never act.
A held-out point's time is when its row was logged (the tensorboard event's time) less the step-0
evaluation's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import scratch, table

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/cpu_demo.yaml"
VARIANTS = {
    "ppo clip": [],
    "dppo tv": ["loss.kind=dppo", "loss.dppo_divergence=tv"],
    "dppo kl": ["loss.kind=dppo", "loss.dppo_divergence=kl"],
    "ppo + difficulty sampling": ["data.difficulty_sampling={}"],
}
TARGET = 0.9
COMMON = ["learner.num_mini_batches=4"]  # four optimizer steps a batch: the trust regions act


def held_out_curve(out: Path) -> list[tuple[int, float, float]]:
    """(step, seconds since the step-0 evaluation, held-out accuracy) of every evaluation."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    scalars = events.Scalars("eval/accuracy")
    return [(e.step, e.wall_time - scalars[0].wall_time, e.value) for e in scalars]


def run(variant: list[str], seed: int, overrides: list[str], out: Path, warm: Path | None) -> dict:
    start_from = [f"model.name_or_path={warm}", "sft_warmup.steps=0"] if warm else []
    subprocess.run(
        [sys.executable, "-m", "rltrain.train", "--config", CONFIG, f"run.seed={seed}", f"run.output_dir={out}",
         *COMMON, *overrides, *variant, *start_from],
        cwd=REPO, check=True, capture_output=True,
    )  # fmt: skip
    curve = held_out_curve(out)
    reached = next(((step, s) for step, s, acc in curve if acc >= TARGET), (None, None))
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "train/clip_fraction" in r]
    # the share of tokens the trust region took out of the gradient: PPO's clip, or DPPO's mask
    masked = [r.get("loss/dppo_masked_low", 0) + r.get("loss/dppo_masked_high", 0) if "loss/dppo_masked_low" in r
              else r["train/clip_fraction"] for r in steps]  # fmt: skip
    return {
        "masked": sum(masked) / len(masked),
        "curve": curve,
        "before": curve[0][2],
        "after": curve[-1][2],
        "best": max(acc for _, _, acc in curve[1:]),
        "step at 90%": reached[0],
        "s at 90%": reached[1],
        "RL s": curve[-1][1],
    }


def plot(results: dict[str, dict[int, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = dict(zip(results, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for name, seeds in results.items():
        for i, r in enumerate(seeds.values()):
            seconds, accuracy = [s for _, s, _ in r["curve"]], [a for _, _, a in r["curve"]]
            ax.plot(seconds, accuracy, color=colors[name], alpha=0.8, marker=".",
                    label=name if i == 0 else None)  # fmt: skip
    ax.axhline(TARGET, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("seconds since RL began (the step-0 evaluation after the warm start)")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title(
        f"{CONFIG} with {' '.join(COMMON)}, seeds {', '.join(map(str, next(iter(results.values()))))}"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--out", default="algorithms_demo.png", help="the plot")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides for every run")
    args = parser.parse_args()
    tmp = scratch("bench-algorithms-")
    results: dict[str, dict[int, dict]] = {name: {} for name in args.variants}
    for seed in args.seeds:
        warm = None  # the seed's first variant warms up; the others start from its warm start
        for name in args.variants:
            folder = tmp / f"{name.replace(' ', '-')}-seed{seed}"
            results[name][seed] = run(VARIANTS[name], seed, args.overrides, folder, warm)
            warm = warm or folder / "sft_model"
            print(f"done: {name} seed {seed}", file=sys.stderr, flush=True)
    rows = [
        [name, seed, f"{r['before']:.1%}", f"{r['after']:.1%}", f"{r['best']:.1%}",
         "-" if r["step at 90%"] is None else r["step at 90%"],
         "-" if r["s at 90%"] is None else f"{r['s at 90%']:.0f}", f"{r['masked']:.2%}", f"{r['RL s']:.0f}"]
        for name, seeds in results.items() for seed, r in seeds.items()
    ]  # fmt: skip
    print(
        f"{CONFIG} {' '.join([*COMMON, *args.overrides])}; held-out accuracy (greedy), 90% = the demo's goal"
    )
    header = ["variant", "seed", "warm start", "end", "best", "step at 90%", "RL s at 90%",
              "tokens clipped or masked", "RL s"]  # fmt: skip
    print(table(header, rows))
    plot(results, Path(args.out))
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
