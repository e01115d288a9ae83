"""A toy policy and a ragged batch of rollouts shared by the invariance tests."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from rltrain.loss.logprobs import token_logprobs
from rltrain.losses import PolicyLossSettings, policy_loss

VOCAB, HIDDEN, T = 11, 8, 7
SETTINGS = PolicyLossSettings(kind="ppo", clip_low=0.2, clip_high=0.28, kl_beta=0.05, kl_estimator="k3")


@dataclass
class Rollouts:
    ids: torch.Tensor  # [N, T]
    mask: torch.Tensor  # [N, T] response tokens
    tool_mask: torch.Tensor  # [N, T] 0 on tool output
    advantages: torch.Tensor  # [N]
    old_logprobs: torch.Tensor  # [N, T]
    ref_logprobs: torch.Tensor  # [N, T]

    def select(self, idx: torch.Tensor) -> Rollouts:
        return Rollouts(*(getattr(self, f)[idx] for f in self.__dataclass_fields__))


def make_policy(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, VOCAB)
    )


def make_rollouts(n: int, seed: int = 1) -> Rollouts:
    """``n`` sequences with lengths 0..T (sequence 0 is all-masked), some tool tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, T), generator=g)
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    lengths[0] = 0
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    tool_mask = (torch.rand(n, T, generator=g) > 0.2).long()
    advantages = torch.randn(n, generator=g)
    old = -2.4 + 0.3 * torch.randn(n, T, generator=g)
    ref = -2.4 + 0.3 * torch.randn(n, T, generator=g)
    return Rollouts(ids, mask, tool_mask, advantages, old, ref)


def micro_batch_loss(
    policy: torch.nn.Module, r: Rollouts, denominator, aggregation="token-mean"
) -> torch.Tensor:
    logprobs = token_logprobs(policy(r.ids), r.ids)
    loss, _ = policy_loss(
        logprobs,
        r.old_logprobs,
        r.advantages,
        r.mask,
        denominator,
        replace(SETTINGS, aggregation=aggregation, aggregation_norm=5.0),
        tool_mask_BT=r.tool_mask,
        ref_logprobs_BT=r.ref_logprobs,
    )
    return loss


def flat_grad(policy: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in policy.parameters()])


def reference_grad(rollouts: Rollouts, aggregation="token-mean") -> torch.Tensor:
    """Gradient of the whole batch's loss in one pass: (sum over every loss token) / (number of
    loss tokens), or the per-sequence aggregation over every sequence holding loss tokens."""
    policy = make_policy()
    micro_batch_loss(policy, rollouts, None, aggregation).backward()
    return flat_grad(policy)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()
