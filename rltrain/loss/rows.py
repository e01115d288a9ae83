"""The structure of a packed or prefix-tree row, read from its position ids alone (pure torch).

- a **document** (a packed sequence) starts where the position id is 0;
- a **branch** of a prefix tree starts at position ``q > 0`` right after tokens whose positions do not
  lead up to it: it continues, for every position ``p < q``, the nearest earlier token at position
  ``p`` (the tree is laid out depth first, so that is the shared prefix it continues).

:mod:`rltrain.learner.attention` attends along this structure; :mod:`rltrain.loss.recurrent` carries
recurrent layers' state along it. The row a forward runs is announced once (:func:`expect`) and read
by the layers that need it (:func:`current`): the attention of a layer that passes no position ids,
the recurrent layers.
"""

from __future__ import annotations

import functools

import torch


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


def parents(position_ids_L: torch.Tensor, pieces: list[tuple[int, int, int]] | None = None) -> list[int]:
    """For each token of the row, the row index of the token before it in its own sequence (-1 for
    a sequence's first token): the previous index inside a piece, and for a branch's first token the
    last token of its ancestors. ``pieces``: the row's :func:`segments`, where known."""
    out: list[int] = []
    pieces = segments(position_ids_L) if pieces is None else pieces
    for k, (s, e, first) in enumerate(pieces):
        before = ancestors(pieces, k) if first > 0 else []
        out.append(before[-1][1] - 1 if before else -1)
        out.extend(range(s, e - 1))
    return out


class Row:
    """One packed or tree row: its position ids and, read from them when a layer asks, each token's
    parent (:func:`parents`) and the pieces a recurrent layer's scan runs (runs of consecutive
    tokens, cut after every token a later piece continues from: a shared prompt's state is carried
    into each of its branches). A sequence-parallel rank's share of a row is a row too: it asks only
    for the position ids."""

    def __init__(self, position_ids_L: torch.Tensor):
        self.position_ids = position_ids_L
        self.device = position_ids_L.device
        self.cache: dict = {}  # what layers derive from the row once per forward (a convolution's index)

    def __len__(self) -> int:
        return self.position_ids.shape[0]

    @functools.cached_property
    def segments(self) -> list[tuple[int, int, int]]:
        return segments(self.position_ids)

    @functools.cached_property
    def parent(self) -> list[int]:
        return parents(self.position_ids, self.segments)

    @functools.cached_property
    def pieces(self) -> list[tuple[int, int]]:
        # a token another piece continues from ends a piece: only a segment's first token has a
        # parent other than the token before it
        length, parent = len(self), self.parent
        continued = {parent[s] for s, _, _ in self.segments if parent[s] >= 0}
        starts = sorted({s for s, _, _ in self.segments} | {p + 1 for p in continued if p + 1 < length})
        return list(zip(starts, [*starts[1:], length]))


# the row the running forward runs (rltrain's forwards set it, :func:`expect`): read by the attention
# of a layer that passes no position ids and by recurrent layers; None: each row its own sequence
_current: list[Row | None] = [None]
_next: list[Row | None] = [None]


def expect(model: torch.nn.Module, position_ids_1L: torch.Tensor | None) -> None:
    """The next forward of ``model`` (a causal LM, also inside a DeepSpeed engine or a peft model)
    runs the row these position ids describe (``[1, L]``; None: rows of their own, a padded batch).
    It is the current row (:func:`current`) from that forward's start until the model's next forward
    starts, so the backward's recomputation of a checkpointed layer reads it too; a forward rltrain
    did not announce (generation, say) runs rows of their own."""
    lm = getattr(model, "module", model)
    lm = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    if not getattr(lm, "_rltrain_rows", False):
        lm.register_forward_pre_hook(_take_row)
        lm._rltrain_rows = True
    _next[0] = None if position_ids_1L is None else Row(position_ids_1L[0])


def _take_row(*_) -> None:
    _current[0], _next[0] = _next[0], None


def current() -> Row | None:
    """The row the model's running forward (or its backward's recomputation) runs, or None."""
    return _current[0]
