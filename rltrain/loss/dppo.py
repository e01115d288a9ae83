"""DPPO, divergence proximal policy optimization (Qi et al. 2026, "Rethinking the Trust Region in
LLM Reinforcement Learning", arXiv 2602.04879): PPO's ratio clip replaced by a mask on an estimate
of how far the policy moved on each token (pure torch).

Per token, with ``p`` the policy's probability of the sampled token, ``p_a`` the anchor policy's
and ``A`` the advantage, the token leaves the gradient (mask ``M = 0``, detached) where

- Binary-TV: ``A > 0`` and ``p - p_a > delta_high``, or ``A < 0`` and ``p_a - p > delta_low``;
- Binary-KL: the same directions, with ``KL(Bern(p_a) || Bern(p))`` over the thresholds;

and the loss is ``-A * r * M`` with ``r = p / p_a`` (``exp`` of the log-ratio clamped to +-20).

Departures and choices, against the peers' code:

- The anchor (``anchor_logprobs_BT``) is the caller's: the engine's sampling log-probs (the paper's
  behaviour policy; Stable-RL, prime-rl, SkyRL) or the recomputed old policy (verl). Against the
  engine's log-probs ``r`` is already the whole importance weight of a token the engine sampled,
  so :func:`rltrain.loss.losses.policy_loss` multiplies in no rollout correction's weight there
  (its rejections still apply); against the old policy the correction's weight ``min(pi_old /
  pi_rollout, cap)`` corrects for the engine, as verl's ``rollout_is_weights`` do. (SkyRL
  multiplies its configured TIS weight in with either anchor; its default configures none.)
- ``delta_high`` None is ``delta_low`` (one bound for both sides), which defaults to the
  divergence's.
- ``ratio_cap``: ``r`` above the cap weighs the token's gradient by the cap instead
  (truncated importance sampling, verl's ``clip_ratio_c``); the loss's value is then ``-A * cap *
  M``. verl writes its surrogate as ``-A * sg(min(r, cap)) * log p * M``, whose *value* differs from
  this one's but whose gradient is the same; SkyRL's, ``-A * r * M`` with no cap, is this one's in
  value and gradient.
- Tokens with ``A = 0`` are never counted as masked (their loss is 0 either way; verl counts them
  on the negative side, SkyRL on neither).
- prime-rl's default loss adds a squared log-ratio term (``kl_tau``) beside the mask; here the KL
  to a reference is ``loss.kl_beta``'s, as for every other loss.
"""

from __future__ import annotations

from typing import Literal

import torch

from rltrain.loss.corrections import LOG_RATIO_BOUND

Divergence = Literal["tv", "kl"]
DEFAULT_DELTA: dict[str, float] = {"tv": 0.15, "kl": 0.05}  # the paper's settings (TRL's, verl's example)
EPS = 1e-8  # in the Bernoulli KL's (1 - p) terms, as the peers write it


def dppo_mask(
    logprobs_BT: torch.Tensor,
    anchor_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    divergence: Divergence = "tv",
    delta_low: float | None = None,
    delta_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(masked_low_BT, masked_high_BT)``, bool, detached: the tokens whose negative (low) or
    positive (high) advantage pushed the policy past the divergence bound."""
    low = DEFAULT_DELTA[divergence] if delta_low is None else delta_low
    high = low if delta_high is None else delta_high  # one bound set: both sides
    with torch.no_grad():
        logp, logp_a = logprobs_BT.float(), anchor_logprobs_BT.float()
        p, p_a = logp.exp(), logp_a.exp()
        up, down = advantages_BT > 0, advantages_BT < 0
        if divergence == "tv":
            return down & (p_a - p > low), up & (p - p_a > high)
        if divergence != "kl":
            raise ValueError(f"DPPO divergence must be tv or kl, got {divergence!r}")
        kl = p_a * (logp_a - logp) + (1 - p_a) * torch.log((1 - p_a + EPS) / (1 - p + EPS))
        return down & (p < p_a) & (kl > low), up & (p > p_a) & (kl > high)


def dppo_loss(
    logprobs_BT: torch.Tensor,
    anchor_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    divergence: Divergence = "tv",
    delta_low: float | None = None,
    delta_high: float | None = None,
    ratio_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPPO-Binary per token: ``(loss_BT, masked_low_BT, masked_high_BT)`` (see the module)."""
    masked_low, masked_high = dppo_mask(
        logprobs_BT, anchor_logprobs_BT, advantages_BT, divergence, delta_low, delta_high
    )
    r = torch.exp((logprobs_BT - anchor_logprobs_BT).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    if ratio_cap is not None:  # past the cap: the cap's value, the cap times d(log p)
        capped = ratio_cap * torch.exp(logprobs_BT - logprobs_BT.detach())
        r = torch.where(r.detach() > ratio_cap, capped, r)
    keep = (~(masked_low | masked_high)).to(logprobs_BT.dtype)
    return -advantages_BT * r * keep, masked_low, masked_high
