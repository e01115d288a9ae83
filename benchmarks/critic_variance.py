"""How much of a PPO run's return variance a critic could explain, from its saved rollouts.

    python benchmarks/critic_variance.py RUN_FOLDER [RUN_FOLDER ...] [--last 10] [--first] [--arithmetic]

(``configs/cpu_ppo.yaml`` saves its rollouts every step.)

A run saved with ``run.save_rollouts_every=1`` (``rollouts/step_<N>.jsonl``) and GAE with
``gamma = lam = 1``: every sampled token's return is its completion's reward. Over the last steps
it prints, token-weighted like ``critic/explained_variance``:

- the return variance;
- the share of it that lies between prompts: what a critic that knew each question's success rate
  exactly would explain at every token (per sample; the within-prompt part estimated without bias
  from the group's own samples: sum (R - group mean)^2 / (k - 1));
- the share that lies between the samples that call the calculator and those that do not: what a
  critic that knew from the first token whether the completion will call it would explain;
- the critic's own explained variances (``metrics.jsonl``): at the question, per sample
  (``critic/question_explained_variance``: the value of the state before the first sampled token,
  the one to hold against the prompt oracle, which is per sample too), and over the loss tokens
  (``critic/explained_variance``, which also counts the tokens after the one that decides);
- how the completions that called the calculator and those that did not fared.

Whatever the prompt does not explain is decided by the sampled tokens themselves: a critic can only
see it after the token that decides it, by reading what was sampled.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from common import mean_of, rollout_paths, table


def step_figures(path: Path) -> dict[str, float]:
    """Sums over one step's samples, each weighted by its loss tokens (sampled by the policy)."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    weights = [sum(r["completion_mask"]) for r in records]
    rewards = [r["reward"] for r in records]
    total = sum(weights)
    mean = sum(w * x for w, x in zip(weights, rewards)) / total
    sums = {"tokens": total, "squares": sum(w * (x - mean) ** 2 for w, x in zip(weights, rewards))}
    groups = defaultdict(list)
    for i, r in enumerate(records):
        groups[r["prompt_index"]].append(i)
    # the prompt's part per sample, not per token: a group's samples differ in length, and
    # weighting its unbiased spread by their tokens makes the estimate too noisy to read
    plain = sum(rewards) / len(rewards)
    sums["sample squares"] = sum((x - plain) ** 2 for x in rewards)
    sums["within prompt"] = 0.0  # unbiased: k * sum (R - group mean)^2 / (k - 1) per group
    for members in groups.values():
        k = len(members)
        group_mean = sum(rewards[i] for i in members) / k
        sums["within prompt"] += (
            k * sum((rewards[i] - group_mean) ** 2 for i in members) / (k - 1) if k > 1 else 0.0
        )
    sums["within call"] = 0.0  # around the mean reward of the samples that (did not) call the tool
    for called in (True, False):
        members = [i for i, r in enumerate(records) if bool(r["tool_calls"]) == called]
        if members:
            w = sum(weights[i] for i in members)
            side = sum(weights[i] * rewards[i] for i in members) / w
            sums["within call"] += sum(weights[i] * (rewards[i] - side) ** 2 for i in members)
    called = [r for r in records if r["tool_calls"]]
    alone = [r for r in records if not r["tool_calls"]]
    sums |= {"samples": len(records), "called": len(called), "reward called": sum(r["reward"] for r in called),
             "reward alone": sum(r["reward"] for r in alone)}  # fmt: skip
    return sums


QUESTION = "critic/question_explained_variance"


def run_figures(run: Path, last: int, first: bool = False, only: int | None = None) -> dict[str, float]:
    """Pooled over the last steps (``only``: that step alone): a ratio of sums, not a mean of
    per-step ratios (a step where nearly every sample succeeds has almost no variance to divide by)."""
    paths = rollout_paths(run)
    paths = paths[:last] if first else paths[-last:]
    if only is not None:
        paths = [run / "rollouts" / f"step_{only}.jsonl"]
    if not paths:
        raise SystemExit(f"{run}: no rollouts/step_*.jsonl (run with run.save_rollouts_every=1)")
    steps = [int(p.stem.split("_")[1]) for p in paths]
    per_step = [step_figures(path) for path in paths]
    s = defaultdict(float)
    for figures in per_step:
        for k, v in figures.items():
            s[k] += v
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    explained = [
        r["critic/explained_variance"]
        for r in rows
        if r["step"] in steps and "critic/explained_variance" in r
    ]
    question = [r[QUESTION] for r in rows if r["step"] in steps and QUESTION in r]
    oracles = [1.0 - f["within prompt"] / f["sample squares"] for f in per_step if f["sample squares"] > 0]
    alone = s["samples"] - s["called"]
    return {
        "variance": s["squares"] / s["tokens"],
        "prompt oracle EV": 1.0 - s["within prompt"] / s["sample squares"],
        "call oracle EV": 1.0 - s["within call"] / s["squares"],
        "prompt oracle EV, mean of steps": mean_of(oracles),
        "critic EV": mean_of(explained),
        "critic EV at the question": mean_of(question),
        "tool-call share": s["called"] / s["samples"],
        "reward with a call": s["reward called"] / s["called"] if s["called"] else float("nan"),
        "reward without": s["reward alone"] / alone if alone else float("nan"),
    }


