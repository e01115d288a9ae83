"""Ulysses sequence parallelism for packed rows: ``sp`` ranks share one packed micro-batch, each
holding a contiguous slice of the row.

Every layer runs on the local slice except attention, which needs the whole row. The attention
function registered here (:data:`ATTENTION`, through transformers' ``AttentionInterface``):

1. repeats key/value heads when their count does not divide by ``sp`` (grouped-query attention);
2. all-to-all: sequence-sharded ``[B, H, L/sp, D]`` -> head-sharded ``[B, H/sp, L, D]``;
3. all-gathers the slices' position ids, which tell the row's documents apart (each starts at 0);
4. runs causal attention on its heads, document by document over the whole row
   (:func:`rltrain.forward.attention.document_attention`, with what the layer asks for: windows,
   soft-capping, its heads' sinks), so packed rows stay exact;
5. all-to-all back to ``[B, L/sp, H, D]``.

The all-to-alls are autograd functions, so the backward pass moves gradients the same way.
Where this departs from DeepSpeed's ``UlyssesSPAttentionHF``: documents are kept apart rather
than the mask dropped (that wrapper is exact only with one sequence per row), and any key/value
head count works.

A rank's share of a row is a packed row's layout like any other (``RowLayout.shard``, its slice
and its tokens' log-probs in :mod:`rltrain.forward`). Loss tokens: the log-prob of packed token
``j`` comes from the logits at ``j - 1``, so the rank holding position ``j - 1`` *owns* it
(:func:`rltrain.forward.layouts.owned_positions`). Each rank sums its loss over the
tokens it owns and counts only those in the token totals, so every loss token is counted exactly
once over the world, in the same one collective as without sequence parallelism. The scale factor
that cancels the engine's gradient reduction is derived in :mod:`rltrain.loss.masked_mean`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single

from rltrain.batch import TrainBatch
from rltrain.forward.attention import document_attention, layer_asks, register_attention
from rltrain.forward.layouts import owned_positions

ATTENTION = "rltrain_ulysses"
_group: dist.ProcessGroup | None = None


def use_group(group: dist.ProcessGroup) -> str:
    """Make ``group`` (this rank's ``sp`` ranks) the one the attention function talks to, register
    the attention function with transformers, and return its name for ``attn_implementation``."""
    global _group
    _group = group
    register_attention(ATTENTION, ulysses_attention)
    return ATTENTION


def group_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum ``values`` over the ranks of this rank's group (each holds part of every sequence of the
    micro-batch: a per-sequence ``[B]`` sum, or ``[B, T]`` values on its owned positions): one
    ``all_reduce`` in the group, no gradient (GSPO's sequence log-ratio is a stop-gradient value).
    Every rank of the group calls it for the same micro-batch."""
    total = values.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=_group)
    return total


def ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-function signature; ``query`` ``[B, H, L/sp, D]``, ``key``/``value``
    ``[B, Hkv, L/sp, D]``; returns ``[B, L/sp, H, D]``. ``attention_mask`` is ignored: documents
    come from ``position_ids`` (packed rows, no padding inside a row)."""
    if _group is None or position_ids is None:
        raise RuntimeError("ulysses_attention needs use_group() and position_ids (a packed row)")
    sp = dist.get_world_size(_group)
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % sp:
        raise ValueError(f"{heads} attention heads do not divide over sequence_parallel_size={sp}")
    if kv_heads % sp:
        key, value = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (key, value))
    q, k, v = (_sequence_to_heads(x, sp) for x in (query, key, value))  # [B, H/sp, L, D]
    rank, share = dist.get_rank(_group), heads // sp
    asks = layer_asks(module, scaling, kwargs).heads(
        slice(rank * share, (rank + 1) * share)
    )  # this rank's heads
    out = document_attention(q, k, v, _all_gather_positions(position_ids, sp), scaling, dropout, asks)
    return _heads_to_sequence(out, sp).transpose(1, 2).contiguous(), None


def _sequence_to_heads(x: torch.Tensor, sp: int) -> torch.Tensor:
    """``[B, H, L/sp, D]`` on each rank -> ``[B, H/sp, L, D]``: head chunk ``r`` goes to rank ``r``."""
    b, h, n, d = x.shape
    send = x.reshape(b, sp, h // sp, n, d).transpose(0, 1).contiguous()  # [sp (to), B, H/sp, n, D]
    received = all_to_all_single(torch.empty_like(send), send, group=_group)  # [sp (from), ...]
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * n, d)


def _heads_to_sequence(x: torch.Tensor, sp: int) -> torch.Tensor:
    """``[B, H/sp, L, D]`` -> ``[B, H, L/sp, D]``: sequence chunk ``r`` goes back to rank ``r``."""
    b, h, length, d = x.shape
    send = (
        x.reshape(b, h, sp, length // sp, d).permute(2, 0, 1, 3, 4).contiguous()
    )  # [sp (to), B, H/sp, n, D]
    received = all_to_all_single(torch.empty_like(send), send, group=_group)  # [sp (from: head chunk), ...]
    return received.transpose(0, 1).reshape(b, sp * h, length // sp, d)


def _all_gather_positions(position_ids: torch.Tensor, sp: int) -> torch.Tensor:
    parts = [torch.empty_like(position_ids) for _ in range(sp)]
    dist.all_gather(parts, position_ids.contiguous(), group=_group)
    return torch.cat(parts, dim=-1)


def own_tokens(mb: TrainBatch, sp: int, rank: int) -> TrainBatch:
    """The loss tokens of ``rank`` in its group of ``sp``: those whose log-prob it computes, so each
    token counts once in the losses, the metrics and the token totals. A per-sequence loss divides
    by the whole sequence's token count (``sequence_tokens``: every rank holds the whole row's
    masks), and the rank owning a sequence's first loss token counts the sequence (``counted``), so
    it counts once in the step's sequence total. ``sp`` 1: ``mb`` itself."""
    if sp == 1:
        return mb
    keep = mb.response_mask.bool() & mb.tool_mask.bool()
    owned = owned_positions(mb.attention_mask, sp, rank)
    first = keep.float().argmax(-1, keepdim=True)  # the first loss token of each row
    counted = keep.any(-1) & owned.gather(-1, first).squeeze(-1)
    return mb.replace(
        response_mask=mb.response_mask * owned, sequence_tokens=keep.sum(-1), counted=counted.long()
    )
