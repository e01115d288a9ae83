"""One long sequence, trained with and without Ulysses sequence parallelism: step time and peak
memory per rank at sp=1 (one learner) and sp=2 (two learners sharing the row).

    python benchmarks/bench_sequence_parallel.py [--length 8192] [--hidden 128] [--layers 2] [--repeats 2]

Two views of activation memory per rank: what autograd keeps for the backward pass at the end of
the forward (the saved tensors, counted once per storage, parameters left out), and the growth of
the learner process's peak resident memory during training over its resident memory once set up
(model, optimizer, DeepSpeed), which also holds transient buffers and allocator slack.
"""

from __future__ import annotations

import argparse
import resource
import statistics

import ray
import torch
from common import model_folder, start_ray, table

from rltrain.batch import TrainBatch
from rltrain.diagnostics import layout_config
from rltrain.learner.group import LearnerGroup
from rltrain.learner.policy import PolicyLearner


class MemoryLearner(PolicyLearner):
    saved_mib = 0.0

    def resident_mib(self) -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20

    def saved_activation_mib(self) -> float:
        return self.saved_mib

    def _micro_batch_loss(self, *args):
        parameters = {p.untyped_storage().data_ptr() for p in self.engine.module.parameters()}
        saved: dict[int, int] = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in parameters:
                saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = super()._micro_batch_loss(*args)
        self.saved_mib = max(self.saved_mib, sum(saved.values()) / 2**20)
        return out


def long_sequence(length: int, prompt: int = 64, vocab: int = 256) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    attention = torch.ones(1, length, dtype=torch.long)
    response = attention.clone()
    response[:, :prompt] = 0
    return TrainBatch(
        input_ids=torch.randint(0, vocab, (1, length), generator=g),
        attention_mask=attention,
        response_mask=response,
        tool_mask=torch.ones_like(attention),
        advantages=torch.ones(1),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    start_ray(num_cpus=4)
    path = model_folder(None, args.hidden, args.layers)
    batch = long_sequence(args.length)
    rows, activation, saved = [], {}, {}
    for sp in (1, 2):
        config = layout_config(sp, 1, 2, optimizer="adamw", lr=1e-6, cpus_per_learner=2 / sp,
                               max_tokens_per_micro_batch=args.length, sequence_parallel_size=sp)  # fmt: skip
        config.data.max_prompt_tokens, config.rollout.max_new_tokens = 64, args.length - 64
        group = LearnerGroup(config, path, total_optimizer_steps=10**6, learner_cls=MemoryLearner)
        baseline = max(ray.get([a.resident_mib.remote() for a in group.actors]))
        metrics = [group.train_step(batch) for _ in range(args.repeats)]
        saved[sp] = max(ray.get([a.saved_activation_mib.remote() for a in group.actors]))
        group.shutdown()
        peak = max(m["perf/peak_memory_mib"] for m in metrics)
        activation[sp] = peak - baseline
        seconds = statistics.median(m["time/train_s"] for m in metrics)
        rows.append([sp, args.length // sp, f"{seconds:.2f}", f"{saved[sp]:.0f}", f"{baseline:.0f}", f"{peak:.0f}",
                     f"{activation[sp]:.0f}"])  # fmt: skip
    ray.shutdown()
    print(
        f"1 sequence of {args.length} tokens; built-in model hidden {args.hidden} x {args.layers} layers; "
        f"ZeRO-2, AdamW, CPU (2 cores shared by the ranks); median of {args.repeats} steps"
    )
    print(table(["sp", "tokens per rank", "step (s)", "saved activations per rank (MiB)", "set-up RSS (MiB)",
                 "peak RSS (MiB)", "peak RSS growth per rank (MiB)"], rows))  # fmt: skip
    print(
        f"sp=2 / sp=1 per rank: saved activations {saved[2] / saved[1]:.2f}, "
        f"peak RSS growth {activation[2] / activation[1]:.2f}"
    )


if __name__ == "__main__":
    main()
