"""Verifiable rewards, user reward functions, and time limits (no ray, no deepspeed).

A reward function takes ``(completion_text, answer)`` and returns a float. Built-ins:

- ``math``: 1.0 when math-verify finds the completion's final answer equivalent to the reference.
- ``exact_match``: 1.0 when the stripped completion equals the stripped answer.
- ``format``: 1.0 when the completion ends its answer in ``\\boxed{...}``.
- ``digits``: the share of the completion's visible characters that are digits, a dense shaping
  reward that a tiny randomly initialized model can climb in minutes (the CPU demo uses it).

Anything else is ``module:function``. A function that raises or runs past ``timeout_s`` scores 0
for that sample and is counted in the metrics; the run goes on.
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

RewardFn = Callable[[str, str], float]
# math-verify warns on every call that its own timeout is off; ours is in call_all_with_timeout
logging.getLogger("math_verify").setLevel(logging.ERROR)
BOXED = re.compile(r"\\boxed\{[^{}]+\}\s*$")


def math_reward(completion: str, answer: str) -> float:
    from math_verify import parse, verify

    # math-verify's own timeouts use SIGALRM, which only works in the main thread; the scorer
    # enforces the time limit instead
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


def load_reward_fn(spec: str) -> RewardFn:
    """A built-in name or ``module:function``; raises ValueError with what was wrong."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{spec!r} is neither a built-in ({', '.join(BUILTIN)}) nor module:function")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load {spec!r}: {e}") from None
    if not callable(fn):
        raise ValueError(f"{spec!r} is not callable")
    return fn


def call_all_with_timeout(
    fn: RewardFn, completions: list[str], answers: list[str], timeout_s: float
) -> list[float | None]:
    """``fn(completion, answer)`` for every pair, concurrently, within one shared deadline.

    Each entry is a float, or None where the call raised, returned a non-number (NaN included) or
    was still running at the deadline. Calls run in daemon threads: a hung function is abandoned
    (Python cannot kill a thread) but never blocks the run or its exit.
    """
    results: list[float | None] = [None] * len(completions)

    def target(i: int) -> None:
        try:
            value = float(fn(completions[i], answers[i]))
            results[i] = value if value == value else None
        except Exception:
            results[i] = None

    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(len(completions))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [None if t.is_alive() else r for t, r in zip(threads, results)]


@dataclass
class Scores:
    rewards: list[float]  # weighted sum per completion
    per_function: dict[str, float]  # mean score of each function
    failures: int  # calls that raised, hung or returned a non-number


class RewardScorer:
    def __init__(self, functions: dict[str, float], timeout_s: float):
        self.functions = {name: (load_reward_fn(name), weight) for name, weight in functions.items()}
        self.timeout_s = timeout_s

    def __call__(self, completions: list[str], answers: list[str]) -> Scores:
        totals = [0.0] * len(completions)
        per_function, failures = {}, 0
        for name, (fn, weight) in self.functions.items():
            values = call_all_with_timeout(fn, completions, answers, self.timeout_s)
            failures += sum(v is None for v in values)
            scores = [v or 0.0 for v in values]
            totals = [t + weight * v for t, v in zip(totals, scores)]
            per_function[name] = sum(scores) / max(len(scores), 1)
        return Scores(totals, per_function, failures)


def soft_overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment: 0 up to ``max - buffer`` tokens, then a linear ramp to
    ``-penalty`` at ``max_new_tokens``."""
    start = max_new_tokens - buffer
    if length <= start:
        return 0.0
    return -penalty * min(1.0, (length - start) / buffer)
