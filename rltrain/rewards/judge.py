"""An LLM judge (``reward.judge``): each completion is put to a model in a prompt, and the verdict
in its greedy reply is the completion's score. The judge runs on generator engines: the policy's
own (judging with its current weights) or engines of its own for another model. A reply without a
verdict scores 0 and is counted, so is a batch of replies that passes the time limit; neither
stops the run."""

from __future__ import annotations

import math
import re
from typing import Any

from rltrain.batch import Completion
from rltrain.config import JudgeConfig
from rltrain.data import Prompt, chat_ids


def parse_verdict(reply: str, pattern: str, values: dict[str, float]) -> float | None:
    """The score of the last verdict ``pattern`` (its first group) finds in ``reply``: its value in
    ``values`` (case-insensitive), or with no ``values`` the verdict read as a number; None when
    there is none, or it is not listed, or not a finite number."""
    verdicts = [m.group(1) for m in re.finditer(pattern, reply)]
    if not verdicts or verdicts[-1] is None:
        return None
    verdict = verdicts[-1].strip()
    if values:
        return {k.lower(): v for k, v in values.items()}.get(verdict.lower())
    try:
        number = float(verdict)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


class Judge:
    """Scores completions with a model's verdicts; a :data:`rltrain.run.scoring.ModelScorer`."""

    def __init__(self, config: JudgeConfig, tokenizer: Any, engines: Any, max_prompt_tokens: int,
                 own_actors: bool = False):  # fmt: skip
        self.config, self.tokenizer, self.engines = config, tokenizer, engines
        self.max_prompt_tokens = max_prompt_tokens  # the engines' context less the verdict's tokens
        # engines of its own (reward.judge.model): scored beside the training loop; on the policy's
        # engines the judge queues behind generation and weight updates, in the loop's order
        self.own_actors = own_actors

    def render(self, prompt: Prompt, completion: Completion) -> list[int]:
        """The judge's chat prompt for one completion, as token ids."""
        row = prompt.row or {}
        question = row.get("prompt") or self.tokenizer.decode(prompt.token_ids, skip_special_tokens=True)
        content = self.config.prompt.format(
            question=question, answer=prompt.answer, completion=completion.text
        )
        return chat_ids([{"role": "user", "content": content}], self.tokenizer)

    def __call__(
        self, prompts: list[Prompt], completions: list[Completion]
    ) -> tuple[list[float | None], dict[str, float]]:
        cfg = self.config
        rendered = [self.render(p, c) for p, c in zip(prompts, completions)]
        fits = [i for i, ids in enumerate(rendered) if len(ids) <= self.max_prompt_tokens]
        replies: list[str | None] = [None] * len(rendered)
        if fits:
            answered = self.engines.complete([rendered[i] for i in fits], cfg.max_new_tokens, cfg.timeout_s)
            for i, reply in zip(fits, answered):
                replies[i] = reply
        scores = [None if r is None else parse_verdict(r, cfg.pattern, cfg.values) for r in replies]
        timeouts = sum(r is None for r in replies) - (len(rendered) - len(fits))
        return scores, {
            "reward/judge_unparsed": float(sum(s is None for s, r in zip(scores, replies) if r is not None)),
            "reward/judge_timeouts": float(timeouts),
            "reward/judge_too_long": float(len(rendered) - len(fits)),
        }
