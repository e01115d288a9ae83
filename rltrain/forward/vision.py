"""Images in the learner's forwards, for vision-language models whose rotary positions
have several axes (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

Two things an image changes in a forward, both built here for padded, packed and tree rows alike:

- **its features**: the vision tower runs once per distinct image of a micro-batch (a group's
  completions share their prompt's images; so do a tree's branches), and the features go to the
  model as its precomputed encoder outputs (transformers' ``mm_encoder_outputs``), one row per
  image placeholder token in the order the placeholders appear in the forward's input;
- **its positions**: each sequence's ``[3, T]`` rotary positions (time, height, width; an image's
  tokens lie on its grid, the text after it resumes past the grid) are the model's own
  ``get_rope_index`` of that sequence alone, so a packed document or a tree branch sees the ones it
  has in its own forward. The text positions (the first of the four axes the model takes) tell
  documents and branches apart, as for text.

Image tokens are prompt tokens: never sampled, never loss tokens, never in the token totals.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from rltrain.forward.model import causal_lm


@dataclass(frozen=True)
class Images:
    """One sequence's images in the order their placeholders appear in it: the processor's
    ``pixel_values`` rows (``[P, D]``, the flattened patches of every image) and ``grid_thw``
    (``[n, 3]``: each image's patch grid, time x height x width). ``keys``: one per image, equal for
    equal images (:meth:`of` hashes each image's patches)."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    keys: tuple[str, ...]

    @classmethod
    def of(cls, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> Images:
        grid_thw = torch.as_tensor(grid_thw, dtype=torch.long).reshape(-1, 3)
        sizes = grid_thw.prod(-1).tolist()
        if sum(sizes) != pixel_values.shape[0]:
            raise ValueError(
                f"pixel_values has {pixel_values.shape[0]} patch rows; the grids {grid_thw.tolist()} need {sum(sizes)}"
            )
        keys = tuple(
            hashlib.sha1(p.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
            for p in torch.split(pixel_values, sizes)
        )
        return cls(pixel_values, grid_thw, keys)

    def to(self, device) -> Images:
        return Images(self.pixel_values.to(device), self.grid_thw, self.keys)

    def tokens(self, merge: int) -> list[int]:
        """Placeholder tokens of each image: its patches over ``merge`` x ``merge`` merged ones."""
        return (self.grid_thw.prod(-1) // merge**2).tolist()


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    """The vision-language model inside the conditional-generation wrapper (``get_image_features``,
    ``get_rope_index``)."""
    lm = causal_lm(model)
    return lm.model if hasattr(lm, "model") and hasattr(lm.model, "get_rope_index") else lm


def image_token_id(model: torch.nn.Module) -> int:
    return int(causal_lm(model).config.image_token_id)


def _merge(model: torch.nn.Module) -> int:
    config = causal_lm(model).config
    return int(getattr(config.vision_config, "spatial_merge_size", 1))


def rope_positions(model: torch.nn.Module, input_ids_T: torch.Tensor, images: Images | None) -> torch.Tensor:
    """``[3, T]``: the rotary positions of one sequence (its attended tokens) as the model's own
    ``get_rope_index`` builds them for that sequence alone."""
    inner = _inner(model)
    ids = input_ids_T[None]
    types = (ids == image_token_id(model)).int()  # 1 on image placeholders (transformers' mm_token_type_ids)
    grid = None if images is None else images.grid_thw.to(ids.device)
    positions, _ = inner.get_rope_index(ids, types, image_grid_thw=grid, attention_mask=torch.ones_like(ids))
    return positions[:, 0]


def _cells(model: torch.nn.Module, input_ids_BT, attention_mask_BT, images: list[Images | None]):
    """For each attended cell of a ``[B, T]`` micro-batch: its rotary positions ``[3, B, T]`` and, on
    image placeholders, the row of the distinct images' features it takes (``[B, T]``, -1
    elsewhere); and those distinct images' ``(pixel_values, grid_thw)``."""
    keep_BT = attention_mask_BT.bool()
    positions = torch.zeros(3, *input_ids_BT.shape, dtype=torch.long, device=input_ids_BT.device)
    feature_BT = torch.full(input_ids_BT.shape, -1, dtype=torch.long, device=input_ids_BT.device)
    merge, token = _merge(model), image_token_id(model)
    # an image's key -> (its first row among the distinct images' features, its patches, its grid)
    distinct: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = {}
    rows = 0
    for b, seq_images in enumerate(images):
        ids = input_ids_BT[b][keep_BT[b]]
        placeholders = int((ids == token).sum())
        counts = [] if seq_images is None else seq_images.tokens(merge)
        if placeholders != sum(counts):
            raise ValueError(
                f"sequence {b}: {placeholders} image placeholder tokens, its images need {sum(counts)}"
            )
        positions[:, b, keep_BT[b]] = rope_positions(model, ids, seq_images)
        if seq_images is None:
            continue
        sizes = seq_images.grid_thw.prod(-1).tolist()
        patches = torch.split(seq_images.pixel_values, sizes)
        mine = []
        for key, p, grid, n in zip(seq_images.keys, patches, seq_images.grid_thw, counts):
            if key not in distinct:
                distinct[key] = (rows, p, grid)
                rows += n
            mine.append(torch.arange(distinct[key][0], distinct[key][0] + n))
        cols = keep_BT[b].nonzero()[:, 0][ids == token]
        feature_BT[b, cols] = torch.cat(mine).to(feature_BT.device)
    return positions, feature_BT, [(p, g) for _, p, g in distinct.values()]


def _features(model: torch.nn.Module, distinct) -> torch.Tensor:
    """``[N, H]``: the distinct images' features, the vision tower run once on all of them."""
    pixels = torch.cat([p for p, _ in distinct])
    grids = torch.stack([g for _, g in distinct])
    out = _inner(model).get_image_features(pixel_values=pixels, image_grid_thw=grids.to(pixels.device))
    pooled = out.pooler_output if hasattr(out, "pooler_output") else out
    return torch.cat(list(pooled)) if isinstance(pooled, (list, tuple)) else pooled


def forward_inputs(
    model: torch.nn.Module,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    images: list[Images | None],
    text_positions: torch.Tensor,
    order=None,
    idle: Images | None = None,
) -> dict:
    """The keyword arguments that carry a micro-batch's images into one forward of the model:
    ``position_ids`` (``[4, R, L]``: ``text_positions`` ``[R, L]`` first, then the three rotary axes)
    and ``mm_encoder_outputs`` (the features, one row per placeholder of the forward's input).

    ``order``: how the forward's input ``[R, L]`` takes the micro-batch's cells: None for padded
    rows (the ``[B, T]`` layout itself), else a function from ``[B, T]`` values to the row's ``[L]``
    (a packed row: the attended cells in order; a tree: :meth:`PrefixTree.in_row_order`).

    ``idle``: an image for the vision tower of a micro-batch without images whose peers on other
    ranks have some (a ZeRO-3 tower's forward gathers its weights, a trained tower's backward
    reduces its gradients: collectives every rank must run). The tower runs on it, and its features
    join the forward with weight 0 (:func:`_tie`): this rank's outputs are those it has without it."""
    if not hasattr(_inner(model), "get_rope_index"):
        raise ValueError(
            f"images go to vision-language models with multi-axis rotary positions (Qwen2-VL, Qwen2.5-VL, "
            f"Qwen3-VL); {type(causal_lm(model)).__name__} has none"
        )
    positions_3BT, feature_BT, distinct = _cells(model, input_ids_BT, attention_mask_BT, images)
    if order is None:
        rotary, feature = positions_3BT, feature_BT
    else:
        rotary = torch.stack([order(axis) for axis in positions_3BT])[:, None]
        feature = order(feature_BT)[None]
    extra = {"position_ids": torch.cat([text_positions[None], rotary])}
    if not distinct and idle is not None:
        _tie(model, _features(model, [(idle.pixel_values, idle.grid_thw[0])]))
    if distinct:
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        rows = _features(model, distinct)
        taken = feature[feature >= 0]  # the placeholders in the input's order
        extra["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=(rows[taken],))}
    return extra


def _tie(model: torch.nn.Module, features: torch.Tensor) -> None:
    """The next forward's input embeddings plus ``0 * features.sum()``: nothing changes but that a
    trained tower's parameters are in the backward's graph (their gradients 0 on this rank)."""
    if not features.requires_grad:  # (a frozen tower: its forward alone is what the peers wait for)
        return
    embeddings = causal_lm(model).get_input_embeddings()

    def add(_module, _args, out):
        handle.remove()
        return out + 0.0 * features.sum().to(out.dtype)

    handle = embeddings.register_forward_hook(add)


def packed_order(attention_mask_BT: torch.Tensor):
    """:func:`forward_inputs`'s ``order`` for one packed row of the micro-batch's attended cells."""
    keep_BT = attention_mask_BT.bool()
    return lambda values_BT: values_BT[keep_BT]
