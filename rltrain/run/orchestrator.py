"""The generation pipeline: which prompts are in flight for which step, and the data order.

:class:`Orchestrator` draws prompts from the :class:`~rltrain.prompt_sampler.PromptSampler`, keeps
``rollout.max_staleness`` steps of generation in flight ahead of the step being trained, collects a
step's completions, scores them and, with DAPO's dynamic sampling, refills the batch with more
prompts (:func:`collect_groups`). Every sampled token carries the policy version that sampled it
(the engines stamp it; with ``rollout.inflight_updates`` a completion can span several versions);
a group with a token more than ``max_staleness`` versions older than the learners' weights is
dropped and counted (:func:`~rltrain.run.scoring.drop_stale`): a weight sync that never reached an engine
shows up there instead of being trained on.

Model scorers on actors of their own (a reward model, a judge with engines of its own) score a
step as soon as its completions are in, in one thread beside the training loop: a step generated
ahead is scored while the policy trains on the one before.

**The data order is part of the checkpoint, whatever draws from the sampler.** Refill rounds and
steps generated ahead take prompts between two saves, so the sampler's position alone cannot say
which prompts a resumed run must train on next. :meth:`Orchestrator.state` is taken when a step's
batch is complete: the sampler position *after* that step's refills and the steps already
submitted ahead, plus, for each step ahead, the prompts it took and its completions (fetched when
the checkpoint is written: they were sampled by weights older than the checkpoint's, so a resumed
run could not sample them again). A resumed or restarted run restores that state and hands the
learners exactly the batches of the uninterrupted run; request seeds are a function of (run seed,
step, round), so what it generates from there is the same too.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from rltrain.batch import Completion
from rltrain.config import Config
from rltrain.data import Prompt
from rltrain.loss.advantages import zero_variance_groups
from rltrain.prompt_sampler import PromptSampler
from rltrain.run.scoring import ModelScorer, ModelScores, ScoredGroups, drop_stale, per_completion, score


def request_seeds(config: Config, step: int, round_: int, count: int) -> list[int]:
    """Distinct per-request seeds, a function of (run seed, step, round): resumable sampling."""
    base = (config.run.seed * 1_000_003 + step * 10_007 + round_ * 101) * 1_000
    return [(base + i) % 2**31 for i in range(count)]


def submit(generators, prompts: list[Prompt], config: Config, step: int, round_: int) -> list[Any]:
    """Start ``group_size`` completions of every prompt (non-blocking); returns the references."""
    n = config.algorithm.group_size
    requests = [request(p, config) for p in prompts for _ in range(n)]
    return generators.submit(requests, request_seeds(config, step, round_, len(requests)))


def request(prompt: Prompt, config: Config) -> list[int] | dict:
    """What a generator takes for a prompt: its token ids, or with an environment or an agent its data row."""
    return prompt.row if config.episodic else prompt.token_ids


def collect_groups(generators, refs, prompts, sampler, config: Config, scorer, step: int,
                   completions: list[Completion] | None = None,
                   model_scorers: dict[str, ModelScorer] | None = None,
                   model_scores: dict[str, ModelScores] | None = None) -> ScoredGroups:  # fmt: skip
    """Completions of this step (``completions`` when already fetched, else ``refs``), scored (by
    ``model_scorers`` too: reward.model, reward.judge, unless ``model_scores`` already holds a
    scorer's result for them); with dynamic sampling, zero-variance groups are dropped and more
    prompts are generated (up to ``max_sampling_rounds``) to refill the batch."""
    alg = config.algorithm
    scored = score(
        prompts,
        completions if completions is not None else generators.collect(refs),
        config,
        scorer,
        model_scorers,
        model_scores,
    )
    observe(sampler, scored, config)
    if not alg.dynamic_sampling:
        return scored
    parts, found, rounds = [], 0, 1
    while True:
        valid = scored.valid() if config.reward.on_failure == "drop" else None  # (failed ones count not)
        informative = ~zero_variance_groups(scored.rewards, alg.group_size, valid)
        parts.append(scored.keep(informative, alg.group_size))
        found += int(informative.sum())
        if found >= alg.prompts_per_step or rounds >= alg.max_sampling_rounds:
            break
        more = sampler.take(alg.prompts_per_step)
        more_completions = generators.collect(submit(generators, more, config, step, rounds))
        scored = score(more, more_completions, config, scorer, model_scorers)
        observe(sampler, scored, config)
        rounds += 1
    merged = ScoredGroups.concat(parts)
    merged = merged.keep(torch.arange(len(merged.prompts)) < alg.prompts_per_step, alg.group_size)
    merged.metrics = {
        **parts[0].metrics,
        "rollout/sampling_rounds": float(rounds),
        "rollout/informative_groups": float(len(merged.prompts)),
    }
    return merged


def observe(sampler: PromptSampler, scored: ScoredGroups, config: Config) -> None:
    """Difficulty sampling (``data.difficulty_sampling``): each group's mean reward over the samples
    that count, before any filter drops it (a group the policy always or never solves is the one
    to know about)."""
    if config.data.difficulty_sampling is None or not scored.prompts:
        return
    n = config.algorithm.group_size
    counted = (
        scored.valid() if config.reward.on_failure == "drop" else torch.ones(len(scored.completions)).bool()
    )
    rewards_Gn, counted_Gn = scored.rewards.double().view(-1, n), counted.view(-1, n)
    sums, counts = (rewards_Gn * counted_Gn).sum(-1), counted_Gn.sum(-1)
    sampler.observe(scored.prompts, [None if k == 0 else (t / k).item() for t, k in zip(sums, counts)])


@dataclass
class _Ahead:
    """A step whose prompts were taken and submitted before it is trained."""

    step: int
    prompts: list[Prompt]
    refs: list[Any] = field(default_factory=list)
    completions: list[Completion] | None = None  # once fetched
    model_scores: Future | None = None  # the beside scorers' results, once started
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def fetch(self, generators) -> list[Completion]:
        with self._lock:  # the scoring thread and a checkpoint may ask at the same time
            if self.completions is None:
                self.completions = generators.collect(self.refs)
            return self.completions


class Orchestrator:
    """The sampler, the steps in flight and the data order; see the module docstring."""

    def __init__(self, config: Config, sampler: PromptSampler, generators, scorer,
                 model_scorers: dict[str, ModelScorer] | None = None):  # fmt: skip
        self.config, self.sampler, self.generators, self.scorer = config, sampler, generators, scorer
        model_scorers = model_scorers or {}
        # scorers on actors of their own run in one thread, in order, whoever asks (a refill round
        # too): their actors never see two batches at once
        self._beside = {name: s for name, s in model_scorers.items() if getattr(s, "own_actors", False)}
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="rltrain-scoring") if self._beside else None
        self.model_scorers = {
            name: partial(self._in_thread, s) if name in self._beside else s
            for name, s in model_scorers.items()
        }
        self.ahead: deque[_Ahead] = deque()  # oldest first
        # per completed step: (sampler state, the steps ahead then); the last two are kept, for a save
        # after the step and for Ctrl-C while the next one is collected
        self._after: dict[int, tuple[dict[str, int], list[_Ahead]]] = {0: (sampler.state(), [])}

    def next_batch(self, step: int) -> ScoredGroups:
        """The scored groups of ``step``, without stale groups; keeps ``rollout.max_staleness``
        steps in flight beyond it."""
        cfg = self.config
        last = cfg.run.steps
        while len(self.ahead) <= cfg.rollout.max_staleness and step + len(self.ahead) <= last:
            ahead_step = step + len(self.ahead)
            prompts = self.sampler.take(cfg.algorithm.prompts_per_step)
            self.ahead.append(
                _Ahead(ahead_step, prompts, submit(self.generators, prompts, cfg, ahead_step, 0))
            )
        for ahead in self.ahead:  # scored as soon as generated, while the policy trains
            if self._thread is not None and ahead.model_scores is None:
                ahead.model_scores = self._thread.submit(self._score_beside, ahead)
        current = self.ahead.popleft()
        assert current.step == step, (current.step, step)
        model_scores = current.model_scores.result() if current.model_scores is not None else None
        scored = collect_groups(self.generators, current.refs, current.prompts, self.sampler, cfg,
                                self.scorer, step, current.completions, self.model_scorers,
                                model_scores)  # fmt: skip
        # the learners hold version step - 1 (the weights after step - 1 updates)
        scored = drop_stale(scored, step - 1, cfg.rollout.max_staleness, cfg.algorithm.group_size)
        if cfg.data.difficulty_sampling is not None:
            scored.metrics = {**scored.metrics, **self.sampler.pool_sizes()}
        self._after = {s: v for s, v in self._after.items() if s >= step - 1}
        self._after[step] = (self.sampler.state(), list(self.ahead))
        return scored

    def _score_beside(self, ahead: _Ahead) -> dict[str, ModelScores]:
        """In the scoring thread: a step's completions (waiting for its generation) scored by the
        model scorers on actors of their own; ``time/model_scoring_s`` is their time."""
        completions = ahead.fetch(self.generators)
        prompts = per_completion(ahead.prompts, self.config.algorithm.group_size)
        start = time.perf_counter()
        results = {name: scorer(prompts, completions) for name, scorer in self._beside.items()}
        elapsed = {"time/model_scoring_s": time.perf_counter() - start}
        return {name: (scores, metrics | elapsed) for name, (scores, metrics) in results.items()}

    def _in_thread(
        self, scorer: ModelScorer, prompts: list[Prompt], completions: list[Completion]
    ) -> ModelScores:
        assert self._thread is not None
        return self._thread.submit(scorer, prompts, completions).result()

    def close(self) -> None:
        """Stops the scoring thread (a batch it is scoring ends when its actors are stopped)."""
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)

    def state(self, step: int) -> dict[str, Any]:
        """The data order after ``step``'s batch (see the module docstring); fetches the completions
        of the steps generated ahead, which a resumed run cannot sample again."""
        sampler_state, ahead = self._after[step]
        return {
            "sampler": sampler_state,
            "ahead": [
                {
                    "step": a.step,
                    "prompts": [p.index for p in a.prompts],
                    "completions": [c.state() for c in a.fetch(self.generators)],
                }  # fmt: skip
                for a in ahead
            ],
        }

    def load_state(self, state: dict[str, Any], step: int) -> None:
        """Continue after ``step`` from :meth:`state` (a checkpoint's ``data``)."""
        self.sampler.load_state(state["sampler"])
        by_index = {p.index: p for p in self.sampler.prompts}
        self.ahead = deque(
            _Ahead(
                a["step"],
                [by_index[i] for i in a["prompts"]],
                completions=[Completion.from_state(c) for c in a["completions"]],
            )  # fmt: skip
            for a in state.get("ahead", [])
        )
        self._after = {step: (self.sampler.state(), list(self.ahead))}
