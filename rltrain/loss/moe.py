"""The load-balancing loss of a mixture of experts, exact over an optimizer step.

transformers' ``load_balancing_loss_func`` (Switch Transformer's auxiliary loss, as Qwen3-MoE,
Qwen2-MoE, OLMoE and Mixtral define it) pools the rows of *one forward*, every layer's together::

    aux = E * sum_e f_e * P_e,   f_e = c_e / R,   P_e = p_e / R

with ``E`` experts, ``R`` the rows counted (tokens x layers), ``c_e`` the top-k assignments of expert
``e`` over those rows and ``p_e`` the sum of its router probabilities. Under gradient accumulation
and data parallelism a trainer that adds it per forward optimizes a mean of micro-batch losses:
the layout's choice, as a per-micro-batch mean is for the policy loss
(:mod:`rltrain.loss.masked_mean`).

The fractions ``f_e`` carry no gradient, so the step's loss splits into micro-batch terms exactly:
with the step's counts ``C_e`` and rows ``R`` (summed over every micro-batch of the accumulation
group on every rank, in the one collective of :func:`~rltrain.loss.masked_mean.step_totals`)::

    aux_step = E * sum_e (C_e / R) * (sum_mb p_e^mb) / R = sum_mb  E * sum_e C_e * p_e^mb / R^2

:func:`load_balancing_loss` gives one micro-batch's term. Summed over micro-batches and ranks it is
transformers' loss on all of the step's rows at once, value and gradient; with an engine that
averages gradients over ``W`` ranks, multiply each term by ``W`` (as the ``token`` mode does).
Given its own counts (:func:`expert_counts` of the same logits) it *is* transformers' per-forward
loss: the ``micro_batch`` scope, kept as the control.

Which rows count: a row is one token in one layer; every attended token of a real sequence (its
prompt and its completion) counts, padding and the empty micro-batches that keep ranks in step do
not. ``rows_N`` says which of a forward's router rows those are: bool, or an int64 count of the
sequences a row stands for (a prompt token computed once for the G members sharing it, in a
prefix-tree forward, counts G times, as its G copies do in the unshared forward).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def expert_counts(
    router_logits: Sequence[torch.Tensor],
    rows_N: torch.Tensor,
    top_k: int,
    chosen: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Top-``top_k`` assignments of every expert in every layer over the counted rows: int64
    ``[L, E]`` (no gradient). ``router_logits``: one ``[N, E]`` tensor per layer; ``chosen``: the
    ``[N, k]`` experts each row went to where they are not the logits' top-k (routing replay)."""
    keep, uses = rows_N.bool(), rows_N.long()
    counts = []
    for layer, logits_NE in enumerate(router_logits):
        picked = None if chosen is None else chosen[layer]
        if picked is None:
            picked = torch.topk(logits_NE.detach(), top_k, dim=-1).indices  # softmax keeps the order
        picked = picked[keep].repeat_interleave(uses[keep], dim=0)  # a row per sequence it stands for
        counts.append(torch.bincount(picked.reshape(-1), minlength=logits_NE.shape[-1]))
    return torch.stack(counts).long()


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    rows_N: torch.Tensor,
    counts_E: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """One forward's term of the load-balancing loss whose assignment counts are ``counts_E``
    (summed over layers: ``[E]``, or ``[L, E]`` summed here), ``E * sum_e counts_e * p_e / R^2``
    with ``R = counts.sum() / top_k`` the rows they were counted over (see the module docstring).
    Zero counts give 0."""
    counts_E = counts_E.reshape(-1, counts_E.shape[-1]).sum(0).to(torch.float64)
    num_experts = counts_E.shape[0]
    rows = counts_E.sum() / top_k
    if rows == 0:
        return router_logits[0].new_zeros(()) * router_logits[0].sum()  # keeps the graph
    keep = rows_N.bool()
    uses = rows_N[keep].float()[:, None]
    prob_sum_E = sum(
        (torch.softmax(logits_NE[keep].float(), dim=-1) * uses).sum(0) for logits_NE in router_logits
    )
    weights_E = (counts_E * num_experts / rows**2).to(prob_sum_E.dtype)
    return (weights_E * prob_sum_E).sum()


def router_entropy_sum(router_logits: Sequence[torch.Tensor], rows_N: torch.Tensor) -> torch.Tensor:
    """The entropy of the router's distribution (nats) summed over the counted rows of every layer."""
    keep = rows_N.bool()
    uses = rows_N[keep].float()[:, None]
    total = torch.zeros((), dtype=torch.float64)
    for logits_NE in router_logits:
        logp = torch.log_softmax(logits_NE.detach()[keep].float(), dim=-1)
        total += -(logp.exp() * logp * uses).sum().double().cpu()
    return total


def expert_load_max(counts_LE: torch.Tensor) -> torch.Tensor:
    """Per layer, the busiest expert's share of the assignments over an even share (1: balanced,
    ``E / top_k``: every token to the same experts): ``[L]``; 0 for a layer with no assignments."""
    counts = counts_LE.to(torch.float64)
    total = counts.sum(-1)
    even = total / counts.shape[-1]
    return torch.where(total > 0, counts.max(-1).values / even.clamp(min=1e-12), torch.zeros_like(total))
