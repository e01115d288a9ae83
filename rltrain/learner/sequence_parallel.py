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

Loss tokens: the log-prob of packed token ``j`` comes from the logits at ``j - 1``, so the rank
holding position ``j - 1`` *owns* it (:func:`owned_positions`). Each rank sums its loss over the
tokens it owns and counts only those in the token totals, so every loss token is counted exactly
once over the world, in the same one collective as without sequence parallelism. The scale factor
that cancels the engine's gradient reduction is derived in :mod:`rltrain.loss.masked_mean`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.nn.functional import all_to_all_single

from rltrain.batch import TrainBatch
from rltrain.forward.attention import document_attention, layer_asks, register_attention
from rltrain.forward.head import head_forward
from rltrain.forward.layouts import pack_sequences, packed_forward
from rltrain.loss.logprobs import Truncation, predicted_logprobs

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


# ---------------------------------------------------------------------------- slicing a packed row


def row_slice(length: int, sp: int, rank: int) -> slice:
    """This rank's contiguous part of a packed row of ``length`` tokens padded to a multiple of ``sp``."""
    per_rank = -(-length // sp)
    return slice(rank * per_rank, (rank + 1) * per_rank)


def shard_packed_row(
    input_ids_1L: torch.Tensor, position_ids_1L: torch.Tensor, sp: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad the row to a multiple of ``sp`` (the padding is a document of its own, masked out of
    everything) and return this rank's slice of ids and position ids."""
    length = input_ids_1L.shape[1]
    pad = -length % sp
    ids = F.pad(input_ids_1L, (0, pad))
    positions = torch.cat([position_ids_1L, torch.arange(pad, device=position_ids_1L.device)[None]], dim=1)
    part = row_slice(length, sp, rank)
    return ids[:, part], positions[:, part]


def owned_positions(attention_mask_BT: torch.Tensor, sp: int, rank: int) -> torch.Tensor:
    """``[B, T]`` bool: the tokens whose log-prob this rank computes (packed index ``j`` with its
    predicting position ``j - 1`` in this rank's slice). Over the ``sp`` ranks each attended token
    but the row's first is owned exactly once."""
    keep_BT = attention_mask_BT.bool()
    length = int(keep_BT.sum())
    part = row_slice(length, sp, rank)
    packed_index = torch.arange(length, device=attention_mask_BT.device)
    owned_L = (packed_index - 1 >= part.start) & (packed_index - 1 < part.stop)
    return torch.zeros_like(keep_BT).masked_scatter(keep_BT, owned_L)


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    sp: int,
    rank: int,
    truncation: Truncation | None = None,
    agree_chunks=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`rltrain.forward.sequence_logprobs` (packed) for one rank of a sequence-parallel group:
    ``[B, T]`` log-probs (and entropy) on this rank's :func:`owned_positions`, 0 elsewhere.

    Every rank of the group calls this with the same micro-batch at the same time.
    """
    keep_BT = attention_mask_BT.bool()
    ids_1L, positions_1L = pack_sequences(input_ids_BT, attention_mask_BT)
    length = ids_1L.shape[1]
    local_ids, local_positions = shard_packed_row(ids_1L, positions_1L, sp, rank)
    states_1N, head = head_forward(
        model, lambda **extra: packed_forward(model, local_ids, local_positions, **extra)
    )
    # targets: the next token of the whole row (the last local position predicts the first of the
    # next rank's slice); positions past the row predict padding and are dropped below
    part = row_slice(length, sp, rank)
    targets_1N = F.pad(ids_1L, (0, part.stop + 1 - length))[:, part.start + 1 : part.stop + 1]
    logprobs_1N, entropy_1N = predicted_logprobs(
        states_1N, head, targets_1N, temperature, with_entropy, truncation, agree_chunks
    )
    # packed index j = part.start + 1 + n; a document's first token is predicted by the previous
    # document and gets 0, as in the single-rank packed layout
    index_N = torch.arange(part.start + 1, part.stop + 1, device=ids_1L.device)
    valid_N = index_N < length
    starts_N = positions_1L[0, index_N.clamp(max=length - 1)] == 0
    owned_BT = owned_positions(attention_mask_BT, sp, rank)

    def unpack(values_1N: torch.Tensor) -> torch.Tensor:
        values_N = torch.where(starts_N, 0.0, values_1N[0])[valid_N]
        return values_N.new_zeros(keep_BT.shape).masked_scatter(owned_BT, values_N)

    return unpack(logprobs_1N), None if entropy_1N is None else unpack(entropy_1N)


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
