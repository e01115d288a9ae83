"""Exact normalization without a gradient rescaling pass.

One optimizer step of token-mean loss over several micro-batches, done two ways:
- rltrain: each micro-batch's token sum divided by the precomputed step total, then backward;
- rescaling (the approach of a public SFT fix): each micro-batch's token sum, then after the
  last backward every parameter gradient multiplied by 1 / total.
Counts the operations that touch parameter gradients outside backward, times the rescaling pass
on a model of the given size, and checks both give the same gradient.

    python benchmarks/bench_no_rescale.py [--params-millions 100] [--micro-batches 4]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import table
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rltrain.masked_mean import group_token_totals, masked_mean


class GradTouches(TorchDispatchMode):
    """Counts aten operations that read or write a parameter's .grad while not inside backward."""

    def __init__(self, params: list[torch.nn.Parameter]):
        super().__init__()
        self.params, self.count, self.in_backward = params, 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.in_backward:
            grads = {p.grad.untyped_storage().data_ptr() for p in self.params if p.grad is not None}
            if any(
                isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in grads
                for t in tree_leaves((args, kwargs))
            ):
                self.count += 1
        return func(*args, **(kwargs or {}))

    def backward(self, loss: torch.Tensor) -> None:
        self.in_backward = True
        loss.backward()
        self.in_backward = False


def make_model(params_millions: float, width: int = 1024) -> torch.nn.Module:
    layers = max(1, round(params_millions * 1e6 / (width * width + width)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def micro_batches(k: int, width: int):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, 8, width, generator=g), torch.rand(4, 8, generator=g) < 0.2 + 0.2 * i)
        for i in range(k)
    ]


def step(model, batches, mode: str) -> int:
    """One accumulation step; returns the number of operations on .grad outside backward."""
    params = list(model.parameters())
    model.zero_grad(set_to_none=True)
    total = group_token_totals([m for _, m in batches], len(batches))[0]
    counter = GradTouches(params)
    with counter:
        for x, mask in batches:
            per_token = model(x).pow(2).mean(-1)  # [B, T]
            if mode == "rltrain":
                counter.backward(masked_mean(per_token, mask, denominator=total))
            else:
                counter.backward(masked_mean(per_token, mask, denominator=1.0))  # the token sum
        if mode == "rescale":
            rescale(params, total)
    return counter.count


def rescale(params: list[torch.nn.Parameter], total: torch.Tensor) -> None:
    for p in params:
        p.grad.mul_(1.0 / total)


def time_rescale(model, repeats: int) -> float:
    """Best wall time of one rescaling pass over every gradient (no counter attached)."""
    params, best = list(model.parameters()), float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        rescale(params, torch.tensor(1.0))
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params-millions", type=float, default=100)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = make_model(args.params_millions)
    n_params = sum(p.numel() for p in model.parameters())
    batches = micro_batches(args.micro_batches, 1024)
    touches, grads = {}, {}
    for mode in ("rltrain", "rescale"):
        touches[mode] = step(model, batches, mode)
        grads[mode] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    seconds = time_rescale(model, args.repeats)
    diff = ((grads["rltrain"] - grads["rescale"]).norm() / grads["rescale"].norm()).item()
    print(
        f"{n_params / 1e6:.0f}M fp32 parameters in {len(list(model.parameters()))} tensors, "
        f"{args.micro_batches} micro-batches; gradients agree to {diff:.1e} relative"
    )
    print(
        table(
            [
                "normalization",
                "ops on .grad outside backward",
                f"rescaling pass (ms, best of {args.repeats})",
            ],
            [
                ["rltrain token mode (denominator before backward)", touches["rltrain"], "0 (none runs)"],
                ["rescale gradients after accumulation", touches["rescale"], f"{seconds * 1e3:.1f}"],
            ],
        )
    )


if __name__ == "__main__":
    main()
