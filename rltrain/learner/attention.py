"""Attention over packed rows, one document at a time (variable-length attention without a mask).

transformers runs a packed row on ``sdpa`` with one ``[L, L]`` block-diagonal mask: exact, but the
attention work and the mask grow with the square of the whole row, and on CPU (no variable-length
kernel) that outgrows everything else once rows hold a few thousand tokens. The function
registered here (:data:`PACKED`) cuts the row at the documents' boundaries (where the position id
is 0) and runs causal ``scaled_dot_product_attention`` on each document: work and memory follow
``sum(document_length ** 2)``, as with flash-attention's variable-length kernels, and no mask is built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACKED = "rltrain_packed"


def register() -> str:
    """Register :data:`PACKED` with transformers; returns the name for ``attn_implementation``."""
    register_attention(PACKED, packed_attention)
    return PACKED


def register_attention(name: str, function) -> None:
    """Register an attention function that builds no mask of its own (packed rows carry their
    documents in the position ids)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, lambda *args, **kwargs: None)


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
    """transformers attention-function signature: ``query`` ``[1, H, L, D]``, ``key``/``value``
    ``[1, Hkv, L, D]`` of one packed row; returns ``[1, L, H, D]``."""
    if position_ids is None:
        raise RuntimeError(f"the {PACKED!r} attention needs position_ids (a packed row)")
    out = document_attention(query, key, value, position_ids, scaling, dropout)
    return out.transpose(1, 2).contiguous(), None


def document_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    position_ids_1L: torch.Tensor,
    scaling: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention inside each document of one packed row: ``[1, H, L, D]``. A document starts
    where the position id is 0; grouped-query key/value heads are broadcast."""
    if position_ids_1L.shape[0] != 1:
        raise ValueError(f"packed attention takes one row, got {position_ids_1L.shape[0]}")
    length = position_ids_1L.shape[-1]
    starts = (position_ids_1L[0] == 0).nonzero().flatten().tolist()
    bounds = ([0] if not starts or starts[0] != 0 else []) + starts + [length]
    gqa = query.shape[1] != key.shape[1]
    parts = [
        F.scaled_dot_product_attention(
            query[:, :, s:e],
            key[:, :, s:e],
            value[:, :, s:e],
            is_causal=True,
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=gqa,
        )  # fmt: skip
        for s, e in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(parts, dim=2)
