"""Tool calls in the model's own format (no ray, no vllm).

A parser reads one assistant turn's text and returns its calls and any malformed ones. Named by
``rollout.tool_parser``:

- ``hermes``: Qwen2.5 / Hermes JSON, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number per turn; the turn ends at the model's end-of-turn token, and the results come back
  as ``tool`` messages rendered by the chat template.
- ``tag``: ``<tool:NAME>ARGUMENT</tool>``; generation stops at ``</tool>``, the result is appended
  inline as ``<result>...</result>`` and the same turn goes on.
- any other name: that parser of vLLM's registry (``vllm.tool_parsers``: ``llama3_json``,
  ``mistral``, ``qwen3_xml``, ``deepseek_v3``, ...), results as ``tool`` messages. It reads the
  turn's sampled ids decoded with their special tokens (Mistral's ``[TOOL_CALLS]`` is one), less
  the end-of-turn token; the ids themselves stay as sampled.

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
    id: str | None = None  # as the model wrote it (Mistral), else made by the episode


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
                | ({"id": c.id} if c.id else {})
                for c in self.calls
            ]
        return msg


class ToolParser(Protocol):
    stop: ClassVar[list[str]]  # stop strings that end a generation round (kept in the output)
    inline_results: ClassVar[bool]  # results appended raw inside the turn (True) or as tool messages
    reads_ids: ClassVar[bool]  # parse_ids(the turn's sampled ids) instead of parse(its text)

    def parse(self, text: str) -> ParsedTurn: ...

    def format_result(self, output: str) -> str:
        """An inline result's text (``inline_results`` parsers only)."""
        ...


class HermesParser:
    stop: ClassVar[list[str]] = []
    inline_results: ClassVar[bool] = False
    reads_ids: ClassVar[bool] = False
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
    reads_ids: ClassVar[bool] = False
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


class VllmParser:
    """One of vLLM's tool parsers, by its registered name, on whole turns."""

    stop: ClassVar[list[str]] = []
    inline_results: ClassVar[bool] = False
    reads_ids: ClassVar[bool] = True

    def __init__(self, name: str, tokenizer, tools: list[dict] | None = None):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        self.tokenizer = tokenizer
        self.parser = ToolParserManager.get_tool_parser(name)(tokenizer)  # some check the vocabulary
        self.request = ChatCompletionRequest(
            model="rltrain", messages=[{"role": "user", "content": ""}], tools=tools or None
        )
        self.turn_ends = set(tokenizer.all_special_ids)

    def parse_ids(self, ids: list[int]) -> ParsedTurn:
        """The turn's calls, read from its ids decoded with special tokens, less the end-of-turn
        token(s) that close it."""
        end = len(ids)
        while end and ids[end - 1] in self.turn_ends:
            end -= 1
        return self.parse(self.tokenizer.decode(ids[:end], skip_special_tokens=False))

    def parse(self, text: str) -> ParsedTurn:
        info = self.parser.extract_tool_calls(text, self.request)
        if not info.tools_called:
            return ParsedTurn(text.strip())
        turn = ParsedTurn((info.content or "").strip())
        for call in info.tool_calls:
            try:
                arguments = json.loads(call.function.arguments or "{}")
            except json.JSONDecodeError as e:
                turn.errors.append(
                    ("bad_json", f"error: the tool call's arguments are not valid JSON ({e.msg})")
                )
                continue
            if not isinstance(arguments, dict):
                turn.errors.append(("bad_call", "error: a tool call's arguments are an object"))
                continue
            turn.calls.append(ToolCall(call.function.name, arguments, call.id if call.id in text else None))
        # an id the model wrote (Mistral) is kept, so the tool message answers the call under its own
        # id (vLLM's parsers may make up another); one the parser made up is replaced by the episode's
        written = written_ids(text)
        if len(written) == len(turn.calls):
            for call, own in zip(turn.calls, written):
                call.id = own or call.id
        return turn

    def format_result(self, output: str) -> str:
        raise NotImplementedError("results are tool messages")


def written_ids(text: str) -> list[str | None]:
    """The ``id`` of each tool call object (a JSON object with a ``name``) in ``text``, in order,
    None where a call has none."""
    decoder, ids, at = json.JSONDecoder(), [], text.find("{")
    while at != -1:
        try:
            value, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            end = at + 1
        else:
            if isinstance(value, dict) and "name" in value:
                ids.append(value["id"] if isinstance(value.get("id"), str) and value["id"] else None)
        at = text.find("{", end)
    return ids


BUILT_IN: dict[str, type] = {"hermes": HermesParser, "tag": TagParser}


def registered_parsers() -> list[str]:
    """The parser names ``rollout.tool_parser`` takes: the built-in ones, then vLLM's."""
    try:
        from vllm.tool_parsers import ToolParserManager
    except ImportError:
        return list(BUILT_IN)
    return [*BUILT_IN, *(n for n in ToolParserManager.list_registered() if n not in BUILT_IN)]


def get_parser(name: str, tokenizer=None, tools: list[dict] | None = None) -> ToolParser:
    """The parser ``name``: built in, or vLLM's (which needs the policy's ``tokenizer``)."""
    if name in BUILT_IN:
        return BUILT_IN[name]()
    if tokenizer is None or name not in registered_parsers():
        raise ValueError(f"unknown tool parser {name!r} (built in: {', '.join(BUILT_IN)}; or one of vLLM's)")
    return VllmParser(name, tokenizer, tools)
