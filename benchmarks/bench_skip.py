"""Sequences whose gradient is exactly zero counted, not run (``learner.skip_zero_gradient``): the
learners' time for a step against the share of its sequences skipped, and the whole step's tokens
per second, synchronous and asynchronous. Every setting runs in this one invocation, the settings
alternating (skip, no skip, skip, ...) so the machine's load falls on both alike.

    python benchmarks/bench_skip.py [--model builtin|smollm2|<folder>] [--repeats 3] [--steps 4]

Learner time: a group of 2 learners (the demo's layout: ZeRO-2, packed rows) trains on one batch of
32 sequences (8 groups of 4 sharing a prompt of 40 tokens; completions of 60-160 tokens), the
advantages of a known share of the groups set to 0 (a group whose rewards all tie); ``time/train_s``
with the skip and without, the median over the repeats. The goal: at most ``(1 - share) + 0.1`` of
the unskipped time.

Whole step: the demo's config on the model (plain GRPO, no warm start) with a reward under which
the groups of even answers tie (about half), synchronous and with ``rollout.max_staleness=1``;
``perf/tokens_per_s`` over the steps after the first, with the skip and without.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from common import model_folder, run_trainer, scratch, start_ray, table

SHARES = [0.0, 0.25, 0.5, 0.75]


def the_model(choice: str) -> str:
    if choice == "builtin":
        return model_folder(None, hidden_size=256, num_layers=4)
    if choice == "smollm2":
        from rltrain.models.pretrained import hf_folder_from_gguf, smollm2_gguf

        return str(hf_folder_from_gguf(smollm2_gguf()))
    return choice


def batch_with_ties(share: float, vocab: int, seed: int = 0):
    """32 sequences in groups of 4, ``share`` of the groups with advantage 0."""
    import torch

    from rltrain.batch import Completion, collate

    g = torch.Generator().manual_seed(seed)
    prompts, completions, advantages = [], [], []
    for group in range(8):
        prompt = torch.randint(3, vocab, (40,), generator=g).tolist()
        tied = group < round(share * 8)
        for _ in range(4):
            n = int(torch.randint(60, 161, (1,), generator=g))
            ids = torch.randint(3, vocab, (n,), generator=g).tolist()
            prompts.append(prompt)
            completions.append(Completion(ids, [-1.0] * n, [1] * n))
            advantages.append(0.0 if tied else float(torch.randn(1, generator=g)))
    return collate(prompts, completions, torch.tensor(advantages), 0)


def learner_times(model: str, repeats: int) -> list[list[object]]:
    from transformers import AutoConfig

    from rltrain.config import Config
    from rltrain.learner.group import LearnerGroup

    vocab = AutoConfig.from_pretrained(model).vocab_size
    config = lambda skip: Config.model_validate({  # noqa: E731
        "learner": {"num_learners": 2, "zero_stage": 2, "max_tokens_per_micro_batch": 1024, "skip_zero_gradient": skip},
        "data": {"max_prompt_tokens": 64}, "rollout": {"max_new_tokens": 200}})  # fmt: skip
    group = LearnerGroup(config(True), model, total_optimizer_steps=10_000)
    rows = []
    try:
        group.train_step(batch_with_ties(0.0, vocab))  # warm-up
        for share in SHARES:
            batch = batch_with_ties(share, vocab)
            times = {True: [], False: []}
            for _ in range(repeats):
                for skip in (True, False):
                    group.restart(config(skip), 10_000)
                    times[skip].append(group.train_step(batch)["time/train_s"])
            on, off = statistics.median(times[True]), statistics.median(times[False])
            rows.append(
                [f"{share:.0%}", f"{off:.2f}", f"{on:.2f}", f"{on / off:.2f}", f"{1 - share + 0.1:.2f}"]
            )
    finally:
        group.shutdown()
    return rows


def whole_steps(model: str, steps: int) -> list[list[object]]:
    rows = []
    reward = ["reward.functions={tied_rewards:tied_reward: 1.0}"]
    for mode, more in [("synchronous", []), ("staleness 1", ["rollout.max_staleness=1"])]:
        figures = {}
        for skip in (True, False):
            out = scratch("rltrain-skip-")
            got = run_trainer(out, [f"model.name_or_path={model}", f"run.steps={steps}", "rollout.max_new_tokens=64",
                                    f"learner.skip_zero_gradient={str(skip).lower()}", *reward, *more])  # fmt: skip
            later = got[1:] or got
            figures[skip] = (statistics.mean(r["perf/tokens_per_s"] for r in later),
                             statistics.mean(r["time/train_s"] for r in later),
                             statistics.mean(r.get("perf/skipped_sequences", 0.0) for r in later))  # fmt: skip
        (on, on_train, share), (off, off_train, _) = figures[True], figures[False]
        rows.append([mode, f"{share:.0%}", f"{off:.1f}", f"{on:.1f}", f"{on / off:.2f}", f"{off_train:.2f}",
                     f"{on_train:.2f}"])  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    here = str(Path(__file__).resolve().parent)  # the tied reward's module, for the trainer's workers too
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    model = the_model(args.model)
    start_ray()
    print(f"model: {args.model}\n")
    print(table(["share skipped", "train s, no skip", "train s, skip", "ratio", "goal (at most)"],
                learner_times(model, args.repeats)))  # fmt: skip
    import ray

    ray.shutdown()
    print()
    print(table(["mode", "skipped", "tokens/s, no skip", "tokens/s, skip", "ratio", "train s, no skip", "train s, skip"],
                whole_steps(model, args.steps)))  # fmt: skip


if __name__ == "__main__":
    main()
