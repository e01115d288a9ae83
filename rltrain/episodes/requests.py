"""What a chat-completions request to the gateway (:mod:`rltrain.episodes.gateway`) may ask,
checked before anything of its episode is touched: its shape (:class:`ChatRequest`) and its sampling
settings (:class:`Sampling`, the run's own, never changed). A request that does not fit is
:class:`Refused` with an HTTP status and one line naming the field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from rltrain.config import DataConfig
from rltrain.media import ImageError, image_bytes

# request fields that would change the distribution sampled from (refused unless they equal the
# run's), and those that are ignored (they change nothing the policy is trained on)
SAMPLING = ("temperature", "top_p", "top_k", "min_p")
REFUSED = ("logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop",
           "response_format", "logprobs", "top_logprobs", "stream", "n", "best_of", "guided_json",
           "guided_regex", "guided_choice", "functions", "function_call")  # fmt: skip
# a refused field sent empty, false (0 too) or as its default asks for nothing: served as if left out
ASKS_NOTHING = (None, False, {}, [])
MAX_IMAGE_PIXELS = DataConfig.model_fields["max_image_pixels"].default  # the data's bound, one literal
DEFAULTS: dict[str, list[Any]] = {"n": [1], "best_of": [1], "response_format": ["text", {"type": "text"}]}


class Refused(Exception):
    """A request the gateway answers with an HTTP error (``status``) and counts (``kind``)."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind = status, kind


class _Open(BaseModel):
    """A part of a request: the fields named are checked, any others are passed over."""

    model_config = ConfigDict(extra="allow")


class _Function(_Open):
    name: str
    arguments: str | dict[str, Any] = "{}"


class _ToolCall(_Open):
    id: str | None = None
    type: str = "function"
    function: _Function


class _ImageURL(_Open):
    url: str


class _ContentPart(_Open):
    type: str
    text: str | None = None
    image_url: _ImageURL | None = None


ROLES = ("system", "developer", "user", "assistant", "tool")  # what the OpenAI API accepts


class _Message(_Open):
    role: Literal[ROLES]  # (an unknown one is refused with 400 naming these, as the OpenAI API does)
    content: str | list[_ContentPart] | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class _ToolFunction(_Open):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class _Tool(_Open):
    type: str = "function"
    function: _ToolFunction


class ChatRequest(_Open):
    """The shape of a chat-completions request, checked before anything of its episode is touched:
    a request that does not fit is refused with 400 and one line naming the field."""

    messages: list[_Message] = Field(min_length=1)
    tools: list[_Tool] | None = None
    # each image part's bytes, decoded once by the check: (message, part) -> the encoded image
    _images: dict[tuple[int, int], bytes] = PrivateAttr(default_factory=dict)
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)

    @classmethod
    def check(cls, body: Any, images: bool = False, max_pixels: int = MAX_IMAGE_PIXELS) -> ChatRequest:
        """``images``: whether the model takes images (a vision-language model's processor)."""
        try:
            request = cls.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "the body"
            raise Refused(400, "bad_request", f"{where}: {first['msg']}") from None
        for m, message in enumerate(request.messages):
            for p, part in enumerate(message.content if isinstance(message.content, list) else []):
                if (data := check_part(part, f"messages.{m}.content.{p}", images, max_pixels)) is not None:
                    request._images[m, p] = data
        return request

    def message_dicts(self) -> list[dict[str, Any]]:
        """The messages as dicts, each image part as ``{"type": "image", "image": bytes}`` (decoded
        by the check, not again)."""
        out = []
        for m, message in enumerate(self.messages):
            data = message.model_dump(exclude_none=True)
            for p in range(len(data["content"]) if isinstance(data.get("content"), list) else 0):
                if (m, p) in self._images:
                    data["content"][p] = {"type": "image", "image": self._images[m, p]}
            out.append(data)
        return out


def check_part(
    part: _ContentPart, where: str, images: bool = False, max_pixels: int = MAX_IMAGE_PIXELS
) -> bytes | None:
    """A content part the gateway can take: text, and an ``image_url`` part where the model takes
    images (else refused before it is decoded: a reply to the text alone would be trained on), read
    and checked (a data URL: nothing is fetched; at most ``max_pixels``): its image's bytes. Any
    other part (audio, files) is refused: never dropped in silence."""
    if part.type == "text":
        return None
    if part.type != "image_url" or part.image_url is None:
        raise Refused(
            400, "bad_request", f"{where}: content parts of type {part.type!r} are not served (text only)"
        )
    if not images:
        raise Refused(400, "bad_request", f"{where}: this model takes no images (it has no image processor), "
                      "and a reply to the text alone would be trained on")  # fmt: skip
    try:
        return image_bytes(part.image_url.url, f"{where}.image_url", max_pixels)
    except ImageError as e:
        raise Refused(400, "bad_request", str(e)) from None


@dataclass
class Sampling:
    """The run's sampling settings: what a request may repeat, never change."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def check(self, body: dict[str, Any]) -> None:
        for key in SAMPLING:
            value = body.get(key)
            if value is not None and value != getattr(self, key) and not (key == "top_k" and value == -1):
                raise Refused(400, "sampling", f"{key}={value!r}: this gateway samples with the run's "
                              f"{key}={getattr(self, key)!r} (rollout.{key}); leave it out")  # fmt: skip
        for key in REFUSED:
            value = body.get(key)
            if value not in ASKS_NOTHING and value not in DEFAULTS.get(key, []):
                raise Refused(400, "sampling", f"{key} is not served: training samples from the run's "
                              "own distribution, one choice per call, without streaming")  # fmt: skip
        choice = body.get("tool_choice")
        if choice not in (None, "auto"):
            raise Refused(400, "sampling", f"tool_choice={choice!r} is not served (only auto)")
