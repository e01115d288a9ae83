"""A hybrid layer's short causal convolution over a long packed row, each token over its own
sequence's inputs (rltrain.loss.recurrent.convolve: each piece with the K - 1 inputs before it
prepended, one depthwise conv1d), against the padded forward's convolution of the same sequences
(the model's own causal_conv1d_fn, one row per sequence) and against the per-token gather it
replaced (``[C, L, K]``, kept for the backward). Forward and backward; peak memory is the
process's resident set over what the inputs take (each variant in a fresh process), time the
median of the repeats. Rows of ``--documents`` sequences of ``--length`` tokens, and a prefix tree
(each group's prompt once, ``--group`` completions continuing it).

    python benchmarks/bench_hybrid_conv.py [--channels 1024] [--length 2048] [--documents 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from common import table

KERNEL = 4


def rows(documents: int, length: int, group: int) -> dict[str, torch.Tensor]:
    """The position ids of a packed row of ``documents`` sequences, and of a tree whose groups of
    ``group`` share a prompt of half the length."""
    packed = torch.cat([torch.arange(length)] * documents)
    prompt = length // 2
    tree = []
    for _ in range(documents // group):
        tree.append(torch.arange(prompt))
        tree += [torch.arange(prompt, length)] * group
    return {"packed": packed, "tree": torch.cat(tree)}


def gathered(row, x_1CL, weight):
    """The per-token gather the packed convolution used before: ``[C, L, K]`` built token by token."""
    length = len(row)
    index = torch.empty(length, KERNEL, dtype=torch.long)
    for i in range(length):
        j = i
        for k in range(KERNEL - 1, -1, -1):
            index[i, k] = j if j >= 0 else length
            j = row.parent[j] if j >= 0 else -1
    x = F.pad(x_1CL[0], (0, 1))
    return F.silu((x[:, index] * weight[:, None, :]).sum(-1))[None]


def run(
    variant: str, layout: str, channels: int, length: int, documents: int, group: int, repeats: int
) -> dict:
    from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn

    from rltrain.forward.recurrent import convolve
    from rltrain.forward.structure import Row

    torch.manual_seed(0)
    positions = rows(documents, length, group)[layout]
    weight = torch.randn(channels, KERNEL, requires_grad=True)
    if variant == "padded":  # one row per sequence, as the padded forward runs them
        x = torch.randn(documents, channels, length, requires_grad=True)
    else:
        x = torch.randn(1, channels, len(positions), requires_grad=True)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        if variant == "padded":
            out = causal_conv1d_fn(x, weight, None, activation="silu")
        else:
            row = Row(positions)  # (built once per forward, its index once per row)
            out = convolve(row, x, weight, None, "silu") if variant == "rltrain" else gathered(row, x, weight)
        out.square().sum().backward()
        seconds.append(time.perf_counter() - start)
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    return {"seconds": statistics.median(seconds), "peak_mib": peak, "tokens": x.shape[0] * x.shape[-1]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--channels", type=int, default=1024)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--documents", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # (a variant and layout in this process)
    args = parser.parse_args()
    shape = (args.channels, args.length, args.documents, args.group, args.repeats)
    if args.one:
        print(json.dumps(run(*args.one, *shape)))
        return
    torch.set_num_threads(1)
    results = []
    for variant, layout in [("padded", "packed"), ("rltrain", "packed"), ("gathered", "packed"),
                            ("rltrain", "tree"), ("gathered", "tree")]:  # fmt: skip
        done = subprocess.run([sys.executable, __file__, "--one", variant, layout, *sum(
            ([f"--{k}", str(v)] for k, v in zip(("channels", "length", "documents", "group", "repeats"), shape)), [])],
            capture_output=True, text=True, check=True)  # fmt: skip
        results.append((variant, layout, json.loads(done.stdout.strip().splitlines()[-1])))
    padded = results[0][2]
    print(f"causal convolution (kernel {KERNEL}, {args.channels} channels, fp32), forward + backward, "
          f"{args.documents} sequences of {args.length} tokens")  # fmt: skip
    print(table(["convolution", "row", "tokens", "time (s)", "x padded", "peak MiB", "x padded"],
                [[v, layout, r["tokens"], f"{r['seconds']:.3f}", f"{r['seconds'] / padded['seconds']:.2f}",
                  f"{r['peak_mib']:.0f}", f"{r['peak_mib'] / max(padded['peak_mib'], 1):.2f}"]
                 for v, layout, r in results]))  # fmt: skip


if __name__ == "__main__":
    main()
