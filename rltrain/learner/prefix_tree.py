"""Prefix-tree forwards: a micro-batch's shared prompts computed once (pure torch).

A GRPO group's completions share their prompt, and every forward that reads a batch (the policy's,
the old log-probs', the reference's, a teacher's, the critic's, the MoE count forward) would run
that prompt once per member. Here a micro-batch becomes one row holding a **prefix tree**: each
shared prefix once, followed depth first by what each member adds, every token at the position
id it has in its own sequence. :mod:`rltrain.learner.attention` reads the tree from those position
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

from rltrain.batch import TrainBatch, nonempty, token_keys
from rltrain.loss import vision
from rltrain.loss.forwards import head_forward, packed_forward, token_outputs
from rltrain.loss.logprobs import Truncation, predicted_logprobs
from rltrain.loss.vision import Images


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
    share only where the image is the same (:func:`rltrain.batch.token_keys`)."""
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
    :data:`rltrain.learner.attention.PACKED`)."""
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`rltrain.loss.logprobs.sequence_logprobs` through the tree: ``[B, T]`` log-probs of
    every token given its prefix (each sequence's first token 0), and the entropy.

    Each distinct (predicting row token, target) pair is computed once: the shared prompt's
    predictions once, and at a branch point the shared last token once per member's own next token.
    ``images`` (each row's, :class:`rltrain.loss.vision.Images`): a shared prompt's images
    enter the row once, with the rotary positions each sequence has alone (``idle_image``: see
    :func:`rltrain.loss.vision.forward_inputs`)."""
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
    logprobs_K, entropy_K = predicted_logprobs(
        states[0, source[first]][None], head, target[first][None], temperature, with_entropy, truncation
    )

    def spread(values_1K: torch.Tensor) -> torch.Tensor:
        out = values_1K.new_zeros(cell_BT.shape)
        return out.index_put((predicted_BT,), values_1K[0, inverse])

    return spread(logprobs_K), None if entropy_K is None else spread(entropy_K)


def tree_outputs(model: torch.nn.Module, tree: PrefixTree) -> torch.Tensor:
    """:func:`rltrain.loss.forwards.token_outputs` through the tree: the model's per-position
    ``logits`` (a value head's few outputs) ``[B, T, C]``, 0 on padding."""
    return tree.gather(tree_forward(model, tree).logits)


def outputs(model: torch.nn.Module, mb: TrainBatch, tree: PrefixTree | None, packed: bool) -> torch.Tensor:
    """The model's per-position ``logits`` ``[B, T, C]`` for a head with few outputs (a value or
    score head): through ``tree`` where given, else padded or packed."""
    if tree is not None:
        return tree_outputs(model, tree)
    return token_outputs(model, mb.input_ids, mb.attention_mask, packed)


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
    ) -> bool | None:
        """The check of each layout still unchecked (prefix trees, packed rows) against padded rows,
        on every rank of a group at once: each model's ``[B, T]`` outputs (``forwards``) on this
        rank's first micro-batch that runs in that layout and has ``positions`` to compare (its loss
        tokens; a reward model's last tokens), in the layout and padded.

        Every rank runs the same forwards whatever it holds (ZeRO-3 gathers, the head's chunk
        agreement and an image tower's forward are collectives): the ranks first agree, in one
        all-reduce, which layouts any of them has a micro-batch for, and a rank without one runs a
        blank micro-batch (:func:`rltrain.batch.nonempty`) that compares nothing. A layout no rank
        has a micro-batch for stays unchecked (the next call checks it).

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
        blank = nonempty(micro_batches[0].select(torch.arange(0)))
        blank = blank.replace(**{k: v.to(micro_batches[0].input_ids.device)
                                 for k, v in vars(blank).items() if isinstance(v, torch.Tensor)})  # fmt: skip
        differences = torch.zeros(len(layouts), len(forwards), dtype=torch.float64)
        for i, layout in enumerate(layouts):
            if not found[i]:
                continue
            mb = chosen[i] if chosen[i] is not None else blank
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
