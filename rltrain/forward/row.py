"""How a learner runs a micro-batch through a model, exactly, in one place: a :class:`RowLayout`
built once per micro-batch (padded rows, one packed row or a prefix tree, and its images) and the two
things asked of it, per-token log-probs (:func:`logprobs`) and the per-position outputs of a head with
few outputs (:func:`outputs`: a value or score head). Every forward of the learners (the policy's, the
old log-probs', the reference's, a teacher's, the critic's, a reward model's) goes through them;
:func:`sequence_logprobs` is the same for a batch given as tensors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rltrain.forward import vision
from rltrain.forward.head import head_forward
from rltrain.forward.layouts import (
    pack_sequences,
    packed_forward,
    padded_forward,
    text_positions,
    token_outputs,
    trailing_order,
    unordered,
)
from rltrain.forward.tree import PrefixTree, tree_logprobs, tree_outputs
from rltrain.forward.vision import Images
from rltrain.loss.logprobs import Truncation, predicted_logprobs


@dataclass
class RowLayout:
    """How one micro-batch (``[B, T]``: left-padded prompts, right-padded completions) runs through a
    model: as padded rows, as one packed row (``packed``) or as a prefix tree (``tree``, which wins);
    ``images``: each sequence's (None for one without), with ``idle_image`` for a micro-batch
    without any whose peers on other ranks have some (:func:`rltrain.forward.vision.forward_inputs`)."""

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    packed: bool = False
    tree: PrefixTree | None = None
    images: list[Images | None] | None = None
    idle_image: Images | None = None

    @property
    def kind(self) -> str:
        return "tree" if self.tree is not None else "packed" if self.packed else "padded"


def logprobs(
    model: torch.nn.Module,
    row: RowLayout,
    temperature: float = 1.0,
    with_entropy: bool = False,
    truncation: Truncation | None = None,
    from_hidden: bool = True,
    agree_chunks: Callable[[int], int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, T]`` log-probs of every token given its prefix (each sequence's first token 0), and the
    entropy where asked, through ``row``'s layout (:func:`sequence_logprobs`,
    :func:`rltrain.forward.tree.tree_logprobs`: the same values in every layout)."""
    if row.tree is not None:
        return tree_logprobs(model, row.tree, row.input_ids_BT, temperature, with_entropy, truncation, from_hidden,
                             row.images, row.idle_image, agree_chunks)  # fmt: skip
    return sequence_logprobs(model, row.input_ids_BT, row.attention_mask_BT, temperature, with_entropy, row.packed,
                             truncation, from_hidden, row.images, row.idle_image, agree_chunks)  # fmt: skip


def target_logprobs(
    model: torch.nn.Module,
    row: RowLayout,
    targets_BT: torch.Tensor,
    agree_chunks: Callable[[int], int] | None = None,
) -> torch.Tensor:
    """``[B, T]``: the log-prob of ``targets[b, t]`` given ``input_ids[b, :t + 1]`` at every attended
    cell (each position predicts its own target: the Tinker API's datums), 0 elsewhere; through
    padded rows or one packed row (``row.packed``), from the last hidden states and the head."""
    if row.tree is not None or row.images is not None:
        raise ValueError("target log-probs run on padded or packed rows of text")
    keep_BT = row.attention_mask_BT.bool()
    if row.packed:
        ids_1L, positions_1L = pack_sequences(row.input_ids_BT, row.attention_mask_BT)
        states, head = head_forward(
            model, lambda **extra: packed_forward(model, ids_1L, positions_1L, **extra)
        )
        values_1L, _ = predicted_logprobs(
            states, head, targets_BT[keep_BT][None], 1.0, False, None, agree_chunks
        )
        return values_1L.new_zeros(keep_BT.shape).masked_scatter(keep_BT, values_1L[0])
    states, head = head_forward(
        model, lambda **extra: padded_forward(model, row.input_ids_BT, row.attention_mask_BT, **extra)
    )
    values_BT, _ = predicted_logprobs(states, head, targets_BT, 1.0, False, None, agree_chunks)
    return torch.where(keep_BT, values_BT, 0.0)


