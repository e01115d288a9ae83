"""Group-relative advantages (pure torch).

Rewards arrive flat, ``[num_groups * group_size]``, with the completions of one prompt contiguous.

- GRPO: ``(r - mean_group) / (std_group + eps)``; the std is the unbiased (Bessel-corrected) one,
  as in the DeepSeekMath reference implementation.
- Dr. GRPO: the same without the std division (``normalize_std=False``), which removes the
  question-difficulty bias the std introduces.
- RLOO: ``r_i - mean_{j != i} r_j``, the leave-one-out baseline.

A group whose rewards are all equal has zero advantage everywhere and teaches nothing;
:func:`zero_variance_groups` finds them so DAPO's dynamic sampling can drop and refill them.
"""

from __future__ import annotations

import torch


def _grouped(rewards_N: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 1 or rewards_N.numel() % group_size != 0:
        raise ValueError(f"{rewards_N.numel()} rewards do not split into groups of {group_size} completions")
    return rewards_N.reshape(-1, group_size).float()  # [G, n]


def grpo_advantages(
    rewards_N: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO (``normalize_std=True``) or Dr. GRPO (``False``) advantages, shape ``[N]``."""
    r_Gn = _grouped(rewards_N, group_size)
    centered = r_Gn - r_Gn.mean(-1, keepdim=True)
    if normalize_std:
        std = r_Gn.std(-1, keepdim=True) if group_size > 1 else torch.zeros_like(r_Gn[:, :1])
        centered = centered / (std + eps)
    return centered.reshape(-1)


def rloo_advantages(rewards_N: torch.Tensor, group_size: int) -> torch.Tensor:
    """Leave-one-out advantages ``r_i - mean_{j != i} r_j = n/(n-1) * (r_i - mean)``, shape ``[N]``."""
    if group_size < 2:
        raise ValueError("RLOO needs group_size >= 2")
    r_Gn = _grouped(rewards_N, group_size)
    baseline = (r_Gn.sum(-1, keepdim=True) - r_Gn) / (group_size - 1)
    return (r_Gn - baseline).reshape(-1)


def zero_variance_groups(rewards_N: torch.Tensor, group_size: int) -> torch.Tensor:
    """Boolean ``[G]``: True for groups whose completions all got the same reward."""
    r_Gn = _grouped(rewards_N, group_size)
    return (r_Gn == r_Gn[:, :1]).all(-1)
