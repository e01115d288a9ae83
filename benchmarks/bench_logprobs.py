"""Per-token log-probs + entropy, forward and backward: rltrain's chunked computation vs a naive full
float32 log_softmax. Peak extra memory, time, and agreement of values and gradients.

    python benchmarks/bench_logprobs.py [--vocab 32000 151936] [--tokens 4096] [--dtype bf16]

Each (implementation, vocabulary) runs in a fresh process: on CPU the peak is the growth of the
process's peak RSS over the computation (inputs already allocated); on GPU, max_memory_allocated.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import table

from rltrain.logprobs import token_entropy, token_logprobs

GRAD_ROWS = 64  # rows of the logits gradient compared between implementations


def naive(logits: torch.Tensor, ids: torch.Tensor, temperature: float):
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)  # the full float32 [N, V]
    logprobs = log_p.gather(-1, ids[:, None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(log_p.exp() * log_p).sum(-1)
    return logprobs, entropy


def chunked(logits: torch.Tensor, ids: torch.Tensor, temperature: float):
    return token_logprobs(logits, ids, temperature), token_entropy(logits, temperature)


def peak_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def worker(impl: str, vocab: int, tokens: int, dtype: str, device: str, out: str) -> None:
    torch.manual_seed(0)
    logits = (3 * torch.randn(tokens, vocab, device=device)).to(getattr(torch, dtype)).requires_grad_(True)
    ids = torch.randint(0, vocab, (tokens,), device=device)
    weights = torch.randn(tokens, device=device)
    fn = naive if impl == "naive" else chunked
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = peak_bytes(device)
    start = time.perf_counter()
    logprobs, entropy = fn(logits, ids, 0.9)
    (logprobs * weights).sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    extra = peak_bytes(device) - before
    torch.save(
        {
            "logprobs": logprobs.detach().cpu(),
            "entropy": entropy.cpu(),
            "grad": logits.grad[:GRAD_ROWS].float().cpu(),
        },
        out,
    )
    print(json.dumps({"seconds": seconds, "extra_bytes": extra}))


def measure(impl: str, vocab: int, tokens: int, dtype: str, device: str, out: Path) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--worker", impl, str(vocab), str(tokens), dtype, device, str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    parser.add_argument("--tokens", type=int, default=4096, help="sequences x length in one micro-batch")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        impl, vocab, tokens, dtype, device, out = args.worker
        worker(impl, int(vocab), int(tokens), dtype, device, out)
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="bench-logprobs-"))
    for vocab in args.vocab:
        res = {
            impl: measure(impl, vocab, args.tokens, args.dtype, device, tmp / f"{impl}.pt")
            for impl in ("naive", "chunked")
        }
        ref, ours = torch.load(tmp / "naive.pt"), torch.load(tmp / "chunked.pt")
        diff = max((ours[k] - ref[k]).abs().max().item() for k in ("logprobs", "entropy"))
        grad_diff = (ours["grad"] - ref["grad"]).abs().max().item()
        mem_ratio = res["chunked"]["extra_bytes"] / res["naive"]["extra_bytes"]
        time_ratio = res["chunked"]["seconds"] / res["naive"]["seconds"]
        rows.append(
            [
                vocab,
                f"{res['naive']['extra_bytes'] / 2**20:.0f}",
                f"{res['chunked']['extra_bytes'] / 2**20:.0f}",
                f"{mem_ratio:.3f}",
                f"{res['naive']['seconds']:.2f}",
                f"{res['chunked']['seconds']:.2f}",
                f"{time_ratio:.2f}",
                f"{diff:.1e}",
                f"{grad_diff:.1e}",
            ]
        )
    print(f"{args.tokens} tokens, {args.dtype} logits, temperature 0.9, forward + backward, on {device}")
    print(
        table(
            [
                "vocab",
                "naive peak MiB",
                "chunked peak MiB",
                "memory ratio",
                "naive s",
                "chunked s",
                "time ratio",
                "max |value diff|",
                "max |grad diff|",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
