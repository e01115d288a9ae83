"""From completions to a training batch: rewards, overlong handling, group advantages or GAE
with a critic's values, DAPO's dynamic-sampling filter (no ray, no deepspeed)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rltrain.batch import Completion, TrainBatch, collate, last_positions
from rltrain.config import AlgorithmConfig, Config
from rltrain.data import Prompt
from rltrain.episodes.chat import TEMPLATE
from rltrain.episodes.gateway import GATEWAY
from rltrain.loss.advantages import (
    distill_advantages,
    gae_advantages,
    grpo_advantages,
    rloo_advantages,
    whiten,
    zero_variance_groups,
)
from rltrain.models.images import not_with_images
from rltrain.rewards.functions import AGENT, ENV, VERIFIERS_ENV, Calls, RewardScorer, soft_overlong_penalty


@dataclass
class ScoredGroups:
    """``group_size`` completions per prompt, flat, with their rewards."""

    prompts: list[Prompt]
    completions: list[Completion]  # [len(prompts) * group_size]
    rewards: torch.Tensor  # [len(completions)], shaped (overlong penalty included)
    metrics: dict[str, float]
    per_function: dict[str, torch.Tensor] = field(default_factory=dict)  # each function's scores, [N]
    # the user's code called for these groups (and for any filtered out): see user_code_calls
    calls: dict[str, Calls] = field(default_factory=dict)
    # why each completion failed outside the policy (its reward, its episode), or None: [N]
    failed: list[str | None] = field(default_factory=list)

    def keep(self, groups: torch.Tensor, group_size: int) -> ScoredGroups:
        """The groups whose flag in ``groups`` ([G] bool) is True."""
        kept = [g for g, flag in enumerate(groups.tolist()) if flag]
        rows = [g * group_size + j for g in kept for j in range(group_size)]
        return ScoredGroups(
            [self.prompts[g] for g in kept],
            [self.completions[i] for i in rows],
            self.rewards[rows],
            self.metrics,
            {name: scores[rows] for name, scores in self.per_function.items()},
            self.calls,
            [self.failed[i] for i in rows] if self.failed else [],
        )

    def valid(self) -> torch.Tensor:
        """Bool ``[N]``: the completions that did not fail outside the policy."""
        return torch.tensor([f is None for f in self.failed] or [True] * len(self.completions))

    @staticmethod
    def concat(parts: list[ScoredGroups]) -> ScoredGroups:
        return ScoredGroups(
            [p for s in parts for p in s.prompts],
            [c for s in parts for c in s.completions],
            torch.cat([s.rewards for s in parts]),
            parts[0].metrics,
            {name: torch.cat([s.per_function[name] for s in parts]) for name in parts[0].per_function},
            merge_calls([s.calls for s in parts]),
            [f for s in parts for f in (s.failed or [None] * len(s.completions))],
        )


# a score computed by actors, not by the reward workers (reward.model's, reward.judge's): each
# completion's prompt and the completions -> a score each (None: not scored) and metrics
ModelScores = tuple[list[float | None], dict[str, float]]  # a score per completion (None: failed), metrics
ModelScorer = Callable[[list[Prompt], list[Completion]], ModelScores]
"""A reward computed by a model (reward.model, reward.judge) from each completion and its prompt.
One whose ``own_actors`` attribute is true runs on actors of its own, so the orchestrator may score
a step with it while the policy trains."""


def per_completion(prompts: list[Prompt], group_size: int) -> list[Prompt]:
    """Each prompt repeated for each of its ``group_size`` completions (their order)."""
    return [p for p in prompts for _ in range(group_size)]


def score(
    prompts: list[Prompt],
    completions: list[Completion],
    config: Config,
    scorer: RewardScorer,
    model_scorers: dict[str, ModelScorer] | None = None,
    model_scores: dict[str, ModelScores] | None = None,
) -> ScoredGroups:
    """Every reward function's score of every completion, the environment's and those of
    ``model_scorers`` (by reward.functions name: `model`, `judge`; a result already in
    ``model_scores`` is taken as it is) included; the shaped rewards and the metrics."""
    n = config.algorithm.group_size
    expanded = per_completion(prompts, n)
    answers = [p.answer for p in expanded]
    given: dict[str, list[float | None]] = {
        ENV: [c.env_reward for c in completions],
        AGENT: [c.agent_reward for c in completions],
    }
    model_metrics: dict[str, float] = {}
    for name, model_scorer in (model_scorers or {}).items():
        done = (model_scores or {}).get(name)
        given[name], more = done if done is not None else model_scorer(expanded, completions)
        model_metrics |= more
    columns = batch_columns(expanded) if scorer.batch else None
    scores = scorer([c.text for c in completions], answers, given, columns)
    rewards = torch.tensor(scores.rewards)
    alg, max_new = config.algorithm, config.rollout.max_new_tokens
    shaping = {}
    if alg.overlong == "soft_penalty":
        penalties = torch.tensor([
            soft_overlong_penalty(len(c.token_ids), max_new, alg.overlong_buffer, alg.overlong_penalty)
            for c in completions
        ])  # fmt: skip
        rewards = rewards + penalties
        shaping["reward/overlong"] = penalties.mean().item()  # shown apart from the reward functions
    failed = [episode_failure(c) or reward for c, reward in zip(completions, scores.failed)]
    # every reward figure is over the samples that count: with reward.on_failure=drop the failed
    # ones train on nothing, so they are in no mean, spread or group statistic either
    counted = torch.tensor([f is None or config.reward.on_failure == "zero" for f in failed])
    per_function = {name: torch.tensor([float("nan") if v is None else v for v in values])  # NaN: none
                    for name, values in scores.per_sample.items()}  # fmt: skip
    lengths = [len(c.token_ids) for c in completions]
    metrics = {
        **reward_figures(rewards, per_function, counted, n),
        "reward/failures": float(scores.failures),
        **model_metrics,
        **shaping,
        "rollout/length_mean": sum(lengths) / len(lengths),
        "rollout/truncated_fraction": sum(c.truncated for c in completions) / len(completions),
        "rollout/tool_calls": float(sum(c.tool_calls for c in completions)),
        "rollout/tool_errors": float(sum(c.tool_errors for c in completions)),
        **episode_metrics(completions),
    }
    if alg.overlong == "soft_penalty":  # a sample's reward is the sum of these: the penalty shown too
        per_function["overlong"] = penalties
    calls = user_code_calls(completions, scores.calls, VERIFIERS_ENV if config.verifiers else AGENT)
    metrics["failures/outside_policy"] = float(sum(f is not None for f in failed))
    # the policy's own: a malformed or refused tool call, an answer cut at its length
    metrics["failures/policy"] = float(sum(bool(c.errors) or c.truncated for c in completions))
    return ScoredGroups(prompts, completions, rewards, metrics, per_function, calls, failed)


def reward_figures(
    rewards_N: torch.Tensor, per_function: dict[str, torch.Tensor], counted_N: torch.Tensor, group_size: int
) -> dict[str, float]:
    """``reward/mean``, ``reward/std``, ``reward/<function>`` (over the samples it applies to) and
    ``rollout/zero_variance_groups``, each over the samples that count (``counted_N``, [N] bool);
    a group with no sample that counts is in no figure."""
    counted = rewards_N[counted_N].double()
    groups = counted_N.view(-1, group_size).any(-1)
    flat = zero_variance_groups(rewards_N, group_size, counted_N)[groups]
    return {
        "reward/mean": counted.mean().item() if len(counted) else 0.0,
        "reward/std": counted.std().item() if len(counted) > 1 else 0.0,
        **{
            f"reward/{name}": _mean(scores[counted_N & ~scores.isnan()])
            for name, scores in per_function.items()
        },
        "rollout/zero_variance_groups": flat.float().mean().item() if len(flat) else 0.0,
    }


def _mean(values: torch.Tensor) -> float:
    return values.double().mean().item() if len(values) else 0.0


def episode_failure(c: Completion) -> str | None:
    """Why a completion failed outside the policy, or None: its episode ended on a failure of the
    environment, a tool's host, an agent or the chat template (finish reason ``error``), or it holds
    no token the policy sampled (an agent that never called)."""
    if c.finish_reason == "error":
        return next(iter(c.failures), "episode error")
    if not any(any(part.tool_mask) for part in [*c.earlier, c]):
        return "no token sampled"
    return None


def drop_failed(scored: ScoredGroups, group_size: int, fewest: int = 2) -> ScoredGroups:
    """``reward.on_failure: drop``: the groups with at least ``fewest`` completions that did not
    fail outside the policy (a group baseline needs two; GAE's critic needs no group: one) (the
    failed ones in them are kept out of the loss by :func:`build_batch`); logs
    ``rollout/dropped_samples``, the completions that will not train."""
    valid = scored.valid().view(-1, group_size)
    kept = scored.keep(valid.sum(-1) >= fewest, group_size) if not valid.all() else scored
    dropped = len(scored.completions) - int(kept.valid().sum())
    kept.metrics = {**scored.metrics, "rollout/dropped_samples": float(dropped)}
    return kept


def batch_columns(prompts: list[Prompt]) -> dict[str, list]:
    """What a batch-form reward function gets besides the completions: each completion's prompt
    text (``prompts``) and every other column of its data row, a list each."""
    rows = [p.row or {} for p in prompts]
    keys = [k for k in rows[0] if k not in ("prompt", "answer")] if rows else []
    return {"prompts": [r.get("prompt", "") for r in rows], **{k: [r.get(k) for r in rows] for k in keys}}


def user_code_calls(
    completions: list[Completion], reward_calls: dict[str, Calls], gateway_kind: str = AGENT
) -> dict[str, Calls]:
    """The user's code a step called, by kind: each reward function (``reward function <spec>``),
    a black-box agent or a verifiers environment (``gateway_kind``: the episodes through the
    gateway), an environment's ``reset`` and ``step`` (an episode's failure there ends it: calls
    are the episodes that reached the method), the chat template where it raised or rewrote an
    episode's history, and each tool that raised (calls: every tool call)."""
    calls = {f"reward function {spec}": record for spec, record in reward_calls.items()}
    if any(c.by_agent for c in completions):  # an agent's or a verifiers environment's episodes
        calls[gateway_kind] = _calls(len(completions), completions, gateway_kind)
    elif any(c.turns or c.failures or c.messages for c in completions):  # episodes of an environment
        reset_failed = [c for c in completions if "environment reset" in c.failures]
        calls["environment reset"] = _calls(len(completions), reset_failed, "environment reset")
        stepped = [c for c in completions if c not in reset_failed]
        calls["environment step"] = _calls(len(stepped), stepped, "environment step")
    if any(TEMPLATE in c.failures for c in completions):  # calls: the episodes
        calls[TEMPLATE] = _calls(len(completions), completions, TEMPLATE)
    tool_calls = sum(c.tool_calls for c in completions)
    for kind in sorted({k for c in completions for k in c.failures if k.startswith("tool ")}):
        calls[kind] = _calls(tool_calls, completions, kind)
    return calls