GROUPINGS = {  # what a built-in arithmetic question shows: (a, operation, b) -> the group's key
    "the operation": lambda a, op, b: op,
    "the operation and the operands' lengths": lambda a, op, b: (op, len(a), len(b)),
    "the question itself": lambda a, op, b: (a, op, b),
}


def grouping_figures(run: Path, last: int) -> dict[str, float]:
    """``builtin:arithmetic``: the share of the last steps' return variance (per sample) that lies
    between groups of questions alike in what they show, in-sample (each group's own mean; a group
    of one explains its sample entirely, so finer groupings overstate)."""
    from rltrain.data import ARITHMETIC

    records = [
        json.loads(line) for path in rollout_paths(run)[-last:] for line in path.read_text().splitlines()
    ]
    rewards = [r["reward"] for r in records]
    mean = sum(rewards) / len(rewards)
    total = sum((x - mean) ** 2 for x in rewards)
    shown = [ARITHMETIC.match(r["messages"][0]["content"]).groups() for r in records]
    out = {}
    for name, key in GROUPINGS.items():
        groups = defaultdict(list)
        for parts, x in zip(shown, rewards):
            groups[key(*parts)].append(x)
        within = sum(sum((x - sum(xs) / len(xs)) ** 2 for x in xs) for xs in groups.values())
        out[name] = 1.0 - within / total if total else float("nan")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--last", type=int, default=10, help="steps to pool (the newest)")
    parser.add_argument("--first", action="store_true", help="pool the oldest --last steps instead")
    parser.add_argument("--arithmetic", action="store_true",
                        help="builtin:arithmetic runs: what groups of questions alike explain, in-sample")  # fmt: skip
    args = parser.parse_args()
    header = ["run", "return variance", "prompt oracle EV", "prompt oracle EV (mean of steps)",
              "critic EV at the question (mean of steps)", "critic EV over tokens (mean of steps)",
              "call oracle EV", "tool-call share", "reward with a call", "reward without"]  # fmt: skip
    rows, figures = [], [run_figures(run, args.last, args.first) for run in args.runs]
    for run, f in zip(args.runs, figures):
        rows.append([run.name, f"{f['variance']:.3f}", f"{f['prompt oracle EV']:.2f}",
                     f"{f['prompt oracle EV, mean of steps']:.2f}", f"{f['critic EV at the question']:.3f}",
                     f"{f['critic EV']:.3f}", f"{f['call oracle EV']:.2f}",
                     f"{f['tool-call share']:.1%}", f"{f['reward with a call']:.2f}", f"{f['reward without']:.2f}"])  # fmt: skip
    print(f"{'first' if args.first else 'last'} {args.last} steps with rollouts, pooled, token-weighted")
    print(table(header, rows))
    oracle = mean_of([f["prompt oracle EV"] for f in figures])
    question = mean_of([f["critic EV at the question"] for f in figures])
    print(f"mean over {len(figures)} run(s): prompt oracle EV {oracle:.3f}, critic EV at the question "
          f"{question:.3f} ({question / oracle:.0%} of the oracle)")  # fmt: skip
    if args.arithmetic:
        groupings = [grouping_figures(run, args.last) for run in args.runs]
        print(
            f"\nthe last {args.last} steps' return variance (per sample) between questions alike, in-sample"
        )
        print(table(["run", *GROUPINGS], [[run.name, *(f"{g[k]:.2f}" for k in GROUPINGS)]
                                          for run, g in zip(args.runs, groupings)]))  # fmt: skip


if __name__ == "__main__":
    main()
