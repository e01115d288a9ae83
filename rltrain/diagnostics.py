"""Checks a user can run on their own cluster: does one optimizer step on the same batch give the
same update whatever the split over learners and micro-batches, and which collectives does a
piece of code issue?"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from rltrain.batch import TrainBatch
from rltrain.config import Config

T = TypeVar("T")
COLLECTIVES = ["all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "all_reduce_coalesced",
               "_reduce_scatter_base", "_all_gather_base"]  # fmt: skip


@contextlib.contextmanager
def count_collectives() -> Iterator[dict[str, int]]:
    """Count calls of torch.distributed collectives (they still run) while the block executes.

    Catches every caller that looks the function up on ``torch.distributed`` at call time, as
    rltrain and DeepSpeed's torch backend do.
    """
    calls: dict[str, int] = {}
    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    for name, real in saved.items():

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kwargs)

        setattr(dist, name, spy)
    try:
        yield calls
    finally:
        for name, real in saved.items():
            setattr(dist, name, real)


SYNTHETIC_PROMPT_TOKENS, SYNTHETIC_COMPLETION_TOKENS = 5, 9


def synthetic_rollouts(
    n: int = 8, t: int = 14, vocab: int = 256, seed: int = 0, group_size: int = 1
) -> TrainBatch:
    """Left-padded prompts (columns 0-4), uneven completions (columns 5 to t-1), tool tokens, one
    all-masked sequence (index 3); ``group_size`` consecutive sequences share their prompt (GRPO
    groups, whose prompt a prefix-tree forward computes once)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, t), generator=g)
    pos = torch.arange(t)[None, :]
    prompt_start = torch.randint(0, 3, (n, 1), generator=g)
    first = torch.arange(n) // group_size * group_size  # each sequence's group's first
    ids[:, :SYNTHETIC_PROMPT_TOKENS] = ids[first, :SYNTHETIC_PROMPT_TOKENS]
    prompt_start = prompt_start[first]
    completion_end = torch.randint(6, t + 1, (n, 1), generator=g)
    attention = (pos >= prompt_start) & (pos < completion_end)
    response = attention & (pos >= SYNTHETIC_PROMPT_TOKENS)
    response[min(3, n - 1)] = False
    tool = torch.ones(n, t, dtype=torch.bool)
    tool[0, 6:8] = False
    tool[n // 2, 7:10] = False
    return TrainBatch(ids, attention.long(), response.long(), tool.long(), torch.randn(n, generator=g))


def layout_config(
    num_learners: int,
    micro_batch_size: int,
    zero_stage: int,
    denominator="token",
    max_tokens_per_micro_batch: int | None = None,
    loss: dict | None = None,
    **learner,
) -> Config:
    """Plain SGD without clipping: the update is then linear in the gradient, so a wrong
    denominator shows up as a wrong update (Adam's first step is ~sign(g) and would hide it).

    Micro-batches hold ``micro_batch_size`` padded sequences, or, with a token budget
    ``max_tokens_per_micro_batch``, are packed under it. Several learners check their collectives
    against each other (``run.check_collectives``). Sequence limits fit
    :func:`synthetic_rollouts` (t=14). ``loss`` adds keys of the loss section (``aggregation``, ...)."""
    packing = {
        "packing": max_tokens_per_micro_batch is not None,
        "max_tokens_per_micro_batch": max_tokens_per_micro_batch,
    }
    return Config.model_validate(
        {
            "learner": {
                "num_learners": num_learners,
                "micro_batch_size": micro_batch_size,
                "zero_stage": zero_stage,
                "optimizer": "sgd",
                "lr": 0.5,
                "max_grad_norm": 0,
                **packing,
                **learner,
            },
            "loss": {"masked_mean_denominator": denominator, **(loss or {})},
            "data": {"max_prompt_tokens": SYNTHETIC_PROMPT_TOKENS},
            "rollout": {"max_new_tokens": SYNTHETIC_COMPLETION_TOKENS},
            # every collective's op and shapes compared across the ranks first: a layout whose ranks
            # hold different work fails at once where they would diverge, instead of hanging
            "run": {"check_collectives": num_learners > 1},
        }
    )


def critic_layout_config(*args, value_clip: float | None = 0.1, **kwargs) -> Config:
    """:func:`layout_config` for the critic's learners (PPO with GAE); the same arguments."""
    raw = layout_config(*args, **kwargs).model_dump()
    raw["algorithm"]["advantage"] = "gae"
    raw["critic"] = {"learners": raw["learner"], "value_clip": value_clip}
    return Config.model_validate(raw)


def with_value_targets(batch: TrainBatch, seed: int = 0) -> TrainBatch:
    """``batch`` with random returns and rollout-time values, what a critic trains on."""
    g = torch.Generator().manual_seed(seed)
    shape = batch.input_ids.shape
    return batch.replace(
        returns=torch.randn(shape, generator=g), old_values=0.1 * torch.randn(shape, generator=g)
    )


def update_after_one_step(
    config: Config, model_path: str, batch: TrainBatch, learner_cls: type | None = None
) -> dict[str, torch.Tensor]:
    """Weights after one training step minus weights before, on fresh learners (the policy's, or
    ``learner_cls``'s such as :class:`rltrain.learner.critic.CriticLearner`)."""
    return updates_after_one_step([config], model_path, batch, learner_cls)[0]


def _one_update(group, batch: TrainBatch) -> dict[str, torch.Tensor]:
    before = group.state_dict()
    group.train_step(batch)
    after = group.state_dict()
    return {k: after[k] - before[k] for k in before}


def metrics_of_one_step(config: Config, model_path: str, batch: TrainBatch) -> dict[str, float]:
    """The logged metrics of one training step on fresh policy learners."""
    with learners(config, model_path) as group:
        return group.train_step(batch)


_KEPT: Any = None  # where learner groups are kept (a KeptLearners), inside keeping_learners()


@contextlib.contextmanager
def keeping_learners(kept: Any) -> Iterator[Any]:
    """Within the block, the learner groups of these checks (:func:`learners`, :func:`on_learners`
    and the functions built on them) come from ``kept`` (a
    :class:`~rltrain.learner.group.KeptLearners`) and go back to it when their check ends
    (one process of checks, such as a test session, pays each placement's start once); the groups
    stay kept after it, until ``kept.close()``."""
    global _KEPT
    before, _KEPT = _KEPT, kept
    try:
        yield kept
    finally:
        _KEPT = before


@contextlib.contextmanager
def learners(
    config: Config, model_path: str, total_optimizer_steps: int = 1, learner_cls: type | None = None
) -> Iterator[Any]:
    """The :class:`~rltrain.learner.group.LearnerGroup` of ``learner_cls`` (the policy's by
    default) for one check, started on ``config`` from the weights at ``model_path``: a kept group
    restarted inside :func:`keeping_learners`, else a new one; stopped or kept when the block ends."""
    from rltrain.learner.group import LearnerGroup
    from rltrain.learner.policy import PolicyLearner

    learner_cls = learner_cls or PolicyLearner
    kept = _KEPT
    if kept is None:
        group = LearnerGroup(config, model_path, total_optimizer_steps, learner_cls)
    else:
        group = kept.take(config, model_path, total_optimizer_steps, learner_cls)
    try:
        yield group
    except BaseException:
        group.shutdown()
        raise
    if kept is None:
        group.shutdown()
    else:
        kept.give(group)


def updates_after_one_step(
    configs: list[Config],
    model_path: str,
    batch: TrainBatch | list[TrainBatch],
    learner_cls: type | None = None,
    at_once: int = 2,
) -> list[dict[str, torch.Tensor]]:
    """:func:`update_after_one_step` for each config (on ``batch``, or on each config's own batch
    in a list), through :func:`on_learners`."""
    batches = batch if isinstance(batch, list) else [batch] * len(configs)
    return on_learners(
        configs, model_path, lambda group, i: _one_update(group, batches[i]), learner_cls, at_once
    )


def on_learners(
    configs: list[Config],
    model_path: str,
    run: Callable[[Any, int], T],
    learner_cls: type | None = None,
    at_once: int = 2,
    total_optimizer_steps: int = 1,
) -> list[T]:
    """``run(group, i)`` for each config ``i``, on a :class:`~rltrain.learner.group.LearnerGroup`
    of ``learner_cls`` (the policy's by default) fresh for it. Configs whose learners are placed
    alike (:func:`~rltrain.learner.group.placement_of`: the number of learners and their resources)
    run one after another in one group of processes, started over from the model's weights between
    them (:meth:`~rltrain.learner.group.LearnerGroup.restart`: a process's imports and its
    torch.distributed group cost more than a step); ``at_once`` such groups run at a time (a group
    the cluster has no free CPUs for waits for one to end)."""
    from concurrent.futures import ThreadPoolExecutor

    from rltrain.learner.group import placement_of  # ray and deepspeed load only for this check
    from rltrain.learner.policy import PolicyLearner

    learner_cls = learner_cls or PolicyLearner
    alike: dict[tuple, list[int]] = {}
    for i, config in enumerate(configs):
        alike.setdefault(placement_of(learner_cls.section(config)), []).append(i)
    results: list[Any] = [None] * len(configs)

    def run_alike(indices: list[int]) -> None:
        with learners(configs[indices[0]], model_path, total_optimizer_steps, learner_cls) as group:
            for n, i in enumerate(indices):
                if n:
                    group.restart(configs[i], total_optimizer_steps)
                results[i] = run(group, i)

    with ThreadPoolExecutor(at_once) as pool:
        list(pool.map(run_alike, alike.values()))
    return results


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all tensors together."""
    num = sum(((a[k] - b[k]) ** 2).sum() for k in a) ** 0.5
    return (num / sum((b[k] ** 2).sum() for k in b) ** 0.5).item()
