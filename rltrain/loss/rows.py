"""The structure of a packed or prefix-tree row, read from its position ids alone (pure torch).

- a **document** (a packed sequence) starts where the position id is 0;
- a **branch** of a prefix tree starts at position ``q > 0`` right after tokens whose positions do not
  lead up to it: it continues, for every position ``p < q``, the nearest earlier token at position
  ``p`` (the tree is laid out depth first, so that is the shared prefix it continues).

:mod:`rltrain.learner.attention` attends along this structure; :mod:`rltrain.loss.recurrent` carries
recurrent layers' state along it.
"""

from __future__ import annotations

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


def parents(position_ids_L: torch.Tensor) -> list[int]:
    """For each token of the row, the row index of the token before it in its own sequence (-1 for
    a sequence's first token): the previous index inside a piece, and for a branch's first token the
    last token of its ancestors."""
    out: list[int] = []
    pieces = segments(position_ids_L)
    for k, (s, e, first) in enumerate(pieces):
        before = ancestors(pieces, k) if first > 0 else []
        out.append(before[-1][1] - 1 if before else -1)
        out.extend(range(s, e - 1))
    return out
