"""The structure of a packed or prefix-tree row, read from its position ids alone (pure torch).

- a **document** (a packed sequence) starts where the position id is 0;
- a **branch** of a prefix tree starts at position ``q > 0`` right after tokens whose positions do not
  lead up to it: it continues, for every position ``p < q``, the nearest earlier token at position
  ``p`` (the tree is laid out depth first, so that is the shared prefix it continues).

:mod:`rltrain.forward.attention` attends along this structure; :mod:`rltrain.forward.recurrent`
carries recurrent layers' state along it. The row a model's forward runs is announced once
(:func:`expect`) to that model's own context (:class:`RowContext`), and read through the module
that runs (:func:`row_of`) by the layers that need it: the attention (its pieces planned once for
every layer), the recurrent layers.
"""

from __future__ import annotations

import functools

import torch

from rltrain.forward.model import causal_lm


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
    """One packed or tree row (``[1, L]`` position ids) and, read from them when a layer asks, each token's
    parent (:func:`parents`) and the pieces a recurrent layer's scan runs (runs of consecutive
    tokens, cut after every token a later piece continues from: a shared prompt's state is carried
    into each of its branches). A sequence-parallel rank's share of a row is a row too: it asks only
    for the position ids."""

    def __init__(self, position_ids_1L: torch.Tensor):
        if position_ids_1L.dim() == 1:
            position_ids_1L = position_ids_1L[None]
        self.position_ids_1L = position_ids_1L
        self.position_ids = position_ids_1L[0]
        self.device = position_ids_1L.device
        # what layers derive from the row once per forward (the attention's pieces, a convolution's
        # windows), by what they derive it from
        self.cache: dict = {}

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


class RowContext:
    """What the layers of one model's forward read beside their arguments (transformers calls a
    layer's attention, convolution and scan with its own arguments): the row that forward runs
    (:attr:`row`, None: each row its own sequence), announced before it starts (:func:`expect`) and
    kept until the model's next forward starts, so the backward's recomputation of a checkpointed
    layer reads it too; and whether it is the head's probe (:func:`rltrain.forward.head.probing`).
    One for each model, held by the model and each of its modules (:func:`context`): two models in
    one process (a policy and its reference, a server's models) never read each other's rows."""

    def __init__(self):
        self.row: Row | None = None
        self.announced: Row | None = None
        self.probing = False

    def take(self, *_) -> None:
        """A forward of the model starts (its pre-hook): its announced row is the current one."""
        self.row, self.announced = self.announced, None


def attach(model: torch.nn.Module) -> RowContext:
    """The row context of ``model`` (a causal LM, also inside a DeepSpeed engine or a peft model):
    made at the first call and given to the model and every module it holds then, read back by
    :func:`context`."""
    lm = causal_lm(model)
    found = lm.__dict__.get("_rltrain_context")
    if found is None:
        found = RowContext()
        for module in lm.modules():  # (a plain attribute: not a submodule, not in the state dict)
            module.__dict__["_rltrain_context"] = found
        lm.register_forward_pre_hook(found.take)
    return found


def context(module: torch.nn.Module) -> RowContext | None:
    """The row context of the model ``module`` belongs to (:func:`attach`), or None: a module of no
    model rltrain announced a row to."""
    return module.__dict__.get("_rltrain_context")


def expect(model: torch.nn.Module, position_ids_1L: torch.Tensor | None) -> None:
    """The next forward of ``model`` runs the row these position ids describe (``[1, L]``; None: rows
    of their own, a padded batch): :attr:`RowContext.row` of the model's context from that forward's
    start until its next forward starts; a forward rltrain did not announce (generation, say) runs
    rows of their own."""
    attach(model).announced = None if position_ids_1L is None else Row(position_ids_1L)


def row_of(module: torch.nn.Module) -> Row | None:
    """The row the running forward (or its backward's recomputation) of ``module``'s model runs, or
    None."""
    found = context(module)
    return None if found is None else found.row
