"""Masked means and the token totals that make them exact under accumulation and data parallelism.

The bug this module exists to prevent: a trainer that takes the mean loss of each micro-batch and
then averages those means (over accumulation steps with ``/accumulation_steps``, over ranks with the
gradient all-reduce) weights a token in a short micro-batch more than a token in a long one, and the
update changes with the number of GPUs. The fix is to divide every micro-batch's *token sum* by the
number of loss tokens in the whole optimizer step: all micro-batches of the accumulation group, on
all data-parallel ranks, after every mask (padding, tool output, truncation) is applied.

Scaling, per micro-batch loss, for each ``masked_mean_denominator`` mode (``A`` accumulation steps,
``W`` data-parallel ranks whose gradients the engine *averages*, as DeepSpeed/DDP/FSDP do):

============  ==========================================================  ===================
mode          micro-batch loss                                            then
============  ==========================================================  ===================
``None``      sum(loss * mask) / mask.sum()    (this micro-batch's mean)  divide by ``A``
number ``c``  sum(loss * mask) / c             (Dr. GRPO's constant)      divide by ``A``
``"token"``   sum(loss * mask) / (N_group / W)  where ``N_group`` is the   do NOT divide by ``A``
              loss-token count of the group summed over all ranks
============  ==========================================================  ===================

In ``token`` mode the gradients summed over the ``A`` micro-batches and averaged over the ``W``
ranks are ``(1/W) * sum_ranks sum_mb grad(sum loss) * W / N_group = grad(sum of all loss tokens) /
N_group``: exactly the gradient of the global token mean. The factor ``W`` cancels the engine's
averaging; skipping ``/A`` is right because ``N_group`` already counts every micro-batch. With an
engine that *sums* gradients over ranks, use ``W = 1``.

Sequence parallelism (``sp`` ranks share each micro-batch, each holding a slice of its packed row,
:mod:`rltrain.learner.sequence_parallel`): each rank sums the loss over the tokens it *owns* (those whose
log-prob it computes) and counts only those in :func:`group_token_totals` over the whole world, so
``N_group`` still counts each loss token once. The gradient of the group's loss is the sum of its
``sp`` ranks' gradients (the all-to-alls carry each rank's share back through attention). The
factor is the number of ranks the engine averages over:

- averaged over all ``W`` ranks (DDP, DeepSpeed without an ``mpu``, rltrain's learners):
  ``(1/W) * sum_ranks grad(owned sum) * W / N_group = grad(all loss tokens) / N_group``: factor ``W``,
  the same formula as without sequence parallelism;
- summed over the ``sp`` ranks of a group and averaged over the ``D = W / sp`` data-parallel groups
  (DeepSpeed given a sequence-data-parallel ``mpu``): ``(1/D) * sum_groups sum_sp grad(owned sum) *
  D / N_group``: factor ``D``.

**Per-sequence aggregations** (:func:`aggregate`, verl's ``loss_agg_mode`` names). With ``n_s`` the
loss tokens of sequence ``s`` and ``S`` the sequences holding at least one loss token:

===========================  ==================================================================
``token-mean``               ``sum_s sum_t l_st / sum_s n_s``
``seq-mean-token-mean``      ``sum_s (sum_t l_st / n_s) / |S|``
``seq-mean-token-sum``       ``sum_s sum_t l_st / |S|``
``seq-mean-token-sum-norm``  ``sum_s sum_t l_st / (norm * |S|)`` (Dr. GRPO: ``norm`` a constant)
===========================  ==================================================================

Each is a sum over tokens with a per-token weight known on the rank that holds the token (``1``,
``1/n_s`` or ``1/norm``) divided by one global count (tokens or sequences). So the ``token`` scaling
above holds unchanged with ``N_group`` the group's token count (``token-mean``) or its sequence count
(the others): :func:`step_totals` returns both from the same single ``all_reduce``. Under sequence
parallelism ``n_s`` is the whole sequence's count (every rank of the group holds the whole row's
masks, so it needs no collective) and a sequence is counted on one rank only: the one that owns its
first loss token.

Only :func:`step_totals` touches ``torch.distributed``: one ``all_reduce`` for all groups.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.distributed as dist

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)


def masked_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    axis: int | None = None,
    denominator: float | torch.Tensor | None = None,
    aggregation: Aggregation | None = None,
    norm: float = 1.0,
) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is non-zero, reduced as ``aggregation``
    says (:func:`aggregate`; default ``token-mean``).

    ``denominator`` is the count the aggregation divides by, as everywhere in rltrain: a token
    count for ``token-mean`` (default ``mask.sum()``), a *sequence* count for the per-sequence
    modes (default: the rows holding a token). Pass a positive number (a constant, as Dr. GRPO
    does) or a scalar tensor (a step's total, see :func:`step_totals`).

    ``axis=1`` is the older spelling of ``aggregation="seq-mean-token-mean"`` (each row's masked
    mean, then the mean over the rows that hold a token). Together with ``denominator`` it used to
    divide each *row* by the denominator; that meaning is refused with the new spelling.

    An all-zero mask gives ``0`` (never NaN or inf) and a zero gradient. Masked-out positions never
    reach the result, even when they hold NaN or inf.
    """
    if denominator is not None and not isinstance(denominator, torch.Tensor):
        if not _is_positive_number(denominator):
            raise ValueError(f"masked_mean: denominator must be a positive number, got {denominator!r}")
    if axis is not None:
        if axis not in (1, -1) or values.dim() != 2:
            raise ValueError(f"masked_mean: axis={axis} on shape {tuple(values.shape)}; per-sequence means are "
                             "aggregation='seq-mean-token-mean' over [B, T] (axis=1 is its older spelling)")  # fmt: skip
        if denominator is not None:
            raise ValueError(
                "masked_mean(axis=1, denominator=c) divided each row's sum by c; write "
                "masked_mean(values, mask, aggregation='seq-mean-token-sum-norm', norm=c) for that (the "
                "denominator of a per-sequence aggregation is now a sequence count, as in aggregate and the config)"
            )
        if aggregation not in (None, "seq-mean-token-mean"):
            raise ValueError(
                f"masked_mean: axis=1 means aggregation='seq-mean-token-mean', got {aggregation!r}"
            )
        aggregation = "seq-mean-token-mean"
    return aggregate(values, mask, aggregation or "token-mean", denominator, norm=norm)


