"""Per-token log-probs + entropy (forward + backward, and forward without grad): rltrain's chunked computation vs a naive full
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

from rltrain.loss.logprobs import token_logprobs_and_entropy

GRAD_ROWS = 64  # rows of the logits gradient compared between implementations


def naive(logits: torch.Tensor, ids: torch.Tensor, temperature: float):
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)  # the full float32 [N, V]
    logprobs = log_p.gather(-1, ids[:, None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(log_p.exp() * log_p).sum(-1)
    return logprobs, entropy


def chunked(logits: torch.Tensor, ids: torch.Tensor, temperature: float):
    return token_logprobs_and_entropy(logits, ids, temperature)


def peak_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def make_logits(tokens: int, vocab: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Random logits built block by block, so no full-size float32 temporary raises the process's
    peak before the measurement starts."""
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.empty(tokens, vocab, dtype=dtype, device=device)
    for start in range(0, tokens, 16):
        block = logits[start : start + 16]
        block.copy_(3 * torch.randn(block.shape, generator=g, device=device))
    return logits


def worker(impl: str, vocab: int, tokens: int, dtype: str, device: str, mode: str, out: str) -> None:
    logits = make_logits(tokens, vocab, getattr(torch, dtype), device).requires_grad_(mode == "train")
    torch.manual_seed(1)  # the same ids and weights in every process
    ids = torch.randint(0, vocab, (tokens,), device=device)
    weights = torch.randn(tokens, device=device)
    fn = naive if impl == "naive" else chunked
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = peak_bytes(device)
    start = time.perf_counter()
    with torch.set_grad_enabled(mode == "train"):
        logprobs, entropy = fn(logits, ids, 0.9)
        if mode == "train":
            (logprobs * weights).sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    extra = peak_bytes(device) - before
    grad = logits.grad[:GRAD_ROWS].float().cpu() if mode == "train" else torch.zeros(0)
    # float64 reference on the first rows, to tell rounding from error
    log_p64 = torch.log_softmax(logits[:GRAD_ROWS].detach().double() / 0.9, dim=-1)
    ref = {
        "logprobs": log_p64.gather(-1, ids[:GRAD_ROWS, None]).squeeze(-1),
        "entropy": -(log_p64.exp() * log_p64).sum(-1),
    }
    err64 = max((x.detach()[:GRAD_ROWS].double() - ref[k]).abs().max().item() for k, x in
                (("logprobs", logprobs), ("entropy", entropy)))  # fmt: skip
    torch.save(
        {"logprobs": logprobs.detach().cpu(), "entropy": entropy.cpu(), "grad": grad, "err64": err64}, out
    )
    print(json.dumps({"seconds": seconds, "extra_bytes": extra}))


def measure(impl: str, vocab: int, tokens: int, dtype: str, device: str, mode: str, out: Path) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--worker", impl, str(vocab), str(tokens), dtype, device, mode, str(out)],
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
    parser.add_argument("--worker", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        impl, vocab, tokens, dtype, device, mode, out = args.worker
        worker(impl, int(vocab), int(tokens), dtype, device, mode, out)
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="bench-logprobs-"))
    for vocab, mode in [(v, m) for v in args.vocab for m in ("train", "no_grad")]:
        res = {impl: measure(impl, vocab, args.tokens, args.dtype, device, mode, tmp / f"{impl}.pt")
               for impl in ("naive", "chunked")}  # fmt: skip
        ref, ours = torch.load(tmp / "naive.pt"), torch.load(tmp / "chunked.pt")
        diff = max((ours[k] - ref[k]).abs().max().item() for k in ("logprobs", "entropy"))
        err64 = f"{ref['err64']:.1e} / {ours['err64']:.1e}"
        grad_diff = (ours["grad"] - ref["grad"]).abs().max().item() if mode == "train" else None
        naive_mib, ours_mib = (res[i]["extra_bytes"] / 2**20 for i in ("naive", "chunked"))
        naive_s, ours_s = (res[i]["seconds"] for i in ("naive", "chunked"))
        rows.append([vocab, "forward + backward" if mode == "train" else "forward, no grad",
                     f"{naive_mib:.0f}", f"{ours_mib:.0f}", f"{ours_mib / naive_mib:.3f}", f"{naive_s:.2f}",
                     f"{ours_s:.2f}", f"{ours_s / naive_s:.2f}", f"{diff:.1e}", err64,
                     "-" if grad_diff is None else f"{grad_diff:.1e}"])  # fmt: skip
    print(f"{args.tokens} tokens, {args.dtype} logits, temperature 0.9, log-probs + entropy, on {device}")
    header = ["vocab", "pass", "naive peak MiB", "chunked peak MiB", "memory ratio", "naive s", "chunked s",
              "time ratio", "max |value diff|", "max |err| vs float64 (naive / chunked)", "max |grad diff|"]  # fmt: skip
    print(table(header, rows))


if __name__ == "__main__":
    main()
