"""A causal LM's forward in each layout the learners run: padded rows (left-padded prompts, or with
the padding after each sequence where a layer's handling of padding is not known), and one packed
row of several documents, each attending to itself (its structure in its position ids, announced to
the layers that read it: :mod:`rltrain.forward.structure`)."""

from __future__ import annotations

import torch

from rltrain.forward import recurrent
from rltrain.forward.model import causal_lm, multi_axis_positions


def padded_forward(
    model: torch.nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, **extra
):
    """The model's output for padded rows (left-padded prompts: positions count attended tokens);
    ``extra``: more keyword arguments of the model's forward (``position_ids`` among them replace
    the text positions, as :func:`rltrain.forward.vision.forward_inputs` builds them for images)."""
    position_ids = extra.pop("position_ids", None)
    recurrent.expect(model, None)  # (each row its own sequence)
    if position_ids is None:
        position_ids = with_axes(model, text_positions(attention_mask_BT))
    return model(
        input_ids=input_ids_BT, attention_mask=attention_mask_BT, position_ids=position_ids, use_cache=False,
        **extra,
    )  # fmt: skip


def trailing_order(model: torch.nn.Module, attention_mask_BT: torch.Tensor) -> torch.Tensor | None:
    """``[B, T]``: for a model whose padded rows keep their padding after each sequence (a layer
    whose handling of padding rltrain cannot know, :attr:`rltrain.models.families.ModelNeeds.trailing_padding`,
    set on the model at load), each row's columns with its attended ones first; None where the rows
    are laid out so already or the model reads padding as padding."""
    if not getattr(causal_lm(model), "_rltrain_trailing_padding", False):
        return None
    order = torch.sort(~attention_mask_BT.bool(), dim=-1, stable=True).indices
    return None if bool((order == torch.arange(order.shape[1], device=order.device)).all()) else order


