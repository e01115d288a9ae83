"""Per-token log-probs + entropy (forward + backward, and forward without grad) from the model's last
hidden states and its output head, three ways: naive (the head's full logits, a full float32
log_softmax), logits (the head's full logits, rltrain's chunked log-softmax over them: the path
before log-probs came from hidden states) and hidden (rltrain's head applied chunk by chunk,
recomputed in the backward: no ``[tokens, vocab]`` logits at all). Peak extra memory, time, and
agreement of values and gradients (of the hidden states and of the head's weight).

    python benchmarks/bench_logprobs.py [--vocab 32000 151936] [--tokens 4096] [--hidden 896] [--dtype bfloat16]

Each (implementation, vocabulary) runs in a fresh process: on CPU the peak is the growth of the
process's peak RSS over the computation (inputs already allocated); on GPU, max_memory_allocated.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import scratch, table

from rltrain.loss.logprobs import head_logprobs_and_entropy, token_logprobs_and_entropy

GRAD_ROWS = 64  # rows of the hidden states' gradient compared between implementations
IMPLEMENTATIONS = ("naive", "logits", "hidden")


def naive(head: torch.nn.Linear, hidden: torch.Tensor, ids: torch.Tensor, temperature: float):
    log_p = torch.log_softmax(head(hidden).float() / temperature, dim=-1)  # the full float32 [N, V]
    logprobs = log_p.gather(-1, ids[:, None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(log_p.exp() * log_p).sum(-1)
    return logprobs, entropy


def logits(head: torch.nn.Linear, hidden: torch.Tensor, ids: torch.Tensor, temperature: float):
    return token_logprobs_and_entropy(head(hidden), ids, temperature)


def from_hidden(head: torch.nn.Linear, hidden: torch.Tensor, ids: torch.Tensor, temperature: float):
    return head_logprobs_and_entropy(head, hidden, ids, temperature)


def peak_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def worker(
    impl: str, vocab: int, tokens: int, width: int, dtype: str, device: str, mode: str, out: str
) -> None:
    torch.manual_seed(0)  # the same head, hidden states, ids and weights in every process
    head = torch.nn.Linear(width, vocab, bias=False, device=device, dtype=getattr(torch, dtype))
    torch.nn.init.normal_(head.weight, std=3 / width**0.5)  # logits of standard deviation ~3
    hidden = torch.randn(tokens, width, device=device, dtype=getattr(torch, dtype))
    hidden.requires_grad_(mode == "train")
    head.requires_grad_(mode == "train")
    ids = torch.randint(0, vocab, (tokens,), device=device)
    weights = torch.randn(tokens, device=device)
    fn = {"naive": naive, "logits": logits, "hidden": from_hidden}[impl]
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = peak_bytes(device)
    start = time.perf_counter()
    with torch.set_grad_enabled(mode == "train"):
        logprobs, entropy = fn(head, hidden, ids, 0.9)
        if mode == "train":
            (logprobs * weights).sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    extra = peak_bytes(device) - before
    grad = hidden.grad[:GRAD_ROWS].float().cpu() if mode == "train" else torch.zeros(0)
    head_grad = head.weight.grad[:GRAD_ROWS].float().cpu() if mode == "train" else torch.zeros(0)
    # float64 reference on the first rows, to tell rounding from error
    with torch.no_grad():
        log_p64 = torch.log_softmax(head(hidden[:GRAD_ROWS]).double() / 0.9, dim=-1)
    ref = {
        "logprobs": log_p64.gather(-1, ids[:GRAD_ROWS, None]).squeeze(-1),
        "entropy": -(log_p64.exp() * log_p64).sum(-1),
    }
    err64 = max((x.detach()[:GRAD_ROWS].double() - ref[k]).abs().max().item() for k, x in
                (("logprobs", logprobs), ("entropy", entropy)))  # fmt: skip
    torch.save(
        {
            "logprobs": logprobs.detach().cpu(),
            "entropy": entropy.cpu(),
            "grad": grad,
            "head_grad": head_grad,
            "err64": err64,
        },
        out,  # fmt: skip
    )
    print(json.dumps({"seconds": seconds, "extra_bytes": extra}))


def measure(
    impl: str, vocab: int, tokens: int, width: int, dtype: str, device: str, mode: str, out: Path
) -> dict:
    done = subprocess.run(
        [
            sys.executable,
            __file__,
            "--worker",
            impl,
            str(vocab),
            str(tokens),
            str(width),
            dtype,
            device,
            mode,
            str(out),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    parser.add_argument("--tokens", type=int, default=4096, help="sequences x length in one micro-batch")
    parser.add_argument("--hidden", type=int, default=896, help="the hidden size (Qwen2.5-0.5B's: 896)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--worker", nargs=8, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        impl, vocab, tokens, width, dtype, device, mode, out = args.worker
        worker(impl, int(vocab), int(tokens), int(width), dtype, device, mode, out)
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    tmp = scratch("bench-logprobs-")
    for vocab, mode in [(v, m) for v in args.vocab for m in ("train", "no_grad")]:
        res = {impl: measure(impl, vocab, args.tokens, args.hidden, args.dtype, device, mode, tmp / f"{impl}.pt")
               for impl in IMPLEMENTATIONS}  # fmt: skip
        saved = {impl: torch.load(tmp / f"{impl}.pt") for impl in IMPLEMENTATIONS}
        ref = saved["naive"]
        for impl in ("logits", "hidden"):
            ours = saved[impl]
            diff = max((ours[k] - ref[k]).abs().max().item() for k in ("logprobs", "entropy"))
            grad_diff = (
                max((ours[k] - ref[k]).abs().max().item() for k in ("grad", "head_grad"))
                if mode == "train"
                else None
            )
            naive_mib, ours_mib = (res[i]["extra_bytes"] / 2**20 for i in ("naive", impl))
            naive_s, ours_s = (res[i]["seconds"] for i in ("naive", impl))
            rows.append([vocab, "forward + backward" if mode == "train" else "forward, no grad", impl,
                         f"{naive_mib:.0f}", f"{ours_mib:.0f}", f"{ours_mib / max(naive_mib, 1e-9):.3f}",
                         f"{naive_s:.2f}", f"{ours_s:.2f}", f"{ours_s / naive_s:.2f}", f"{diff:.1e}",
                         f"{ref['err64']:.1e} / {ours['err64']:.1e}",
                         "-" if grad_diff is None else f"{grad_diff:.1e}"])  # fmt: skip
    print(f"{args.tokens} tokens, hidden size {args.hidden}, {args.dtype} head and hidden states, "
          f"temperature 0.9, log-probs + entropy, on {device}")  # fmt: skip
    header = ["vocab", "pass", "rltrain path", "naive peak MiB", "its peak MiB", "memory ratio", "naive s", "its s",
              "time ratio", "max |value diff|", "max |err| vs float64 (naive / it)", "max |grad diff|"]  # fmt: skip
    print(table(header, rows))


if __name__ == "__main__":
    main()
