"""How a global batch is laid out over ranks, accumulation groups and micro-batches: padded
micro-batches of a fixed size (:func:`plan_micro_batches`) or packed rows under a token budget
(:func:`plan_packed_micro_batches`), a group's prefix tree kept whole. Pure torch: no ray, no
deepspeed; the batches themselves are :mod:`rltrain.batch`'s."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from rltrain.batch import TrainBatch
from rltrain.forward.tree import token_keys


@dataclass
class MicroBatchPlan:
    """Sequence indices of every micro-batch, per rank and per accumulation group.

    ``groups[r][g][m]`` is a (possibly empty) index tensor: rank ``r``'s micro-batch ``m`` of
    accumulation group ``g``. Every rank has the same number of groups, and every group the same
    number of micro-batches (``accumulation_steps``), so collectives (ZeRO-3 gathers, the
    token-total all-reduce) stay in lockstep; shorter shares are padded with empty micro-batches
    that contribute zero.
    """

    groups: list[list[list[torch.Tensor]]] = field(default_factory=list)
    oversized: int = 0  # sequences longer than the token budget, each alone in its micro-batch
    # per accumulation group: the sequences counted in its totals but run by no rank (their
    # gradient is exactly zero: :func:`plan_skipping`); empty where none is skipped
    counted_only: list[torch.Tensor] = field(default_factory=list)

    def micro_batches_per_group(self) -> list[int]:
        return [len(group) for group in self.groups[0]]


def plan_skipping(num_sequences: int, num_mini_batches: int, skipped: torch.Tensor, world_size: int,
                  plan_kept) -> MicroBatchPlan:  # fmt: skip
    """The plan of a batch some of whose sequences are counted but not run (``skipped``, ``[N]``
    bool): the accumulation groups are the whole batch's contiguous cuts, as without skipping, so
    every skipped sequence counts in the group it would have run in (:attr:`MicroBatchPlan.counted_only`);
    each group's other sequences are planned alone by ``plan_kept(indices)`` (a one-group plan of the
    batch of those sequences). A group with none to run gives every rank one empty micro-batch."""
    if num_sequences < num_mini_batches:
        raise ValueError(f"{num_sequences} sequences cannot fill {num_mini_batches} mini-batches")
    plan = MicroBatchPlan([[] for _ in range(world_size)])
    for cut in torch.arange(num_sequences).tensor_split(num_mini_batches):
        kept, plan.counted_only = cut[~skipped[cut]], [*plan.counted_only, cut[skipped[cut]]]
        if not len(kept):
            for rank in plan.groups:
                rank.append([cut[:0]])
            continue
        one = plan_kept(kept)
        plan.oversized += one.oversized
        for rank, (group,) in zip(plan.groups, one.groups):
            rank.append([kept[idx] for idx in group])
    return plan


def plan_micro_batches(
    num_sequences: int, world_size: int, num_mini_batches: int, micro_batch_size: int
) -> MicroBatchPlan:
    """Cut ``num_sequences`` into accumulation groups, ranks and micro-batches; drop nothing.

    Groups are contiguous and as even as possible (sizes differ by at most one); within a group,
    ranks get contiguous shares as even as possible; each share is cut into micro-batches of at most
    ``micro_batch_size``, and shorter shares are padded with empty micro-batches.
    """
    if num_sequences < num_mini_batches:
        raise ValueError(f"{num_sequences} sequences cannot fill {num_mini_batches} mini-batches")
    groups = torch.arange(num_sequences).tensor_split(num_mini_batches)
    largest_share = -(-max(len(g) for g in groups) // world_size)  # ceil
    accumulation_steps = max(1, -(-largest_share // micro_batch_size))
    plan: list[list[list[torch.Tensor]]] = [[] for _ in range(world_size)]
    for group in groups:
        for rank, share in enumerate(group.tensor_split(world_size)):
            micro = list(share.split(micro_batch_size)) if len(share) else []
            micro += [share[:0]] * (accumulation_steps - len(micro))
            plan[rank].append(micro)
    return MicroBatchPlan(plan)


def plan_packed_micro_batches(
    lengths: torch.Tensor,
    world_size: int,
    num_mini_batches: int,
    max_tokens: int,
    shared: list[int] | None = None,
) -> MicroBatchPlan:
    """Like :func:`plan_micro_batches`, but micro-batches are bounded by tokens, not sequences.

    ``lengths[i]`` is sequence i's token count (prompt + completion). Accumulation groups are the
    same contiguous cuts as in :func:`plan_micro_batches`. Within a group, sequences go to ranks
    longest first, each to the rank with the fewest tokens so far (greedy balancing); each rank
    then packs its share first-fit decreasing into micro-batches of at most ``max_tokens``. A
    sequence longer than ``max_tokens`` gets a micro-batch of its own (counted in ``oversized``),
    never cut. Every rank gets the number of micro-batches of the busiest rank in that group,
    padded with empty ones, so collectives stay in lockstep. Nothing is dropped or repeated.

    ``shared[i]``: the leading tokens sequence i shares with sequence i - 1 (a prefix-tree
    forward computes them once, :func:`shared_prefix_lengths`). Consecutive sequences sharing a
    prefix then travel together, as one tree of ``lengths[first] + sum(lengths[i] - shared[i])``
    tokens; a tree over the budget splits into sub-trees that fit, each with its own copy of the
    prefix. Trees also split where they would leave ranks idle (:func:`_balanced`).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    num_sequences = len(lengths)
    if num_sequences < num_mini_batches:
        raise ValueError(f"{num_sequences} sequences cannot fill {num_mini_batches} mini-batches")
    lengths = [int(x) for x in lengths]
    shared = [0] * num_sequences if shared is None else [int(x) for x in shared]
    plan: list[list[list[torch.Tensor]]] = [[] for _ in range(world_size)]
    oversized = 0
    for group in torch.arange(num_sequences).tensor_split(num_mini_batches):
        trees = _balanced(_trees(group.tolist(), lengths, shared, max_tokens), lengths, shared, world_size)
        cost = [_tree_cost(t, lengths, shared) for t in trees]
        shares, _ = _greedy_shares(trees, cost, world_size)
        packed = [_first_fit_decreasing(share, cost, max_tokens) for share in shares]
        oversized += sum(lengths[i] > max_tokens for i in group.tolist())
        steps = max(1, max(len(bins) for bins in packed))
        for rank, bins in enumerate(packed):
            micro = [torch.tensor(sorted(i for u in b for i in trees[u]), dtype=torch.long) for b in bins]
            micro += [torch.zeros(0, dtype=torch.long)] * (steps - len(micro))
            plan[rank].append(micro)
    return MicroBatchPlan(plan, oversized)


