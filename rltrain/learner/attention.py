"""Attention over packed rows and prefix trees, segment by segment (variable-length attention
without a mask over the whole row).

transformers runs a packed row on ``sdpa`` with one ``[L, L]`` block-diagonal mask: exact, but the
attention work and the mask grow with the square of the whole row, and on CPU (no variable-length
kernel) that outgrows everything else once rows hold a few thousand tokens. The function
registered here (:data:`PACKED`) cuts the row where the position ids stop counting up by one and
runs ``scaled_dot_product_attention`` on each piece: work and memory follow each piece's own
length, as with flash-attention's variable-length kernels, and no mask over the row is built.

The position ids say everything about the row's structure:

- a **document** (a packed sequence) starts where the position id is 0 and attends causally to
  itself;
- a **branch** of a prefix tree (:mod:`rltrain.learner.prefix_tree`) starts at position ``q > 0``
  right after tokens whose positions do not lead up to it: it attends to its ancestors, for every
  position ``p < q`` the nearest earlier token at position ``p`` (the tree is laid out depth first,
  so that is the shared prefix it continues), and causally to itself. A completion's position ids
  thus continue from the end of the prompt it shares, as they would in its own row.

A padded batch (a 2-D attention mask) goes to transformers' own ``sdpa`` attention and mask, so
a model loaded with :data:`PACKED` runs padded rows exactly as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

PACKED = "rltrain_packed"


def register() -> str:
    """Register :data:`PACKED` with transformers; returns the name for ``attn_implementation``."""
    from transformers.masking_utils import sdpa_mask

    def mask(*args, attention_mask=None, **kwargs):
        # a packed or tree row carries its structure in the position ids: no mask is built for it
        return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)

    register_attention(PACKED, packed_attention, mask)
    return PACKED


def register_attention(name: str, function, mask=None) -> None:
    """Register an attention function with transformers, beside its mask function (without one,
    transformers would silently build none, or a causal one over the whole row): ``mask`` None, a
    function that builds no mask (packed rows carry their documents in the position ids)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, mask or (lambda *args, **kwargs: None))


def packed_attention(
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
    """transformers attention-function signature: ``query`` ``[B, H, L, D]``, ``key``/``value``
    ``[B, Hkv, L, D]``; returns ``[B, L, H, D]``. Rows without a mask (packed rows, prefix trees)
    are cut by their position ids; a masked (padded) batch runs on transformers' ``sdpa``."""
    if attention_mask is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if position_ids is None:
        raise RuntimeError(f"the {PACKED!r} attention needs position_ids (a packed row)")
    if query.shape[0] == 1:  # a packed or tree row (its pieces are planned once for every layer)
        out = document_attention(query, key, value, position_ids, scaling, dropout)
    else:
        out = torch.cat([
            document_attention(query[b : b + 1], key[b : b + 1], value[b : b + 1], position_ids[b : b + 1],
                               scaling, dropout)
            for b in range(query.shape[0])
        ])  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def segments(position_ids_L: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(start index, end index, first position)`` of each run of the row whose position ids count
    up by one."""
    length = position_ids_L.shape[0]
    breaks = (position_ids_L[1:] != position_ids_L[:-1] + 1).nonzero().flatten().add(1).tolist()
    bounds = [0, *breaks, length]
    first = position_ids_L[bounds[:-1]].tolist() if length else []
    return [(s, e, int(p)) for s, e, p in zip(bounds[:-1], bounds[1:], first)]


def ancestors(pieces: list[tuple[int, int, int]], k: int) -> list[tuple[int, int]]:
    """The index ranges of piece ``k``'s ancestors, in order: for every position below the
    piece's first one, the nearest earlier token at that position (depth-first layout)."""
    need, out = pieces[k][2], []
    for s, e, first in reversed(pieces[:k]):
        if need <= 0:
            break
        if first < need:
            out.append((s, s + min(e - s, need - first)))
            need = first
    if need > 0:
        raise ValueError(
            f"a row piece starts at position {pieces[k][2]} with no tokens before it at {need - 1}"
        )
    return out[::-1]


def document_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    position_ids_1L: torch.Tensor,
    scaling: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Attention inside each document and prefix tree of one row: ``[1, H, L, D]`` (see the
    module docstring). Grouped-query key/value heads are broadcast."""
    if position_ids_1L.shape[0] != 1:
        raise ValueError(f"packed attention takes one row, got {position_ids_1L.shape[0]}")
    gqa = query.shape[1] != key.shape[1]
    parts = []
    for s, e, index in _pieces(position_ids_1L):
        if index is None:
            parts.append(F.scaled_dot_product_attention(
                query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True, dropout_p=dropout,
                scale=scaling, enable_gqa=gqa,
            ))  # fmt: skip
            continue
        # the branch's tokens see every ancestor and, causally, each other: causal aligned to the
        # last key (no mask is built; the fused kernels take it)
        parts.append(F.scaled_dot_product_attention(
            query[:, :, s:e], key.index_select(2, index), value.index_select(2, index),
            attn_mask=causal_lower_right(e - s, index.shape[0]), dropout_p=dropout, scale=scaling,
            enable_gqa=gqa,
        ))  # fmt: skip
    return torch.cat(parts, dim=2)


_last_plan: list = [None, None]  # the last row's (position ids, pieces): every layer reads the same row


def _pieces(position_ids_1L: torch.Tensor) -> list[tuple[int, int, torch.Tensor | None]]:
    """Each piece of the row: ``(start, end, key indices)``; a document's (or a tree's root's)
    indices are None (causal over itself), a branch's are its ancestors' and its own."""
    if _last_plan[0] is position_ids_1L:
        return _last_plan[1]
    pieces = segments(position_ids_1L[0])
    device = position_ids_1L.device
    plan = []
    for k, (s, e, first) in enumerate(pieces):
        before = ancestors(pieces, k) if first > 0 else []
        if not before:
            plan.append((s, e, None))
            continue
        index = torch.cat([torch.arange(a, b) for a, b in before] + [torch.arange(s, e)]).to(device)
        plan.append((s, e, index))
    _last_plan[:] = [position_ids_1L, plan]
    return plan
