"""Per-token policy losses, KL estimators and the SFT cross-entropy (pure torch).

Every loss here returns a *per-token* tensor ``[B, T]``; reduction is one call to
:func:`rltrain.loss.masked_mean.masked_mean` with a denominator chosen outside (the micro-batch's own
count, a constant, or the global token total of the optimizer step). That keeps normalization in
one place and makes every objective exact under accumulation and data parallelism.

Departures from the papers:
- PPO/DAPO: the lower and upper clip ranges are separate (DAPO's clip-higher); the optional dual
  clip (Ye et al. 2020) bounds the loss of negative-advantage tokens at ``-A * dual_clip``.
- CISPO (MiniMax-M1): REINFORCE on ``logprobs`` weighted by the clipped, stop-gradient ratio.
- GSPO: the sequence ratio is the length-normalized ratio of the sequence; we use the GSPO-token
  form (ratio value from the sequence, gradient per token), which equals GSPO when all tokens of a
  sequence share one advantage, and reduce it with the same per-token denominators as the others.
  Under sequence parallelism a sequence's log-ratio sum is spread over the ranks of its group; the
  caller passes ``sequence_sum`` (one all-reduce in that group, :mod:`rltrain.learner.sequence_parallel`)
  and ``sequence_tokens_B`` (the whole sequence's token count), so every rank uses the sequence's
  full ratio. The ratio is a stop-gradient value, so the sum needs no backward collective.
- DPPO (:mod:`rltrain.loss.dppo`): a divergence mask in place of the ratio clip, against the
  engine's sampling policy or the old one (``dppo_anchor``).
- Every ratio is ``exp`` of a log-ratio clamped to ``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND]`` (20, as
  verl): a token whose policies disagree wildly (a broken sync, a bf16 outlier) gives a finite loss
  and gradient instead of inf/NaN. Such a token is far outside any clip range, so the bound changes
  nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from rltrain.loss.corrections import LOG_RATIO_BOUND, RolloutCorrection, correction_mask, correction_weights
from rltrain.loss.dppo import Divergence, dppo_loss
from rltrain.loss.logprobs import token_logprobs
from rltrain.loss.masked_mean import Aggregation, aggregate, loss_token_mask

PolicyLossType = Literal["ppo", "cispo", "gspo", "dppo"]
KLEstimator = Literal["k1", "k2", "k3", "k3+", "abs"]
# LOG_RATIO_BOUND (rltrain.loss.corrections): exp(20) ~ 4.9e8, finite in fp32 and bf16


def ratio(logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor) -> torch.Tensor:
    """``exp(logp - old)`` with the log-ratio clamped to ``+-LOG_RATIO_BOUND`` (finite, always)."""
    return torch.exp(torch.clamp(logprobs_BT - old_logprobs_BT, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def ppo_clip_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token. Returns ``(loss_BT, clipped_BT)``.

    ``loss = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))`` with ``r = exp(logp - old)``;
    with ``dual_clip = c > 1`` the loss of tokens with ``A < 0`` is further capped at ``-A * c``.
    ``clipped_BT`` is True where the clipped branch was taken (no gradient flows there).
    """
    r = ratio(logprobs_BT, old_logprobs_BT)
    unclipped = -advantages_BT * r
    clipped = -advantages_BT * torch.clamp(r, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        cap = -advantages_BT * dual_clip
        dual = (advantages_BT < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        was_clipped = was_clipped | dual
    return loss, was_clipped


def cispo_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    clip_low: float = 1.0,
    clip_high: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO per token: ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp``.

    Unlike PPO, clipped tokens still get a gradient (through ``logp``); only their weight is
    bounded. Returns ``(loss_BT, clipped_BT)``.
    """
    r = ratio(logprobs_BT, old_logprobs_BT).detach()
    weight = torch.clamp(r, 1.0 - clip_low, 1.0 + clip_high)
    return -weight * advantages_BT * logprobs_BT, weight != r


def gspo_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    sequence_tokens_B: torch.Tensor | None = None,
    sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO(-token) per token. Returns ``(loss_BT, clipped_BT)``.

    The sequence ratio ``s_i = exp(mean_t (logp - old))`` over the sequence's loss tokens is shared
    by its tokens as a value, ``s_it = sg(s_i) * exp(logp_t - sg(logp_t))``, then clipped as in PPO.
    The paper's clip ranges are tiny (3e-4 / 4e-4) because ``s_i`` is a geometric mean. When this
    rank holds part of each sequence, ``sequence_sum`` sums a ``[B]`` tensor over the ranks holding
    the rest and ``sequence_tokens_B`` is the whole sequences' token counts.
    """
    keep = mask_BT.bool()
    log_ratio = torch.where(keep, logprobs_BT - old_logprobs_BT, torch.zeros_like(logprobs_BT))
    log_ratio_sum_B = log_ratio.detach().sum(-1)
    if sequence_sum is not None:
        log_ratio_sum_B = sequence_sum(log_ratio_sum_B)
    counts_B = keep.sum(-1) if sequence_tokens_B is None else sequence_tokens_B
    seq_log_ratio_B = log_ratio_sum_B / counts_B.clamp(min=1)
    seq_log_ratio_B = seq_log_ratio_B.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    token_ratio = torch.exp(seq_log_ratio_B[:, None] + logprobs_BT - logprobs_BT.detach())
    unclipped = -advantages_BT * token_ratio
    clipped = -advantages_BT * torch.clamp(token_ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def truncated_is_weights(
    learner_logprobs_BT: torch.Tensor, generator_logprobs_BT: torch.Tensor, cap: float = 2.0
) -> torch.Tensor:
    """Truncated importance weights ``min(exp(learner - generator), cap)``, without gradient.

    Corrects for the generator (vLLM, possibly a step behind) sampling from a slightly different
    distribution than the learner's old policy; multiply the per-token loss by these.
    """
    if cap <= 0:
        raise ValueError(f"truncated importance-sampling cap must be > 0, got {cap}")
    return ratio(learner_logprobs_BT, generator_logprobs_BT).clamp(max=cap).detach()


def kl_penalty(
    logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, estimator: KLEstimator = "k3"
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman's k1-k3).

    With ``d = ref - logp``: k1 = ``-d``; k2 = ``d**2 / 2``; k3 = ``exp(d) - d - 1`` (unbiased and
    never negative); ``abs`` = ``|d|``; ``k3+`` = k3's value with k2's gradient (straight-through:
    an unbiased estimate whose gradient is the unbiased gradient of the KL, as verl's ``+`` forms).
    ``d`` is clamped to ``+-LOG_RATIO_BOUND`` first, so ``exp`` stays finite.
    """
    d = torch.clamp(ref_logprobs_BT - logprobs_BT, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.expm1(d) - d
    if estimator == "k3+":
        k2, k3 = 0.5 * d * d, torch.expm1(d) - d
        return k2 + (k3 - k2).detach()
    if estimator == "abs":
        return d.abs()
    raise ValueError(f"kl estimator must be one of k1, k2, k3, k3+, abs; got {estimator!r}")


@dataclass(frozen=True)
class PolicyLossSettings:
    """What shapes the per-token policy loss (mirrors the ``loss`` section of the config)."""

    kind: PolicyLossType = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    kl_beta: float = 0.0
    kl_estimator: KLEstimator = "k3"
    tis_cap: float | None = None  # the older spelling of correction=RolloutCorrection("tis", cap=tis_cap)
    correction: RolloutCorrection | None = None  # rltrain.loss.corrections; takes precedence over tis_cap
    aggregation: Aggregation = (
        "token-mean"  # how per-token losses reduce (rltrain.loss.masked_mean.aggregate)
    )
    aggregation_norm: float = 1.0  # the constant of seq-mean-token-sum-norm
    dppo_divergence: Divergence = "tv"  # DPPO (kind="dppo"): rltrain.loss.dppo
    dppo_delta_low: float | None = None  # None: the divergence's default (rltrain.loss.dppo.DEFAULT_DELTA)
    dppo_delta_high: float | None = None  # None: dppo_delta_low's
    dppo_anchor: Literal["rollout", "old"] = "rollout"  # the engine's sampling log-probs, or the old policy's
    dppo_ratio_cap: float | None = None


def _surrogate(
    s: PolicyLossSettings,
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    keep_BT: torch.Tensor,
    sequence_tokens_B: torch.Tensor | None,
    sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_BT, clipped_BT)`` of ``s.kind``, with one advantage per sequence (group estimators)
    or per token (GAE)."""
    advantages_BT = _per_token(advantages_B, logprobs_BT)
    if s.kind == "ppo":
        return ppo_clip_loss(
            logprobs_BT, old_logprobs_BT, advantages_BT, s.clip_low, s.clip_high, s.dual_clip
        )
    if s.kind == "cispo":
        return cispo_loss(logprobs_BT, old_logprobs_BT, advantages_BT, s.clip_low, s.clip_high)
    if s.kind == "gspo":
        return gspo_loss(logprobs_BT, old_logprobs_BT, advantages_BT, keep_BT, s.clip_low, s.clip_high,
                         sequence_tokens_B, sequence_sum)  # fmt: skip
    raise ValueError(f"policy loss kind must be ppo, cispo or gspo, got {s.kind!r}")


def _per_token(advantages_B: torch.Tensor, logprobs_BT: torch.Tensor) -> torch.Tensor:
    """One advantage per sequence (group estimators) or per token (GAE), as ``[B, T]``."""
    per_sequence = advantages_B.dim() == 1
    advantages_BT = (advantages_B[:, None] if per_sequence else advantages_B).expand_as(logprobs_BT)
    return advantages_BT.to(logprobs_BT.dtype)


def _dppo(s: PolicyLossSettings, logprobs_BT, old_logprobs_BT, generator_logprobs_BT, advantages_B):
    """DPPO's ``(loss_BT, masked_low_BT, masked_high_BT)`` against its anchor: the engine's sampling
    log-probs where asked for and given, else the old policy's."""
    rollout = s.dppo_anchor == "rollout" and generator_logprobs_BT is not None
    anchor = generator_logprobs_BT if rollout else old_logprobs_BT
    return dppo_loss(logprobs_BT, anchor, _per_token(advantages_B, logprobs_BT), s.dppo_divergence,
                     s.dppo_delta_low, s.dppo_delta_high, s.dppo_ratio_cap)  # fmt: skip


def policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    denominator: float | torch.Tensor | None,
    settings: PolicyLossSettings = PolicyLossSettings(),
    tool_mask_BT: torch.Tensor | None = None,
    ref_logprobs_BT: torch.Tensor | None = None,
    generator_logprobs_BT: torch.Tensor | None = None,
    axis: int | None = None,
    sequence_tokens_B: torch.Tensor | None = None,
    sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    fresh_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy objective for one micro-batch, reduced with ``aggregate(..., settings.aggregation,
    denominator)`` (a token count for ``token-mean``, a sequence count for the per-sequence modes).

    Loss tokens are ``mask & tool_mask``, less what a rollout correction rejects (``settings.correction``,
    or ``tis_cap``; :mod:`rltrain.loss.corrections`). ``axis=1`` is the older spelling of
    ``seq-mean-token-mean``. ``sequence_tokens_B`` and ``sequence_sum`` serve a rank that holds part
    of each sequence (sequence parallelism; see :func:`aggregate` and :func:`gspo_loss`). Returns the
    scalar loss and detached per-token *sums* over the loss tokens (``pg_loss``, ``kl``,
    ``clipped``, ``ratio``; ``mismatch_kl`` and ``mismatch_max`` over the sampled tokens (those of
    ``fresh_BT``, the ones the current weights sampled, where given) with their count
    ``mismatch_tokens``, and ``rejected`` tokens with a rejecting correction) plus ``tokens``: a caller sums these over micro-batches and ranks and
    divides by the summed ``tokens`` to log global token means rather than means of micro-batch means.
    """
    s = settings
    keep = sampled = loss_token_mask(mask_BT, tool_mask_BT)
    correction = s.correction or (RolloutCorrection("tis", cap=s.tis_cap) if s.tis_cap is not None else None)
    if generator_logprobs_BT is None:
        correction = None
    if correction is not None:
        # rejected tokens leave the loss (a caller that computes token totals removed them already)
        keep = correction_mask(old_logprobs_BT, generator_logprobs_BT, keep, correction, sequence_sum)
    masked = None
    if s.kind == "dppo":
        pg, *masked = _dppo(s, logprobs_BT, old_logprobs_BT, generator_logprobs_BT, advantages_B)
        clipped = masked[0] | masked[1]
    else:
        pg, clipped = _surrogate(
            s, logprobs_BT, old_logprobs_BT, advantages_B, keep, sequence_tokens_B, sequence_sum
        )
    # DPPO against the engine's log-probs: its ratio is the importance weight already (rltrain.loss.dppo)
    weighted = not (s.kind == "dppo" and s.dppo_anchor == "rollout")
    if correction is not None and weighted:
        pg = pg * correction_weights(old_logprobs_BT, generator_logprobs_BT, keep, correction, sequence_sum)

    per_token = pg
    kl = None
    if s.kl_beta > 0:
        if ref_logprobs_BT is None:
            raise ValueError("kl_beta > 0 needs reference log-probs")
        kl = kl_penalty(logprobs_BT, ref_logprobs_BT, s.kl_estimator)
        per_token = pg + s.kl_beta * kl

    aggregation = "seq-mean-token-mean" if axis == 1 else s.aggregation
    loss = aggregate(per_token, keep, aggregation, denominator, sequence_tokens_B, s.aggregation_norm)

    def token_sum(x: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, x.detach().float(), 0.0).sum()

    metrics = {
        "pg_loss": token_sum(pg),
        "clipped": token_sum(clipped.float()),
        "ratio": token_sum(ratio(logprobs_BT, old_logprobs_BT)),
        "tokens": keep.sum().float(),
    }
    if kl is not None:
        metrics["kl"] = token_sum(kl)
    if masked is not None:  # DPPO: the tokens masked on each side
        metrics["dppo_masked_low"], metrics["dppo_masked_high"] = (token_sum(m.float()) for m in masked)
    if generator_logprobs_BT is not None:  # over every sampled loss token, rejected ones included
        measured = sampled if fresh_BT is None else sampled & fresh_BT.bool()
        metrics |= sampling_mismatch(old_logprobs_BT, generator_logprobs_BT, measured)
        metrics["mismatch_tokens"] = measured.sum().float()
    if correction is not None and correction.rejects:
        metrics["rejected"] = (sampled & ~keep).sum().float()
    return loss, metrics


def sampling_mismatch(
    learner_logprobs_BT: torch.Tensor, generator_logprobs_BT: torch.Tensor, keep_BT: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the engine's sampling distribution is from the learner's, on the sampled tokens.

    ``mismatch_kl`` is the *sum* over ``keep`` of k3 = ``exp(d) - d - 1`` with ``d = learner -
    generator`` (an estimate of KL(engine || learner) from the engine's own samples; divide by the
    token count for the mean); ``mismatch_max`` is the largest ``|d|``. With the learner's log-probs
    taken under the weights that sampled the tokens, both are ~0 in fp32; a sync that never arrived
    or a kernel mismatch shows here first.
    """
    d = torch.where(keep_BT, learner_logprobs_BT.detach().float() - generator_logprobs_BT.float(), 0.0)
    d = d.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return {
        "mismatch_kl": (torch.expm1(d) - d).sum(),
        "mismatch_max": d.abs().max() if d.numel() else d.sum(),
    }


def value_loss(
    values_BT: torch.Tensor,
    old_values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    denominator: float | torch.Tensor | None,
    value_clip: float | None = 0.2,
    aggregation: Aggregation = "token-mean",
    sequence_tokens_B: torch.Tensor | None = None,
    aggregation_norm: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss, reduced with ``aggregate(..., aggregation, denominator)`` like the
    policy loss.

    Per token ``0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)``; ``value_clip=None``
    gives the plain ``0.5 * (v - R)^2``. Returns the scalar loss and detached per-token sums over
    the masked tokens (``value_loss``, ``value_clipped``, ``value``, ``return``, ``tokens``) for
    global token means.
    """
    keep = mask_BT.bool()
    unclipped = (values_BT - returns_BT) ** 2
    per_token = unclipped
    clipped_taken = torch.zeros_like(keep)
    if value_clip is not None:
        clipped_values = old_values_BT + torch.clamp(values_BT - old_values_BT, -value_clip, value_clip)
        clipped = (clipped_values - returns_BT) ** 2
        per_token = torch.maximum(unclipped, clipped)
        clipped_taken = clipped > unclipped
    per_token = 0.5 * per_token
    loss = aggregate(per_token, keep, aggregation, denominator, sequence_tokens_B, aggregation_norm)

    def token_sum(x: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, x.detach().float(), 0.0).sum()

    metrics = {
        "value_loss": token_sum(per_token),
        "value_clipped": token_sum(clipped_taken.float()),
        "value": token_sum(values_BT),
        "return": token_sum(returns_BT),
        "tokens": keep.sum().float(),
    }
    return loss, metrics


def sft_cross_entropy(
    logits_BTV: torch.Tensor,
    labels_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    denominator: float | torch.Tensor | None = None,
    aggregation: Aggregation = "token-mean",
    sequence_tokens_B: torch.Tensor | None = None,
    aggregation_norm: float = 1.0,
) -> torch.Tensor:
    """SFT cross-entropy: the negative log-likelihood of the masked labels, reduced with
    ``aggregate(..., aggregation, denominator)`` (``token-mean``: summed, ``/ denominator``).

    ``logits_BTV[:, t]`` predicts ``labels_BT[:, t]`` (shift before calling). With the group token
    total from :func:`rltrain.loss.masked_mean.group_token_totals` as ``denominator`` (times the DP world
    size when the engine averages over ranks, and without ``/accumulation_steps``) every supervised
    token weighs the same whatever the micro-batching: no gradient rescaling pass after backward,
    so it works unchanged under DeepSpeed, where parameter gradients are not reachable then.
    """
    nll_BT = -token_logprobs(logits_BTV, labels_BT)
    return aggregate(nll_BT, mask_BT, aggregation, denominator, sequence_tokens_B, aggregation_norm)


def question_sums(
    keep_BT: torch.Tensor, returns_BT: torch.Tensor, residual_BT: torch.Tensor, counted_B: torch.Tensor | None
) -> torch.Tensor:
    """``[samples, sum R, sum R^2, sum (R - V), sum (R - V)^2]`` at each row's first loss token (a
    sequence-parallel rank counts the rows whose first loss token it holds: ``counted``)."""
    first_B1 = keep_BT.float().argmax(-1, keepdim=True)
    rows_B = keep_BT.any(-1) if counted_B is None else keep_BT.any(-1) & counted_B.bool()
    r_B = returns_BT.gather(-1, first_B1)[:, 0].double()[rows_B]
    d_B = residual_BT.gather(-1, first_B1)[:, 0].double()[rows_B]
    return torch.stack([rows_B.sum().double(), r_B.sum(), (r_B**2).sum(), d_B.sum(), (d_B**2).sum()])
