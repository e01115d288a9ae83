"""Synchronous against asynchronous training (bounded staleness, in-flight weight updates), end to
end: tokens per second, how much of the time the learners and the engine sat idle, the staleness
of what was trained on, and the reward reached. Every setting runs in this one invocation, one
after the other, on the same machine.

    python benchmarks/bench_async.py [--steps 6] [--prompts 8] [--group 8] [--max-new-tokens 384]

The model is the built-in Qwen2-shaped one at hidden 256 x 4 layers (~2.3M parameters), randomly
initialised: it ends a completion when it happens to sample its end token, so completion lengths
spread geometrically with a long tail up to the limit, like reasoning rollouts (the table prints the
spread). The layout is the CPU demo's (2 DeepSpeed learners + 1 vLLM engine on Ray) with the dense
"digits" reward. The first step of each run (warm-up) is left out of the figures.

Idle shares: a learner is idle for the part of a step it does not spend in its update
(``perf/learner_busy_share``); the engine is idle for the part it does not spend generating
(``perf/engine_busy_share``).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from common import model_folder, run_trainer, scratch, table

SETTINGS = {
    "synchronous": [],
    "staleness 1": ["rollout.max_staleness=1"],
    "staleness 1, in-flight": ["rollout.max_staleness=1", "rollout.inflight_updates=true"],
    "staleness 2": ["rollout.max_staleness=2"],
    "staleness 2, in-flight": ["rollout.max_staleness=2", "rollout.inflight_updates=true"],
}


def run(model: str, overrides: list[str], args, out: Path) -> list[dict]:
    return run_trainer(out, [
        f"model.name_or_path={model}",
        f"algorithm.prompts_per_step={args.prompts}",
        f"algorithm.group_size={args.group}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"rollout.max_model_len={args.max_new_tokens + 128}",
        f"rollout.inflight_chunk_tokens={args.chunk}",
        f"run.steps={args.steps}",
        *overrides,
    ])  # fmt: skip


def figures(rows: list[dict]) -> dict[str, float]:
    timed = rows[1:]  # the first step warms up
    seconds = sum(r["time/step_s"] for r in timed)
    tokens = sum(r["rollout/length_mean"] * r["train/sequences"] for r in timed)

    def share(key: str) -> float:  # time-weighted over the timed steps
        return sum(r[key] * r["time/step_s"] for r in timed) / seconds

    return {
        "tokens/s": tokens / seconds,
        "learner idle": 1 - share("perf/learner_busy_share"),
        "engine idle": 1 - share("perf/engine_busy_share"),
        "staleness": statistics.mean(r["rollout/staleness_mean"] for r in timed),
        "dropped": sum(r["rollout/stale_dropped"] for r in rows),
        "reward": statistics.mean(r["reward/mean"] for r in rows[-2:]),
        "length": statistics.mean(r["rollout/length_mean"] for r in timed),
        "truncated": statistics.mean(r["rollout/truncated_fraction"] for r in timed),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--chunk", type=int, default=16, help="rollout.inflight_chunk_tokens")
    parser.add_argument("--model", default=None)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    args = parser.parse_args()
    model = model_folder(args.model, hidden_size=256, num_layers=4)
    folder = scratch("rltrain-bench-async-")
    results = {}
    for i, name in enumerate(args.settings):
        results[name] = figures(run(model, SETTINGS[name], args, folder / f"run{i}"))
        print(f"{name}: {results[name]}", flush=True)
    base = results[args.settings[0]]["tokens/s"]
    rows = [
        [
            name,
            f"{r['tokens/s']:.0f}",
            f"{r['tokens/s'] / base:.2f}x",
            f"{r['learner idle']:.0%}",
            f"{r['engine idle']:.0%}",
            f"{r['staleness']:.2f}",
            f"{r['dropped']:.0f}",
            f"{r['reward']:.3f}",
            f"{r['length']:.0f} ({r['truncated']:.0%} at the limit)",
        ]  # fmt: skip
        for name, r in results.items()
    ]
    header = ["setting", "tokens/s", f"vs {args.settings[0]}", "learner idle", "engine idle",
              "mean staleness", "dropped", "final reward", "mean completion length"]  # fmt: skip
    print(table(header, rows))


if __name__ == "__main__":
    main()
