"""The learner's math on one GPU, with only what a bare GPU machine holds: torch, transformers, peft
and rltrain's pure-torch loss code (no Ray, DeepSpeed, vLLM or pydantic).

    python scripts/gpu_check.py                      # CUDA, real shapes, under 8 minutes on one H100/H200
    python scripts/gpu_check.py --device cpu         # tiny shapes, seconds (the test suite runs this)
    python scripts/gpu_check.py --parts logprobs step --out figures.json

Each part runs under its own time limit and its figures are written to the JSON file as soon as it
ends, so a part that hangs or fails leaves the earlier ones. A part's ``ok`` is its own comparison
(exactness against a threshold); the exit code is 1 if any comparison failed. The parts:

- ``token_mode``: one batch of uneven sequences (tool tokens masked) as 1, 2 and 4 uneven
  micro-batches: the token-mode gradient (each micro-batch's token sum over the step's token total)
  against the single micro-batch's, in fp32 and bf16, and the per-micro-batch mean as the control.
- ``logprobs``: per-token log-probs and entropy, forward and backward, at a 151,936 vocabulary: from
  hidden states chunk by chunk (rltrain.loss.logprobs.head_logprobs_and_entropy) against the head's
  full logits and a float32 log_softmax: peak memory, time, agreement.
- ``step``: learner tokens/s and MFU (6 N per token over the device's dense bf16 peak) at
  Qwen2.5-0.5B and 1.5B shapes in bf16, with and without gradient checkpointing: packed rows,
  log-probs from hidden states, a token-mode policy-gradient loss, AdamW.
- ``packed``: packed rows against padded ones (log-probs and gradient), fp32 and bf16.
- ``moe_aux``: the load-balancing loss at step scope summed over micro-batches against transformers'
  own on the whole batch, in bf16 (value and router gradient).
- ``prefix_tree``: a group's prompt computed once (rltrain.learner.prefix_tree) against the unshared
  packed row: log-probs and gradient in fp32 and bf16, and the time of forward + backward in bf16
  by prompt:completion ratio and group size.

docs/gpu.md says what each figure means and keeps the table of every run on a lent GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # rltrain from the checkout, not installed

from rltrain.forward import sequence_logprobs  # noqa: E402
from rltrain.loss.logprobs import head_logprobs_and_entropy  # noqa: E402
from rltrain.loss.masked_mean import masked_mean  # noqa: E402
from rltrain.loss.moe import expert_counts, load_balancing_loss  # noqa: E402

NOT_HERE = ("ray", "deepspeed", "vllm", "pydantic")  # what a bare GPU machine lacks
VOCAB = 151_936
# (hidden, layers, heads, kv heads, intermediate): Qwen2.5's, with tied embeddings
SHAPES = {"0.5B": (896, 24, 14, 2, 4864), "1.5B": (1536, 28, 12, 2, 8960)}
TINY = (64, 2, 2, 1, 128)
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s


def qwen2(
    shape: tuple[int, ...], vocab: int, dtype: torch.dtype, device: str, seed: int = 0, attn: str = "sdpa"
):
    from transformers import AutoModelForCausalLM, Qwen2Config

    hidden, layers, heads, kv, inter = shape
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, intermediate_size=inter, tie_word_embeddings=True,
                         max_position_embeddings=32768, attn_implementation=attn)  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype)


def uneven_batch(vocab: int, lengths: list[int], device: str, seed: int = 0):
    """Right-padded rows of the given lengths: ids, attention mask, loss mask (the first quarter of
    each row is prompt, a few tokens in the middle are tool output), advantages."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), width), generator=g)
    attention = torch.zeros_like(ids)
    loss = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        attention[row, :n] = 1
        loss[row, n // 4 : n] = 1
        loss[row, n // 2 : n // 2 + 3] = 0  # tool output
    advantages = torch.randn(len(lengths), 1, generator=g).expand_as(ids).contiguous()
    return [t.to(device) for t in (ids, attention, loss, advantages)]


def pg_loss(model, ids, attention, loss_mask, advantages, denominator, packed=False):
    logprobs, _ = sequence_logprobs(model, ids, attention, packed=packed)
    return masked_mean(-advantages * logprobs, loss_mask, denominator=denominator)


def gradient(model) -> torch.Tensor:
    return torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def accumulated(model, batch, splits: list[list[int]], mode: str) -> torch.Tensor:
    """The gradient of one optimizer step whose micro-batches are the row sets in ``splits``:
    ``token`` divides each micro-batch's token sum by the step's token total, ``micro`` takes each
    micro-batch's own mean and divides by the number of micro-batches."""
    ids, attention, loss_mask, advantages = batch
    model.zero_grad(set_to_none=True)
    total = loss_mask.sum()
    for rows in splits:
        part = [t[rows] for t in batch]
        if mode == "token":
            pg_loss(model, *part, denominator=total).backward()
        else:
            (pg_loss(model, *part, denominator=None) / len(splits)).backward()
    return gradient(model)


def part_token_mode(args) -> dict:
    shape, vocab, lengths = (
        (TINY, 512, [60, 3, 41, 2, 50, 4, 33, 3])
        if args.cpu
        else (SHAPES["0.5B"], VOCAB, [2048, 512, 3000, 1200, 4096, 700, 2500, 1800])
    )
    out = {}
    for dtype, bound in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
        model = qwen2(shape, vocab, dtype, args.device)
        batch = uneven_batch(vocab, lengths, args.device)
        one = accumulated(model, batch, [list(range(len(lengths)))], "token")
        splits = {"2 uneven": [[0, 1, 2], [3, 4, 5, 6, 7]], "4 uneven": [[0], [1, 2, 3], [4, 5], [6, 7]]}
        token = max(relative(accumulated(model, batch, s, "token"), one) for s in splits.values())
        control = min(relative(accumulated(model, batch, s, "micro"), one) for s in splits.values())
        name = "fp32" if dtype == torch.float32 else "bf16"
        out[f"{name} token mode vs one micro-batch"] = token
        out[f"{name} per-micro-batch mean vs one micro-batch"] = control
        out[f"{name} ok"] = token < bound and control > 3 * token
        del model
    out["ok"] = out["fp32 ok"] and out["bf16 ok"]
    return out


def measure(device: str, fn: Callable[[], None]) -> tuple[float, float | None]:
    """Seconds of ``fn`` (after one warm-up call) and, on CUDA, its peak memory above what was
    allocated before it, in GiB."""
    fn()
    sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    fn()
    sync(device)
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device == "cuda" else None
    return seconds, peak


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def part_logprobs(args) -> dict:
    hidden, vocab, tokens = (64, 4096, 256) if args.cpu else (896, VOCAB, 8192)
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False, device=args.device, dtype=args.dtype)
    states = torch.randn(1, tokens, hidden, device=args.device, dtype=args.dtype, requires_grad=True)
    ids = torch.randint(0, vocab, (1, tokens), device=args.device)
    weights = torch.randn(1, tokens, device=args.device)
    results = {}

    def naive():
        log_p = torch.log_softmax(head(states).float(), -1)
        logprobs = log_p.gather(-1, ids[..., None]).squeeze(-1)
        with torch.no_grad():
            entropy = -(log_p.exp() * log_p).sum(-1)
        (logprobs * weights).sum().backward()
        results["naive"] = (logprobs.detach(), entropy, states.grad.clone(), head.weight.grad.clone())

    def from_hidden():
        logprobs, entropy = head_logprobs_and_entropy(head, states, ids)
        (logprobs * weights).sum().backward()
        results["hidden"] = (logprobs.detach(), entropy, states.grad.clone(), head.weight.grad.clone())

    out = {"vocab": vocab, "tokens": tokens, "dtype": str(args.dtype).removeprefix("torch.")}
    for name, fn in (("naive", naive), ("hidden", from_hidden)):

        def run(fn=fn):
            states.grad, head.weight.grad = None, None
            fn()

        seconds, peak = measure(args.device, run)
        out[f"{name} s"], out[f"{name} peak GiB"] = seconds, peak
    out["time hidden/naive"] = out["hidden s"] / out["naive s"]
    if args.device == "cuda":
        out["peak hidden/naive"] = out["hidden peak GiB"] / out["naive peak GiB"]
    # the chunking's two sizes: tokens whose logits exist at once, float32 bytes of a softmax piece
    for rows, mib in ((1024, 256), (2048, 64), (2048, 256), (4096, 256), (4096, 1024)):

        def sized(rows=rows, mib=mib):
            states.grad, head.weight.grad = None, None
            logprobs, _ = head_logprobs_and_entropy(
                head, states, ids, max_chunk_bytes=mib * 2**20, chunk_rows=rows
            )
            (logprobs * weights).sum().backward()

        seconds, peak = measure(args.device, sized)
        out[f"chunk {rows} rows, {mib} MiB: time/naive"] = seconds / out["naive s"]
        if args.device == "cuda":
            out[f"chunk {rows} rows, {mib} MiB: peak/naive"] = peak / out["naive peak GiB"]
    names = ("logprobs", "entropy", "hidden-state grad", "head grad")
    diffs = {n: relative(h.float(), v.float()) for n, h, v in zip(names, results["hidden"], results["naive"])}
    out.update({f"{n} rel. diff": d for n, d in diffs.items()})
    out["ok"] = max(diffs.values()) < (1e-5 if args.dtype == torch.float32 else 2e-2)
    return out


def part_step(args) -> dict:
    shapes = {"tiny": TINY} if args.cpu else SHAPES
    vocab, tokens = (512, 512) if args.cpu else (VOCAB, 16384)
    peak = next((f for name, f in PEAK_BF16.items() if args.device == "cuda"
                 and name in torch.cuda.get_device_name()), None)  # fmt: skip
    out = {"tokens per micro-batch": tokens, "peak FLOP/s": peak}
    from rltrain.forward import attention as packed_attention

    for name, shape in shapes.items():
        # the packed row on the trainer's own attention (document by document, no [L, L] mask)
        model = qwen2(shape, vocab, args.dtype, args.device, attn=packed_attention.register())
        n = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        lengths = [tokens // 16] * 16  # 16 sequences in one packed row
        batch = uneven_batch(vocab, lengths, args.device)
        for checkpointing in (True, False):
            if checkpointing:
                model.gradient_checkpointing_enable()
            else:
                model.gradient_checkpointing_disable()

            def step(model=model, optimizer=optimizer, batch=batch):
                optimizer.zero_grad(set_to_none=True)
                pg_loss(model, *batch, denominator=batch[2].sum(), packed=True).backward()
                optimizer.step()

            seconds, memory = measure(args.device, step)
            label = f"{name} {'ckpt' if checkpointing else 'no ckpt'}"
            out[f"{label} tokens/s"] = tokens / seconds
            out[f"{label} MFU"] = 6 * n * tokens / seconds / peak if peak else None
            out[f"{label} peak GiB"] = memory
        out[f"{name} parameters"] = n
        del model, optimizer
    out["ok"] = all(v is None or math.isfinite(v) for k, v in out.items() if k.endswith("tokens/s"))
    return out


def part_packed(args) -> dict:
    shape, vocab, lengths = (
        (TINY, 512, [9, 23, 4, 16]) if args.cpu else (SHAPES["0.5B"], VOCAB, [900, 2300, 400, 1600])
    )
    out = {}
    for dtype, bound in ((torch.float32, 1e-4), (torch.bfloat16, 1e-1)):
        model = qwen2(shape, vocab, dtype, args.device)
        batch = uneven_batch(vocab, lengths, args.device)
        grads, values = [], []
        for packed in (False, True):
            model.zero_grad(set_to_none=True)
            logprobs, _ = sequence_logprobs(model, batch[0], batch[1], packed=packed)
            masked_mean(-batch[3] * logprobs, batch[2]).backward()
            values.append((logprobs * batch[1]).detach().float())
            grads.append(gradient(model))
        name = "fp32" if dtype == torch.float32 else "bf16"
        out[f"{name} log-probs max abs diff"] = (values[0] - values[1]).abs().max().item()
        out[f"{name} gradient rel. diff"] = relative(grads[1], grads[0])
        out[f"{name} ok"] = out[f"{name} gradient rel. diff"] < bound
        del model
    out["ok"] = out["fp32 ok"] and out["bf16 ok"]
    return out


def part_moe_aux(args) -> dict:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    hidden, experts, top_k, layers = (32, 8, 2, 2) if args.cpu else (1024, 64, 8, 4)
    config = Qwen3MoeConfig(vocab_size=512 if args.cpu else VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                            moe_intermediate_size=hidden, num_experts=experts, num_experts_per_tok=top_k,
                            intermediate_size=2 * hidden, attn_implementation="sdpa")  # fmt: skip
    lengths = [13, 40, 7, 25] if args.cpu else [1300, 4000, 700, 2500]
    ids, attention, _, _ = uneven_batch(config.vocab_size, lengths, args.device)
    splits = [[0], [1, 2], [3]]  # the step's micro-batches
    out = {}
    for dtype, bounds in ((torch.float32, (1e-5, 1e-4)), (torch.bfloat16, (2e-2, 2e-1))):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).to(device=args.device, dtype=dtype)
        routers = [p for n, p in model.named_parameters() if "mlp.gate" in n]

        def router_logits(rows, model=model):
            forward = model(input_ids=ids[rows], attention_mask=attention[rows], output_router_logits=True)
            return [r.reshape(-1, experts) for r in forward.router_logits]

        # transformers on the whole batch in one forward
        model.zero_grad(set_to_none=True)
        whole = load_balancing_loss_func(tuple(router_logits(slice(None))), experts, top_k, attention)
        whole.backward()
        want = torch.cat([p.grad.float().flatten() for p in routers])
        # rltrain at step scope: each micro-batch's term with the step's counts
        with torch.no_grad():
            counts = sum(
                expert_counts(router_logits(rows), attention[rows].flatten(), top_k) for rows in splits
            )
        model.zero_grad(set_to_none=True)
        total = 0.0
        for rows in splits:
            term = load_balancing_loss(router_logits(rows), attention[rows].flatten(), counts, top_k)
            term.backward()
            total += term.item()
        got = torch.cat([p.grad.float().flatten() for p in routers])
        name = "fp32" if dtype == torch.float32 else "bf16"
        out[f"{name} transformers, step scope"] = f"{whole.item():.6g}, {total:.6g}"
        out[f"{name} value rel. diff"] = abs(total - whole.item()) / abs(whole.item())
        out[f"{name} router gradient rel. diff"] = relative(got, want)
        out[f"{name} ok"] = (
            out[f"{name} value rel. diff"] < bounds[0]
            and out[f"{name} router gradient rel. diff"] < bounds[1]
        )
        del model
    out["ok"] = out["fp32 ok"] and out["bf16 ok"]
    return out


def grouped(vocab: int, groups: int, size: int, prompt: int, completion: int, device: str):
    """``groups`` prompts of ``prompt`` tokens with ``size`` completions each (of ``completion``
    tokens give or take a quarter): (ids, attention, response mask) for a tree and a packed row."""
    g = torch.Generator().manual_seed(0)
    n, width = groups * size, prompt + completion + completion // 4
    ids = torch.randint(3, vocab, (n, width), generator=g)
    attention, response = torch.zeros_like(ids), torch.zeros_like(ids)
    for i in range(n):
        ids[i, :prompt] = ids[i - i % size, :prompt]
        end = (
            prompt + completion + int(torch.randint(-completion // 4, completion // 4 + 1, (1,), generator=g))
        )
        attention[i, :end], response[i, prompt:end] = 1, 1
    return ids.to(device), attention.to(device), response.to(device)


def part_prefix_tree(args) -> dict:
    from rltrain.forward import attention as tree_attention
    from rltrain.forward.tree import build_tree, tree_logprobs

    shape, vocab = (TINY, 512) if args.cpu else (SHAPES["0.5B"], VOCAB)
    name = tree_attention.register()
    out = {}

    def both(model, ids, mask, response, tree, weights):
        """(log-probs, gradient) unshared (one packed row) and through the tree."""
        results = []
        for shared in (False, True):
            model.zero_grad(set_to_none=True)
            if shared:
                logprobs, _ = tree_logprobs(model, tree, ids)
            else:
                logprobs, _ = sequence_logprobs(model, ids, mask, packed=True)
            (logprobs * weights * response).sum().backward()
            results.append(((logprobs * response).detach().float(), gradient(model)))
        return results

    small = (2, 4, 48, 16) if args.cpu else (2, 8, 1200, 300)
    for dtype, bound in ((torch.float32, 1e-4), (torch.bfloat16, 1e-1)):
        model = qwen2(shape, vocab, dtype, args.device, attn=name)
        ids, mask, response = grouped(vocab, *small, args.device)
        tree = build_tree(ids, mask, ~response.bool())
        weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1)).to(args.device)
        (values, grads), (tree_values, tree_grads) = both(model, ids, mask, response, tree, weights)
        label = "fp32" if dtype == torch.float32 else "bf16"
        out[f"{label} log-probs max abs diff"] = (values - tree_values).abs().max().item()
        out[f"{label} gradient rel. diff"] = relative(tree_grads, grads)
        out[f"{label} ok"] = out[f"{label} gradient rel. diff"] < bound
        del model
    # time, bf16: forward + backward of one micro-batch, tree over unshared
    model = qwen2(shape, vocab, torch.bfloat16, args.device, attn=name)
    total = 240 if args.cpu else 2400  # prompt + completion
    cases = [(8, 4, 1), (8, 1, 1), (8, 1, 4), (16, 4, 1)]
    for size, p, c in cases:
        groups = max(1, (4 if args.cpu else 16) // size)
        ids, mask, response = grouped(
            vocab, groups, size, total * p // (p + c), total * c // (p + c), args.device
        )
        tree = build_tree(ids, mask, ~response.bool())
        weights = torch.ones(ids.shape, device=args.device)

        def run(shared, model=model, ids=ids, mask=mask, response=response, tree=tree):
            model.zero_grad(set_to_none=True)
            if shared:
                logprobs, _ = tree_logprobs(model, tree, ids)
            else:
                logprobs, _ = sequence_logprobs(model, ids, mask, packed=True)
            (logprobs * response).sum().backward()

        unshared_s, unshared_peak = measure(args.device, lambda run=run: run(False))
        shared_s, shared_peak = measure(args.device, lambda run=run: run(True))
        key = f"G{size} {p}:{c}"
        out[f"{key} shared fraction"] = tree.shared_fraction
        out[f"{key} time shared/unshared"] = shared_s / unshared_s
        if unshared_peak:
            out[f"{key} peak shared/unshared"] = shared_peak / unshared_peak
    out["ok"] = out["fp32 ok"] and out["bf16 ok"]
    return out


PARTS = {"token_mode": part_token_mode, "logprobs": part_logprobs, "step": part_step, "packed": part_packed,
         "moe_aux": part_moe_aux, "prefix_tree": part_prefix_tree}  # fmt: skip
LIMIT_S = {"token_mode": 90, "logprobs": 60, "step": 180, "packed": 60, "moe_aux": 60, "prefix_tree": 90}


class PartTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: int):
    def expire(*_):
        raise PartTimeout(f"over its {seconds} s limit")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--out", default="gpu_check.json", help="the JSON file, rewritten after each part")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here (--device cpu runs the tiny shapes)")
    args.cpu = args.device == "cpu"
    args.dtype = torch.float32 if args.cpu else torch.bfloat16
    scale = 0.2 if args.cpu else 1.0  # tiny shapes: seconds
    report = {"device": torch.cuda.get_device_name() if not args.cpu else "cpu", "torch": torch.__version__,
              "parts": {}}  # fmt: skip
    for name in args.parts:
        start = time.perf_counter()
        try:
            with time_limit(max(5, int(LIMIT_S[name] * scale))):
                figures = PARTS[name](args)
        except Exception as e:  # a part that fails or hangs leaves the others
            figures = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        figures["seconds"] = time.perf_counter() - start
        report["parts"][name] = figures
        report["imported"] = sorted(m for m in NOT_HERE if m in sys.modules)
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"== {name} ({figures['seconds']:.1f} s)")
        for key, value in figures.items():
            shown = f"{value:.3g}" if isinstance(value, float) else value
            print(f"  {key:48s} {shown}")
        if args.device == "cuda":
            torch.cuda.empty_cache()
    failed = [name for name, f in report["parts"].items() if f.get("ok") is False]
    print(
        f"figures in {args.out}; " + (f"failed: {', '.join(failed)}" if failed else "every comparison held")
    )
    return 1 if failed or report["imported"] else 0


if __name__ == "__main__":
    sys.exit(main())