def _calls(called: int, completions: list[Completion], kind: str) -> Calls:
    failed = [c.failures[kind] for c in completions if kind in c.failures]
    return Calls(called, len(failed), failed[0] if failed else None)


def merge_calls(parts: list[dict[str, Calls]]) -> dict[str, Calls]:
    """The calls of several scorings of one step (dynamic sampling's refills), summed."""
    merged: dict[str, Calls] = {}
    for part in parts:
        for kind, c in part.items():
            m = merged.setdefault(kind, Calls())
            m.called, m.failed = m.called + c.called, m.failed + c.failed
            m.first_error = m.first_error or c.first_error
    return merged


def episode_metrics(completions: list[Completion]) -> dict[str, float]:
    """Failed tool and environment calls by kind (summed); with an environment, turns per
    episode, tool calls per turn, the share of the completion tokens the environment, the tools
    and the template added, and how episodes ended."""
    errors = Counter()
    for c in completions:
        errors.update(c.errors)
    metrics = {
        f"rollout/{kind}" if kind.startswith(GATEWAY) else f"rollout/tool_errors/{kind}": float(count)
        for kind, count in sorted(errors.items())
    }
    if any(c.calls for c in completions):  # a black-box agent's episodes (rltrain.episodes.gateway)
        metrics["rollout/gateway_calls"] = sum(len(c.calls) for c in completions) / len(completions)
        metrics.setdefault("rollout/gateway_splits", 0.0)
    metrics |= {f"env/{name}": value for name, value in mean_metrics(completions).items()}
    turns = sum(c.turns for c in completions)
    if turns == 0:
        return metrics
    tokens = sum(len(c.tool_mask) for c in completions)
    ends = Counter(c.finish_reason for c in completions)
    return {
        **metrics,
        "rollout/turns": turns / len(completions),
        "rollout/tool_calls_per_turn": sum(c.tool_calls for c in completions) / turns,
        "rollout/env_token_share": sum(c.tool_mask.count(0) for c in completions) / max(tokens, 1),
        **{f"rollout/finish_{reason}": ends[reason] / len(completions) for reason in ("turns", "error")},
    }


