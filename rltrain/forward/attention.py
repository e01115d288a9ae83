"""Attention over packed rows and prefix trees, segment by segment (variable-length attention
without a mask over the whole row), honouring what each layer asks for.

transformers runs a packed row on ``sdpa`` with one ``[L, L]`` block-diagonal mask: exact, but the
attention work and the mask grow with the square of the whole row, and on CPU (no variable-length
kernel) that outgrows everything else once rows hold a few thousand tokens. The function
registered here (:data:`PACKED`) cuts the row where the position ids stop counting up by one and
runs attention on each piece: work and memory follow each piece's own length, as with
flash-attention's variable-length kernels, and no mask over the row is built.

The position ids say everything about the row's structure (:mod:`rltrain.forward.structure`):

- a **document** (a packed sequence) starts where the position id is 0 and attends causally to
  itself;
- a **branch** of a prefix tree (:mod:`rltrain.forward.tree`) starts at position ``q > 0``
  right after tokens whose positions do not lead up to it: it attends to its ancestors, for every
  position ``p < q`` the nearest earlier token at position ``p`` (the tree is laid out depth first,
  so that is the shared prefix it continues), and causally to itself. A completion's position ids
  thus continue from the end of the prompt it shares, as they would in its own row.

What a layer asks for comes with each call, as transformers' attention functions receive it
(:mod:`rltrain.models.families` says which families ask for what):

- ``sliding_window`` ``w`` (Mistral, Qwen2's sliding layers, Gemma 2/3, gpt-oss, OLMo 3): a query at
  position ``q`` sees keys at positions ``q - w < p <= q``, as transformers' masks say. A piece's
  key indices are in position order (a branch: its ancestors' positions 0..q-1, then its own), so
  the window is a band on them; ``scaled_dot_product_attention`` takes it as a mask built per piece
  (only where the window is shorter than the piece).
- ``softcap`` (Gemma 2's attention logits, ``c * tanh(s / c)``) and ``s_aux``, attention sinks
  (gpt-oss: a logit per head in each softmax's denominator, attending to nothing): no fused kernel
  takes them here, so such layers run the model's own eager arithmetic, piece by piece.
- ``scaling`` (Gemma's ``query_pre_attn_scalar``): passed through.

A padded batch (a 2-D attention mask) goes to transformers' own ``sdpa`` attention and mask (the
mask holds the window), or with soft-capping or sinks to the same eager arithmetic over that mask:
a model loaded with :data:`PACKED` runs padded rows exactly as its own attention does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from rltrain.forward import structure
from rltrain.forward.structure import ancestors, segments

PACKED = "rltrain_packed"
# keyword arguments a model's attention layer may pass that change nothing here: a flash kernel's
# variable-length hints (the row's pieces are read from the position ids), the forward's own
# arguments passed down (flags of the forward, true or false, pass too)
PASSED_OVER = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "cache_position",
               "position_embeddings", "past_key_values", "layer_idx"}  # fmt: skip


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


@dataclass(frozen=True)
class LayerAsks:
    """What one attention call asks for beyond causal attention (see the module docstring)."""

    scaling: float | None = None
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [H]

    @property
    def eager(self) -> bool:
        """Soft-capping and sinks: the model's eager arithmetic (no fused kernel takes them)."""
        return self.softcap is not None or self.sinks is not None

    def heads(self, part: slice) -> LayerAsks:
        """The same for the heads of ``part`` (a sequence-parallel rank's share)."""
        sinks = None if self.sinks is None else self.sinks[part]
        return LayerAsks(self.scaling, self.sliding_window, self.softcap, sinks)


