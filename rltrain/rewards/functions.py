"""Verifiable rewards, user reward functions, and time limits (no ray, no deepspeed).

A reward function has one of two forms, told apart by its signature:

- ``fn(completion, answer) -> float``: one completion's text and its row's answer;
- TRL's batch form, any function with a parameter named ``completions``:
  ``fn(prompts, completions, **kwargs) -> list[float]``, called once per step with every
  completion, keyword arguments ``prompts`` (each completion's prompt text), ``completions`` (their
  texts) and one list per other column of the data rows (``answer``, ...); ``None`` in the list
  means the function does not apply to that completion (below).

Built-ins:

- ``math``: 1.0 when math-verify finds the completion's final answer equivalent to the reference.
- ``exact_match``: 1.0 when the stripped completion equals the stripped answer.
- ``format``: 1.0 when the completion ends its answer in ``\\boxed{...}``.
- ``digits``: the share of the completion's visible characters that are digits, a dense shaping
  reward that a tiny randomly initialized model can climb in minutes (the CPU demo uses it).

``env`` is an environment's own reward (:mod:`rltrain.envs`), taken from its episodes.
Anything else is ``module:function`` (an importable module) or ``path/to/file.py:function``. Calls
run in worker processes; one that raises, returns a non-number or runs past ``timeout_s`` (a batch
call: ``timeout_s`` per completion) fails that sample and is counted, with its first traceback, in
:attr:`Scores.calls`; one past its deadline is stopped for good: its worker process is killed and
replaced (a hung thread could never be).

``None`` (or NaN) means what it means in TRL: the function does not apply to this sample (a
multi-task reward, one function per task type). A sample's reward is the weighted sum of the
functions that apply to it; it fails only where none applies (with one function: where it returns
None). An episode's own reward (``env``, ``agent``) always applies (None scores 0).
"""

from __future__ import annotations

import functools
import inspect
import logging
import multiprocessing
import numbers
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pebble import ProcessPool

from rltrain.config import first_line
from rltrain.loading import import_attribute, with_deadline
from rltrain.tasks import reasoning_gym_reward

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
    "reasoning_gym": reasoning_gym_reward,  # a reasoning_gym:<name> data source's own scorer
}


ENV = "env"  # the environment's reward: computed by its episodes, not by a function
MODEL = "model"  # reward.model's score: computed by its actors
JUDGE = "judge"  # reward.judge's verdict: computed by generator engines
AGENT = "agent"  # a black-box agent's returned reward (rltrain.episodes.gateway)
VERIFIERS_ENV = "verifiers environment"  # the user code a verifiers episode's failure is charged to
GIVEN = (ENV, MODEL, JUDGE, AGENT)  # scores computed outside the reward workers, handed to RewardScorer


def takes_batches(fn: Callable) -> bool:
    """TRL's batch form (a parameter named ``completions``), or ``fn(completion, answer)``."""
    try:
        return "completions" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without an inspectable signature
        return False


def load_reward_fn(spec: str) -> RewardFn:
    """A built-in name, ``module:function`` or ``path/to/file.py:function``; raises ValueError with
    what was wrong."""
    if spec == ENV:
        raise ValueError("`env` is the environment's reward, not a function")
    if spec == AGENT:
        raise ValueError("`agent` is the agent's returned reward, not a function")
    if spec in (MODEL, JUDGE):
        raise ValueError(f"`{spec}` is reward.{spec}'s score, not a function")
    if spec in BUILTIN:
        return BUILTIN[spec]
    fn = import_attribute(spec, f"neither a built-in ({', '.join(BUILTIN)}) nor module:function")
    if not callable(fn):
        raise ValueError(f"{spec!r} is not callable")
    try:
        if takes_batches(fn):  # called as fn(prompts=..., completions=..., **columns)
            inspect.signature(fn).bind_partial(prompts=[], completions=[])  # columns: checked on a row
        else:
            inspect.signature(fn).bind("", "")  # called as fn(completion, answer)
    except TypeError as e:
        raise ValueError(
            f"{spec!r} must take (completion, answer), or (prompts, completions, **kwargs) as TRL's reward "
            f"functions do: {e}"
        ) from None
    except ValueError:
        pass  # a callable without an inspectable signature (a builtin): it is called as it is
    return fn


