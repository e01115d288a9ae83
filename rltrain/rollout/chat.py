"""The chat template's tokens for what an environment or a tool adds to an episode (no ray, no vllm).

Token-in/token-out: an episode's sequence is the opening prompt's rendering, then each assistant
turn's ids exactly as the engine sampled them, then what the template adds after the turn. Sampled
text is never encoded again (decoding and re-encoding need not give the same ids, and log-probs,
masks and token totals must be those of the ids the policy produced).

What the template adds after a turn is a difference of two renderings: the conversation through
the assistant turn, and the same conversation with the new messages and the generation prompt. The
first must be a prefix of the second. A template that re-renders earlier turns (Qwen3 drops
earlier reasoning once a new user message arrives) fails that check: the run stops with
:class:`TemplateError`, unless ``env.render`` is ``last_turn``, which renders the new messages after
a one-message stand-in for the history (the policy then trains on a context the template itself
would not build; verl and others do the same).
"""

from __future__ import annotations

from typing import Any, Literal

Messages = list[dict[str, Any]]
PLACEHOLDER_USER = {"role": "user", "content": "."}
PLACEHOLDER_ASSISTANT = {"role": "assistant", "content": "."}


class TemplateError(ValueError):
    """The chat template does not keep the rendered prefix of a conversation unchanged."""


class ChatRenderer:
    """Renders messages with a tokenizer's chat template and the tools' JSON schemas."""

    def __init__(
        self, tokenizer, tools: list[dict] | None = None, history: Literal["full", "last_turn"] = "full"
    ):
        self.tokenizer, self.tools, self.history = tokenizer, tools or None, history
        self.eos = tokenizer.eos_token_id
        self.name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__

    def render(self, messages: Messages, add_generation_prompt: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        if hasattr(ids, "keys"):  # some tokenizers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def opening(self, messages: Messages) -> list[int]:
        """The prompt: the opening messages and the generation prompt."""
        return self.render(messages, add_generation_prompt=True)

    def additions(self, history: Messages, new: Messages) -> list[int]:
        """The ids that follow an assistant turn ended by its end-of-turn token (``history[-1]``):
        the rest of that turn's rendering (Qwen's newline after ``<|im_end|>``), the ``new``
        messages, and the generation prompt of the next assistant turn."""
        if self.history == "last_turn":
            tail = self._tail([PLACEHOLDER_USER, PLACEHOLDER_ASSISTANT])
            return tail + self._difference([PLACEHOLDER_USER], new)
        return self._tail(history) + self._difference(history, new)

    def _tail(self, history: Messages) -> list[int]:
        """What the template writes after the last end-of-turn token of ``history``."""
        ids = self.render(history, add_generation_prompt=False)
        return ids[len(ids) - ids[::-1].index(self.eos) :] if self.eos in ids else []

    def _difference(self, base: Messages, new: Messages) -> list[int]:
        before = self.render(base, add_generation_prompt=False)
        after = self.render(base + new, add_generation_prompt=True)
        if after[: len(before)] != before:
            at = next(i for i, (a, b) in enumerate(zip(before, after + [None] * len(before))) if a != b)
            raise TemplateError(
                f"the chat template of {self.name} changes earlier turns when a "
                f"{'/'.join(m['role'] for m in new)} message is added (first difference at token {at} "
                f"of {len(before)}: {self.tokenizer.decode(before[at : at + 12])!r} becomes "
                f"{self.tokenizer.decode(after[at : at + 12])!r}); training would use a context the "
                "policy never saw. Use a template that keeps the prefix, or set env.render=last_turn"
            )
        return after[len(before) :]

    def conversation(self, messages: Messages) -> tuple[list[int], list[int], list[int]]:
        """A written conversation (a warm-up example) as ``(prompt ids, completion ids, mask)``: the
        template's own tokens, built turn by turn as an episode builds them; mask 1 on the
        assistant turns through their end-of-turn token, 0 on everything the template and the
        other roles add."""
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if first is None:
            raise ValueError("a conversation needs an assistant message")
        prompt = self.opening(messages[:first])
        ids, mask = list(prompt), [0] * len(prompt)
        j = first
        while j < len(messages):
            turn = self.render(messages[: j + 1], add_generation_prompt=False)
            if turn[: len(ids)] != ids:
                self._difference(messages[:j], [messages[j]])  # raises with the details
            sampled = turn[len(ids) : len(turn) - len(self._tail(messages[: j + 1]))]
            ids, mask = ids + sampled, mask + [1] * len(sampled)
            k = j + 1
            while k < len(messages) and messages[k]["role"] != "assistant":
                k += 1
            if k == j + 1:
                break  # the conversation ends with this assistant turn
            added = self.additions(messages[: j + 1], messages[j + 1 : k])
            if k == len(messages):  # trailing messages: no generation prompt after them
                added = added[: len(added) - len(self._generation_prompt())]
            ids, mask = ids + added, mask + [0] * len(added)
            j = k
        return prompt, ids[len(prompt) :], mask[len(prompt) :]

    def _generation_prompt(self) -> list[int]:
        with_prompt = self.render([PLACEHOLDER_USER], add_generation_prompt=True)
        return with_prompt[len(self.render([PLACEHOLDER_USER], add_generation_prompt=False)) :]
