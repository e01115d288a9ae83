"""Episodes: an environment and the policy, turn by turn, token-in/token-out (no ray, no vllm).

Each request opens an episode from its data row (``reset``), and every round generates the next
stretch of every live episode in one engine call. After an assistant turn:

- tool calls (parsed by the ``rollout.tool_parser``) are run in the episode's process, and their
  results (or the error of a malformed call) are appended as ``tool`` messages; generation goes on;
- a turn without calls goes to the environment's ``step``, which appends messages, gives a
  reward, or ends the episode.

The sequence is the ids the engine sampled, with their log-probs and mask 1, and between turns the
chat template's tokens for what was added (:class:`~rltrain.episodes.chat.ChatRenderer`), mask 0 and
log-prob 0. Nothing sampled is decoded and encoded again. An environment's messages and a tool's
result may hold images (content parts, :func:`rltrain.media.checked_message`) for a
vision-language model: the processor renders them, and the sequence's images (its prompt's
:class:`~rltrain.batch.ImagePrompt`) grow with each; a bad image, or one a text model is given,
ends its episode alone (``image``). ``rollout.max_new_tokens`` bounds the
whole episode after the prompt (added tokens included) and ``rollout.max_model_len`` the context;
an episode cut by either ends with finish reason ``length``; ``env.max_turns`` assistant turns end
it with ``turns``; an environment that raises, hangs or dies ends it with ``error``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rltrain.batch import Completion, ImagePrompt, Segment, images_of
from rltrain.episodes.chat import TEMPLATE, ChatRenderer, TemplateError, message_images
from rltrain.episodes.env_host import EnvHost
from rltrain.episodes.episode_state import EpisodeLimits, EpisodeState
from rltrain.episodes.parsers import NO_CALLS_LEFT, ParsedTurn, ToolCall, ToolParser
from rltrain.episodes.tools import SEED_STRIDE, GenerateFn
from rltrain.media import ImageError, checked_message, described

TOOL_SLACK_S = 1.0  # on top of rollout.tools.timeout_s: the python tool's sandbox stops it first


class Episodes:
    """A generator's environment side: its host process, template renderer, parser and limits."""

    def __init__(self, config, tokenizer, encode: Callable[[str], list[int]], model_path: str | None = None):
        """``model_path``: the policy's folder (a vision-language model's processor renders images)."""
        from rltrain.episodes.environments import tool_schemas
        from rltrain.episodes.parsers import get_parser
        from rltrain.episodes.tools import ToolRunner
        from rltrain.models.images import vision_inputs

        rc, env = config.rollout, config.env
        self.host = EnvHost(env.name, env.kwargs, ToolRunner.from_config(rc.tools, enabled=["python"]))
        schemas = tool_schemas(self.host.tools)
        self.renderer = ChatRenderer(tokenizer, schemas, env.render, vision_inputs(config, model_path))
        self.parser = get_parser(config.tool_parser, tokenizer, schemas)
        self.encode = encode  # inline (tag) tool results
        self.limits = EpisodeLimits.from_config(config)

    def run(self, generate: GenerateFn, rows: list[dict[str, Any]], seeds: list[int]) -> list[Completion]:
        return run_episodes(
            generate, self.host, self.renderer, self.parser, self.encode, rows, seeds, self.limits
        )


class _Episode(EpisodeState):
    def __init__(self, key: int, seed: int, limits: EpisodeLimits):
        super().__init__(limits, Completion())
        self.key, self.seed, self.rounds = key, seed, 0
        self.turn_text = ""  # the assistant turn being generated (inline tool results included)
        self.turn_ids: list[int] = []  # its sampled ids
        self.live = True

    def fail(self, kind: str, tool: bool = False, failure: tuple[str, str] | None = None) -> None:
        """A call that ends the episode (its environment's process is gone or broke); ``failure``:
        which of the user's code failed, and its traceback or what went wrong."""
        self.count(kind, tool)
        if failure is not None:
            self.c.failures.setdefault(*failure)
        self.end("error")

    def end(self, reason: str) -> None:
        self.c.finish_reason, self.live = reason, False

    def take(self, seg: Segment) -> None:
        self.c.take(seg)
        self.turn_text += seg.text
        self.turn_ids += seg.token_ids
        self.rounds += 1

    def add(self, ids: list[int]) -> None:
        """Tokens the template, a tool or the environment added; cut at the budget (then ended)."""
        if not super().add(ids):
            self.end("length")

    def close_turn(self, turn: ParsedTurn) -> None:
        self.c.messages.append(turn.message())
        self.c.text = turn.content
        self.c.turns += 1
        self.turn_text, self.turn_ids = "", []

    def read(self, parser: ToolParser) -> ParsedTurn:
        """The turn being generated, as the parser reads it (its text, or its sampled ids)."""
        return parser.parse_ids(self.turn_ids) if parser.reads_ids else parser.parse(self.turn_text)