@functools.cache
def _cached_fn(spec: str) -> RewardFn:
    return load_reward_fn(spec)


def _preload(specs: list[str], started) -> None:
    """Worker start-up: import every function before taking calls (imports do not eat deadlines),
    then say so on ``started`` (a semaphore)."""
    for spec in specs:
        _cached_fn(spec)
    started.release()


def reward_name(spec: str) -> str:
    """A reward function's name in metrics, logs and rollouts on disk: its spec, but for a
    ``path/to/file.py:function`` the file's stem in place of its path (``file:function``)."""
    module, sep, attr = spec.rpartition(":")
    if sep and module.endswith(".py"):
        return f"{Path(module).stem}:{attr}"
    return spec


def score_value(value: Any) -> float | None:
    """A reward function's return value as a score: a real number (a bool, numpy's too) as a float,
    None or NaN as None (no score); anything else, a string "1.0" among them, raises TypeError."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, numbers.Real):
        raise TypeError(f"returned {value!r} ({type(value).__name__}), not a number")
    value = float(value)
    return value if value == value else None


def _call(spec: str, completion: str, answer: str) -> float | None:
    """One reward call, in a worker process: a float, or None for None or NaN."""
    return score_value(_cached_fn(spec)(completion, answer))


def _call_batch(spec: str, columns: dict[str, list]) -> list[float | None]:
    """One batch call (TRL's form), in a worker process: a float per completion, None for None or NaN."""
    values = list(_cached_fn(spec)(**columns))
    if len(values) != len(columns["completions"]):
        raise ValueError(f"returned {len(values)} scores for {len(columns['completions'])} completions")
    return [score_value(v) for v in values]


@dataclass
class Calls:
    """One reward function's calls in a step: how many, how many failed, the first failure's
    traceback (or what went wrong)."""

    called: int = 0
    failed: int = 0
    first_error: str | None = None


@dataclass
class Scores:
    rewards: list[float]  # weighted sum per completion
    per_function: dict[str, float]  # mean score of each function, over the samples it applies to
    failures: int  # calls that raised, hung or returned a non-number, and Nones where none applies
    # each function's score of each completion (None: it does not apply; 0: it failed)
    per_sample: dict[str, list[float | None]]
    calls: dict[str, Calls] = field(default_factory=dict)  # each called function's calls
    # each completion's first function (its name) whose score could not be computed, or None
    failed: list[str | None] = field(default_factory=list)


class RewardScorer:
    """Weighted reward functions, scored in ``workers`` processes (spawned, so a function never
    inherits the trainer's threads or actors). Close it (or use ``with``) to stop the workers.

    The workers start at the first call; one that is still starting when the scorer closes is
    waited for (up to ``START_WAIT_S``): stopped then, it would fail to read its start-up state
    (whose semaphores the stopping pool has released) and print a traceback over the run's last
    line."""

    START_WAIT_S = 60.0

    def __init__(self, functions: dict[str, float], timeout_s: float, workers: int = 2):
        called = [spec for spec in functions if spec not in GIVEN]
        self.batch = {spec for spec in called if takes_batches(load_reward_fn(spec))}  # a bad spec fails here
        self.functions, self.timeout_s = dict(functions), timeout_s
        context = multiprocessing.get_context("spawn")
        self.started = context.Semaphore(0)  # released once by each worker that finished starting
        self.launched = 0  # workers started so far: the pool's, and one for each one it replaced
        self.workers = workers
        self.pool = ProcessPool(
            max_workers=workers, initializer=_preload, initargs=(called, self.started), context=context
        )

    def one(
        self, spec: str, completions: list[str], answers: list[str], columns: dict[str, list] | None = None
    ) -> list[float | None]:
        """One function's score per completion (None where it failed or does not apply), in the
        same workers; a function this scorer was not made with is loaded here (``columns``: as for
        ``__call__``)."""
        if spec not in self.functions and takes_batches(load_reward_fn(spec)):
            self.batch.add(spec)
        return self._scores(spec, completions, answers, columns)[0]

    def _scores(
        self, spec: str, completions: list[str], answers: list[str], columns: dict[str, list] | None
    ) -> tuple[list[float | None], list[str | None]]:
        """``spec``'s score of each completion (None: it does not apply, or the call failed) and
        what went wrong with each call (None: nothing, a None score included)."""
        self.launched = self.launched or self.workers  # the pool starts them at its first call
        if spec in self.batch:
            columns = {"answer": answers, **(columns or {}), "completions": completions}
            columns.setdefault("prompts", [""] * len(completions))
            future = self.pool.schedule(
                _call_batch, (spec, columns), timeout=self.timeout_s * len(completions)
            )
            values, error = self._outcome(future)
            outcomes = (
                [(v, error) for v in values] if values is not None else [(None, error)] * len(completions)
            )
        else:
            futures = [self.pool.schedule(_call, (spec, c, a), timeout=self.timeout_s)
                       for c, a in zip(completions, answers)]  # fmt: skip
            outcomes = [self._outcome(f) for f in futures]
        return [v for v, _ in outcomes], [e for _, e in outcomes]

    def __call__(
        self,
        completions: list[str],
        answers: list[str],
        given: dict[str, list[float | None]] | None = None,
        columns: dict[str, list] | None = None,
    ) -> Scores:
        """Every function's score of every completion. ``given`` holds the scores computed
        elsewhere: ``env``, the episodes' own rewards (None, an episode that gave none, scores 0),
        ``model`` and ``judge``, a reward model's and a judge's (None, a sequence they did not
        score: a failure). ``columns``: what batch-form functions get besides the completions
        (``prompts`` and the data rows' columns, a list each).

        A called function's None is TRL's "does not apply": the sample's reward is the weighted
        sum of the functions that apply, and it fails (its first function's name in
        :attr:`Scores.failed`) only where a call raised, a model gave no score, or none applies."""
        given, n = given or {}, len(completions)
        values, errors = {}, {}  # by spec: scores (None: no score), what went wrong (None: nothing)
        for spec in self.functions:
            if spec in (ENV, AGENT):  # an episode's own reward always applies (None: it gave none, 0)
                values[spec] = [v or 0.0 for v in given.get(spec, [None] * n)]
                errors[spec] = [None] * n
            elif spec in GIVEN:  # a reward model's or judge's None: it could not score the sequence
                values[spec] = given.get(spec, [None] * n)
                errors[spec] = [None if v is not None else f"{spec} gave no score" for v in values[spec]]
            else:
                values[spec], errors[spec] = self._scores(spec, completions, answers, columns)
        applies = [any(values[spec][i] is not None for spec in self.functions) for i in range(n)]
        for spec in self.functions:  # where none applies, each None is a failure of its function
            errors[spec] = [e or (None if v is not None or ok else "returned None or NaN (and no other "
                                  "reward function applies)")
                            for e, v, ok in zip(errors[spec], values[spec], applies)]  # fmt: skip
        totals = [0.0] * n
        per_function, per_sample, calls, failures = {}, {}, {}, 0
        failed: list[str | None] = [None] * n
        for spec, weight in self.functions.items():
            name = reward_name(spec)
            wrong = [e for e in errors[spec] if e is not None]
            if spec not in GIVEN:
                calls[name] = Calls(n, len(wrong), wrong[0] if wrong else None)
            failures += len(wrong)
            failed = [f or (name if e is not None else None) for f, e in zip(failed, errors[spec])]
            totals = [t + weight * (v or 0.0) for t, v in zip(totals, values[spec])]
            # each sample's score: None where the function does not apply, 0 where it failed
            per_sample[name] = [0.0 if e is not None else v for v, e in zip(values[spec], errors[spec])]
            scored = [v for v in values[spec] if v is not None]  # (where it applies and gave a score)
            per_function[name] = sum(scored) / max(len(scored), 1)
        return Scores(totals, per_function, failures, per_sample, calls, failed)

    def _outcome(self, future) -> tuple[Any, str | None]:
        value, error = _outcome(future)
        if error is not None and error.startswith((TIMED_OUT, DIED)):
            self.launched += 1  # the pool replaces the worker it stopped or lost
        return value, error

    def close(self) -> None:
        deadline = time.monotonic() + self.START_WAIT_S
        for _ in range(self.launched):
            if not self.started.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
                break
        self.pool.stop()
        self.pool.join()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


TIMED_OUT = "did not return in time (reward.timeout_s); its worker was stopped"
DIED = "its worker process died"


def _outcome(future) -> tuple[Any, str | None]:
    """A call's value, or None and what went wrong: the function's traceback, a timeout (its
    worker killed), or a worker that died."""
    from concurrent.futures import TimeoutError as CallTimeout

    from pebble import ProcessExpired

    try:
        return future.result(), None
    except CallTimeout:
        return None, TIMED_OUT
    except ProcessExpired as e:
        return None, f"{DIED} ({e})"
    except Exception as e:  # raised in the function: pebble carries the worker's traceback
        return None, getattr(e, "traceback", None) or f"{type(e).__name__}: {e}"


def soft_overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment: 0 up to ``max - buffer`` tokens, then a linear ramp to
    ``-penalty`` at ``max_new_tokens``."""
    start = max_new_tokens - buffer
    if length <= start:
        return 0.0
    return -penalty * min(1.0, (length - start) / buffer)


def check_reward_functions(functions: dict[str, float], timeout_s: float, row: dict) -> None:
    """Each reward function, called once on the first data row with its answer as the completion
    (both forms: ``fn(completion, answer)``, and TRL's ``fn(prompts=, completions=, **columns)``),
    returns a number or None (TRL's "does not apply"), and at least one function applies; raises
    ValueError naming the function otherwise."""
    answer = str(row.get("answer", ""))
    called = [spec for spec in functions if spec not in GIVEN]
    none = []  # the functions that do not apply to the row
    for spec in called:
        fn = load_reward_fn(spec)
        if takes_batches(fn):
            columns = {k: [v] for k, v in row.items() if k not in ("prompt", "answer")}
            call = functools.partial(
                fn, prompts=[row.get("prompt", "")], completions=[answer], answer=[answer], **columns
            )
            form = "fn(prompts=[...], completions=[...], answer=[...], <other columns>=[...])"
        else:
            call, form = functools.partial(fn, answer, answer), "fn(completion, answer)"
        try:
            value = with_deadline(timeout_s, call)
            if len(value if takes_batches(fn) else [value]) != 1:
                raise ValueError(f"returned {len(value)} scores for 1 completion")
            number = score_value(list(value)[0] if takes_batches(fn) else value)
            number = float("nan") if number is None else number
        except Exception as e:
            raise ValueError(
                f"reward.functions: {spec}, called as {form} on the first data row with its answer as the "
                f"completion, raised {first_line(e)}"
            ) from None
        if number != number:
            none.append(spec)
    if none and len(none) == len(functions):  # (an episode's or a model's score applies)
        names = " and ".join(none) if len(none) < 3 else f"all {len(none)} of {', '.join(none)}"
        raise ValueError(
            f"reward.functions: {names} returned no score (None or NaN) on the first data row with its "
            "answer as the completion: no function applies to it"
        )
