"""The chat template's tokens for what an environment or a tool adds to an episode (no ray, no vllm).

Token-in/token-out: an episode's sequence is the opening prompt's rendering, then each assistant
turn's ids exactly as the engine sampled them, then what the template adds after the turn. Sampled
text is never encoded again (decoding and re-encoding need not give the same ids, and log-probs,
masks and token totals must be those of the ids the policy produced).

What the template adds after a turn is a difference of two renderings: the conversation through
the assistant turn, and the same conversation with the new messages and the generation prompt. The
first must be a prefix of the second, and the turn itself must render after its context as the
policy saw it. A template that re-renders earlier turns (Qwen3 drops earlier reasoning once a new
user message arrives; Hermes-3 ends a tool message with a newline only when another message
follows it) fails that check with :class:`TemplateError`, unless ``env.render`` is ``last_turn``,
which renders the new messages after a stand-in for the history (a user message and the turn's
tool calls; the policy then trains on a context the template itself would not build; verl and
others do the same). A template error ends its episode, never the run; preflight probes a
realistic conversation first and names the mode to use.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

from rltrain.media import IMAGE_PART_TYPES

if TYPE_CHECKING:
    from rltrain.data import Conversation

Messages = list[dict[str, Any]]
Encoded = tuple[list[int], list[int], list[int]]  # a conversation's (prompt ids, completion ids, mask)
PLACEHOLDER_USER = {"role": "user", "content": "."}
MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")  # OpenAI's, as templates read them
TEMPLATE = "chat template"  # the failure's kind: an episode it ends is counted and shown, the run goes on


class TemplateError(ValueError):
    """The chat template does not keep the rendered prefix of a conversation unchanged, or raised."""


def call_id(n: int) -> str:
    """The ``n``-th tool call's id in an episode: 9 alphanumeric characters, the form Mistral's
    templates require (others ignore ids or take any string)."""
    return f"call{n:05d}"


def canonical(message: dict[str, Any]) -> dict[str, Any]:
    """A message as the template gets it and as prefixes are compared: OpenAI's fields only,
    ``content`` a string (or, with images, its parts: text, and ``{"type": "image", "image": bytes}``
    for an ``image_url`` part, its data URL decoded), tool-call arguments parsed from their JSON string."""
    out = {k: message[k] for k in MESSAGE_KEYS if message.get(k) is not None}
    content = out.get("content", "")
    if isinstance(content, list):  # content parts: the text ones, and the images where there are any
        parts = [p for p in content if isinstance(p, dict)]
        if any(p.get("type") in IMAGE_PART_TYPES for p in parts):
            content = [_part(p) for p in parts]
        else:
            content = "".join(p.get("text", "") for p in parts)
    out["content"] = content if isinstance(content, str | list) else str(content)
    if out.get("tool_calls"):
        calls = []
        for call in out["tool_calls"]:
            function = call.get("function") or {}
            arguments = function.get("arguments", {})
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except json.JSONDecodeError:
                    pass  # kept as written: it will not match a reply's, so the history splits
            entry = {"type": "function", "function": {"name": function.get("name"), "arguments": arguments}}
            calls.append(entry | ({"id": call["id"]} if call.get("id") else {}))
        out["tool_calls"] = calls
    else:
        out.pop("tool_calls", None)
    return out


def _part(part: dict[str, Any]) -> dict[str, Any]:
    """A content part as the template and the processor take it (an image's bytes, decoded)."""
    from rltrain.media import raw_bytes  # (the request's check decoded and bounded it already)

    if part.get("type") == "image_url":
        return {"type": "image", "image": raw_bytes(part["image_url"]["url"], "image_url")}
    if part.get("type") == "image":  # (checked already: rltrain.media.checked_message)
        return {"type": "image", "image": part["image"]}
    return {"type": "text", "text": part.get("text", "")}


def message_images(messages: Messages) -> tuple[bytes, ...]:
    """The images of ``messages`` (:func:`canonical`'s), in order."""
    return tuple(p["image"] for m in messages if isinstance(m.get("content"), list)
                 for p in m["content"] if p.get("type") == "image")  # fmt: skip


def with_call_ids(messages: Messages) -> Messages:
    """``messages`` with an id on every tool call that has none (numbered in order) and, on each tool
    message without one, the id of the call it answers (the k-th tool message after an assistant
    turn answers its k-th call; one past them gets a fresh id). Messages that have ids keep them."""
    out, pending, made = [], [], 0
    for message in messages:
        if message.get("role") == "assistant" and message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                if not call.get("id"):
                    call, made = {**call, "id": call_id(made)}, made + 1
                calls.append(call)
            message, pending = {**message, "tool_calls": calls}, [c["id"] for c in calls]
        elif message.get("role") == "tool" and not message.get("tool_call_id"):
            if pending:
                message = {**message, "tool_call_id": pending.pop(0)}
            else:
                message, made = {**message, "tool_call_id": call_id(made)}, made + 1
        elif message.get("role") != "tool":
            pending = []
        out.append(message)
    return out


class ChatRenderer:
    """Renders messages with a tokenizer's chat template and the tools' JSON schemas."""

    def __init__(self, tokenizer, tools: list[dict] | None = None, history: Literal["full", "last_turn"] = "full",
                 images=None):  # fmt: skip
        """``images``: a vision-language model's :class:`~rltrain.models.images.ImageInputs`, which
        renders messages with images (an :class:`~rltrain.batch.ImagePrompt`)."""
        self.tokenizer, self.tools, self.history, self.images = tokenizer, tools or None, history, images
        self.eos = tokenizer.eos_token_id
        self.name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__

    def render(self, messages: Messages, add_generation_prompt: bool) -> list[int]:
        """The template's ids; a template that raises (Mistral's role alternation, its tool-call
        ids) raises :class:`TemplateError` with the template's own message."""
        images = message_images(messages)
        if images and self.images is None:
            raise TemplateError(
                f"messages with images, and no image processor to render them with {self.name}"
            )
        try:
            if images:
                return self.images.render(messages, images, self.tools, add_generation_prompt)
            ids = self.tokenizer.apply_chat_template(
                messages, tools=self.tools, add_generation_prompt=add_generation_prompt, tokenize=True
            )
        except Exception as e:  # jinja's raise_exception, or a template that reads a missing field
            roles = "/".join(m.get("role", "?") for m in messages)
            raise TemplateError(
                f"the chat template of {self.name} raised {type(e).__name__} on {roles} messages: "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else 'no message'}"
            ) from None
        if hasattr(ids, "keys"):  # some tokenizers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def opening(self, messages: Messages) -> list[int]:
        """The prompt: the opening messages and the generation prompt."""
        return self.render(messages, add_generation_prompt=True)

    def additions(self, history: Messages, new: Messages) -> list[int]:
        """The ids that follow an assistant turn ended by its end-of-turn token (``history[-1]``):
        the rest of that turn's rendering (Qwen's newline after ``<|im_end|>``), the ``new``
        messages, and the generation prompt of the next assistant turn.

        ``full``: the template must render the turn after its context as the policy saw it (the
        context with its generation prompt, then the turn) and keep that prefix once ``new`` is
        added; a template that rewrites either raises :class:`TemplateError`, as
        :meth:`conversation` does. ``last_turn``: ``new`` follows a stand-in for the history, a
        user message and the turn with its tool calls but no text (roles still alternate, tool
        messages answer calls)."""
        if self.history == "last_turn":
            return self._after_stand_in(history[-1], new)
        self._turn(history[:-1], history[-1])  # the turn as the policy saw it, or TemplateError
        return self._tail(history) + self._difference(history, new)

    def _after_stand_in(self, turn: dict[str, Any], new: Messages) -> list[int]:
        """``last_turn``: what the template writes after a stand-in for the history (a user message
        and ``turn``'s tool calls with no text), once ``new`` follows: everything past the stand-in
        turn's end-of-turn token. Where the template moves a block on (Mistral writes the tools
        before the last user message), the additions carry it, as the template would."""
        base = [PLACEHOLDER_USER, self._stand_in(turn)]
        ends_before = self.render(base[:1], add_generation_prompt=False).count(self.eos)
        after = self.render(base + new, add_generation_prompt=True)
        ends = [i for i, t in enumerate(after) if t == self.eos]
        if len(ends) <= ends_before:
            raise TemplateError(
                f"the chat template of {self.name} does not end an assistant turn with the end-of-turn "
                f"token {self.tokenizer.decode([self.eos])!r} (the tokenizer's eos_token)"
            )
        return after[ends[ends_before] + 1 :]

    @staticmethod
    def _stand_in(turn: dict[str, Any]) -> dict[str, Any]:
        stand_in = {"role": "assistant", "content": ""}  # empty: a template that drops or rewrites
        # earlier turns (their reasoning, or their text) has nothing to change here
        if turn.get("tool_calls"):  # tool messages must answer calls (and Mistral checks their ids)
            stand_in["tool_calls"] = turn["tool_calls"]
        return stand_in

    def _tail(self, history: Messages) -> list[int]:
        """What the template writes after the last end-of-turn token of ``history``."""
        ids = self.render(history, add_generation_prompt=False)
        return ids[len(ids) - ids[::-1].index(self.eos) :] if self.eos in ids else []

    def _turn(self, context: Messages, turn: dict[str, Any]) -> list[int]:
        """The assistant ``turn``'s ids after ``context`` and its generation prompt, through its
        end-of-turn token: what the policy would have sampled. A generation prompt may end with
        tokens that the finished turn's rendering lacks (QwQ opens every turn with ``<think>``, and
        a turn written without reasoning does not have it): the turn's ids then start where the two
        renderings part, inside the generation prompt, as an episode whose policy sampled the turn
        after that prompt holds them."""
        before = self.render(context, add_generation_prompt=True)
        after = self.render([*context, turn], add_generation_prompt=False)
        start = len(before)
        if after[:start] != before:
            start = next(i for i, (a, b) in enumerate(zip(before, after + [None] * len(before))) if a != b)
            if start < len(self.render(context, add_generation_prompt=False)):  # an earlier turn changed
                raise self._rewritten(before, after, start, [turn])
        ids = after[start:]
        return ids[: len(ids) - len(self._tail([*context, turn]))]

    def _difference(self, base: Messages, new: Messages) -> list[int]:
        return self._extension(base, False, new, True)

    def _extension(self, base: Messages, base_prompt: bool, new: Messages, new_prompt: bool) -> list[int]:
        """``render(base + new)`` past ``render(base)``; a template whose rendering of ``base``
        changes once ``new`` follows it raises :class:`TemplateError`."""
        before = self.render(base, add_generation_prompt=base_prompt)
        after = self.render(base + new, add_generation_prompt=new_prompt)
        if after[: len(before)] != before:
            at = next(i for i, (a, b) in enumerate(zip(before, after + [None] * len(before))) if a != b)
            raise self._rewritten(before, after, at, new)
        return after[len(before) :]

    def _rewritten(self, before: list[int], after: list[int], at: int, new: Messages) -> TemplateError:
        return TemplateError(
            f"the chat template of {self.name} changes earlier turns when a "
            f"{'/'.join(m['role'] for m in new)} message is added (first difference at token {at} "
            f"of {len(before)}: {self.tokenizer.decode(before[at : at + 12])!r} becomes "
            f"{self.tokenizer.decode(after[at : at + 12])!r}); training would use a context the "
            "policy never saw. Use a template that keeps the prefix, or set env.render=last_turn"
        )

    def conversation(self, messages: Messages) -> tuple[list[int], list[int], list[int]]:
        """A written conversation (a warm-up example) as ``(prompt ids, completion ids, mask)``:
        exactly what an episode builds, under either ``env.render``, if the policy sampled each
        assistant turn as the template renders it after its context (the history, or under
        ``last_turn`` the stand-in user message).
        Mask 1 on the assistant turns through their end-of-turn token, 0 on everything the template
        and the other roles add. Tool calls without ids get them (:func:`with_call_ids`)."""
        messages = with_call_ids(messages)
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if first is None:
            raise ValueError("a conversation needs an assistant message")
        prompt = self.opening(messages[:first])
        ids, mask = list(prompt), [0] * len(prompt)
        j = first
        while j < len(messages):
            # under last_turn every turn, the first too, is read after the stand-in user message: a
            # template that moves the opening's system prompt or tools onto the last user message
            # (Mistral's) rewrites the opening once a turn follows, never the turn itself
            context = messages[:j] if self.history == "full" else [PLACEHOLDER_USER]
            sampled = self._turn(context, messages[j])
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
        if images := message_images(messages):  # the prompt holds its sequence's images, as an episode's
            from rltrain.batch import ImagePrompt

            prompt = ImagePrompt(prompt, images, self.images.image_token_id)
        return prompt, ids[len(prompt) :], mask[len(prompt) :]

    def _generation_prompt(self) -> list[int]:
        with_prompt = self.render([PLACEHOLDER_USER], add_generation_prompt=True)
        return with_prompt[len(self.render([PLACEHOLDER_USER], add_generation_prompt=False)) :]


