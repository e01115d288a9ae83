"""One episode's bookkeeping, shared by the three multi-turn paths: environment episodes
(:mod:`rltrain.episodes.turns`), inline tool turns (:func:`rltrain.episodes.tools.generate_with_tools`)
and black-box agents' episodes (:mod:`rltrain.episodes.gateway`). Each path keeps its own control
flow; the limits, the token room, the tool-call ids and the failures counted by kind live here, so
that a fix to any of them lands once."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rltrain.episodes.chat import call_id

if TYPE_CHECKING:
    from rltrain.batch import Completion


@dataclass(frozen=True)
class EpisodeLimits:
    max_new_tokens: int  # a sequence's tokens after its prompt, what templates and tools add included
    max_model_len: int  # prompt + completion
    max_prompt_tokens: int  # a sequence's opening prompt
    max_turns: int = sys.maxsize  # assistant turns of an environment's episode
    max_tool_calls: int = sys.maxsize  # tool calls rltrain runs in one episode
    max_calls: int = sys.maxsize  # chat completions of an agent's episode (the gateway's)
    step_timeout_s: float = 60.0  # an environment's reset and step
    tool_timeout_s: float = 10.0
    max_image_pixels: int = 16_777_216  # an image an environment or a tool returns (data.max_image_pixels)

    @classmethod
    def from_config(cls, config) -> EpisodeLimits:
        rc = config.rollout
        return cls(rc.max_new_tokens, rc.max_model_len, config.max_prompt_tokens, config.env.max_turns,
                   rc.tools.max_calls, config.agent.max_calls, config.env.step_timeout_s,
                   rc.tools.timeout_s, config.data.max_image_pixels)  # fmt: skip


class EpisodeState:
    """The sequence being built (``c``, None until an agent's first call opens one) and what every
    path counts on it."""

    def __init__(self, limits: EpisodeLimits, c: Completion | None = None):
        self.limits, self.c = limits, c
        self.ids_made = 0

    def next_call_id(self) -> str:
        """An id for a tool call the model wrote without one (templates answer calls by id)."""
        self.ids_made += 1
        return call_id(self.ids_made - 1)

    def count(self, kind: str, tool: bool = True) -> None:
        """A failure of this kind, on the sequence (``rollout/tool_errors/<kind>``); ``tool``: a
        tool call that failed (malformed, over the limit, raised, timed out), ``tool_errors`` too."""
        assert self.c is not None
        self.c.errors[kind] = self.c.errors.get(kind, 0) + 1
        self.c.tool_errors += tool

    def room(self) -> int:
        """Tokens the sequence may still take: the next round's, or the next addition's."""
        c = self.c
        assert c is not None
        used = len(c.token_ids)
        return min(self.limits.max_new_tokens - used, self.limits.max_model_len - len(c.prompt_ids) - used)

    def calls_left(self) -> int:
        """Tool calls the episode may still run."""
        assert self.c is not None
        return max(0, self.limits.max_tool_calls - self.c.tool_calls)

    def add(self, ids: list[int]) -> bool:
        """Tokens a template, a tool or the environment added (mask 0), cut at the room; whether
        any room is left after them."""
        assert self.c is not None
        self.c.insert(ids[: max(self.room(), 0)])
        return self.room() > 0
