"""Rollout corrections: the engine sampled from a distribution a little different from the learner's
old policy (another precision, kernels, weights some steps older); these reweight or reject the
sampled tokens by the ratio ``r = exp(learner - generator)`` of the two log-probs (pure torch).

Kinds:
- ``tis``: truncated importance weights ``min(r, cap)`` (no gradient), multiplied into the per-token loss.
- ``mis``: masked importance sampling (IcePop): tokens whose ratio lies outside ``[low, high]``
  leave the loss.
- ``geo_mask``: a sequence whose geometric-mean ratio ``exp(mean_t log r_t)`` lies outside
  ``[low, high]`` leaves the loss whole.

Level ``token`` uses each token's ratio; level ``sequence`` uses the sequence's ratio ``prod_t r_t``
(``tis``: one weight for every token of the sequence; ``mis``: the whole sequence kept or rejected).
``geo_mask`` is a sequence rule by definition.

Rejected tokens and the ``token`` denominators: a rejected token leaves the loss *and* the token
(or sequence) totals, exactly as a padding or tool token does, and is counted. The learner folds
:func:`correction_mask` into the tool mask before the step's one token-total collective, so the
update stays exact under any layout; a caller of :func:`rltrain.loss.losses.policy_loss` who computes
totals does the same (the loss applies the mask again, which changes nothing then).

Under sequence parallelism a sequence's log-ratio sum and token count are spread over the ranks of
its group: pass ``sequence_sum`` (one all-reduce in that group) and every rank sees whole sequences.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

CorrectionKind = Literal["tis", "mis", "geo_mask"]
CorrectionLevel = Literal["token", "sequence"]
LOG_RATIO_BOUND = 20.0  # as rltrain.loss.losses: exp stays finite


@dataclass(frozen=True)
class RolloutCorrection:
    """Which correction, at which level, with which bounds (mirrors ``loss.rollout_correction``)."""

    kind: CorrectionKind = "tis"
    level: CorrectionLevel = "token"
    cap: float = 2.0  # tis: the largest weight
    low: float = 0.5  # mis, geo_mask: ratios below leave the loss
    high: float = 2.0  # mis, geo_mask: ratios above leave the loss

    def __post_init__(self):
        if self.kind not in ("tis", "mis", "geo_mask") or self.level not in ("token", "sequence"):
            raise ValueError(f"rollout correction kind/level {self.kind!r}/{self.level!r} is unknown")
        if self.cap <= 0 or not 0 < self.low < self.high:
            raise ValueError(f"rollout correction needs cap > 0 and 0 < low < high; got {self}")
        if self.kind == "geo_mask" and self.level != "sequence":
            raise ValueError("rollout correction geo_mask is a sequence rule: level must be sequence")

    @property
    def rejects(self) -> bool:
        """Whether tokens can leave the loss (and so the token totals)."""
        return self.kind != "tis"


def _correction_log_ratio(
    learner_BT: torch.Tensor,
    generator_BT: torch.Tensor,
    keep_BT: torch.Tensor,
    correction: RolloutCorrection,
    sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None,
) -> torch.Tensor:
    """The log-ratio the correction judges by: each token's ``[B, T]``, or its sequence's ``[B, 1]``
    (the sum; the mean for ``geo_mask``), clamped to ``+-LOG_RATIO_BOUND``."""
    d = torch.where(keep_BT, learner_BT.detach().float() - generator_BT.float(), 0.0)
    if correction.level == "token":
        return d.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    total_B, count_B = d.sum(-1), keep_BT.sum(-1).float()
    if sequence_sum is not None:  # over every rank holding part of the sequence
        total_B, count_B = sequence_sum(total_B), sequence_sum(count_B)
    value_B = total_B / count_B.clamp(min=1.0) if correction.kind == "geo_mask" else total_B
    return value_B.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)[:, None]


def correction_mask(
    learner_BT: torch.Tensor,
    generator_BT: torch.Tensor,
    keep_BT: torch.Tensor,
    correction: RolloutCorrection,
    sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``[B, T]`` bool: the loss tokens (``keep``) the correction keeps; all of ``keep`` for ``tis``."""
    keep_BT = keep_BT.bool()
    if not correction.rejects:
        return keep_BT
    log_r = _correction_log_ratio(learner_BT, generator_BT, keep_BT, correction, sequence_sum)
    inside = (log_r >= math.log(correction.low)) & (log_r <= math.log(correction.high))
    return keep_BT & inside


def correction_weights(
    learner_BT: torch.Tensor,
    generator_BT: torch.Tensor,
    keep_BT: torch.Tensor,
    correction: RolloutCorrection,
    sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``[B, T]`` weights without gradient to multiply the per-token loss by: ``min(r, cap)`` for
    ``tis`` (the token's or its sequence's ratio), 1 for the rejecting kinds."""
    if correction.rejects:
        return torch.ones_like(learner_BT).detach()
    log_r = _correction_log_ratio(learner_BT, generator_BT, keep_BT.bool(), correction, sequence_sum)
    return torch.exp(log_r).expand_as(learner_BT).clamp(max=correction.cap).to(learner_BT.dtype).detach()