def mean_metrics(completions: list[Completion]) -> dict[str, float]:
    """Each score a verifiers episode reported by name (``reward/<function>``, its metrics),
    averaged over the episodes that reported it (one that failed reports none)."""
    values: dict[str, list[float]] = {}
    for c in completions:
        for name, value in c.env_metrics.items():
            values.setdefault(name, []).append(value)
    return {name: sum(v) / len(v) for name, v in sorted(values.items())}


def drop_stale(scored: ScoredGroups, version: int, max_staleness: int, group_size: int) -> ScoredGroups:
    """The groups every sampled token of which (an agent's earlier sequences' included) is at most
    ``max_staleness`` policy versions older than ``version`` (the learners' weights); logs
    ``rollout/staleness_mean`` and ``rollout/staleness_max`` over every sampled token collected and
    ``rollout/stale_dropped`` (completions dropped: a group goes whole, its advantages need every
    member)."""
    ages, oldest = [], []
    for c in scored.completions:  # an agent's episode: the sequences split off before its last too
        own = [version - v for part in [*c.earlier, c] for v, m in zip(part.versions, part.tool_mask) if m]
        ages += own
        oldest.append(max(own, default=0))
    stale = torch.tensor(oldest, dtype=torch.long).view(-1, group_size).amax(-1) > max_staleness
    kept = scored.keep(~stale, group_size) if stale.any() else scored
    kept.metrics = {
        **scored.metrics,
        "rollout/staleness_mean": sum(ages) / max(len(ages), 1),
        "rollout/staleness_max": float(max(ages, default=0)),
        "rollout/stale_dropped": float(len(scored.completions) - len(kept.completions)),
    }
    return kept


