"""Prefix-tree rows: a micro-batch's shared prompts computed once.

A GRPO group's completions share their prompt, and every forward that reads a batch (the policy's,
the old log-probs', the reference's, a teacher's, the critic's, the MoE count forward) would run
that prompt once per member. Here a micro-batch becomes one row holding a **prefix tree**: each
shared prefix once, followed depth first by what each member adds, every token at the position
id it has in its own sequence. :mod:`rltrain.forward.attention` reads the tree from those position
ids and lets each branch attend to its ancestors and, causally, to itself, so every token's hidden
state is the one it has in its own row.

What may be shared: a common prefix of the members' token ids made only of tokens no member trains
on (``shareable``: the prompt, an environment's opening turns). A sampled token is never shared,
so each member keeps its own log-probs, ratios and gradient; at a branch point the last shared
token's hidden state predicts each member's own next token. Outputs come back in the ``[B, T]``
layout of the micro-batch, so the losses do not change; a shared token's gradient is the sum over
its copies, as in the unshared forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rltrain.forward import vision
from rltrain.forward.head import head_forward
from rltrain.forward.layouts import packed_forward
from rltrain.forward.vision import Images
from rltrain.loss.logprobs import Truncation, predicted_logprobs


def token_keys(ids: list[int], images: tuple[bytes, ...] | None, image_token: int | None) -> list:
    """What two sequences must agree on to share a prefix: each token id, and for an image's
    placeholder tokens the image too (the ``k``-th run of ``image_token`` is image ``k``; equal ids
    of different images are different inputs)."""
    if not images or image_token is None:
        return ids
    keys, run = [], -1
    for t, token in enumerate(ids):
        if token == image_token:
            run += t == 0 or ids[t - 1] != image_token
            keys.append((token, images[run] if run < len(images) else None))
        else:
            keys.append(token)
    return keys


@dataclass
class PrefixTree:
    """One row holding a micro-batch's sequences as a prefix tree.

    ``cell_BT``: the row index of the token at each attended cell of the micro-batch (-1 on
    padding)."""

    input_ids_1L: torch.Tensor
    position_ids_1L: torch.Tensor
    cell_BT: torch.Tensor

    @property
    def tokens(self) -> int:
        """Tokens the tree's forward runs on."""
        return int(self.input_ids_1L.shape[1])

    @property
    def uses_L(self) -> torch.Tensor:
        """How many sequences each row token stands for (1 unshared, G for a prefix shared by G
        members)."""
        return torch.bincount(self.cell_BT[self.cell_BT >= 0], minlength=self.tokens)

    @property
    def unshared_tokens(self) -> int:
        """Tokens a padding-free forward without sharing runs on: the micro-batch's attended cells."""
        return int((self.cell_BT >= 0).sum())

    @property
    def shared_fraction(self) -> float:
        """Tokens not recomputed over the tokens the unshared (packed) forward runs on."""
        return 1.0 - self.tokens / max(self.unshared_tokens, 1)

    def gather(self, values_1L: torch.Tensor) -> torch.Tensor:
        """Per-token values of the row (``[1, L, ...]``) in the micro-batch's ``[B, T, ...]`` layout,
        0 on padding; differentiable (a shared token's gradient sums over its cells)."""
        keep_BT = self.cell_BT >= 0
        out = values_1L.new_zeros(*self.cell_BT.shape, *values_1L.shape[2:])
        return out.index_put((keep_BT,), values_1L[0, self.cell_BT[keep_BT]])

    def in_row_order(self, values_BT: torch.Tensor) -> torch.Tensor:
        """``[B, T, ...]`` values as the tree row's tokens (a shared token takes its first
        member's)."""
        keep_BT = self.cell_BT >= 0
        return values_BT[keep_BT][first_index(self.cell_BT[keep_BT], self.tokens)]


def first_index(group_N: torch.Tensor, groups: int) -> torch.Tensor:
    """``[groups]``: for each group id in ``0..groups-1``, the first position of ``group_N`` that
    holds it (every id must occur)."""
    first = torch.full((groups,), len(group_N), dtype=torch.long, device=group_N.device)
    return first.scatter_reduce(0, group_N, torch.arange(len(group_N), device=group_N.device), "amin")


