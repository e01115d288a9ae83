"""Group-relative advantages (pure torch).

Rewards arrive flat, ``[num_groups * group_size]``, with the completions of one prompt contiguous.

- GRPO: ``(r - mean_group) / (std_group + eps)``; the std is the unbiased (Bessel-corrected) one,
  as in the DeepSeekMath reference implementation.
- Dr. GRPO: the same without the std division (``normalize_std=False``), which removes the
  question-difficulty bias the std introduces.
- RLOO: ``r_i - mean_{j != i} r_j``, the leave-one-out baseline.

A sample may be marked invalid (``valid_N``): its reward could not be computed (a reward function
raised, an environment or agent failed), so it is no outcome of the policy. Its group's statistics
are taken over the valid samples alone, and it gets advantage 0.

A group whose rewards are all equal has **exactly** zero advantage everywhere and teaches nothing;
:func:`zero_variance_groups` finds them so DAPO's dynamic sampling can drop and refill them. Group
statistics are computed in float64 and equal groups are zeroed explicitly: in float32 the rounding
error of the mean of eight rewards of 0.7, divided by ``std + eps`` with ``std ~ 0``, became an
advantage of +0.056 for every member (a push in one direction from a group with no signal).
Results are float32, or float64 for float64 rewards (never silently downcast).

GAE (:func:`gae_advantages`, classic PPO with a learned critic) works per token, ``[B, T]``, over
the tokens the policy generated; where it departs from the paper: tokens the policy did not
generate (prompt, padding, tool output) are not steps of the episode. The recursion carries over
them, so the step after a policy token is the next *policy* token, and nothing a masked position
holds can change an advantage or a return (multi-turn tool output is an observation, not an action).
"""

from __future__ import annotations

import torch


def _grouped(rewards_N: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 1 or rewards_N.numel() % group_size != 0:
        raise ValueError(f"{rewards_N.numel()} rewards do not split into groups of {group_size} completions")
    return rewards_N.reshape(-1, group_size).to(torch.float64)  # [G, n]


def _finish(
    advantages_Gn: torch.Tensor, r_Gn: torch.Tensor, rewards_N: torch.Tensor, valid_Gn: torch.Tensor
) -> torch.Tensor:
    """Zero the groups whose valid rewards are all equal (exactly, whatever the rounding) and the
    samples that are not valid, flatten, and return float64 for float64 rewards, float32 otherwise."""
    equal_G = ((r_Gn == _first_valid(r_Gn, valid_Gn)) | ~valid_Gn).all(-1, keepdim=True)
    advantages_Gn = torch.where(equal_G | ~valid_Gn, torch.zeros_like(advantages_Gn), advantages_Gn)
    dtype = torch.float64 if rewards_N.dtype == torch.float64 else torch.float32
    return advantages_Gn.reshape(-1).to(dtype)


def _first_valid(r_Gn: torch.Tensor, valid_Gn: torch.Tensor) -> torch.Tensor:
    """Each group's first valid reward, ``[G, 1]`` (0 for a group with none)."""
    first = valid_Gn.long().argmax(-1, keepdim=True)
    return r_Gn.gather(-1, first)


def _valid(valid_N: torch.Tensor | None, r_Gn: torch.Tensor) -> torch.Tensor:
    """``[G, n]`` bool: the samples whose reward counts (every one when ``valid_N`` is None)."""
    return torch.ones_like(r_Gn, dtype=torch.bool) if valid_N is None else valid_N.reshape(r_Gn.shape).bool()


def grpo_advantages(
    rewards_N: torch.Tensor,
    group_size: int,
    normalize_std: bool = True,
    eps: float = 1e-6,
    valid_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO (``normalize_std=True``) or Dr. GRPO (``False``) advantages, shape ``[N]``. ``valid_N``
    (bool ``[N]``): only these samples' rewards form their group's mean and std, and the others get
    advantage 0 (a sample whose reward could not be computed is no outcome of the policy)."""
    r_Gn = _grouped(rewards_N, group_size)
    valid_Gn = _valid(valid_N, r_Gn)
    count_G = valid_Gn.sum(-1, keepdim=True)
    mean_G = torch.where(valid_Gn, r_Gn, 0.0).sum(-1, keepdim=True) / count_G.clamp(min=1)
    centered = r_Gn - mean_G
    if normalize_std:
        # the unbiased std over the valid samples (0 where fewer than two)
        squares_G = torch.where(valid_Gn, centered**2, 0.0).sum(-1, keepdim=True)
        std = (squares_G / (count_G - 1).clamp(min=1)).sqrt() * (count_G > 1)
        centered = centered / (std + eps)
    return _finish(centered, r_Gn, rewards_N, valid_Gn)


def rloo_advantages(
    rewards_N: torch.Tensor, group_size: int, valid_N: torch.Tensor | None = None
) -> torch.Tensor:
    """Leave-one-out advantages ``r_i - mean_{j != i} r_j = n/(n-1) * (r_i - mean)``, shape ``[N]``;
    with ``valid_N``, over the valid samples of each group (the others get 0)."""
    if group_size < 2:
        raise ValueError("RLOO needs group_size >= 2")
    r_Gn = _grouped(rewards_N, group_size)
    valid_Gn = _valid(valid_N, r_Gn)
    count_G = valid_Gn.sum(-1, keepdim=True)
    total_G = torch.where(valid_Gn, r_Gn, 0.0).sum(-1, keepdim=True)
    baseline = (total_G - r_Gn) / (count_G - 1).clamp(min=1)
    return _finish(r_Gn - baseline, r_Gn, rewards_N, valid_Gn)


def zero_variance_groups(
    rewards_N: torch.Tensor, group_size: int, valid_N: torch.Tensor | None = None
) -> torch.Tensor:
    """Boolean ``[G]``: True for groups whose (valid) completions all got the same reward."""
    r_Gn = _grouped(rewards_N, group_size)
    valid_Gn = _valid(valid_N, r_Gn)
    return ((r_Gn == _first_valid(r_Gn, valid_Gn)) | ~valid_Gn).all(-1)


def gae_advantages(
    rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over masked tokens: ``(advantages_BT, returns_BT)``.

    ``values_BT[:, t]`` is the critic's value of the state before token ``t``; ``rewards_BT[:, t]``
    the reward for emitting token ``t`` (the sequence reward sits on the last policy token);
    ``mask_BT`` is 1 on tokens the policy generated. For the policy tokens ``t_1 < t_2 < ...`` of a
    row: ``delta_k = r_k + gamma * V_{k+1} - V_k`` (``V`` after the last one is 0) and
    ``A_k = delta_k + gamma * lam * A_{k+1}``; returns ``R_k = A_k + V_k``. Both are 0 off the mask.
    """
    keep = mask_BT.bool()
    rewards = torch.where(keep, rewards_BT.float(), 0.0)
    values = torch.where(keep, values_BT.float(), 0.0)
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])  # V of the next policy token (0 past the last)
    next_advantage = torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        step = keep[:, t]
        advantages[:, t] = torch.where(step, advantage, 0.0)
        next_value = torch.where(step, values[:, t], next_value)
        next_advantage = torch.where(step, advantage, next_advantage)
    return advantages, torch.where(keep, advantages + values, 0.0)