def run_episodes(
    generate: GenerateFn,
    host: EnvHost,
    renderer: ChatRenderer,
    parser: ToolParser,
    encode: Callable[[str], list[int]],
    rows: list[dict[str, Any]],
    seeds: list[int],
    limits: EpisodeLimits,
) -> list[Completion]:
    """One finished episode per row (see the module docstring); ``generate(prompts, max_tokens,
    seeds)`` is the engine, stopping at the parser's stop strings and keeping them."""
    episodes = [_Episode(key, seed, limits) for key, seed in zip(host.open(len(rows)), seeds)]
    answers = host.call([(e.key, "reset", row, limits.step_timeout_s) for e, row in zip(episodes, rows)])
    for e, (status, value) in zip(episodes, answers):
        if status != "ok":
            e.fail(f"env_{status}", failure=("environment reset", value))
            continue
        e.c.messages = _checked(e, list(value), renderer, limits, "environment reset")
        if not e.live:
            continue
        try:
            e.c.prompt_ids = renderer.opening(e.c.messages)
        except TemplateError as error:
            e.fail("template", failure=(TEMPLATE, str(error)))
            continue
        if len(e.c.prompt_ids) > limits.max_prompt_tokens:
            e.fail("prompt_too_long")
    try:
        live = [e for e in episodes if e.live]
        while live:
            for e in live:
                if e.room() <= 0:
                    e.end("length")
            live = [e for e in live if e.live]
            if not live:
                break
            segments = generate(
                [e.c.prompt_ids + e.c.token_ids for e in live],
                [e.room() for e in live],
                [e.seed + e.rounds * SEED_STRIDE for e in live],
            )
            for e, seg in zip(live, segments):
                e.take(seg)
                if seg.finish_reason == "length" or e.room() <= 0:
                    e.close_turn(e.read(parser))
                    e.end("length")
            live = [e for e in live if e.live]
            _after_turns(live, host, renderer, parser, encode, limits)
            live = [e for e in live if e.live]
    finally:
        host.close([e.key for e in episodes])
    for e in episodes:  # (JSON-ready: each image named; the sequence keeps the images themselves)
        e.c.messages = described(e.c.messages)
    return [e.c for e in episodes]


def _after_turns(live, host, renderer, parser, encode, limits) -> None:
    """Tool calls, then ``step`` for the turns that called none; what they add is appended."""
    turns = {e.key: e.read(parser) for e in live}
    calling = {}
    for e in live:
        turn = turns[e.key]
        for call in turn.calls:  # the tool messages answer them by id (Mistral's templates check)
            call.id = call.id or e.next_call_id()
        # an inline (tag) turn that stopped at its call's stop string goes on, with the call's
        # result or its error: "no tool calls left", or what is malformed (it has no end-of-turn
        # token yet, so it cannot be handed on as a finished turn)
        if turn.calls and (e.calls_left() or parser.inline_results):
            calling[e.key] = turn
        elif turn.errors:
            calling[e.key] = turn  # malformed calls only: the model is told what was wrong
    outputs = _run_tools([e for e in live if e.key in calling], calling, host, limits)
    stepping = []
    for e in live:
        if e.key not in calling:  # the turn is over (with inline results, its whole text is the message)
            e.close_turn(ParsedTurn(e.turn_text) if parser.inline_results else turns[e.key])
            stepping.append(e)
            continue
        if not e.live:  # its tool hung or killed the process
            e.close_turn(turns[e.key])
            continue
        results = outputs[e.key]
        if parser.inline_results:  # tag: the result goes on inside the same turn
            if not isinstance(results[0]["content"], str):
                e.fail("image", True, (f"tool {results[0]['name']}", INLINE_IMAGE))
                e.close_turn(ParsedTurn(e.turn_text))
                continue
            text = parser.format_result(results[0]["content"])
            e.turn_text += text
            e.add(encode(text))
            if not e.live:
                e.close_turn(ParsedTurn(e.turn_text))
            continue
        e.close_turn(turns[e.key])
        _append(e, results, renderer, limits)
    if not stepping:
        return
    answers = host.call([(e.key, "step", e.c.messages, limits.step_timeout_s) for e in stepping])
    for e, (status, value) in zip(stepping, answers):
        if status != "ok":
            e.fail(f"env_{status}", failure=("environment step", value))
            continue
        if value["reward"] is not None:
            e.c.env_reward = float(value["reward"])
        if value["done"] or not value["messages"]:
            e.end("stop")
        elif e.c.turns >= limits.max_turns:
            e.end("turns")
        else:
            _append(e, value["messages"], renderer, limits)
    for e in live:  # a turn of tool calls counts as a turn too
        if e.live and e.c.turns >= limits.max_turns and not e.turn_text:
            e.end("turns")


