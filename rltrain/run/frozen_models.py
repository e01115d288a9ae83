"""The frozen models' groups as the driver uses them: a teacher and a reward model whose actors
(:mod:`rltrain.learner.frozen`) recover on their own, and the reward model's score of each sequence.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from rltrain.batch import TrainBatch, collate
from rltrain.learner.frozen import last_token_scores
from rltrain.run.scoring import sequence_prompts


def score_sequences(group, prompts: list, completions: list) -> list[float]:
    """A reward model's score of each sequence (its prompt's ids + the completion's ids as
    sampled), by the actors of ``group`` (a :class:`LearnerGroup` of :class:`RewardModelLearner`)."""
    prompt_ids = sequence_prompts(prompts, completions)
    # padding ids are never attended (padded forwards mask them, packed rows leave them out)
    batch = collate(prompt_ids, completions, torch.zeros(len(completions)), pad_id=0)
    return last_token_scores(group.per_token(batch), batch.attention_mask).tolist()


class RestartingGroup:
    """A frozen model's actors that recover on their own: a call they fail (one died or passed
    ``run.actor_timeout_s``) is said in one line, gives None, and the actors are stopped and
    started afresh; the run goes on. The policy's own actors restart the whole run instead."""

    def __init__(self, start: Callable[[], Any], role: str):
        self.start, self.role = start, role  # start: a new LearnerGroup of the frozen model's actors
        self.group = start()

    def _run(self, call: Callable[[Any], Any], lost: str) -> Any:
        from rltrain.remote import ActorFailure

        try:
            return call(self.group)
        except ActorFailure as failure:
            print(
                f"rltrain: {failure}; {lost}; restarting the {self.role}'s actors",
                file=sys.stderr,
                flush=True,
            )
            self.group.shutdown()
            self.group = self.start()
            return None

    def where(self) -> list[dict[str, Any]]:
        return self.group.where()

    def shutdown(self) -> None:
        self.group.shutdown()


class Teacher(RestartingGroup):
    """``algorithm.teacher``'s actors (:class:`TeacherLearner`); :meth:`per_token` gives None for a
    batch they failed to score (the step is then not trained, ``distill/teacher_failures``)."""

    def __init__(self, start: Callable[[], Any]):
        super().__init__(start, "teacher")

    def per_token(self, batch: TrainBatch) -> torch.Tensor | None:
        return self._run(lambda group: group.per_token(batch), "this step is not trained")


class RewardModel(RestartingGroup):
    """``reward.model``'s scores (a :data:`rltrain.run.scoring.ModelScorer`). A batch its actors fail to
    score scores None for every sequence (0, counted in ``reward/failures`` and
    ``reward/model_failures``)."""

    own_actors = True  # scored beside the training loop (rltrain.run.orchestrator)

    def __init__(self, start: Callable[[], Any]):
        super().__init__(start, "reward model")

    def __call__(self, prompts: list, completions: list) -> tuple[list[float | None], dict[str, float]]:
        lost = f"{len(completions)} sequences score 0 (reward/model_failures)"
        scores = self._run(lambda group: score_sequences(group, prompts, completions), lost)
        if scores is None:
            return [None] * len(completions), {"reward/model_failures": float(len(completions))}
        return scores, {"reward/model_failures": 0.0}
