"""The demo over several seeds: held-out accuracy (with an environment: success) and tool-call rate
before RL (after the warm start) and at the end, the best held-out figure of the run, the rollouts'
seconds a step, the warm-up's and the whole run's wall time, per seed and on average; with a critic
(PPO with GAE) also its explained variances over the last ten steps (over the tokens, and at the
question: what it makes of each question before a token is sampled).

    python benchmarks/bench_demo.py [overrides ...] [--seeds 0 1 2] [--config configs/cpu_demo.yaml ...]

Several configs (``--config configs/cpu_demo.yaml configs/cpu_ppo.yaml``: GRPO against PPO with the
same warm start, reward and generation budget) run seed by seed, one after another, in one table;
so do variants of each, named sets of overrides (``--variant full: --variant "lora r32:model.lora.rank=32
learner.lr=3e-3"``: full fine-tuning against LoRA on the same seeds).

Each seed is one `python -m rltrain.train --config configs/cpu_demo.yaml run.seed=S` run, as
`make demo` starts it: the seed changes the model's initialization, the warm-up examples' order and
every sampled completion; the held-out questions are the same for all seeds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from common import mean_of, scratch, table
from critic_variance import QUESTION

from rltrain.run.tracking import held_out_score

REPO = Path(__file__).resolve().parents[1]


def run_demo(config: str, seed: int, overrides: list[str], out: Path) -> dict[str, float]:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "rltrain.train", "--config", config, f"run.seed={seed}",
         f"run.output_dir={out}", *overrides],
        cwd=REPO, check=True, capture_output=True,
    )  # fmt: skip
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if held_out_score(r)]
    score = held_out_score(evals[0])  # accuracy, or an environment's success
    steps = [r for r in rows if "reward/mean" in r]  # training steps (the step-0 row is evaluation only)
    first, last = evals[0], evals[-1]
    done = out / "sft_model" / "rltrain_sft.json"  # (none when the run starts from a warm model)
    warm_up = json.loads(done.read_text())["seconds"] if done.exists() else 0.0
    explained = [r["critic/explained_variance"] for r in steps if "critic/explained_variance" in r]
    question = [r[QUESTION] for r in steps if QUESTION in r]
    return {
        "accuracy before": first[score],
        "accuracy after": last[score],
        "best after": max(r[score] for r in evals[1:]),
        "tool calls before": first["eval/tool_call_rate"],
        "tool calls after": last["eval/tool_call_rate"],
        "reward first 5 steps": sum(r["reward/mean"] for r in steps[:5]) / 5,
        "reward last 5 steps": sum(r["reward/mean"] for r in steps[-5:]) / 5,
        "generate s a step": sum(r["time/generate_s"] for r in steps) / len(steps),
        "warm-up s": warm_up,
        "run s": wall,
        "critic EV, last 10 steps": mean_of(explained[-10:]),
        "critic EV at the question, last 10 steps": mean_of(question[-10:]),
    }


def shown(key: str, value: float) -> str:
    if "before" in key or "after" in key:
        return f"{value:.1%}"
    if "EV" in key:
        return "-" if value != value else f"{value:.3f}"  # NaN: no critic
    return f"{value:.2f}" if "reward" in key or "a step" in key else f"{value:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--config", nargs="+", default=["configs/cpu_demo.yaml"])
    parser.add_argument(
        "--variant", action="append", default=[], metavar="NAME:OVERRIDES",
        help="a named set of overrides (space-separated) run on every config and seed; repeatable",
    )  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="dotted config overrides for every run")
    args = parser.parse_args()
    if misplaced := [c for c in args.config if "=" in c]:  # --config takes every word after it
        parser.error(f"{' '.join(misplaced)}: an override after --config; put overrides before it")
    variants = [v.split(":", 1) for v in args.variant] or [["", ""]]
    tmp = scratch("bench-demo-")
    rows = []
    for config in args.config:
        for variant, extra in variants:
            name = " ".join(filter(None, [Path(config).stem, variant]))
            results = {}
            for seed in args.seeds:
                folder = tmp / f"{name.replace(' ', '-')}-seed{seed}"
                results[seed] = run_demo(config, seed, [*args.overrides, *extra.split()], folder)
                print(f"done: {name} seed {seed}", file=sys.stderr, flush=True)
            keys = list(next(iter(results.values())))
            mean = {k: sum(r[k] for r in results.values()) / len(results) for k in keys}
            rows += [[f"{name} seed {s}", *(shown(k, r[k]) for k in keys)] for s, r in results.items()]
            rows.append([f"{name} mean", *(shown(k, mean[k]) for k in keys)])
    print(
        f"{' vs '.join(args.config)} {' '.join(args.overrides)}; held-out: greedy (accuracy, or an environment's success)"
    )
    print(table(["run", *keys], rows))


if __name__ == "__main__":
    main()
