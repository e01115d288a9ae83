"""Black-box agents: an OpenAI-compatible gateway beside each generator, token-in/token-out.

``agent.entrypoint`` names the user's agent, ``async def run(row, base_url, api_key, model) ->
float``, unchanged apart from where it reads its endpoint. Each episode gets its own random key;
every chat completion the agent asks for with it is recorded against its episode.

Each call's prompt is built as an environment turn builds it (:class:`~rltrain.episodes.chat.ChatRenderer`):

- the first call renders its messages (the opening prompt);
- a call whose messages extend the previous call's messages and the reply it got (as returned)
  keeps the sequence: the reply's ids stay as sampled, and what the new messages add is the chat
  template's difference (mask 0); nothing sampled is decoded and encoded again;
- a call that does not (the agent dropped, edited or summarised its history, or changed its tools)
  closes the sequence and opens another from its own rendering: the episode *splits* into several
  training sequences, each token-in/token-out, all with the episode's reward (counted in
  ``rollout/gateway_splits``).

Masks are 1 exactly on sampled ids. The run's sampling settings apply to every call; a request that
asks for others (temperature, top_p, logit_bias, ...) is refused with HTTP 400 and counted, never
mixed into training. An unknown or finished key gets 401 and is counted.

This module holds the episodes and the protocol (no ray, no vllm), what a request may ask is
:mod:`rltrain.episodes.requests`; :mod:`rltrain.episodes.agents` runs the agents, the HTTP server
and the engine calls.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from rltrain.batch import Completion, Segment
from rltrain.episodes.chat import TEMPLATE, ChatRenderer, Messages, TemplateError, canonical, message_images
from rltrain.episodes.episode_state import EpisodeLimits, EpisodeState
from rltrain.episodes.parsers import ParsedTurn, ToolParser
from rltrain.episodes.requests import MAX_IMAGE_PIXELS, ChatRequest, Refused, Sampling
from rltrain.episodes.tools import SEED_STRIDE
from rltrain.media import described

GATEWAY = "gateway_"  # the prefix of an episode's gateway counts (splits, refusals) among its errors


class OutOfRoom(Exception):
    """A call that no longer fits its episode's limits: answered with an empty reply and finish
    reason ``length`` (as the OpenAI API ends a reply cut by its limit), counted, never sampled."""

    def __init__(self, episode: AgentEpisode):
        super().__init__("no room left in the episode")
        self.episode = episode


@dataclass
class CallRecord:
    """One chat completion, as rollouts on disk show it."""

    messages: int  # messages the agent sent
    prompt_tokens: int  # the sequence before the reply (what the engine was given)
    completion_tokens: int
    sequence: int  # which of the episode's training sequences it extended (0, 1, ... after splits)
    finish_reason: str
    reply: dict[str, Any] = field(default_factory=dict)


class AgentEpisode(EpisodeState):
    """One agent's episode: its key, its training sequences (the last one open, ``c``), what its
    calls were, and its history as the gateway last rendered it (the last message its own reply).
    ``counts`` are the episode's requests by kind (splits, refusals), apart from its sequences'."""

    def __init__(self, row: dict[str, Any], seed: int, limits: EpisodeLimits):
        super().__init__(limits)
        self.id = secrets.token_hex(8)  # in the episode's base URL
        self.key = "rlt-" + secrets.token_urlsafe(24)  # its API key: valid on its own URL alone
        self.row, self.seed = row, seed
        self.closed: list[Completion] = []  # sequences split off
        self.history: Messages = []
        self.tools: list[dict] | None = None
        self.renderer: ChatRenderer | None = None
        self.parser: ToolParser | None = None  # the open sequence's (its tools'), built once
        self.extendable = False  # the open sequence's last turn ended with its end-of-turn token
        self.calls: list[CallRecord] = []
        self.counts: dict[str, int] = {}
        self.failures: dict[str, str] = {}
        self.busy = False
        self.open = True  # until the episode is handed on: then no reply may touch its sequences
        self.tool_calls = 0

    def count_request(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def sequences(self) -> list[Completion]:
        return [*self.closed, *([self.c] if self.c is not None else [])]


class Gateway:
    """The episodes of one generator and the chat-completions protocol over them. ``renderer(tools)``
    makes the chat template renderer for a call's tools; ``parser(tools)`` the tool parser. The
    HTTP layer (:mod:`rltrain.episodes.agents`) calls :meth:`begin`, has the engine generate the
    prompt it returns, and calls :meth:`finish` with the segment."""

    def __init__(
        self,
        renderer: Callable[[list[dict] | None], ChatRenderer],
        parser: Callable[[list[dict] | None], ToolParser],
        limits: EpisodeLimits,
        sampling: Sampling,
        model: str,
        images: bool = False,  # whether the renderers take images (the model's processor)
        max_image_pixels: int = MAX_IMAGE_PIXELS,
    ):
        self.images, self.max_image_pixels = images, max_image_pixels
        self.make_renderer, self.make_parser = renderer, parser
        self.limits, self.sampling, self.model = limits, sampling, model
        self.episodes: dict[str, AgentEpisode] = {}
        self.unauthorized = 0
        self.lock = threading.Lock()

    def open(self, row: dict[str, Any], seed: int) -> AgentEpisode:
        episode = AgentEpisode(row, seed, self.limits)
        with self.lock:
            self.episodes[episode.id] = episode
        return episode

    def close(self, episode: AgentEpisode) -> None:
        """The episode is over (its agent returned, failed or timed out): a reply still on its way
        is refused (:meth:`finish`) and counted as ``late``, so its sequences are handed on as
        they are and nothing touches them afterwards."""
        with self.lock:
            episode.open = False
            if episode.busy:  # a call in flight: its reply will come too late
                episode.count_request("late")
            self.episodes.pop(episode.id, None)

    def episode(self, episode_id: str, key: str | None) -> AgentEpisode:
        """The live episode whose URL and key these are; anything else is refused with 401 and
        counted (an unknown or finished episode, no key, another episode's key)."""
        with self.lock:
            episode = self.episodes.get(episode_id)
            if episode is None or not key or not secrets.compare_digest(key, episode.key):
                self.unauthorized += 1
                raise Refused(401, "unauthorized", "unknown or finished episode, or not its key")
            return episode

    def begin(self, episode_id: str, key: str | None, body: Any) -> tuple[AgentEpisode, list[int], int, int]:
        """Check a request and build its prompt: ``(episode, prompt ids, max tokens, seed)``; the
        episode stays busy until :meth:`finish` or :meth:`abandon`. A request of the wrong shape
        is refused before anything of the episode changes; whatever else goes wrong releases it."""
        e = self.episode(episode_id, key)
        try:
            request = ChatRequest.check(body, self.images, self.max_image_pixels)
            self.sampling.check(body)
        except Refused as refused:
            with self.lock:
                self._count(e, refused.kind)
            raise
        with self.lock:
            if not e.open:  # closed since episode() found it: as an unknown or finished episode
                self.unauthorized += 1
                raise Refused(401, "unauthorized", "unknown or finished episode, or not its key")
            if e.busy:
                e.count_request("concurrent")
                raise Refused(409, "concurrent", "this episode has a call in flight; one call at a time")
            if len(e.calls) >= self.limits.max_calls:
                e.count_request("max_calls")
                raise Refused(
                    429,
                    "max_calls",
                    f"the episode's {self.limits.max_calls} calls are used (agent.max_calls)",
                )
            e.busy = True
        try:
            messages = [canonical(m) for m in request.message_dicts()]
            tools = [t.model_dump(exclude_none=True) for t in request.tools or []] or None
            change = self._prompt(e, messages, tools)  # rendered off the lock: it may take a while
            with self.lock:  # the episode's sequences change only while it is open (close holds the lock)
                if not e.open:
                    raise Refused(410, "late", "the episode closed while its call was rendered")
                prompt, room = change(), e.room()
            asked = request.max_completion_tokens or request.max_tokens
            if asked is not None:
                room = min(room, asked)
            if room <= 0:
                raise OutOfRoom(e)
            return e, prompt, room, e.seed + len(e.calls) * SEED_STRIDE
        except BaseException as error:
            with self.lock:  # whatever went wrong releases the episode; a refusal is counted by its kind
                e.busy = False
                if isinstance(error, TemplateError):
                    e.failures.setdefault(TEMPLATE, str(error))
                    self._count(e, "template")
                elif isinstance(error, OutOfRoom):
                    self._count(e, "length")
                elif isinstance(error, Refused) and error.kind != "late":  # (late: counted at close)
                    self._count(e, error.kind)
            if isinstance(error, TemplateError):
                raise Refused(400, "template", str(error)) from None
            raise

    def _count(self, e: AgentEpisode, kind: str) -> None:
        """A refused request of ``e``, counted (under the lock) while the episode is open: once it
        closed its counts were handed on, and its busy call was counted as late there."""
        if e.open:
            e.count_request(kind)

    def _prompt(
        self, e: AgentEpisode, messages: Messages, tools: list[dict] | None
    ) -> Callable[[], list[int]]:
        """The engine's prompt, rendered: the open sequence extended by the new messages
        (token-in/token-out), or a new sequence (a split) where the history is not the one the
        sequence holds. Returns the change to the episode, which returns the prompt's ids: the
        caller makes it once it knows the episode is still open."""
        n = len(e.history)
        if (
            e.c is not None
            and e.extendable
            and tools == e.tools
            and len(messages) > n
            and messages[:n] == e.history
            and messages[n]["role"] != "assistant"
            and not message_images(messages[n:])  # (new images: a sequence renders its images first)
        ):
            assert e.renderer is not None
            try:
                added = e.renderer.additions(e.history, messages[n:])
            except TemplateError:  # the template rewrites earlier turns (env.render=last_turn keeps them)
                added = None
                with self.lock:  # (rendered off the lock; counted while open)
                    self._count(e, "template_rewrites")
            if added is not None:
                if len(added) > e.room():
                    raise OutOfRoom(e)

                def extend() -> list[int]:
                    e.c.insert(added)
                    e.history = list(messages)
                    return e.c.prompt_ids + e.c.token_ids

                return extend
        renderer = self.make_renderer(tools)
        prompt = renderer.opening(messages)
        if len(prompt) > self.limits.max_prompt_tokens:
            with self.lock:  # (rendered off the lock; counted while open)
                self._count(e, "prompt_too_long")
            raise OutOfRoom(e)

        def split() -> list[int]:
            if e.c is not None:
                e.c.finish_reason = "stop" if e.extendable else "length"  # its last reply: ended, or cut
                e.closed.append(e.c)
                e.count_request("splits")
            e.c, e.renderer, e.tools, e.history = (
                Completion(prompt_ids=prompt),
                renderer,
                tools,
                list(messages),
            )
            e.parser = None
            return prompt

        return split

    def finish(self, e: AgentEpisode, seg: Segment, messages: int, prompt_tokens: int) -> dict[str, Any]:
        """Take the sampled turn into the open sequence; the OpenAI response. The episode is free
        for its next call however this ends. A reply whose episode closed while it was sampled (the
        agent timed out, or returned with the call queued) is refused with 410 and counted; its
        episode's sequences, already handed on, are left as they were."""
        c = e.c
        assert c is not None
        try:
            with self.lock:
                if not e.open:  # (counted when it closed)
                    raise Refused(410, "late", "the episode closed before its reply was sampled")
                c.take(seg)
                turn = self._parse(e, seg)
                for call in turn.calls:
                    call.id = call.id or e.next_call_id()
                for kind, _ in turn.errors:
                    e.count(kind)
                e.tool_calls += len(turn.calls)
                e.history.append(turn.message())
                c.messages = described(e.history)  # the sequence's conversation (rollouts on disk)
                c.text, c.turns = turn.content, c.turns + 1
                ended = seg.finish_reason == "stop"
                e.extendable = ended  # a turn cut by its length has no end-of-turn token to go on from
                reason = "length" if not ended else "tool_calls" if turn.calls else "stop"
                reply = reply_message(turn)
                e.calls.append(
                    CallRecord(messages, prompt_tokens, len(seg.token_ids), len(e.closed), reason, reply)
                )
        finally:
            e.busy = False
        return self._response(e, reply, reason, prompt_tokens, len(seg.token_ids))

    def out_of_room(self, e: AgentEpisode, messages: int) -> dict[str, Any]:
        """The answer to a call that no longer fits (:class:`OutOfRoom`): an empty reply whose
        finish reason is ``length``; nothing is sampled, and the call counts among the episode's."""
        reply = {"role": "assistant", "content": ""}
        with self.lock:
            if not e.open:
                raise Refused(410, "late", "the episode closed before its reply was given")
            e.calls.append(CallRecord(messages, 0, 0, len(e.closed), "length", reply))
        return self._response(e, reply, "length", 0, 0)

    def _response(
        self, e: AgentEpisode, reply: dict[str, Any], reason: str, prompt_tokens: int, completion_tokens: int
    ) -> dict[str, Any]:
        """A chat completion in the OpenAI response format."""
        return {
            "id": f"chatcmpl-{e.id}-{len(e.calls)}",  # (the episode's id is in its URL; its key never leaves)
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [{"index": 0, "message": reply, "finish_reason": reason, "logprobs": None}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    def _parse(self, e: AgentEpisode, seg: Segment) -> ParsedTurn:
        """The sampled turn through the sequence's tool parser; a parser that raises leaves the
        turn as plain text (counted: the sampled ids stay as they are, the policy's own output)."""
        parser = e.parser = e.parser or self.make_parser(e.tools)
        try:
            return parser.parse_ids(seg.token_ids) if parser.reads_ids else parser.parse(seg.text)
        except Exception as error:  # noqa: BLE001  (a parser's bug must not wedge the episode)
            return ParsedTurn(seg.text, errors=[("parser_error", f"{type(error).__name__}: {error}")])

    def abandon(self, e: AgentEpisode) -> None:
        """A call that never got its reply (the engine failed, the agent went away)."""
        with self.lock:
            e.busy = False


def reply_message(turn: ParsedTurn) -> dict[str, Any]:
    """The assistant message of a parsed turn in the OpenAI response format (arguments as JSON text)."""
    # (null content only beside tool calls, as OpenAI's API writes it)
    message: dict[str, Any] = {"role": "assistant", "content": turn.content or (None if turn.calls else "")}
    if turn.calls:
        message["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
            for call in turn.calls
        ]  # fmt: skip
    return message


def episode_completions(
    e: AgentEpisode,
    reward: float | None,
    error: tuple[str, str] | None,
    own_reward: bool = True,
    cut: bool = False,
) -> Completion:
    """The episode as the trainer takes it: its last sequence, the sequences split off before it in
    ``earlier``, its reward (the agent's own, or with ``own_reward`` false an environment's), its
    calls (rollouts on disk), and how it ended (``length`` where its last reply was cut, or where
    ``cut``: its environment ended it at a limit, as verifiers' ``max_turns``)."""
    sequences = e.sequences() or [Completion()]
    last = sequences[-1]
    last.earlier = sequences[:-1]
    last.by_agent = True
    if own_reward:
        last.agent_reward = reward
    else:
        last.env_reward = reward
    last.calls = [asdict(call) for call in e.calls]
    last.tool_calls = e.tool_calls
    for kind, n in e.counts.items():  # logged as rollout/gateway_<kind>
        last.errors[f"{GATEWAY}{kind}"] = n
    last.failures.update(e.failures)
    if error is not None:
        last.finish_reason = "error"
        last.failures.setdefault(*error)
    elif cut or (last.token_ids and e.calls and e.calls[-1].finish_reason == "length"):
        last.finish_reason = "length"
    else:
        last.finish_reason = "stop"
    return last
