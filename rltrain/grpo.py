"""From completions to a training batch: rewards, overlong handling, group advantages, DAPO's
dynamic-sampling filter (no ray, no deepspeed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltrain.advantages import grpo_advantages, rloo_advantages, zero_variance_groups
from rltrain.batch import Completion, TrainBatch, collate
from rltrain.config import AlgorithmConfig, Config
from rltrain.data import Prompt
from rltrain.rewards import RewardScorer, soft_overlong_penalty


@dataclass
class ScoredGroups:
    """``group_size`` completions per prompt, flat, with their rewards."""

    prompts: list[Prompt]
    completions: list[Completion]  # [len(prompts) * group_size]
    rewards: torch.Tensor  # [len(completions)], shaped (overlong penalty included)
    metrics: dict[str, float]

    def keep(self, groups: torch.Tensor, group_size: int) -> ScoredGroups:
        """The groups whose flag in ``groups`` ([G] bool) is True."""
        kept = [g for g, flag in enumerate(groups.tolist()) if flag]
        rows = [g * group_size + j for g in kept for j in range(group_size)]
        return ScoredGroups(
            [self.prompts[g] for g in kept],
            [self.completions[i] for i in rows],
            self.rewards[rows],
            self.metrics,
        )

    @staticmethod
    def concat(parts: list[ScoredGroups]) -> ScoredGroups:
        return ScoredGroups(
            [p for s in parts for p in s.prompts],
            [c for s in parts for c in s.completions],
            torch.cat([s.rewards for s in parts]),
            parts[0].metrics,
        )


def score(
    prompts: list[Prompt], completions: list[Completion], config: Config, scorer: RewardScorer
) -> ScoredGroups:
    n = config.algorithm.group_size
    answers = [p.answer for p in prompts for _ in range(n)]
    scores = scorer([c.text for c in completions], answers)
    rewards = torch.tensor(scores.rewards)
    alg, max_new = config.algorithm, config.rollout.max_new_tokens
    if alg.overlong == "soft_penalty":
        penalties = [
            soft_overlong_penalty(len(c.token_ids), max_new, alg.overlong_buffer, alg.overlong_penalty)
            for c in completions
        ]
        rewards = rewards + torch.tensor(penalties)
    lengths = [len(c.token_ids) for c in completions]
    metrics = {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
        "reward/failures": float(scores.failures),
        **{f"reward/{name}": value for name, value in scores.per_function.items()},
        "rollout/length_mean": sum(lengths) / len(lengths),
        "rollout/truncated_fraction": sum(c.truncated for c in completions) / len(completions),
        "rollout/tool_calls": float(sum(c.tool_calls for c in completions)),
        "rollout/tool_errors": float(sum(c.tool_errors for c in completions)),
        "rollout/zero_variance_groups": zero_variance_groups(rewards, n).float().mean().item(),
    }
    return ScoredGroups(prompts, completions, rewards, metrics)


def advantages(rewards: torch.Tensor, alg: AlgorithmConfig) -> torch.Tensor:
    if alg.advantage == "rloo":
        return rloo_advantages(rewards, alg.group_size)
    return grpo_advantages(rewards, alg.group_size, normalize_std=alg.advantage == "grpo")


def build_batch(scored: ScoredGroups, config: Config, pad_id: int) -> TrainBatch:
    n = config.algorithm.group_size
    prompt_ids = [p.token_ids for p in scored.prompts for _ in range(n)]
    exclude = [c.truncated for c in scored.completions] if config.algorithm.overlong == "filter" else None
    return collate(
        prompt_ids, scored.completions, advantages(scored.rewards, config.algorithm), pad_id, exclude
    )