def _trees(group: list[int], lengths: list[int], shared: list[int], budget: int) -> list[list[int]]:
    """Runs of consecutive sequences sharing a prefix, each cut where it would pass ``budget``
    tokens (a cut's first sequence carries the prefix again)."""
    trees: list[list[int]] = []
    size = 0
    for i in group:
        extra = lengths[i] - shared[i]
        if trees and shared[i] > 0 and trees[-1][-1] == i - 1 and size + extra <= budget:
            trees[-1].append(i)
            size += extra
        else:
            trees.append([i])
            size = lengths[i]
    return trees


def _tree_cost(tree: list[int], lengths: list[int], shared: list[int]) -> int:
    """Tokens a tree's forward runs: its first sequence whole, the others past what they share."""
    return lengths[tree[0]] + sum(lengths[i] - shared[i] for i in tree[1:])


def _greedy_shares(trees: list[list[int]], cost: list[int], ranks: int) -> tuple[list[list[int]], list[int]]:
    """Each rank's trees (indices), longest first to the least loaded rank, and each rank's load."""
    longest_first = sorted(range(len(trees)), key=lambda u: (-cost[u], trees[u][0]))
    shares: list[list[int]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    for u in longest_first:
        rank = min(range(ranks), key=lambda r: (loads[r], len(shares[r]), r))
        shares[rank].append(u)
        loads[rank] += cost[u]
    return shares, loads


def _balanced(trees: list[list[int]], lengths: list[int], shared: list[int], ranks: int) -> list[list[int]]:
    """``trees``, the largest split in two while the busiest rank's share is 5% over an even one and a split
    can help, at the cut that repeats the fewest tokens (between groups first), halves as even as can be."""
    trees = list(trees)
    while ranks > 1:
        cost = [_tree_cost(t, lengths, shared) for t in trees]
        excess = max(_greedy_shares(trees, cost, ranks)[1]) - sum(cost) / ranks
        splittable = [u for u in range(len(trees)) if len(trees[u]) > 1]
        if excess <= 0.05 * sum(cost) / ranks or not splittable:
            return trees
        u = max(splittable, key=lambda u: (cost[u], -trees[u][0]))
        if cost[u] <= excess:  # the excess is a sequence too long to share out, not a tree
            return trees
        tree = trees[u]
        # left = tree[:m] = sum(before[: m]) + shared[tree[0]], right = tree[m:] = the rest + shared[tree[m]]
        before = list(itertools.accumulate(lengths[i] - shared[i] for i in tree))
        cut = min(range(1, len(tree)), key=lambda m: (
            shared[tree[m]], abs(2 * before[m - 1] + shared[tree[0]] - shared[tree[m]] - before[-1]),
        ))  # fmt: skip
        trees[u : u + 1] = [tree[:cut], tree[cut:]]
    return trees


def shared_prefix_lengths(batch: TrainBatch) -> list[int]:
    """For each sequence, the leading tokens it shares with the one before it, among the tokens
    neither trains on (its prompt: what a prefix-tree forward may compute once)."""
    keep = batch.attention_mask.bool()
    images = batch.images or [None] * len(batch)
    sequences = [token_keys(row[k].tolist(), im, batch.image_token)
                 for row, k, im in zip(batch.input_ids, keep, images)]  # fmt: skip
    leads = (keep & ~batch.response_mask.bool()).sum(-1).tolist()
    out = [0] * len(sequences)
    for i in range(1, len(sequences)):
        n = min(leads[i - 1], leads[i])
        a, b = sequences[i - 1][:n], sequences[i][:n]
        if batch.images is None:  # token ids alone: compared at once
            differ = np.flatnonzero(np.asarray(a) != np.asarray(b))
            out[i] = int(differ[0]) if len(differ) else n
        else:
            out[i] = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), n)
    return out


def _first_fit_decreasing(share: list[int], lengths: list[int], capacity: int) -> list[list[int]]:
    """``share`` (already longest first) into bins of at most ``capacity`` tokens; an item larger
    than the capacity fills a bin by itself."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in share:
        target = next((b for b in range(len(bins)) if room[b] >= lengths[i]), None)
        if target is None:
            bins.append([])
            room.append(capacity)
            target = len(bins) - 1
        bins[target].append(i)
        room[target] -= lengths[i]
    return bins
