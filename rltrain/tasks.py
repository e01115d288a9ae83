"""Tasks from reasoning-gym (PyPI ``reasoning-gym``, ``pip install rltrain[tasks]``): its procedural
datasets as training and held-out rows, and its own scorers as the ``reasoning_gym`` reward.

``data.source: reasoning_gym:<name>`` generates ``data.size`` rows with ``data.seed`` and the
dataset's own settings in ``data.task_config``; ``reasoning_gym:composite`` mixes datasets, listed
with their weights and settings in ``data.task_config.datasets``. Each row's answer carries the
entry that the dataset's ``score_answer`` needs (its metadata), as JSON.

The ``reasoning_gym`` reward takes the answer from a completion as reasoning-gym's own prompts ask
for it: the text of the last ``<answer>...</answer>``, else of the last ``\\boxed{...}``, else the
completion's last non-empty line; and scores it with the entry's dataset's ``score_answer`` (1.0
right, partial credit where the dataset gives it, 0.0 otherwise).
"""

from __future__ import annotations

import difflib
import json
import re
from typing import Any

PREFIX = "reasoning_gym:"
ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def is_task(source: str) -> bool:
    return source.startswith(PREFIX)


def task_rows(
    source: str, size: int, seed: int, task_config: dict[str, Any], key: str
) -> list[dict[str, str]]:
    """``size`` rows ``{"prompt", "answer"}`` of the dataset ``source`` names; an unknown name or a
    setting it does not take raises ValueError naming ``key``."""
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ValueError(f"{key}: {source!r} needs reasoning-gym (pip install 'rltrain[tasks]')") from None
    name = source[len(PREFIX) :]
    if name not in DATASETS:
        close = difflib.get_close_matches(name, DATASETS, n=3, cutoff=0.6)
        hint = (
            f"; did you mean {', '.join(close)}?"
            if close
            else f" ({len(DATASETS)} datasets: reasoning_gym.factory.DATASETS)"
        )
        raise ValueError(f"{key}: reasoning-gym has no dataset {name!r}{hint}")
    settings = dict(task_config)
    if name == "composite":
        from reasoning_gym.composite import DatasetSpec

        settings["datasets"] = [DatasetSpec(**dict({"weight": 1.0, "config": {}} | spec))
                                for spec in settings.get("datasets", [])]  # fmt: skip
    try:
        dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **settings)
    except (TypeError, ValueError, AssertionError) as e:
        raise ValueError(
            f"{key}: reasoning-gym's {name!r} does not take data.task_config {task_config}: {e}"
        ) from None
    return [{"prompt": entry["question"], "answer": _carried(entry)} for entry in dataset]


def _carried(entry: dict) -> str:
    """The entry as the answer column carries it (tuples in metadata become lists, as JSON has them)."""
    return json.dumps({"answer": entry["answer"], "metadata": entry["metadata"]}, default=str)


def extract_answer(completion: str) -> str:
    """The answer a completion gives (see the module docstring)."""
    for pattern in (ANSWER_TAG, BOXED):
        found = pattern.findall(completion)
        if found:
            return found[-1].strip()
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def reasoning_gym_reward(completion: str, answer: str) -> float:
    """The dataset's own ``score_answer`` on the completion's answer (``answer``: a row's carried
    entry)."""
    import reasoning_gym

    entry = json.loads(answer)
    score = reasoning_gym.get_score_answer_fn(entry["metadata"]["source_dataset"])
    return float(score(extract_answer(completion), entry))