def _run_tools(
    calling_episodes, turns: dict[int, ParsedTurn], host: EnvHost, limits
) -> dict[int, list[dict]]:
    """Each episode's calls in order (one call per episode per round trip, episodes side by side);
    malformed calls answer with their error. Returns the ``tool`` messages of each episode."""
    results: dict[int, list[dict]] = {e.key: [] for e in calling_episodes}
    queues: dict[int, list[ToolCall]] = {}
    for e in calling_episodes:
        turn = turns[e.key]
        for kind, message in turn.errors:
            e.count(kind)
            results[e.key].append(
                {"role": "tool", "name": "error", "content": message, "tool_call_id": e.next_call_id()}
            )
        allowed = e.calls_left()
        queues[e.key] = turn.calls[:allowed]
        for call in turn.calls[allowed:]:
            e.count("limit")
            results[e.key].append(_tool_message(call, NO_CALLS_LEFT))
    by_key = {e.key: e for e in calling_episodes}
    while any(queues.values()):
        batch = [(key, queue.pop(0)) for key, queue in queues.items() if queue]
        timeout = limits.tool_timeout_s + TOOL_SLACK_S
        answers = host.call([(key, "tool", call, timeout) for key, call in batch])
        for (key, call), (status, value) in zip(batch, answers):
            e = by_key[key]
            e.c.tool_calls += 1
            if status != "ok":  # the process is gone: the episode ends
                queues[key] = []
                e.fail(
                    "timeout" if status == "timeout" else f"env_{status}", True, (f"tool {call.name}", value)
                )
                continue
            output, kind, trace = value
            if kind is not None:
                e.count(kind)
            if trace is not None:
                e.c.failures.setdefault(f"tool {call.name}", trace)
            results[key].append(_tool_message(call, output))
    return results


def _tool_message(call: ToolCall, content: str) -> dict:
    return {"role": "tool", "name": call.name, "content": content, "tool_call_id": call.id}


def _append(e: _Episode, messages: list[dict], renderer: ChatRenderer, limits: EpisodeLimits) -> None:
    """What a tool or the environment added, in the template's tokens; a template that raises or
    rewrites the history ends this episode alone (counted as ``template``, its message shown once).
    Their images join the sequence's, each whole or, past the room, not at all."""
    messages = _checked(e, messages, renderer, limits, "environment step")
    if not e.live:
        return
    try:
        ids = renderer.additions(e.c.messages, messages)
    except TemplateError as error:
        e.c.messages += messages
        e.fail("template", failure=(TEMPLATE, str(error)))
        return
    e.c.messages += messages
    if new := message_images(messages):
        token = renderer.images.image_token_id
        if len(ids) <= e.room():
            e.c.prompt_ids = ImagePrompt(e.c.prompt_ids, (images_of(e.c.prompt_ids) or ()) + new, token)
        else:  # the episode ends at its length before the first new image
            e.add(ids[: ids.index(token)])
            e.end("length")
            return
    e.add(ids)


INLINE_IMAGE = ("returned content parts (an image), and rollout.tool_parser=tag writes a result inside the "
                "turn as text: use a parser whose results are tool messages (hermes, or the model's own)")  # fmt: skip


def _checked(e: _Episode, messages: list[dict], renderer: ChatRenderer, limits: EpisodeLimits, source: str):
    """``messages`` with their images checked (:func:`rltrain.media.checked_message`); an image that
    fails its check, or any image for a model without an image processor, ends this episode alone
    (counted as ``image``, the problem shown once; what it said is left out of the conversation)."""
    out = []
    for message in messages:
        tool = message.get("role") == "tool"  # (a tool's failure counts in tool_errors too)
        where = f"tool {message.get('name')}" if tool else source
        try:
            message = checked_message(message, where, limits.max_image_pixels)
        except ImageError as error:
            e.fail("image", tool, (where, str(error)))
            return []
        if renderer.images is None and message_images([message]):
            e.fail("image", tool, (where, f"{where} gave an image, and {renderer.name} takes none (it has no "
                                          "image processor): images need a vision-language model"))  # fmt: skip
            return []
        out.append(message)
    return out