REASONING = "<think>\nLet me work it out.\n</think>\n\n"


def probe_conversation(opening: Messages, tool: str | None) -> Messages:
    """What an episode goes through, after its ``opening`` messages: reasoning in every assistant
    turn, a call of ``tool`` and its result (a tool message that is not last), an answer, a second
    user turn and its answer."""
    messages = list(opening)
    if tool is not None:
        call = {"type": "function", "function": {"name": tool, "arguments": {}}}
        messages += [
            {"role": "assistant", "content": REASONING, "tool_calls": [call]},
            {"role": "tool", "name": tool, "content": "3"},
        ]
    return messages + [
        {"role": "assistant", "content": REASONING + "It is 3."},
        {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": REASONING + "Then 4."},
    ]


def render_problem(
    tokenizer, tools: list[dict] | None, opening: Messages, history: str, images=None
) -> str | None:
    """Why episodes that open with ``opening`` would fail under ``env.render=history`` with this
    template (it raises or rewrites their history), or None: :func:`probe_conversation` built as a
    warm-up example is, an episode is built the same way (``images``: as :class:`ChatRenderer`'s)."""
    tool = tools[0]["function"]["name"] if tools else None
    try:
        ChatRenderer(tokenizer, tools, history, images).conversation(probe_conversation(opening, tool))  # type: ignore[arg-type]
    except TemplateError as e:
        return str(e)
    return None


def render_conversations(
    written: list[Conversation],
    tokenizer,
    history: Literal["full", "last_turn"] = "full",
    images=None,
    max_pixels: int = 16_777_216,
) -> list[Encoded]:
    """Written conversations ``(messages, tool schemas)`` (an environment's demonstrations, or a
    file's in OpenAI's format) as :meth:`ChatRenderer.conversation` encodes them, each as an episode
    or the gateway would have built it had the policy sampled its assistant turns; their images
    (checked, at most ``max_pixels``) rendered by ``images`` (a vision-language model's
    :class:`~rltrain.models.images.ImageInputs`). A template that raises, a bad image or a
    conversation without an assistant turn raises ValueError naming the conversation."""
    from rltrain.media import checked_message

    renderers: dict[str, ChatRenderer] = {}  # one per set of tools
    encoded = []
    for n, (messages, tools) in enumerate(written):
        key = json.dumps(tools, sort_keys=True)
        renderer = renderers.setdefault(key, ChatRenderer(tokenizer, tools, history, images))
        try:
            checked = [checked_message(m, f"message {i}", max_pixels) for i, m in enumerate(messages)]
            encoded.append(renderer.conversation([canonical(m) for m in checked]))
        except ValueError as e:  # TemplateError and ImageError among them
            raise ValueError(f"conversation {n + 1}: {e}") from None
    return encoded
