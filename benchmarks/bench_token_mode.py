"""Cost of exact normalization: learner step time and collectives per step, `token` mode vs the
per-micro-batch mode, same batch, same layout, same engines, steps interleaved.

    python benchmarks/bench_token_mode.py [--learners 2] [--sequences 64] [--micro-batch 8] [--repeats 11] [--hidden 512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
from common import model_folder, start_ray, table

import rltrain.learner.engine
from rltrain.diagnostics import count_collectives, layout_config, synthetic_rollouts
from rltrain.learner.group import LearnerGroup
from rltrain.learner.policy import PolicyLearner


class CountingLearner(PolicyLearner):
    """A learner whose train_step also reports how many torch.distributed collectives it issued."""

    def set_denominator(self, mode) -> None:
        self.config.loss.masked_mean_denominator = mode

    def train_step(self, groups):
        totals_fn, totals_s = rltrain.learner.engine.step_totals, [0.0]

        def timed_totals(*args, **kwargs):
            start = time.perf_counter()
            try:
                return totals_fn(*args, **kwargs)
            finally:
                totals_s[0] += time.perf_counter() - start

        rltrain.learner.engine.step_totals = timed_totals
        try:
            with count_collectives() as calls:
                metrics = super().train_step(groups)
        finally:
            rltrain.learner.engine.step_totals = totals_fn
        return {**metrics, "collectives": float(sum(calls.values())), "token_totals_s": totals_s[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    start_ray()
    path = model_folder(args.model, args.hidden, args.layers)
    config = layout_config(args.learners, args.micro_batch, args.zero_stage, optimizer="adamw", lr=1e-6)
    group = LearnerGroup(config, path, total_optimizer_steps=10**6, learner_cls=CountingLearner)
    batch = synthetic_rollouts(n=args.sequences, t=args.length)
    accumulation = -(-args.sequences // args.learners // args.micro_batch)
    times, collectives, totals_s = {"token": [], None: []}, {}, []
    group.train_step(batch)  # warm-up
    for _ in range(args.repeats):
        for mode in ("token", None):
            ray.get([a.set_denominator.remote(mode) for a in group.actors])
            metrics = group.train_step(batch)
            times[mode].append(metrics["time/train_s"])
            collectives[mode] = int(metrics["collectives"])
            if mode == "token":
                totals_s.append(metrics["token_totals_s"])
    group.shutdown()
    token, naive = statistics.median(times["token"]), statistics.median(times[None])
    # adjacent steps share the machine's momentary load: the median of their ratios is steadier
    paired = statistics.median(t / n for t, n in zip(times["token"], times[None]))
    totals_ms = statistics.median(totals_s) * 1e3
    print(
        f"{args.learners} learners x {accumulation} accumulation steps x micro-batch {args.micro_batch}, "
        f"{args.sequences} sequences x {args.length} tokens, ZeRO-{args.zero_stage}, "
        f"median of {args.repeats} interleaved steps"
    )
    print(
        table(
            ["masked_mean_denominator", "step time (s)", "collectives per step"],
            [
                ["per-micro-batch (null)", f"{naive:.3f}", collectives[None]],
                ["token", f"{token:.3f}", collectives["token"]],
            ],
        )
    )
    print(
        f"token / per-micro-batch step time, median of paired steps: {paired:.4f}; "
        f"extra collectives: {collectives['token'] - collectives[None]}"
    )
    print(f"the added work itself (counting tokens + the all-reduce, timed inside the learner): "
          f"{totals_ms:.2f} ms per step = {totals_ms / 1e3 / naive:.2%} of the step")  # fmt: skip


if __name__ == "__main__":
    main()
