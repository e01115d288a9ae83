"""Padded vs packed micro-batches on a batch whose lengths spread like real RL rollouts: tokens the
model runs on, learner step time, learner tokens/s and peak memory, measured side by side.

    python benchmarks/bench_packing.py [--sequences 64] [--max-length 512] [--micro-batch 8] [--budgets 1024 2048] [--hidden 384]

One learner per layout (ZeRO-0, 2 CPU threads), all alive at once and stepped in turn on the same
batch, so each step pair shares the machine's momentary load; each learner is its own process, so
its peak resident memory is its own. The padded learner cuts the batch into micro-batches of
``--micro-batch`` sequences, each padded to its own longest sequence; the packed ones put
sequences longest-first into padding-free rows of at most ``budget`` tokens.
"""

from __future__ import annotations

import argparse
import statistics

import ray
import torch
from common import model_folder, start_ray, table

from rltrain.batch import TrainBatch
from rltrain.diagnostics import layout_config
from rltrain.learner.group import LearnerGroup


def rl_like_batch(n: int, max_length: int, vocab: int = 256, seed: int = 0) -> TrainBatch:
    """Prompts of 16-64 tokens; completions log-normal (median ~60 tokens), 16..max_length, so a few
    reach the limit (the long tail of reasoning rollouts)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(16, 65, (n,), generator=g)
    completions = torch.exp(4.1 + 0.9 * torch.randn(n, generator=g)).long().clamp(16, max_length)
    p_len, t = int(prompts.max()), int(prompts.max() + completions.max())
    pos = torch.arange(t)[None, :]
    attention = (pos >= p_len - prompts[:, None]) & (pos < p_len + completions[:, None])
    response = attention & (pos >= p_len)
    return TrainBatch(
        input_ids=torch.randint(0, vocab, (n, t), generator=g),
        attention_mask=attention.long(),
        response_mask=response.long(),
        tool_mask=torch.ones(n, t, dtype=torch.long),
        advantages=torch.randn(n, generator=g),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=512, help="longest completion")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per padded micro-batch")
    parser.add_argument("--budgets", type=int, nargs="+", default=[1024, 2048], help="packed token budgets")
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    start_ray(num_cpus=2 * (1 + len(args.budgets)))
    path = model_folder(args.model, args.hidden, args.layers)
    batch = rl_like_batch(args.sequences, args.max_length)
    real = int(batch.attention_mask.sum())
    longest = int(batch.sequence_lengths().max())

    def config(budget: int | None):
        c = layout_config(1, args.micro_batch, 0, optimizer="adamw", lr=1e-6, cpus_per_learner=2)
        c.data.max_prompt_tokens, c.rollout.max_new_tokens = 64, args.max_length
        c.learner.packing, c.learner.max_tokens_per_micro_batch = budget is not None, budget
        return c

    layouts = {"padded": None, **{f"packed, {b} tokens": b for b in args.budgets}}
    groups = {name: LearnerGroup(config(b), path, total_optimizer_steps=10**6) for name, b in layouts.items()}
    results: dict[str, list[dict]] = {name: [] for name in layouts}
    for group in groups.values():
        group.train_step(batch)  # warm-up
    for _ in range(args.repeats):
        for name, group in groups.items():
            results[name].append(group.train_step(batch))
    for group in groups.values():
        group.shutdown()
    ray.shutdown()

    padded_s = [m["time/train_s"] for m in results["padded"]]
    rows = []
    for name, metrics in results.items():
        seconds = statistics.median(m["time/train_s"] for m in metrics)
        # adjacent steps share the machine's momentary load: the median of their ratios is steadier
        speedup = statistics.median(p / m["time/train_s"] for p, m in zip(padded_s, metrics))
        forward = metrics[-1]["perf/forward_tokens"]
        rows.append([name, f"{forward:.0f}", f"{forward / real:.2f}", f"{metrics[-1]['train/micro_batches']:.0f}",
                     f"{seconds:.2f}", f"{real / seconds:.0f}", f"{speedup:.2f}",
                     f"{max(m['perf/peak_memory_mib'] for m in metrics):.0f}"])  # fmt: skip
    print(
        f"{args.sequences} sequences, {real} real tokens (longest {longest}, prompts 16-64, completions "
        f"16-{args.max_length}, log-normal); built-in model hidden {args.hidden} x {args.layers} layers; "
        f"1 learner, ZeRO-0, CPU; median of {args.repeats} steps"
    )
    print(table(["layout", "tokens run", "x real", "micro-batches", "step (s)", "real tokens/s",
                 "speed-up vs padded", "peak RSS (MiB)"], rows))  # fmt: skip


if __name__ == "__main__":
    main()
