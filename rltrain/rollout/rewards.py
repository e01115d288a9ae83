"""Verifiable rewards, user reward functions, and time limits (no ray, no deepspeed).

A reward function takes ``(completion_text, answer)`` and returns a float. Built-ins:

- ``math``: 1.0 when math-verify finds the completion's final answer equivalent to the reference.
- ``exact_match``: 1.0 when the stripped completion equals the stripped answer.
- ``format``: 1.0 when the completion ends its answer in ``\\boxed{...}``.
- ``digits``: the share of the completion's visible characters that are digits, a dense shaping
  reward that a tiny randomly initialized model can climb in minutes (the CPU demo uses it).

``env`` is an environment's own reward (:mod:`rltrain.envs`), taken from its episodes.
Anything else is ``module:function``. Calls run in worker processes; one that raises, returns a
non-number or runs past ``timeout_s`` scores 0 for that sample and is counted in the metrics, and
one past its deadline is stopped for good: its worker process is killed and replaced (a hung
thread could never be). The run goes on.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import multiprocessing
import re
from collections.abc import Callable
from dataclasses import dataclass

from pebble import ProcessPool

RewardFn = Callable[[str, str], float]
# math-verify warns on every call that its own timeout is off; ours is the worker's deadline
logging.getLogger("math_verify").setLevel(logging.ERROR)
BOXED = re.compile(r"\\boxed\{[^{}]+\}\s*$")


def math_reward(completion: str, answer: str) -> float:
    from math_verify import parse, verify

    # the scorer enforces the time limit (math-verify's own uses SIGALRM)
    gold = parse(answer, parsing_timeout=None)
    target = parse(completion, parsing_timeout=None)
    return float(bool(gold) and bool(target) and verify(gold, target, timeout_seconds=None))


def exact_match_reward(completion: str, answer: str) -> float:
    return float(completion.strip() == answer.strip())


def format_reward(completion: str, answer: str) -> float:
    return float(BOXED.search(completion) is not None)


def digits_reward(completion: str, answer: str) -> float:
    visible = [ch for ch in completion if ch.isprintable() and not ch.isspace()]
    return sum(ch.isdigit() for ch in visible) / len(visible) if visible else 0.0


BUILTIN: dict[str, RewardFn] = {
    "math": math_reward,
    "exact_match": exact_match_reward,
    "format": format_reward,
    "digits": digits_reward,
}


ENV = "env"  # the environment's reward: computed by its episodes, not by a function
MODEL = "model"  # reward.model's score: computed by its actors
JUDGE = "judge"  # reward.judge's verdict: computed by generator engines
GIVEN = (ENV, MODEL, JUDGE)  # scores computed outside the reward workers, handed to RewardScorer


def import_attribute(spec: str, not_a_spec: str):
    """``module:name`` imported; raises ValueError saying what went wrong (``not_a_spec`` when
    ``spec`` does not have that shape)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{spec!r} is {not_a_spec}")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load {spec!r}: {e}") from None
    except Exception as e:  # the user's module raised while it was imported
        raise ValueError(
            f"cannot load {spec!r}: importing {module_name} raised {type(e).__name__}: {e}"
        ) from None


def load_reward_fn(spec: str) -> RewardFn:
    """A built-in name or ``module:function``; raises ValueError with what was wrong."""
    if spec == ENV:
        raise ValueError("`env` is the environment's reward, not a function")
    if spec in (MODEL, JUDGE):
        raise ValueError(f"`{spec}` is reward.{spec}'s score, not a function")
    if spec in BUILTIN:
        return BUILTIN[spec]
    fn = import_attribute(spec, f"neither a built-in ({', '.join(BUILTIN)}) nor module:function")
    if not callable(fn):
        raise ValueError(f"{spec!r} is not callable")
    try:
        inspect.signature(fn).bind("", "")  # called as fn(completion, answer)
    except TypeError as e:
        raise ValueError(f"{spec!r} must take (completion, answer): {e}") from None
    except ValueError:
        pass  # a callable without an inspectable signature (a builtin): it is called as it is
    return fn


@functools.cache
def _cached_fn(spec: str) -> RewardFn:
    return load_reward_fn(spec)


def _preload(specs: list[str]) -> None:
    """Worker start-up: import every function before taking calls (imports do not eat deadlines)."""
    for spec in specs:
        _cached_fn(spec)


def _call(spec: str, completion: str, answer: str) -> float | None:
    """One reward call, in a worker process: a float, or None for a non-number (NaN included)."""
    value = float(_cached_fn(spec)(completion, answer))
    return value if value == value else None


@dataclass
class Scores:
    rewards: list[float]  # weighted sum per completion
    per_function: dict[str, float]  # mean score of each function
    failures: int  # calls that raised, hung or returned a non-number
    per_sample: dict[str, list[float]]  # each function's score of each completion


class RewardScorer:
    """Weighted reward functions, scored in ``workers`` processes (spawned, so a function never
    inherits the trainer's threads or actors). Close it (or use ``with``) to stop the workers."""

    def __init__(self, functions: dict[str, float], timeout_s: float, workers: int = 2):
        called = [spec for spec in functions if spec not in GIVEN]
        for spec in called:
            load_reward_fn(spec)  # a bad spec fails here, in the trainer, with what was wrong
        self.functions, self.timeout_s = dict(functions), timeout_s
        self.pool = ProcessPool(
            max_workers=workers,
            initializer=_preload,
            initargs=(called,),
            context=multiprocessing.get_context("spawn"),
        )

    def one(self, spec: str, completions: list[str], answers: list[str]) -> list[float | None]:
        """One function's score per completion (None where it failed), in the same workers."""
        futures = [
            self.pool.schedule(_call, (spec, c, a), timeout=self.timeout_s)
            for c, a in zip(completions, answers)
        ]
        return [_result(f) for f in futures]

    def __call__(
        self,
        completions: list[str],
        answers: list[str],
        given: dict[str, list[float | None]] | None = None,
    ) -> Scores:
        """Every function's score of every completion. ``given`` holds the scores computed
        elsewhere: ``env``, the episodes' own rewards (None, an episode that gave none, scores 0),
        ``model`` and ``judge``, a reward model's and a judge's (None, a sequence they did not
        score: 0, a failure)."""
        given = given or {}
        futures = {
            spec: [
                self.pool.schedule(_call, (spec, c, a), timeout=self.timeout_s)
                for c, a in zip(completions, answers)
            ]
            for spec in self.functions
            if spec not in GIVEN
        }
        totals = [0.0] * len(completions)
        per_function, per_sample, failures = {}, {}, 0
        for spec, weight in self.functions.items():
            values = (
                given.get(spec, [None] * len(completions))
                if spec in GIVEN
                else [_result(f) for f in futures[spec]]
            )
            if spec != ENV:
                failures += sum(v is None for v in values)
            scores = [v or 0.0 for v in values]
            totals = [t + weight * v for t, v in zip(totals, scores)]
            per_function[spec] = sum(scores) / max(len(scores), 1)
            per_sample[spec] = scores
        return Scores(totals, per_function, failures, per_sample)

    def close(self) -> None:
        self.pool.stop()
        self.pool.join()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _result(future) -> float | None:
    try:
        return future.result()
    except Exception:  # raised in the function, timed out (worker killed), or the worker died
        return None


def soft_overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment: 0 up to ``max - buffer`` tokens, then a linear ramp to
    ``-penalty`` at ``max_new_tokens``."""
    start = max_new_tokens - buffer
    if length <= start:
        return 0.0
    return -penalty * min(1.0, (length - start) / buffer)
