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
    row_slice,
    shard_packed_row,
    text_positions,
    token_outputs,
    trailing_order,
    unordered,
    unpacked,
)
from rltrain.forward.tree import PrefixTree, tree_logprobs, tree_outputs
from rltrain.forward.vision import Images
from rltrain.loss.logprobs import Truncation, predicted_logprobs


@dataclass
class RowLayout:
    """How one micro-batch (``[B, T]``: left-padded prompts, right-padded completions) runs through a
    model: as padded rows, as one packed row (``packed``) or as a prefix tree (``tree``, which wins);
    ``shard`` ``(sp, rank)``: a packed row's share of one rank of a sequence-parallel group (its
    slice; the attention sees the whole row, :mod:`rltrain.learner.sequence_parallel`); ``images``:
    each sequence's (None for one without), with ``idle_image`` for a micro-batch without any whose
    peers on other ranks have some (:func:`rltrain.forward.vision.forward_inputs`)."""

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    packed: bool = False
    tree: PrefixTree | None = None
    images: list[Images | None] | None = None
    idle_image: Images | None = None
    shard: tuple[int, int] = (1, 0)

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
    :func:`rltrain.forward.tree.tree_logprobs`: the same values in every layout); a shard of a row,
    on the tokens it owns (:func:`rltrain.forward.layouts.owned_positions`), 0 elsewhere."""
    if row.tree is not None:
        return tree_logprobs(model, row.tree, row.input_ids_BT, temperature, with_entropy, truncation, from_hidden,
                             row.images, row.idle_image, agree_chunks)  # fmt: skip
    return sequence_logprobs(model, row.input_ids_BT, row.attention_mask_BT, temperature, with_entropy, row.packed,
                             truncation, from_hidden, row.images, row.idle_image, agree_chunks, row.shard)  # fmt: skip


def target_logprobs(
    model: torch.nn.Module,
    row: RowLayout,
    targets_BT: torch.Tensor,
    agree_chunks: Callable[[int], int] | None = None,
) -> torch.Tensor:
    """``[B, T]``: the log-prob of ``targets[b, t]`` given ``input_ids[b, :t + 1]`` at every attended
    cell (each position predicts its own target: the Tinker API's datums), 0 elsewhere; through
    padded rows or one packed row (``row.packed``), from the last hidden states and the head: the
    dispatch of :func:`sequence_logprobs`, its targets given."""
    if row.tree is not None or row.images is not None:
        raise ValueError("target log-probs run on padded or packed rows of text")
    return sequence_logprobs(model, row.input_ids_BT, row.attention_mask_BT, packed=row.packed,
                             agree_chunks=agree_chunks, targets_BT=targets_BT)[0]  # fmt: skip


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
    shard: tuple[int, int] = (1, 0),
    targets_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of every token given its prefix under a causal LM: ``[B, T]`` (position 0 gets 0);
    with a ``truncation`` (the engine's top_k/top_p/min_p), of the distribution it sampled from.

    Position ``t`` holds ``log p(input_ids[t] | input_ids[:t])``, aligned with the input so a
    response mask over ``input_ids`` selects the response tokens' log-probs directly. With
    ``targets_BT``, position ``t`` holds ``log p(targets[t] | input_ids[:t + 1])`` instead (0 on
    padding).

    ``packed=True`` runs the model on one padding-free row (:func:`packed_forward`) and scatters
    the result back to ``[B, T]``: the same values, without computing anything for padding;
    ``shard`` ``(sp, rank)``: on rank ``rank``'s slice of that row alone, the values of the tokens
    it owns. ``from_hidden`` (where the model allows, :func:`head_forward`): from the last hidden
    states, the head applied chunk by chunk; false: from the model's full logits.
    ``images``: each row's images (:class:`rltrain.forward.vision.Images`, None for a row without),
    for a vision-language model: each distinct image's features computed once, the rotary positions
    each sequence has alone; ``idle_image``: the tower's input where no row has one but another
    rank's micro-batch does (:func:`rltrain.forward.vision.forward_inputs`). ``agree_chunks``: see
    :func:`rltrain.loss.logprobs.head_logprobs_and_entropy`.
    """
    if packed:
        return _packed_sequence_logprobs(model, input_ids_BT, attention_mask_BT, temperature, with_entropy,
                                         truncation, from_hidden, images, idle_image, agree_chunks, shard,
                                         targets_BT)  # fmt: skip
    if (order := trailing_order(model, attention_mask_BT)) is not None:  # padding after each sequence
        targets = None if targets_BT is None else targets_BT.gather(1, order)
        logprobs_BT, entropy_BT = sequence_logprobs(
            model, input_ids_BT.gather(1, order), attention_mask_BT.gather(1, order), temperature, with_entropy,
            False, truncation, from_hidden, images, idle_image, agree_chunks, targets_BT=targets,
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
    if targets_BT is not None:  # each position its own target
        values_BT, _ = predicted_logprobs(
            states, head, targets_BT, temperature, False, truncation, agree_chunks
        )
        return torch.where(attention_mask_BT.bool(), values_BT, 0.0), None
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
    images=None, idle_image=None, agree_chunks=None, shard=(1, 0), targets_BT=None,
):  # fmt: skip
    """One packed row, or rank ``rank``'s slice of it (``shard``, padded to a multiple of ``sp``):
    each local position ``n`` predicts packed token ``j = start + 1 + n`` (the row's next token: the
    slice's last position predicts the next slice's first), or with targets its own one (``j =
    start + n``); a document's first token would be predicted by the previous document: it gets 0,
    as position 0 does in padded rows."""
    keep_BT = attention_mask_BT.bool()
    ids_1L, positions_1L = pack_sequences(input_ids_BT, attention_mask_BT)
    (sp, rank), length = shard, ids_1L.shape[1]
    part = row_slice(length, sp, rank)
    local_ids, local_positions = shard_packed_row(ids_1L, positions_1L, sp, rank)
    seen = {}
    if images is not None:
        order = vision.packed_order(attention_mask_BT)
        seen = vision.forward_inputs(
            model, input_ids_BT, attention_mask_BT, images, positions_1L, order, idle_image
        )
    states_1N, head = head_forward(
        model, lambda **extra: packed_forward(model, local_ids, local_positions, **seen, **extra), from_hidden
    )
    shift = 1 if targets_BT is None else 0
    wanted_1L = ids_1L if targets_BT is None else targets_BT[keep_BT][None]
    index_N = torch.arange(
        part.start + shift, part.stop + shift, device=ids_1L.device
    )  # packed token predicted
    targets_1N = torch.nn.functional.pad(wanted_1L, (0, part.stop + shift - length))[:, index_N]
    logprobs_1N, entropy_1N = predicted_logprobs(
        states_1N,
        head,
        targets_1N,
        temperature,
        with_entropy and targets_BT is None,
        truncation,
        agree_chunks,
    )
    valid_N = index_N < length
    first_N = (positions_1L[0, index_N.clamp(max=length - 1)] == 0) & (shift == 1)

    def unpack(values_1N: torch.Tensor) -> torch.Tensor:
        values_L = values_1N.new_zeros(length).index_put(
            (index_N[valid_N],), torch.where(first_N, 0.0, values_1N[0])[valid_N]
        )
        return unpacked(values_L, keep_BT)  # [B, T]

    return unpack(logprobs_1N), None if entropy_1N is None else unpack(entropy_1N)