def ordered(values_BT: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Per-cell values (``[B, T, ...]``) laid out as the rows of ``order`` (:func:`trailing_order`)."""
    return values_BT.gather(1, order.reshape(*order.shape, *[1] * (values_BT.dim() - 2)).expand_as(values_BT))


def unordered(values_BT: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Values of rows laid out by ``order`` (:func:`trailing_order`) back in the input's columns."""
    index = order.reshape(*order.shape, *[1] * (values_BT.dim() - 2)).expand_as(values_BT)
    return values_BT.new_zeros(values_BT.shape).scatter(1, index, values_BT)


def token_outputs(
    model: torch.nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, packed: bool = False
) -> torch.Tensor:
    """The model's per-position output ``logits`` ``[B, T, C]`` for a head with few outputs (a value
    head), computed padded or on one packed row and laid out like the input (0 on padding)."""
    if not packed:
        if (order := trailing_order(model, attention_mask_BT)) is not None:
            out = token_outputs(model, input_ids_BT.gather(1, order), attention_mask_BT.gather(1, order))
            return unordered(out, order)
        return padded_forward(model, input_ids_BT, attention_mask_BT).logits
    out_1LC = packed_forward(model, *pack_sequences(input_ids_BT, attention_mask_BT)).logits
    return unpacked(out_1LC[0], attention_mask_BT.bool())


def pack_sequences(
    input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attended tokens of every row, concatenated into one row: ``(input_ids_1L, position_ids_1L)``.

    Position ids restart at 0 for each sequence; that is how transformers tells the documents of
    a packed row apart. Each row's attended tokens must be contiguous (left-padded prompt,
    right-padded completion), as :func:`rltrain.batch.collate` lays them out.
    """
    keep_BT = attention_mask_BT.bool()
    position_ids_BT = attention_mask_BT.long().cumsum(-1) - 1
    return input_ids_BT[keep_BT][None], position_ids_BT[keep_BT][None]


def unpacked(values_L: torch.Tensor, keep_BT: torch.Tensor) -> torch.Tensor:
    """The values of a packed row's tokens (``[L, ...]``, in :func:`pack_sequences`' order) back at
    their cells of ``[B, T, ...]`` (``keep_BT``: the attended ones), 0 elsewhere: the one scatter
    of every packed layout."""
    mask = keep_BT.reshape(*keep_BT.shape, *[1] * (values_L.dim() - 1))
    return values_L.new_zeros(*keep_BT.shape, *values_L.shape[1:]).masked_scatter(mask, values_L)


def row_slice(length: int, sp: int, rank: int) -> slice:
    """Rank ``rank``'s contiguous part of a packed row of ``length`` tokens padded to a multiple of
    ``sp`` (sequence parallelism's share of a row; ``sp`` 1: the whole row)."""
    per_rank = -(-length // sp)
    return slice(rank * per_rank, (rank + 1) * per_rank)


def shard_packed_row(
    input_ids_1L: torch.Tensor, position_ids_1L: torch.Tensor, sp: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad the row to a multiple of ``sp`` (the padding is a document of its own, masked out of
    everything) and return rank ``rank``'s slice of ids and position ids."""
    length = input_ids_1L.shape[1]
    pad = -length % sp
    ids = torch.nn.functional.pad(input_ids_1L, (0, pad))
    positions = torch.cat([position_ids_1L, torch.arange(pad, device=position_ids_1L.device)[None]], dim=1)
    part = row_slice(length, sp, rank)
    return ids[:, part], positions[:, part]


def owned_positions(attention_mask_BT: torch.Tensor, sp: int, rank: int) -> torch.Tensor:
    """``[B, T]`` bool: the tokens whose log-prob rank ``rank`` of ``sp`` computes (packed index
    ``j`` with its predicting position ``j - 1`` in the rank's slice). Over the ``sp`` ranks each
    attended token but the row's first is owned exactly once."""
    keep_BT = attention_mask_BT.bool()
    length = int(keep_BT.sum())
    part = row_slice(length, sp, rank)
    packed_index = torch.arange(length, device=attention_mask_BT.device)
    return unpacked((packed_index - 1 >= part.start) & (packed_index - 1 < part.stop), keep_BT)


def packed_forward(
    model: torch.nn.Module, input_ids_1L: torch.Tensor, position_ids_1L: torch.Tensor, **extra
):
    """The model's output for a packed row, every document attending only to itself.

    transformers builds the block-diagonal causal mask from position ids that restart at 0, but only
    when it is given **no attention mask and no KV cache**: a 2-D mask (even all ones) or a cache
    object (Qwen2's config turns ``use_cache`` on) makes it fall back to one causal mask over the
    whole row, and documents silently attend to each other. Hence both are passed explicitly here.
    ``extra``: more keyword arguments of the model's forward (``position_ids`` among them: the four
    axes of an image's rows, :func:`rltrain.forward.vision.forward_inputs`, ``position_ids_1L`` first).
    """
    recurrent.expect(model, position_ids_1L)  # a hybrid model's recurrent layers: state per sequence
    position_ids = extra.pop("position_ids", None)
    if position_ids is None:
        position_ids = with_axes(model, position_ids_1L)
    return model(
        input_ids=input_ids_1L, position_ids=position_ids, attention_mask=None, use_cache=False, **extra
    )


def with_axes(model: torch.nn.Module, position_ids: torch.Tensor) -> torch.Tensor:
    """Text positions as the model takes them: for multi-axis rotary positions (Qwen2-VL), the text
    axis (which tells documents and tree branches apart) and then the three rotary axes, each a text
    token's position."""
    if multi_axis_positions(model):
        return position_ids[None].expand(4, *position_ids.shape)
    return position_ids


def text_positions(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """The positions of padded rows (left-padded prompts): each attended token's count of attended
    tokens before it, 0 on padding."""
    return (attention_mask_BT.long().cumsum(-1) - 1).clamp(min=0)
