"""Which layout each micro-batch runs in on a learner: a prefix tree (``learner.prefix_sharing``:
each shared prompt once, :mod:`rltrain.forward.tree`) where it saves, else one packed row
(``learner.packing``) or padded rows; and the check of each layout a run uses against padded rows
on its first micro-batch, every rank at once (:meth:`PrefixSharing.check`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rltrain.batch import TrainBatch, nonempty
from rltrain.forward.tree import PrefixTree, build_tree

# learner.prefix_sharing auto: a micro-batch runs as a prefix tree where that saves this share of
# its tokens (against one packed row)
AUTO_MIN_SAVING = 0.1
# each model's first micro-batch in each layout a run uses (packed rows, prefix trees) must give the
# outputs padded rows give to this (absolute, log-probs or values; by precision). Every family the
# contract runs exactly reads under 1e-5 in fp32 (docs/models.md); a layout that gets a family wrong
# reads 1e-3 or more (Bloom's ALiBi over a packed row: 9.1e-4 on a 2-layer model, 7e-3 at a step)
LAYOUT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.25}
SHARING_TOLERANCE = LAYOUT_TOLERANCE  # (the earlier name)


class LayoutMismatch(ValueError):
    """A layout the run asked for (``packing``, ``prefix_sharing: true``) gives other outputs than
    padded rows: the run stops with this line."""


class PrefixSharing:
    """One rank's row layouts: which micro-batches run as prefix trees (``learner.prefix_sharing``;
    the same answer for the same micro-batch within a call, so the old log-probs and the update take
    one path), whether the others run packed (``learner.packing``), and the check of both against
    padded rows (:meth:`check`). Under ``auto`` no micro-batch runs shared before the check has
    passed."""

    def __init__(
        self, setting: str | bool, packing: bool = False, key: str = "learner", check_packed: bool = True
    ):
        self.setting, self.key = setting, key  # "auto", True or False; the config section it is set in
        # auto: None until checked, then whether the check passed; True/False: the setting's own
        self.on: bool | None = None if setting == "auto" else bool(setting)
        self.packing = packing
        # the layouts still to check against padded rows on their first micro-batch
        self.unchecked = [name for name, used in (("tree", setting is not False), ("packed", packing and check_packed))
                          if used]  # fmt: skip
        self.force: str | None = (
            None  # set during a check: "tree", "packed" or "padded" for every micro-batch
        )
        self._trees: dict[int, tuple[torch.Tensor, PrefixTree]] = {}  # by input_ids (kept: ids not reused)

    @property
    def checked(self) -> bool:
        return self.on is not None

    def clear(self) -> None:
        """Forget the trees of the last call's micro-batches."""
        self._trees.clear()

    def _tree_of(self, mb: TrainBatch) -> PrefixTree:
        ids = mb.input_ids
        cached = self._trees.get(id(ids))
        if cached is None or cached[0] is not ids:
            tree = build_tree(ids, mb.attention_mask, ~mb.response_mask.bool(), mb.images, mb.image_token)
            cached = self._trees[id(ids)] = ids, tree
        return cached[1]

    def shares(self, mb: TrainBatch) -> bool:
        """Whether ``mb`` runs as a tree once sharing is on: always under ``true``; under ``auto``
        where sharing itself saves (a padded layout's padding alone does not count)."""
        return self.setting is True or self._tree_of(mb).shared_fraction >= AUTO_MIN_SAVING

    def tree(self, mb: TrainBatch) -> PrefixTree | None:
        """The prefix tree a forward on ``mb`` runs as, or None (the unshared layout)."""
        if self.force is not None:
            return self._tree_of(mb) if self.force == "tree" else None
        return self._tree_of(mb) if self.on and self.shares(mb) else None

    def packed(self) -> bool:
        """Whether an unshared forward runs as one packed row (else padded rows)."""
        return self.packing if self.force is None else self.force == "packed"

    def tokens_forwarded(self, mb: TrainBatch, unshared: float) -> float:
        """Tokens a forward on ``mb`` runs on: the tree's, or ``unshared``."""
        tree = self.tree(mb)
        return unshared if tree is None else tree.tokens

    def _first(self, layout: str, micro_batches: list[TrainBatch], positions) -> TrainBatch | None:
        """This rank's first micro-batch that runs in ``layout`` and has outputs to compare."""
        runs = (lambda m: self.shares(m)) if layout == "tree" else (lambda m: True)
        return next((m for m in micro_batches if runs(m) and positions(m).any()), None)

    @torch.no_grad()
    def check(
        self,
        forwards: dict[str, Callable[[TrainBatch], torch.Tensor]],
        micro_batches: list[TrainBatch],
        positions: Callable[[TrainBatch], torch.Tensor],
        bf16: bool,
        rank: int,
        blank: Callable[[Any], Any] = nonempty,
    ) -> bool | None:
        """The check of each layout still unchecked (prefix trees, packed rows) against padded rows,
        on every rank of a group at once: each model's ``[B, T]`` outputs (``forwards``) on this
        rank's first micro-batch that runs in that layout and has ``positions`` to compare (its loss
        tokens; a reward model's last tokens), in the layout and padded.

        Every rank runs the same forwards whatever it holds (ZeRO-3 gathers, the head's chunk
        agreement and an image tower's forward are collectives): the ranks first agree, in one
        all-reduce, which layouts any of them has a micro-batch for, and a rank without one runs a
        blank micro-batch (``blank`` of an empty one: :func:`rltrain.batch.nonempty`) that compares
        nothing. A layout no rank has a micro-batch for stays unchecked (the next call checks it).

        Where a model differs on any rank beyond rounding, or gives NaN: under ``auto`` sharing goes
        off for the group's run, said in one line; a layout the config asked for
        (``prefix_sharing: true``, ``packing``) raises :class:`LayoutMismatch`, naming it and the
        setting that avoids it. Returns whether sharing is on (None: undecided)."""
        import torch.distributed as dist

        layouts = list(self.unchecked)
        if not layouts:
            return self.on
        chosen = [self._first(layout, micro_batches, positions) for layout in layouts]
        found = torch.tensor([mb is not None for mb in chosen], dtype=torch.float64)
        if dist.is_initialized():  # (every rank runs the forwards of a layout any rank has)
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        empty = blank(micro_batches[0].select(torch.arange(0)))  # (on the micro-batches' device)
        differences = torch.zeros(len(layouts), len(forwards), dtype=torch.float64)
        for i, layout in enumerate(layouts):
            if not found[i]:
                continue
            mb = chosen[i] if chosen[i] is not None else empty
            keep = positions(mb).bool()
            for j, forward in enumerate(forwards.values()):
                outs = []
                for self.force in (layout, "padded"):
                    outs.append(forward(mb).float())
                self.force = None
                worst = float((outs[0] - outs[1])[keep].abs().max()) if keep.any() else 0.0
                differences[i, j] = worst if worst == worst else float("inf")  # NaN never passes
        if dist.is_initialized():  # (every rank decides alike)
            dist.all_reduce(differences, op=dist.ReduceOp.MAX)
        tolerance = LAYOUT_TOLERANCE[torch.bfloat16 if bf16 else torch.float32]
        for i, layout in enumerate(layouts):
            if not found[i]:
                continue
            self.unchecked.remove(layout)
            failed = {name: d for name, d in zip(forwards, differences[i].tolist()) if not d <= tolerance}
            said = ", ".join(f"{name} by {d:.3g}" for name, d in failed.items())
            if layout == "tree":
                self.on = not failed if self.setting == "auto" else self.on
                if failed and self.setting == "auto" and rank == 0:
                    print(f"{self.key}.prefix_sharing: auto: the shared forward differs from padded rows ({said}; "
                          f"> {tolerance:g}) on the first shared micro-batch; going on unshared", flush=True)  # fmt: skip
                elif failed and self.setting is True:
                    raise LayoutMismatch(
                        f"{self.key}.prefix_sharing: prefix-tree rows give other outputs than padded rows ({said}; "
                        f"> {tolerance:g}) on the first shared micro-batch: this model is not run exactly "
                        f"shared; set {self.key}.prefix_sharing=false (or auto, which checks and goes on unshared)"
                    )
            elif failed:
                raise LayoutMismatch(
                    f"{self.key}.packing: packed rows give other outputs than padded rows ({said}; > {tolerance:g}) "
                    f"on the first micro-batch: this model is not run exactly packed; set {self.key}.packing=false"
                )
        return self.on