def advantages(
    rewards: torch.Tensor, alg: AlgorithmConfig, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Group advantages; ``valid`` ([N] bool): the samples whose rewards count (the others get 0)."""
    if alg.advantage == "rloo":
        return rloo_advantages(rewards, alg.group_size, valid)
    # distillation mixes in GRPO's advantages (algorithm.distill_coef)
    return grpo_advantages(
        rewards, alg.group_size, normalize_std=alg.advantage in ("grpo", "distill"), valid_N=valid
    )


def sequence_prompts(prompts: list[Prompt], completions: list[Completion]) -> list[list[int]]:
    """The prompt ids each completion continues (``prompts``: one per completion): its prompt's,
    or an episode's own opening."""
    return [c.prompt_ids or p.token_ids for p, c in zip(prompts, completions)]


def build_batch(scored: ScoredGroups, config: Config, pad_id: int, version: int | None = None) -> TrainBatch:
    """The padded batch with group advantages; with GAE its advantages wait for :func:`with_gae`,
    with distillation for :func:`with_distillation`.
    ``version``: the learners' policy version (marks the tokens it sampled where versions mix)."""
    alg = config.algorithm
    prompt_ids = sequence_prompts(per_completion(scored.prompts, alg.group_size), scored.completions)
    # reward.on_failure=drop: what failed outside the policy counts in no group statistic and no loss
    valid = (
        scored.valid() if config.reward.on_failure == "drop" else torch.ones(len(scored.completions)).bool()
    )
    group = (
        torch.zeros_like(scored.rewards) if alg.advantage == "gae" else advantages(scored.rewards, alg, valid)
    )
    prompt_ids, completions, episode = training_sequences(prompt_ids, scored.completions)
    group, valid = group[episode], valid[episode]  # a split episode's parts share its advantage
    filtered = [alg.overlong == "filter" and c.truncated for c in completions]
    exclude = [f or not v for f, v in zip(filtered, valid.tolist())]
    batch = collate(prompt_ids, completions, group, pad_id, exclude if any(exclude) else None, version)
    if batch.images is not None and (setting := not_with_images(config)):  # an episode's, not the rows'
        raise ValueError(
            f"an episode's images (an environment's, a tool's or an agent's) are not taken with {setting} yet"
        )
    return batch


def training_sequences(
    prompt_ids: list[list[int]], completions: list[Completion]
) -> tuple[list[list[int]], list[Completion], torch.Tensor]:
    """Every training sequence, its prompt, and the index of the completion it belongs to: a
    black-box agent's episode that split (it changed its history) is several, the ones split off
    first (``Completion.earlier``), each with its own prompt. Others are one each."""
    prompts, sequences, episode = [], [], []
    for i, (prompt, last) in enumerate(zip(prompt_ids, completions)):
        for part in [*last.earlier, last]:
            prompts.append(part.prompt_ids if part is not last else prompt)
            sequences.append(part)
            episode.append(i)
    return prompts, sequences, torch.tensor(episode, dtype=torch.long)


def with_gae(
    batch: TrainBatch,
    rewards_N: torch.Tensor,
    values_BT: torch.Tensor,
    alg: AlgorithmConfig,
    ref_logprobs_BT: torch.Tensor | None = None,
) -> TrainBatch:
    """Per-token GAE advantages (whitened over every loss token of the global batch), returns and
    the values they came from. Each sequence's reward sits on its last policy token; with
    ``alg.kl_in_reward`` every policy token also pays ``kl_in_reward * (log pi_gen - log pi_ref)``."""
    keep_BT = batch.response_mask.bool() & batch.tool_mask.bool()
    rewards_BT = torch.zeros(keep_BT.shape)
    has_tokens = keep_BT.any(-1)
    last = last_positions(keep_BT)  # last policy token of each row
    rows = torch.arange(len(batch))[has_tokens]
    rewards_BT[rows, last[has_tokens]] = rewards_N[has_tokens].float()
    if alg.kl_in_reward > 0:
        if ref_logprobs_BT is None or batch.generator_logprobs is None:
            raise ValueError("algorithm.kl_in_reward needs generator and reference log-probs")
        rewards_BT -= alg.kl_in_reward * (batch.generator_logprobs - ref_logprobs_BT)
    advantages_BT, returns_BT = gae_advantages(rewards_BT, values_BT, keep_BT, alg.gamma, alg.lam)
    return batch.replace(advantages=whiten(advantages_BT, keep_BT), returns=returns_BT, old_values=values_BT)


def with_distillation(
    batch: TrainBatch, teacher_logprobs_BT: torch.Tensor, alg: AlgorithmConfig
) -> tuple[TrainBatch, dict[str, float]]:
    """On-policy distillation: every sampled token's advantage is ``teacher - student`` log-prob
    (the student's: the engine's, at sampling time), mixed with the batch's GRPO advantages by
    ``alg.distill_coef``. Also returns ``distill/reverse_kl``: the mean over sampled tokens of
    ``student - teacher`` log-prob, the estimate of KL(student || teacher) that distillation drives
    to 0."""
    keep_BT = batch.response_mask.bool() & batch.tool_mask.bool()
    student_BT = batch.generator_logprobs
    if student_BT is None:
        raise ValueError("distillation needs the engine's log-probs of the sampled tokens")
    gap = (student_BT - teacher_logprobs_BT)[keep_BT]
    advantages_BT = distill_advantages(
        teacher_logprobs_BT, student_BT, keep_BT, alg.distill_coef, batch.advantages
    )
    metrics = {"distill/reverse_kl": gap.mean().item() if gap.numel() else 0.0}
    return batch.replace(advantages=advantages_BT), metrics
