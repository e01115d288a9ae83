"""The user's own code failing, shown and bounded: reward functions, an environment's ``reset`` and
``step``, and its tools.

Each kind's first failure is printed once on the console (one line, with where its traceback went)
and its traceback is kept in ``<output_dir>/errors/<kind>.txt``. Every step logs the failures of
each kind (``failures/<kind>``), and the step line shows their sum. When every call of a reward
function or an environment method fails for ``run.max_user_failure_steps`` steps in a row, the run
stops with one line that names it and points to the traceback: a run whose reward is 0 for a bug,
not for the policy, is not worth its compute. A tool that raises is the model's observation (it
may have called it badly), so tools are shown and counted, never stopped for; so is a chat template
that raises or rewrites an episode's history (that episode ends with finish reason ``error``).
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

from rltrain.episodes.chat import TEMPLATE
from rltrain.rewards.functions import AGENT, VERIFIERS_ENV, Calls

# a tool's failure is the model's observation; a chat template's, a black-box agent's or a
# verifiers environment's ends its episode alone
NEVER_STOPS = ("tool ", TEMPLATE, AGENT, VERIFIERS_ENV)


class UserCodeFailed(RuntimeError):
    """Every call of the user's code of one kind failed for too many steps."""


def slug(kind: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", kind).strip("_")


class UserCodeFailures:
    def __init__(self, out: Path, max_failed_steps: int | None):
        self.folder, self.max_failed_steps = out / "errors", max_failed_steps
        self.saved: dict[str, Path] = {}  # kind -> its first traceback's file
        self.streak: Counter[str] = Counter()  # kind -> steps in a row in which every call failed
        self.note = ""  # the last step's word on its episodes, where most of them failed
        self.empty_steps = 0  # steps in a row whose every sample failed outside the policy

    def check(self, step: int, calls: dict[str, Calls]) -> dict[str, float]:
        """The step's ``failures/<kind>`` metrics; a kind's first failure is shown and kept; raises
        :class:`UserCodeFailed` once a reward function or environment method has failed every call
        for ``max_failed_steps`` steps in a row."""
        metrics = {}
        self.note = most_episodes_failed(calls)
        for kind, c in calls.items():
            if c.failed:
                metrics[f"failures/{slug(kind)}"] = float(c.failed)
                if kind not in self.saved and c.first_error:
                    self._show(step, kind, c)
            every = c.called > 0 and c.failed == c.called
            self.streak[kind] = self.streak[kind] + 1 if every else 0
            limit = self.max_failed_steps
            if limit and self.streak[kind] >= limit and not kind.startswith(NEVER_STOPS):
                where = f"; its first traceback: {self.saved[kind]}" if kind in self.saved else ""
                raise UserCodeFailed(
                    f"step {step}: every call of the {kind} failed for {self.streak[kind]} step(s) in a row "
                    f"({c.failed} of {c.called} this step: {last_line(c.first_error)}){where}; stopping "
                    f"(run.max_user_failure_steps={limit})"
                )
        return metrics

    def nothing_to_train(self, step: int, metrics: dict[str, float]) -> None:
        """A step skipped with nothing to train on: where every sample failed outside the policy,
        raises :class:`UserCodeFailed` once ``max_failed_steps`` such steps came in a row."""
        failed = metrics.get("failures/outside_policy", 0.0)
        if not failed:
            self.empty_steps = 0  # (skipped for staleness or filtering, not for failures)
            return
        self.empty_steps += 1
        limit = self.max_failed_steps
        if limit and self.empty_steps >= limit:
            why = f": {self.note}" if self.note else ""
            raise UserCodeFailed(
                f"step {step}: every sample of {self.empty_steps} step(s) in a row failed outside the policy, "
                f"nothing to train on ({failed:.0f} failed this step{why}); stopping "
                f"(run.max_user_failure_steps={limit}; the failures are counted as failures/* and kept in "
                f"{self.folder})"
            )

    def trained(self) -> None:
        self.empty_steps = 0

    def _show(self, step: int, kind: str, c: Calls) -> None:
        path = self.folder / f"{slug(kind)}.txt"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{kind}, first failure at step {step}:\n{c.first_error}\n")
            self.saved[kind] = path
            where = f"traceback: {path}"
        except OSError as e:
            where = f"its traceback could not be written: {e.strerror}"
        print(f"rltrain: step {step}: the {kind} failed ({c.failed} of {c.called} calls): "
              f"{last_line(c.first_error)} ({where})", file=sys.stderr, flush=True)  # fmt: skip


# the kinds whose calls are a step's episodes: a failure there ends an episode
EPISODE_KINDS = (AGENT, "environment reset", "environment step", TEMPLATE)


def most_episodes_failed(calls: dict[str, Calls]) -> str:
    """Where most of a step's episodes ended in a failure of the user's code (an agent, an
    environment, a chat template): how many, and the most common kind with its message; else ''."""
    episodes = max((calls[k].called for k in EPISODE_KINDS if k in calls), default=0)
    failed = {k: calls[k] for k in EPISODE_KINDS if k in calls and calls[k].failed}
    total = sum(c.failed for c in failed.values())
    if not episodes or total * 2 <= episodes:
        return ""
    kind, c = max(failed.items(), key=lambda item: item[1].failed)
    return f"{min(total, episodes)} of {episodes} episodes failed, most often the {kind}: {last_line(c.first_error)}"


def last_line(text: str | None) -> str:
    """A traceback's last line (the exception), or the message itself."""
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no message"