def outputs(model: torch.nn.Module, row: RowLayout) -> torch.Tensor:
    """The model's per-position ``logits`` ``[B, T, C]`` for a head with few outputs (a value or
    score head), through ``row``'s layout, 0 on padding."""
    if row.tree is not None:
        return tree_outputs(model, row.tree)
    return token_outputs(model, row.input_ids_BT, row.attention_mask_BT, row.packed)


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    packed: bool = False,
    truncation: Truncation | None = None,
    from_hidden: bool = True,
    images: list[Images | None] | None = None,
    idle_image: Images | None = None,
    agree_chunks: Callable[[int], int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of every token given its prefix under a causal LM: ``[B, T]`` (position 0 gets 0);
    with a ``truncation`` (the engine's top_k/top_p/min_p), of the distribution it sampled from.

    Position ``t`` holds ``log p(input_ids[t] | input_ids[:t])``, aligned with the input so a
    response mask over ``input_ids`` selects the response tokens' log-probs directly.

    ``packed=True`` runs the model on one padding-free row (:func:`packed_forward`) and scatters
    the result back to ``[B, T]``: the same values, without computing anything for padding.
    ``from_hidden`` (where the model allows, :func:`head_forward`): from the last hidden states, the
    head applied chunk by chunk; false: from the model's full logits.
    ``images``: each row's images (:class:`rltrain.forward.vision.Images`, None for a row without),
    for a vision-language model: each distinct image's features computed once, the rotary positions
    each sequence has alone; ``idle_image``: the tower's input where no row has one but another
    rank's micro-batch does (:func:`rltrain.forward.vision.forward_inputs`). ``agree_chunks``: see
    :func:`rltrain.loss.logprobs.head_logprobs_and_entropy`.
    """
    if packed:
        return _packed_sequence_logprobs(model, input_ids_BT, attention_mask_BT, temperature, with_entropy,
                                         truncation, from_hidden, images, idle_image, agree_chunks)  # fmt: skip
    if (order := trailing_order(model, attention_mask_BT)) is not None:  # padding after each sequence
        logprobs_BT, entropy_BT = sequence_logprobs(
            model, input_ids_BT.gather(1, order), attention_mask_BT.gather(1, order), temperature, with_entropy,
            False, truncation, from_hidden, images, idle_image, agree_chunks,
        )  # fmt: skip
        return unordered(logprobs_BT, order), None if entropy_BT is None else unordered(entropy_BT, order)
    seen = {}
    if images is not None:
        seen = vision.forward_inputs(
            model, input_ids_BT, attention_mask_BT, images, text_positions(attention_mask_BT), idle=idle_image
        )
    states, head = head_forward(
        model,
        lambda **extra: padded_forward(model, input_ids_BT, attention_mask_BT, **seen, **extra),
        from_hidden,
    )
    # the prediction at t is for token t+1
    logprobs, entropy = predicted_logprobs(
        states[:, :-1], head, input_ids_BT[:, 1:], temperature, with_entropy, truncation, agree_chunks
    )
    zero_col = logprobs.new_zeros(logprobs.shape[0], 1)
    logprobs_BT = torch.cat([zero_col, logprobs], dim=1)
    entropy_BT = None if entropy is None else torch.cat([zero_col, entropy], dim=1)
    return logprobs_BT, entropy_BT


def _packed_sequence_logprobs(
    model, input_ids_BT, attention_mask_BT, temperature, with_entropy, truncation=None, from_hidden=True,
    images=None, idle_image=None, agree_chunks=None,
):  # fmt: skip
    keep_BT = attention_mask_BT.bool()
    input_ids_1L, position_ids_1L = pack_sequences(input_ids_BT, attention_mask_BT)
    seen = {}
    if images is not None:
        order = vision.packed_order(attention_mask_BT)
        seen = vision.forward_inputs(
            model, input_ids_BT, attention_mask_BT, images, position_ids_1L, order, idle_image
        )
    states, head = head_forward(
        model,
        lambda **extra: packed_forward(model, input_ids_1L, position_ids_1L, **seen, **extra),
        from_hidden,
    )
    logprobs_1L, entropy_1L = predicted_logprobs(
        states[:, :-1], head, input_ids_1L[:, 1:], temperature, with_entropy, truncation, agree_chunks
    )
    # a document's first token would be "predicted" by the previous document's last one: it gets 0,
    # as position 0 does in the padded layout
    starts_L = position_ids_1L[0] == 0

    def unpack(values_1L: torch.Tensor) -> torch.Tensor:
        values_L = torch.cat([values_1L.new_zeros(1), values_1L[0]])
        values_L = torch.where(starts_L, 0.0, values_L)
        return values_L.new_zeros(keep_BT.shape).masked_scatter(keep_BT, values_L)  # [B, T]

    return unpack(logprobs_1L), None if entropy_1L is None else unpack(entropy_1L)