def whiten(values_BT: torch.Tensor, mask_BT: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / std`` over the masked tokens of the whole batch (0 elsewhere): one mean and
    std for the global batch, so the result does not depend on how it is later split."""
    keep = mask_BT.bool()
    selected = values_BT[keep].float()
    if selected.numel() < 2:
        return torch.zeros_like(values_BT, dtype=torch.float32)
    return torch.where(keep, (values_BT - selected.mean()) / (selected.std() + eps), 0.0)


def distill_advantages(
    teacher_logprobs_BT: torch.Tensor,
    student_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    coef: float = 1.0,
    task_advantages: torch.Tensor | None = None,
) -> torch.Tensor:
    """On-policy distillation's per-token advantages, ``[B, T]``:
    ``coef * (log p_teacher - log p_student) + (1 - coef) * task_advantage`` on the tokens the
    student sampled (``mask_BT``), 0 elsewhere.

    ``log p_student - log p_teacher`` of a token the student sampled is the one-sample estimate of
    the reverse KL(student || teacher) at that position; its negative as the advantage makes the
    policy-gradient step descend the reverse KL, token by token (no sequence-level credit
    assignment is needed: every token has its own signal). ``task_advantages`` (``[B]``, one per
    sequence, such as GRPO's) mixes in a task reward; without it ``coef`` must be 1.
    """
    if not 0.0 <= coef <= 1.0:
        raise ValueError(f"coef={coef} must be in [0, 1]")
    keep = mask_BT.bool()
    distill = teacher_logprobs_BT.float() - student_logprobs_BT.float()
    if task_advantages is None:
        if coef != 1.0:
            raise ValueError("a coef below 1 mixes in task advantages; none were given")
        task = torch.zeros_like(distill)
    else:
        task = task_advantages.float()[:, None].expand_as(distill)
    return torch.where(keep, coef * distill + (1.0 - coef) * task, 0.0)