def build_tree(
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    shareable_BT: torch.Tensor,
    images: list[tuple[bytes, ...] | None] | None = None,
    image_token: int | None = None,
) -> PrefixTree:
    """The prefix tree of a micro-batch (left-padded prompts, right-padded completions: each row's
    attended tokens contiguous). ``shareable_BT``: tokens that may be shared (no member trains on
    them); a row's shareable tokens must lead it. Rows that share nothing are documents of their
    own, as in a packed row. ``images``: each row's, whose placeholders (``image_token``) rows
    share only where the image is the same (:func:`token_keys`)."""
    keep_BT = attention_mask_BT.bool()
    device = input_ids_BT.device
    ids_cpu, keep_cpu = input_ids_BT.cpu(), keep_BT.cpu()
    sequences = [ids_cpu[b][keep_cpu[b]].tolist() for b in range(len(ids_cpu))]
    keys = [token_keys(seq, im, image_token) for seq, im in zip(sequences, images or [None] * len(sequences))]
    shareable_cpu = (shareable_BT.bool() & keep_BT).cpu()
    # each row's shareable lead: tokens before its first unshareable one
    lead = [int(torch.cat([~s[k], torch.ones(1, dtype=torch.bool)]).int().argmax())
            for s, k in zip(shareable_cpu, keep_cpu)]  # fmt: skip
    ids: list[int] = []
    positions: list[int] = []
    cells: list[list[int]] = [[-1] * len(s) for s in sequences]

    def emit(members: list[int], start: int, end: int) -> None:
        """Tokens ``start:end`` of ``members[0]`` (shared by all ``members``) at the row's end."""
        base = len(ids)
        ids.extend(sequences[members[0]][start:end])
        positions.extend(range(start, end))
        for m in members:
            cells[m][start:end] = range(base, base + end - start)

    def node(members: list[int], start: int) -> None:
        """Members sharing their first ``start`` tokens (already in the row): the rest of them."""
        if len(members) == 1:
            emit(members, start, len(sequences[members[0]]))
            return
        end = start
        while all(end < lead[m] for m in members) and len({keys[m][end] for m in members}) == 1:
            end += 1
        emit(members, start, end)
        branches: dict[object, list[int]] = {}
        for m in members:  # by the next token where it is still shareable; a leaf otherwise
            branches.setdefault(keys[m][end] if end < lead[m] else ("leaf", m), []).append(m)
        for branch in branches.values():
            node(branch, end)

    roots: dict[object, list[int]] = {}
    for b, sequence in enumerate(sequences):
        if sequence:
            roots.setdefault(keys[b][0] if lead[b] > 0 else ("leaf", b), []).append(b)
    for members in roots.values():
        node(members, 0)
    cell_BT = torch.full(input_ids_BT.shape, -1, dtype=torch.long)
    for b, row in enumerate(cells):
        cell_BT[b, keep_cpu[b]] = torch.tensor(row, dtype=torch.long)
    return PrefixTree(
        torch.tensor([ids], dtype=torch.long, device=device),
        torch.tensor([positions], dtype=torch.long, device=device),
        cell_BT.to(device),
    )


def tree_forward(model: torch.nn.Module, tree: PrefixTree, **extra):
    """The model's output on the tree row (its attention must be
    :data:`rltrain.forward.attention.PACKED`)."""
    return packed_forward(model, tree.input_ids_1L, tree.position_ids_1L, **extra)


def tree_logprobs(
    model: torch.nn.Module,
    tree: PrefixTree,
    input_ids_BT: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    truncation: Truncation | None = None,
    from_hidden: bool = True,
    images: list[Images | None] | None = None,
    idle_image: Images | None = None,
    agree_chunks: Callable[[int], int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`rltrain.forward.row.sequence_logprobs` through the tree: ``[B, T]`` log-probs of
    every token given its prefix (each sequence's first token 0), and the entropy.

    Each distinct (predicting row token, target) pair is computed once: the shared prompt's
    predictions once, and at a branch point the shared last token once per member's own next token.
    ``images`` (each row's, :class:`rltrain.forward.vision.Images`): a shared prompt's images
    enter the row once, with the rotary positions each sequence has alone (``idle_image``: see
    :func:`rltrain.forward.vision.forward_inputs`; ``agree_chunks``: see
    :func:`rltrain.loss.logprobs.head_logprobs_and_entropy`)."""
    seen = {}
    if images is not None:  # (the tree's cells are the micro-batch's attended ones)
        attended_BT = (tree.cell_BT >= 0).long()
        seen = vision.forward_inputs(
            model, input_ids_BT, attended_BT, images, tree.position_ids_1L, tree.in_row_order, idle_image
        )
    states, head = head_forward(model, lambda **kw: tree_forward(model, tree, **seen, **kw), from_hidden)
    cell_BT = tree.cell_BT
    # a cell's prediction comes from the row token of the cell before it in its sequence
    predicted_BT = torch.zeros_like(cell_BT, dtype=torch.bool)
    predicted_BT[:, 1:] = (cell_BT[:, 1:] >= 0) & (cell_BT[:, :-1] >= 0)
    source = cell_BT[:, :-1][predicted_BT[:, 1:]]
    target = input_ids_BT[predicted_BT]
    key = source * (int(input_ids_BT.max()) + 1) + target
    unique, inverse = torch.unique(key, return_inverse=True)
    first = first_index(inverse, len(unique))
    logprobs_K, entropy_K = predicted_logprobs(states[0, source[first]][None], head, target[first][None], temperature,
                                               with_entropy, truncation, agree_chunks)  # fmt: skip

    def spread(values_1K: torch.Tensor) -> torch.Tensor:
        out = values_1K.new_zeros(cell_BT.shape)
        return out.index_put((predicted_BT,), values_1K[0, inverse])

    return spread(logprobs_K), None if entropy_K is None else spread(entropy_K)


def tree_outputs(model: torch.nn.Module, tree: PrefixTree) -> torch.Tensor:
    """:func:`rltrain.forward.layouts.token_outputs` through the tree: the model's per-position
    ``logits`` (a value head's few outputs) ``[B, T, C]``, 0 on padding."""
    return tree.gather(tree_forward(model, tree).logits)
