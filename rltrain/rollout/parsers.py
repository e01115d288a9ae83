"""Tool calls in the model's own format (no ray, no vllm).

A parser reads one assistant turn's text and returns its calls and any malformed ones. Named by
``rollout.tool_parser``:

- ``hermes``: Qwen2.5 / Hermes JSON, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number per turn; the turn ends at the model's end-of-turn token, and the results come back
  as ``tool`` messages rendered by the chat template.
- ``tag``: ``<tool:NAME>ARGUMENT</tool>``; generation stops at ``</tool>``, the result is appended
  inline as ``<result>...</result>`` and the same turn goes on.

A malformed call is never a crash: it becomes an error message to the model and is counted by kind
(``bad_json``, ``bad_call``, ``unclosed``; running a call adds ``unknown_tool``, ``bad_arguments``,
``tool_raised``, ``timeout``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

NO_CALLS_LEFT = "error: no tool calls left"


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] | str  # keyword arguments (hermes) or one string (tag)


@dataclass
class ParsedTurn:
    """An assistant turn: its text without the calls, the well-formed calls, the malformed ones."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)  # (kind, message to the model)

    def message(self) -> dict[str, Any]:
        """The turn as a chat message (OpenAI shape), for the template and the environment."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            msg["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.calls
            ]
        return msg


class ToolParser(Protocol):
    stop: ClassVar[list[str]]  # stop strings that end a generation round (kept in the output)
    inline_results: ClassVar[bool]  # results appended raw inside the turn (True) or as tool messages

    def parse(self, text: str) -> ParsedTurn: ...

    def format_result(self, output: str) -> str:
        """An inline result's text (``inline_results`` parsers only)."""
        ...


class HermesParser:
    stop: ClassVar[list[str]] = []
    inline_results: ClassVar[bool] = False
    CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        turn = ParsedTurn(self.CALL.sub("", text).strip())
        for body in self.CALL.findall(text):
            try:
                call = json.loads(body)
            except json.JSONDecodeError as e:
                turn.errors.append(("bad_json", f"error: the tool call is not valid JSON ({e.msg})"))
                continue
            arguments = call.get("arguments", {}) if isinstance(call, dict) else None
            if isinstance(arguments, str):  # some models write the arguments as a JSON string
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    arguments = None
            if (
                not isinstance(call, dict)
                or not isinstance(call.get("name"), str)
                or not isinstance(arguments, dict)
            ):
                turn.errors.append(
                    (
                        "bad_call",
                        'error: a tool call is {"name": <tool name>, "arguments": {<argument>: <value>}}',
                    )
                )
                continue
            turn.calls.append(ToolCall(call["name"], arguments))
        unclosed = text.count("<tool_call>") - text.count("</tool_call>")
        if unclosed > 0:
            turn.errors.append(("unclosed", "error: <tool_call> without </tool_call>"))
            turn.content = turn.content.split("<tool_call>")[0].strip()
        return turn

    def format_result(self, output: str) -> str:
        raise NotImplementedError("hermes results are tool messages")


class TagParser:
    stop: ClassVar[list[str]] = ["</tool>"]
    inline_results: ClassVar[bool] = True
    CALL = re.compile(r"<tool:(\w+)>(.*?)</tool>\s*$", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        match = self.CALL.search(text)
        if match is not None:
            return ParsedTurn(text[: match.start()], [ToolCall(match.group(1), match.group(2))])
        if text.rstrip().endswith("</tool>"):  # stopped at the stop string without a call to run
            return ParsedTurn(text, errors=[("bad_call", "error: a tool call is <tool:NAME>ARGUMENT</tool>")])
        return ParsedTurn(text)

    def format_result(self, output: str) -> str:
        return f"<result>{output}</result>"


PARSERS: dict[str, type] = {"hermes": HermesParser, "tag": TagParser}


def get_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool parser {name!r} (parsers: {', '.join(PARSERS)})")
    return PARSERS[name]()