def layer_asks(module, scaling, kwargs: dict) -> LayerAsks:
    """The features an attention call passes (``kwargs`` as transformers gives them); one a row
    here cannot honour raises, naming it, rather than being dropped."""
    sliding_window, softcap, sinks = (
        kwargs.pop("sliding_window", None),
        kwargs.pop("softcap", None),
        kwargs.pop("s_aux", None),
    )
    unknown = sorted(k for k, v in kwargs.items() if not isinstance(v, bool | None) and k not in PASSED_OVER)
    if unknown:
        raise ValueError(
            f"the {PACKED!r} attention does not know what {type(module).__name__} asks with {unknown}"
        )
    return LayerAsks(scaling, sliding_window, softcap, sinks)


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
    are cut by their position ids; a masked (padded) batch runs on transformers' ``sdpa`` (or the
    eager arithmetic, for soft-capping and sinks). A bidirectional layer (a vision tower's, over one
    image's patches at a time) runs on ``sdpa`` as it is."""
    if getattr(module, "is_causal", True) is False:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    asks = layer_asks(module, scaling, kwargs)
    if attention_mask is not None:
        if asks.eager:
            return eager_attention(query, key, value, attention_mask, asks, dropout).transpose(
                1, 2
            ).contiguous(), None
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    row = structure.row_of(module)
    if position_ids is None:  # a layer that passes none (Ministral 3's, Granite 4.0's): the row's own
        position_ids = row_positions(row, query.shape[0], query.shape[2], query.device)
    if position_ids.dim() == 3:  # multi-axis rotary positions (Qwen2-VL): the text axis tells the pieces
        position_ids = position_ids[0]
    if query.shape[0] == 1:  # a packed or tree row (its pieces are planned once for every layer)
        out = document_attention(query, key, value, position_ids, scaling, dropout, asks, row)
    else:
        out = torch.cat([
            document_attention(query[b : b + 1], key[b : b + 1], value[b : b + 1], position_ids[b : b + 1],
                               scaling, dropout, asks)
            for b in range(query.shape[0])
        ])  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def row_positions(row: structure.Row | None, batch: int, length: int, device) -> torch.Tensor:
    """The position ids of the row a layer's forward runs, for a layer that passes none: the packed
    or tree ``row`` its model's forward announced (:func:`rltrain.forward.structure.row_of`), or where
    there is none, rows of their own without padding (a padded batch whose mask transformers dropped
    as causal)."""
    if row is not None:
        if (batch, length) != (1, len(row)):
            raise RuntimeError(f"the {PACKED!r} attention got {batch} rows of {length} tokens in a forward of "
                               f"one row of {len(row)}")  # fmt: skip
        return row.position_ids[None].to(device)
    return torch.arange(length, device=device)[None].expand(batch, length)


def band(queries: int, keys: int, window: int | None, device=None) -> torch.Tensor:
    """``[queries, keys]`` bool: the keys each of the last ``queries`` positions of ``keys`` (in
    position order) attends to, causally and within ``window`` (None: no window)."""
    q = torch.arange(keys - queries, keys, device=device)[:, None]
    k = torch.arange(keys, device=device)[None, :]
    keep = k <= q
    return keep & (k > q - window) if window is not None else keep


def eager_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask, asks: LayerAsks, dropout: float = 0.0
) -> torch.Tensor:
    """The eager arithmetic of soft-capped and sink layers (Gemma 2's, gpt-oss's): ``[B, H, n, D]``.
    ``mask``: bool (True attends) or additive, broadcast to ``[B, H, n, m]``."""
    groups = query.shape[1] // key.shape[1]
    key, value = (x.repeat_interleave(groups, dim=1) for x in (key, value))
    scaling = asks.scaling if asks.scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if asks.softcap is not None:
        scores = torch.tanh(scores / asks.softcap) * asks.softcap
    if mask.dtype == torch.bool:  # (the dtype's least value, as transformers' masks: a padded row's
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)  # queries see no key, no NaN)
    else:
        scores = scores + mask
    if asks.sinks is not None:  # one more logit per head in each denominator, attending to nothing
        sinks = asks.sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1).to(scores.dtype)
        combined = torch.cat([scores, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    else:
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=dropout > 0).to(value.dtype)
    return torch.matmul(probs, value)


def document_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    position_ids_1L: torch.Tensor,
    scaling: float | None = None,
    dropout: float = 0.0,
    asks: LayerAsks | None = None,
    row: structure.Row | None = None,
) -> torch.Tensor:
    """Attention inside each document and prefix tree of one row: ``[1, H, L, D]`` (see the
    module docstring). Grouped-query key/value heads are broadcast. ``row``: the row the model's
    forward announced, where the pieces planned for its first layer are kept for the others."""
    if position_ids_1L.shape[0] != 1:
        raise ValueError(f"packed attention takes one row, got {position_ids_1L.shape[0]}")
    asks = asks or LayerAsks(scaling)
    window = asks.sliding_window
    gqa = query.shape[1] != key.shape[1]
    parts = []
    for s, e, index in _pieces(position_ids_1L, row):
        q = query[:, :, s:e]
        k, v = (
            (key[:, :, s:e], value[:, :, s:e])
            if index is None
            else (key.index_select(2, index), value.index_select(2, index))
        )
        n, m = e - s, k.shape[2]
        if asks.eager:
            parts.append(eager_attention(q, k, v, band(n, m, window, q.device), asks, dropout))
            continue
        if window is not None and window < m:  # the window cuts keys off: a band mask for this piece
            mask = dict(attn_mask=band(n, m, window, q.device))
        elif index is None:
            mask = dict(is_causal=True)
        else:  # the branch's tokens see every ancestor and, causally, each other (no mask built)
            mask = dict(attn_mask=causal_lower_right(n, m))
        parts.append(
            F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, enable_gqa=gqa, **mask)
        )
    return torch.cat(parts, dim=2)


def _pieces(
    position_ids_1L: torch.Tensor, row: structure.Row | None
) -> list[tuple[int, int, torch.Tensor | None]]:
    """Each piece of the row: ``(start, end, key indices)``; a document's (or a tree's root's)
    indices are None (causal over itself), a branch's are its ancestors' and its own. Planned once
    for every layer: kept with the ``row`` the forward announced, by the position ids it was planned
    from."""
    key = ("pieces", tuple(position_ids_1L.shape))
    planned = None if row is None else row.cache.get(key)
    if planned is not None and (planned[0] is position_ids_1L or torch.equal(planned[0], position_ids_1L)):
        return planned[1]
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
    if row is not None:
        row.cache[key] = position_ids_1L, plan
    return plan
