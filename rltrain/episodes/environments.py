"""Environments: what the policy talks to during a rollout (pure Python; no ray, no vllm).

An environment opens an episode from a data row, lists the tools the model may call, and answers
each assistant turn that calls no tool::

    from rltrain.episodes.environments import Environment, Step

    class Countdown(Environment):
        tools = [calculator]                     # JSON schemas from type hints and docstrings

        def reset(self, row):                    # the opening messages of one episode
            self.target = int(row["answer"])
            return [{"role": "user", "content": row["prompt"]}]

        def step(self, messages):                # after an assistant turn without tool calls
            said = messages[-1]["content"]
            if said.strip() == str(self.target):
                return Step([], reward=1.0, done=True)
            return Step([{"role": "user", "content": "not yet, try again"}], reward=0.0)

rltrain runs the tool calls (each in the episode's own worker process, time-limited: a hung or
raising tool never stops the run) and appends their results as ``tool`` messages; the chat template
renders everything an environment adds. For a vision-language model, a message's content and a
tool's result may hold images: content parts ``{"type": "image", "image": ...}`` (a PIL image, bytes,
a path, base64) or ``{"type": "image_url", ...}`` (a data URL); a tool may also return a PIL image
(``builtin:shapes``). ``env.name: module:Class`` (or ``builtin:calculator``, ``builtin:guess``,
``builtin:chain``, ``builtin:shapes``) picks one, ``env.kwargs`` are its constructor's arguments, and
``reward.functions: {env: 1.0}`` uses the reward its steps give (the last one given; 0 if none).

An environment may also define ``demonstration(row) -> messages``: an expert's conversation for
the row, which ``sft_warmup.source: env`` trains on before RL.
"""

from __future__ import annotations

import inspect
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rltrain.episodes.tools import calculator
from rltrain.loading import import_attribute

Messages = list[dict[str, Any]]


GYM_HINT = " (return Step(messages, reward, done), not a gym-style (observation, reward, done, info) tuple)"


@dataclass
class Step:
    """An environment's answer to an assistant turn."""

    messages: Messages = field(default_factory=list)  # appended to the conversation (role user or tool)
    reward: float | None = None  # the episode's reward, when it has one
    done: bool = False


class Environment:
    """One episode's state. Subclass it; see the module docstring."""

    tools: list[Callable] = []  # noqa: RUF012  (a class-level default, replaced by subclasses)

    def reset(self, row: dict[str, Any]) -> Messages:
        """The opening messages for one data row (``{"prompt", "answer"}``)."""
        raise NotImplementedError

    def step(self, messages: Messages) -> Step:
        """The conversation so far, ending with an assistant turn without tool calls; the default
        ends the episode (a tools-only environment)."""
        return Step(done=True)


def tool_schemas(tools: list[Callable]) -> list[dict[str, Any]]:
    """The JSON schema of each tool, from its type hints and docstring (``Args:`` section)."""
    from transformers.utils import get_json_schema

    return [get_json_schema(fn) for fn in tools]


def load_environment(spec: str) -> type[Environment]:
    """``builtin:NAME`` or ``module:Class``; raises ValueError saying what is wrong."""
    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        if name not in BUILTIN:
            raise ValueError(
                f"unknown built-in {spec!r} (built-ins: {', '.join('builtin:' + n for n in BUILTIN)})"
            )
        return BUILTIN[name]
    cls = import_attribute(spec, "neither builtin:NAME nor module:Class")
    if not (inspect.isclass(cls) and callable(getattr(cls, "reset", None))):
        raise ValueError(f"{spec!r} is not an environment class (one with reset(row) and step(messages))")
    return cls


NUMBER = re.compile(r"-?\d+")


def last_number(text: str) -> int | None:
    numbers = NUMBER.findall(text)
    return int(numbers[-1]) if numbers else None


class CalculatorEnv(Environment):
    """``builtin:calculator``: the built-in arithmetic task with the calculator as a native tool.
    One answer ends the episode; the reward is 1 when its last number is the right one."""

    tools = [calculator]  # noqa: RUF012

    def reset(self, row: dict[str, Any]) -> Messages:
        self.answer = int(row["answer"])
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages: Messages) -> Step:
        return Step(reward=float(last_number(messages[-1]["content"] or "") == self.answer), done=True)

    def demonstration(self, row: dict[str, Any]) -> Messages:
        expression = " ".join(re.match(r"What is (\d+) ([+-]) (\d+)\?", row["prompt"]).groups())
        call = {
            "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": expression}},
        }
        return [
            *self.reset(row),
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": calculator(expression)},
            {"role": "assistant", "content": row["answer"]},
        ]


class GuessEnv(Environment):
    """``builtin:guess``: find a secret whole number from ``low`` to ``high``; after each wrong
    guess the environment answers ``higher`` or ``lower``. Reward 1 when the number is found within
    ``env.max_turns`` guesses. Rows come from ``data.source: builtin:guess``; a row's answer (a
    whole number) picks the secret. Really multi-turn: a policy must read the answers to do better than chance.

    ``guess_cost`` takes that much off the reward for each guess after the first (a find on the
    k-th guess scores ``1 - guess_cost * (k - 1)``), so that a search that uses the answers well
    scores more than one that finds the number late; 0 scores every find alike."""

    def __init__(self, low: int = 1, high: int = 15, guess_cost: float = 0.0):
        if low >= high:
            raise ValueError(f"low={low} must be below high={high}")
        if not 0.0 <= guess_cost < 1.0:
            raise ValueError(f"guess_cost={guess_cost} must be in [0, 1)")
        self.low, self.high, self.guess_cost = low, high, guess_cost

    def reset(self, row: dict[str, Any]) -> Messages:
        self.secret = self.low + int(row["answer"]) % (self.high - self.low + 1)
        return [{"role": "user", "content": f"Guess my number from {self.low} to {self.high}."}]

    def step(self, messages: Messages) -> Step:
        guess = last_number(messages[-1]["content"] or "")
        if guess == self.secret:
            guesses = sum(m["role"] == "assistant" for m in messages)
            return Step(reward=max(0.0, 1.0 - self.guess_cost * (guesses - 1)), done=True)
        hint = "higher" if guess is not None and guess < self.secret else "lower"
        if guess is None:
            hint = f"say a number from {self.low} to {self.high}"
        return Step([{"role": "user", "content": hint}], reward=0.0)

    def demonstration(self, row: dict[str, Any]) -> Messages:
        """Bisection: guess the middle of what is left, until found."""
        messages, low, high = self.reset(row), self.low, self.high
        while True:
            guess = (low + high) // 2
            messages.append({"role": "assistant", "content": str(guess)})
            step = self.step(messages)
            if step.done:
                return messages
            messages += step.messages
            low, high = (guess + 1, high) if guess < self.secret else (low, guess - 1)


class ChainEnv(Environment):
    """``builtin:chain``: a chain of arithmetic over several turns, the calculator a native tool.
    The episode opens with "What is a + b?"; each right answer is followed by the next link,
    "Now add c." or "Now subtract c.", which applies to the previous answer, so the policy must
    use both what it answered and what the environment said. A wrong answer ends the episode.
    Reward 1 when every one of the ``links`` answers is right, else 0. Rows come from
    ``data.source: builtin:chain``; a row's answer (a whole number) seeds the numbers.

    ``demonstration`` (the warm start's examples) answers each link with a calculator call with
    probability ``tool_fraction`` and from memory otherwise, as the single-turn demo's warm start
    does: RL then has to find that the calculator pays on every link."""

    tools = [calculator]  # noqa: RUF012

    def __init__(self, links: int = 2, high: int = 50, tool_fraction: float = 0.3):
        if links < 1:
            raise ValueError(f"links={links} must be at least 1")
        if high < 1:
            raise ValueError(f"high={high} must be at least 1")
        if not 0.0 <= tool_fraction <= 1.0:
            raise ValueError(f"tool_fraction={tool_fraction} must be in [0, 1]")
        self.links, self.high, self.tool_fraction = links, high, tool_fraction

    def reset(self, row: dict[str, Any]) -> Messages:
        rng = random.Random(int(row["answer"]))
        a, b = rng.randint(0, self.high), rng.randint(0, self.high)
        # each link: (operator, operand); the first joins a and b
        self.chain = [("+", b)] + [
            (rng.choice("+-"), rng.randint(0, self.high)) for _ in range(self.links - 1)
        ]
        self.done_links, self.value = 0, a
        self._tool_draws = rng  # the same draws give the demonstration's choices
        return [{"role": "user", "content": f"What is {a} + {b}?"}]

    def _expected(self) -> int:
        op, operand = self.chain[self.done_links]
        return self.value + operand if op == "+" else self.value - operand

    def step(self, messages: Messages) -> Step:
        expected = self._expected()
        if last_number(messages[-1]["content"] or "") != expected:
            return Step(reward=0.0, done=True)
        self.value, self.done_links = expected, self.done_links + 1
        if self.done_links == self.links:
            return Step(reward=1.0, done=True)
        op, operand = self.chain[self.done_links]
        verb = "add" if op == "+" else "subtract"
        return Step([{"role": "user", "content": f"Now {verb} {operand}."}], reward=0.0)

    def demonstration(self, row: dict[str, Any]) -> Messages:
        messages = self.reset(row)
        while True:
            op, operand = self.chain[self.done_links]
            answer = str(self._expected())
            if self._tool_draws.random() < self.tool_fraction:
                expression = f"{self.value} {op} {operand}"
                call = {
                    "type": "function",
                    "function": {"name": "calculator", "arguments": {"expression": expression}},
                }
                messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                             {"role": "tool", "name": "calculator", "content": calculator(expression)}]  # fmt: skip
            messages.append({"role": "assistant", "content": answer})
            step = self.step(messages)
            if step.done:
                return messages
            messages += step.messages


class ShapesEnv(Environment):
    """``builtin:shapes``: the colour of the square in a picture, for a vision-language model (rows
    from ``data.source: builtin:shapes``). The episode opens with the row's picture and question; a
    wrong answer is shown the picture again, ``zoom`` times larger, until ``looks`` pictures have
    been shown, and the ``look`` tool returns it enlarged too: images from an environment's messages
    and from a tool's result. Reward 1 when the answer's last word is the square's colour."""

    def __init__(self, looks: int = 2, zoom: int = 2):
        if looks < 1 or not 1 <= zoom <= 4:
            raise ValueError(f"looks={looks} must be at least 1 and zoom={zoom} from 1 to 4")
        self.looks, self.zoom = looks, zoom
        self.tools = [self.look]

    def reset(self, row: dict[str, Any]) -> Messages:
        self.picture, self.answer, self.shown = row["images"][0], row["answer"], 1
        return [{"role": "user", "content": [{"type": "image", "image": self.picture},
                                             {"type": "text", "text": row["prompt"]}]}]  # fmt: skip

    def look(self, zoom: int):
        """The picture again, enlarged.

        Args:
            zoom: how many times larger, 1 to 4
        """
        import io

        from PIL import Image

        factor = max(1, min(4, int(zoom)))
        with Image.open(io.BytesIO(self.picture)) as image:
            return image.resize((image.width * factor, image.height * factor), Image.NEAREST)

    def step(self, messages: Messages) -> Step:
        words = re.findall(r"[a-z]+", str(messages[-1]["content"] or "").lower())
        if words[-1:] == [self.answer] or self.shown >= self.looks:
            return Step(reward=float(words[-1:] == [self.answer]), done=True)
        self.shown += 1
        closer = [{"type": "image", "image": self.look(self.zoom)}, {"type": "text", "text": "Look closer."}]
        return Step([{"role": "user", "content": closer}], reward=0.0)

    def demonstration(self, row: dict[str, Any]) -> Messages:
        """The right colour at once (``sft_warmup.source: env``)."""
        return [*self.reset(row), {"role": "assistant", "content": row["answer"]}]


BUILTIN: dict[str, type[Environment]] = {"calculator": CalculatorEnv, "guess": GuessEnv, "chain": ChainEnv,
                                         "shapes": ShapesEnv}  # fmt: skip