def _token_mean(
    values: torch.Tensor, mask: torch.Tensor, denominator: float | torch.Tensor | None
) -> torch.Tensor:
    keep = mask.bool()
    total = torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum()
    return _safe_divide(total, keep.sum() if denominator is None else denominator)


def _safe_divide(numerator: torch.Tensor, denominator: float | torch.Tensor) -> torch.Tensor:
    """``numerator / denominator`` where a zero denominator gives 0 (its numerator is 0 then).

    The division runs on a denominator with zeros replaced by 1, rather than selecting after the
    division: ``torch.where(den > 0, num / den, 0)`` would give NaN gradients through the branch
    it discards.
    """
    den = torch.as_tensor(denominator, device=numerator.device)
    den = torch.where(den > 0, den, torch.ones_like(den)).to(numerator.dtype)
    return numerator / den


def loss_token_mask(mask: torch.Tensor, tool_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Positions that count as loss tokens: ``mask`` and, when given, not tool output (``tool_mask`` 1)."""
    keep = mask.bool()
    if tool_mask is not None:
        if tool_mask.shape != mask.shape:
            raise ValueError(
                f"tool_mask shape {tuple(tool_mask.shape)} does not match mask shape {tuple(mask.shape)}"
            )
        keep = keep & tool_mask.bool()
    return keep


def aggregate(
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    aggregation: Aggregation = "token-mean",
    denominator: float | torch.Tensor | None = None,
    sequence_tokens_B: torch.Tensor | None = None,
    norm: float = 1.0,
) -> torch.Tensor:
    """Reduce per-token ``values_BT`` over the positions where ``mask_BT`` is non-zero to one loss.

    - ``token-mean``: ``sum(values * mask) / denominator`` (default: the mask's token count);
    - ``seq-mean-token-mean``: each sequence's token sum divided by its token count ``n_s``
      (``sequence_tokens_B``, default ``mask_BT.sum(-1)``), summed over sequences, ``/ denominator``;
    - ``seq-mean-token-sum``: each sequence's token sum, summed, ``/ denominator``;
    - ``seq-mean-token-sum-norm``: the same divided by the constant ``norm`` too.

    For the ``seq-*`` modes ``denominator`` is a *sequence* count: by default the rows holding at
    least one masked token; pass the step's global count (:func:`step_totals`) for exact
    normalization. Pass ``sequence_tokens_B`` when a rank holds only part of each sequence's tokens
    (sequence parallelism). Zero denominators give 0, never NaN; masked positions never reach the result.
    """
    if (
        denominator is not None
        and not isinstance(denominator, torch.Tensor)
        and not _is_positive_number(denominator)
    ):
        raise ValueError(f"aggregate: denominator must be a positive number, got {denominator!r}")
    if aggregation == "token-mean":
        return _token_mean(values_BT, mask_BT, denominator)
    keep = mask_BT.bool()
    zero = torch.zeros((), dtype=values_BT.dtype, device=values_BT.device)
    sums_B = torch.where(keep, values_BT, zero).sum(-1)
    if aggregation == "seq-mean-token-mean":
        counts_B = keep.sum(-1) if sequence_tokens_B is None else sequence_tokens_B
        sums_B = _safe_divide(sums_B, counts_B)
    elif aggregation == "seq-mean-token-sum-norm":
        if not _is_positive_number(norm):
            raise ValueError(f"aggregate: norm must be a positive number, got {norm!r}")
        sums_B = sums_B / norm
    elif aggregation != "seq-mean-token-sum":
        raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}; got {aggregation!r}")
    if denominator is None:
        denominator = keep.any(-1).sum()
    return _safe_divide(sums_B.sum(), denominator)


@dataclass(frozen=True)
class StepTotals:
    """Loss tokens and sequences holding loss tokens of every accumulation group, on all ranks."""

    tokens: torch.Tensor  # [G] float32
    sequences: torch.Tensor  # [G] float32
    extra: torch.Tensor | None = None  # [G, K] float64: the per-micro-batch counts given as ``extra``

    def denominator(self, group: int, aggregation: Aggregation, world_size: int) -> torch.Tensor:
        """The ``token``-mode denominator of one micro-batch of ``group``: the group's global count
        (tokens for ``token-mean``, sequences otherwise) over the ranks the engine averages over."""
        count = self.tokens if aggregation == "token-mean" else self.sequences
        return count[group] / world_size


def step_totals(
    masks: Sequence[torch.Tensor],
    accumulation_steps: int | Sequence[int],
    tool_masks: Sequence[torch.Tensor] | None = None,
    counted: Sequence[torch.Tensor | None] | None = None,
    group: dist.ProcessGroup | None = None,
    extra: Sequence[torch.Tensor] | None = None,
) -> StepTotals:
    """Loss tokens and sequences of every accumulation group, summed over all ranks of ``group``
    with exactly **one** ``all_reduce`` (see :func:`group_token_totals` for the arguments).

    A sequence counts when it holds at least one loss token; ``counted`` (a bool ``[B]`` per
    micro-batch) overrides which sequences this rank counts (under sequence parallelism, those whose
    first loss token it owns, so a sequence split over ranks counts once; None for a micro-batch
    counted whole, as without ``counted``). ``extra``: other integer
    counts of each micro-batch (an int64 ``[K]`` each: a mixture of experts' assignments,
    :mod:`rltrain.loss.moe`), summed per group in the same collective.
    """
    group_of = _group_index(len(masks), accumulation_steps)
    if tool_masks is not None and len(tool_masks) != len(masks):
        raise ValueError(f"got {len(masks)} masks but {len(tool_masks)} tool_masks")
    num_groups = (group_of[-1] + 1) if group_of else 0
    device = masks[0].device if masks else torch.device("cpu")
    width = 0 if extra is None else extra[0].numel()
    totals = torch.zeros(num_groups, 2 + width, dtype=torch.int64, device=device)  # tokens, sequences, extra
    for i, mask in enumerate(masks):
        keep = loss_token_mask(mask, None if tool_masks is None else tool_masks[i])
        totals[group_of[i], 0] += keep.sum()
        owned = None if counted is None else counted[i]
        totals[group_of[i], 1] += (keep.any(-1) if owned is None else owned.bool()).sum()
        if width:
            totals[group_of[i], 2:] += extra[i].reshape(-1).to(device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
    counts = totals[:, :2].T.to(torch.float32)
    return StepTotals(counts[0], counts[1], totals[:, 2:].to(torch.float64) if width else None)


def group_token_totals(
    masks: Sequence[torch.Tensor],
    accumulation_steps: int | Sequence[int],
    tool_masks: Sequence[torch.Tensor] | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Loss-token count of every accumulation group, summed over all ranks of ``group``.

    ``masks`` are this rank's micro-batch loss masks in order. With an int ``accumulation_steps``,
    micro-batches ``i*accumulation_steps .. (i+1)*accumulation_steps - 1`` form accumulation group
    ``i`` (the last group may be shorter); with a sequence, ``accumulation_steps[i]`` is the number
    of micro-batches of group ``i`` (token-budget packing gives groups different counts).
    ``tool_masks`` (same shapes) are 1 on tokens the policy generated and 0 on tokens a tool
    inserted; loss tokens are ``mask & tool_mask``.

    Returns a float32 tensor of shape ``[num_groups]``. When ``torch.distributed`` is initialized
    the counts are summed over ``group`` (default: the whole world) with exactly one
    ``all_reduce`` for all groups together, so every rank must call this with the same number of
    micro-batches (pad with all-zero masks). Counting happens in int64, so totals are exact.
    """
    return step_totals(masks, accumulation_steps, tool_masks, group=group).tokens


def _group_index(num_masks: int, accumulation_steps: int | Sequence[int]) -> list[int]:
    """The accumulation group of each micro-batch."""
    if isinstance(accumulation_steps, int):
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
        return [i // accumulation_steps for i in range(num_masks)]
    sizes = list(accumulation_steps)
    if any(size < 1 for size in sizes) or sum(sizes) != num_masks:
        raise ValueError(f"accumulation_steps {sizes} must be >= 1 each and sum to the {num_masks} masks")
    return [g for g, size in enumerate(sizes) for _ in range(size)]


def _is_positive_number(value: object) -> bool:
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )
