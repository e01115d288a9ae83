"""The load-balancing loss split over micro-batches (rltrain.loss.moe) against transformers' own
load_balancing_loss_func on all rows at once: value and gradient; and which of vLLM's expert
parameters a mixture's sent weights load (the sync check's diagnosis)."""

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from rltrain.loss.moe import expert_counts, expert_load_max, load_balancing_loss, router_entropy_sum

E, K, LAYERS = 8, 2, 3


def _logits(rows: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, E, generator=g, requires_grad=True) for _ in range(LAYERS)]


def _mask(lengths: list[int], width: int) -> torch.Tensor:
    """Left-padded attention masks ``[B, width]``."""
    return torch.stack([torch.arange(width) >= width - n for n in lengths]).long()


def test_micro_batch_terms_sum_to_the_loss_over_all_rows():
    # three micro-batches of very different sizes (1, 2 and 3 sequences, lengths 2..7, padded)
    masks = [_mask([2], 4), _mask([7, 3], 7), _mask([5, 5, 1], 6)]
    logits = [_logits(m.numel(), seed=i) for i, m in enumerate(masks)]
    rows = [m.reshape(-1) for m in masks]
    # transformers on all rows at once: each layer's rows of every micro-batch, one mask
    whole = tuple(torch.cat([lg[layer] for lg in logits]) for layer in range(LAYERS))
    expected = load_balancing_loss_func(whole, E, K, torch.cat(rows)[None])
    counts = sum(expert_counts(lg, r, K) for lg, r in zip(logits, rows))  # the step's counts [L, E]
    # real rows: 2 + (7 + 3) + (5 + 5 + 1) = 23 tokens, in 3 layers, K assignments each
    assert counts.sum().item() == 23 * LAYERS * K
    ours = sum(load_balancing_loss(lg, r, counts, K) for lg, r in zip(logits, rows))
    torch.testing.assert_close(ours, expected.to(ours.dtype), rtol=1e-6, atol=1e-7)
    grads = torch.autograd.grad(ours, [t for lg in logits for t in lg])
    expected_grads = torch.autograd.grad(expected, [t for lg in logits for t in lg])
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    # the per-micro-batch mean (transformers per forward, /3 accumulation steps) is another loss
    naive = sum(load_balancing_loss(lg, r, expert_counts(lg, r, K), K) for lg, r in zip(logits, rows)) / 3
    assert abs(naive.item() - expected.item()) > 1e-3


def test_own_counts_give_transformers_per_forward_loss():
    mask = _mask([3, 6], 6)
    logits = _logits(mask.numel(), seed=7)
    ours = load_balancing_loss(logits, mask.reshape(-1), expert_counts(logits, mask.reshape(-1), K), K)
    expected = load_balancing_loss_func(tuple(logits), E, K, mask)
    torch.testing.assert_close(ours, expected.to(ours.dtype), rtol=1e-6, atol=1e-7)


def test_no_rows_give_zero_with_a_graph():
    logits = _logits(4, seed=1)
    none = torch.zeros(4, dtype=torch.bool)
    loss = load_balancing_loss(logits, none, expert_counts(logits, none, K), K)
    assert loss.item() == 0.0 and loss.requires_grad


def test_metrics():
    # layer 0: 6 assignments, all to expert 0 -> share 1 over an even 1/2: 2.0; layer 1: 3 and 3 -> 1.0
    counts = torch.tensor([[6, 0], [3, 3], [0, 0]])
    assert expert_load_max(counts).tolist() == [2.0, 1.0, 0.0]
    # uniform logits over E experts: entropy log(E) per row, 2 rows counted of 3, in 3 layers
    uniform = [torch.zeros(3, E) for _ in range(LAYERS)]
    total = router_entropy_sum(uniform, torch.tensor([True, False, True]))
    assert total.item() == pytest.approx(2 * LAYERS * torch.log(torch.tensor(float(E))).item(), rel=1e-6)
