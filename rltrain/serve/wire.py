"""The Tinker SDK's wire format, in and out of rltrain's own shapes: a ``forward_backward`` request
(protobuf: the datums' token chunks and loss inputs as raw little-endian arrays) into
:class:`FwdBwd`, and its result and a sample's result into protobuf bytes the SDK decodes. The
messages are the SDK's own (``tinker.proto.tinker_public_pb2``): the server speaks exactly what the
client writes and reads."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# what a loss input's values may be, by the SDK's dtype codes (float32 and int64 on the public wire)
DTYPES = {1: np.float32, 2: np.int64, 3: np.int32}


class BadRequest(ValueError):
    """A request the caller got wrong (category ``user``), in one sentence."""

    status = 400


class TooLarge(BadRequest):
    """A request body past ``serve.max_request_mib``."""

    status = 413


class Body(dict):
    """A request's JSON object, read field by field: each accessor gives the field's value as the
    type it asks for (its default when the field is absent or null) and refuses any other value in
    one sentence, before anything of it is used."""

    def __init__(self, data: dict, where: str):
        super().__init__(data)
        self.where = where

    def _value(self, key: str, default: Any, kinds: tuple[type, ...], what: str) -> Any:
        value = self.get(key)
        if value is None:
            return default
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            raise BadRequest(f"{self.where}: {key} must be {what}, got {shown(value)}")
        return value

    def text(self, key: str, default: str | None = None) -> str | None:
        return self._value(key, default, (str,), "a string")

    def whole(
        self, key: str, default: int | None = None, low: int = -(1 << 63), high: int = 1 << 63
    ) -> int | None:
        value = self._value(key, default, (int,), "an integer")
        if value is not None and not low <= value <= high:
            raise BadRequest(f"{self.where}: {key} {value} is outside {low} to {high}")
        return value

    def number(self, key: str, default: float | None = None) -> float | None:
        value = self._value(key, default, (int, float), "a number")
        if value is not None and not math.isfinite(value):
            raise BadRequest(f"{self.where}: {key} must be finite, got {value}")
        return None if value is None else float(value)

    def flag(self, key: str, default: bool = False) -> bool:
        return self._value(key, default, (bool,), "true or false")

    def object(self, key: str) -> Body:
        """A nested object (empty when absent)."""
        return Body(self._value(key, {}, (dict,), "an object"), f"{self.where}: {key}")

    def array(self, key: str) -> list:
        return self._value(key, [], (list,), "a list")


def shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def json_body(raw: bytes, where: str) -> Body:
    """A request's body as a :class:`Body`; a body that is no JSON object raises :class:`BadRequest`."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # (not JSON, not UTF-8, or nested past the parser)
        raise BadRequest(f"{where}: the body is no JSON object") from None
    if not isinstance(data, dict):
        raise BadRequest(f"{where}: the body is no JSON object (got {type(data).__name__})")
    return Body(data, where)


@dataclass
class Datum:
    """One training example: its input tokens and each loss input as a flat array (the SDK aligns
    every input with the tokens: position ``i`` predicts target ``i``)."""

    tokens: list[int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class FwdBwd:
    """A ``forward_backward`` (or ``forward``) call's request."""

    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


def _tensor(message, where: str) -> np.ndarray:
    dtype = DTYPES.get(message.dtype)
    if dtype is None:
        raise BadRequest(f"{where}: dtype {message.dtype} is not float32 or int64")
    if message.WhichOneof("encoding") == "sparse_csr":
        csr, shape = message.sparse_csr, list(message.shape)
        if len(shape) != 1:
            raise BadRequest(f"{where}: a sparse input must be 1-D, got shape {shape}")
        out = np.zeros(shape[0], dtype=dtype)
        rows = np.frombuffer(csr.crow_indices, dtype=np.int64)
        columns = np.frombuffer(csr.col_indices, dtype=np.int64)
        if len(rows) != 2 or (len(columns) and (columns.min() < 0 or columns.max() >= shape[0])):
            raise BadRequest(f"{where}: a sparse input's indices do not fit its shape {shape}")
        out[columns] = np.frombuffer(csr.values, dtype=dtype)
        return out
    values = np.frombuffer(message.dense, dtype=dtype)
    if message.shape and int(np.prod(list(message.shape))) != values.size:
        raise BadRequest(f"{where}: {values.size} values for shape {list(message.shape)}")
    if len(message.shape) > 1:
        raise BadRequest(f"{where}: shape {list(message.shape)}; loss inputs are one value per token")
    return values


def forward_backward_request(body: bytes) -> FwdBwd:
    """A ``forward_backward`` request's protobuf body as a :class:`FwdBwd`; a body that does not
    parse or holds inputs other than token text raises :class:`BadRequest`."""
    from google.protobuf.message import DecodeError
    from tinker.proto import tinker_public_pb2 as pb

    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except DecodeError as e:
        raise BadRequest(f"the forward_backward body is no ForwardBackwardRequest message ({e})") from None
    config: dict[str, float | str] = {k: float(v) for k, v in message.loss_fn_config.items()}
    for key, value in message.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    data = []
    for d, datum in enumerate(message.data):
        tokens: list[int] = []
        for c, chunk in enumerate(datum.model_input):
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise BadRequest(f"data[{d}].model_input[{c}]: only token chunks are served (got {kind})")
            tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
        inputs = {
            name: _tensor(t, f"data[{d}].loss_fn_inputs[{name!r}]")
            for name, t in datum.loss_fn_inputs.items()
        }
        data.append(Datum(tokens, inputs))
    return FwdBwd(message.model_id, message.seq_id, message.loss_fn, config, message.forward_only, data)


def _batched(arrays: list[np.ndarray], dtype: int):
    """The SDK's ``BatchedTensor``: every datum's values back to back, with byte offsets."""
    from tinker.proto import tinker_public_pb2 as pb

    numpy = DTYPES[dtype]
    values = [np.ascontiguousarray(a, dtype=numpy) for a in arrays]
    offsets = np.cumsum([0] + [v.nbytes for v in values]).astype(np.int64)
    return pb.BatchedTensor(
        data=b"".join(v.tobytes() for v in values), offsets=offsets.tobytes(), dtype=dtype
    )


def forward_backward_output(outputs: dict[str, list[np.ndarray]], metrics: dict[str, float]) -> bytes:
    """The ``ForwardBackwardOutput`` protobuf: each datum's outputs (``logprobs``,
    ``elementwise_loss``: float32, one value per token) and the call's metrics (``loss:sum``)."""
    from tinker.proto import tinker_public_pb2 as pb

    count = len(next(iter(outputs.values()))) if outputs else 0
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=count)
    for name, arrays in outputs.items():
        record.fields[name].CopyFrom(_batched(arrays, 1))
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
    for key, value in metrics.items():
        message.metrics[key] = float(value)
    return message.SerializeToString()


def sample_response(sequences: list[tuple[list[int], list[float] | None, str]],
                    prompt_logprobs: list[float | None] | None = None) -> bytes:  # fmt: skip
    """The ``SampleResponse`` protobuf: each sequence's tokens, their log-probs and why it stopped
    (``stop`` or ``length``); the prompt's log-probs where asked (its first token's: NaN)."""
    from tinker.proto import tinker_public_pb2 as pb

    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    message = pb.SampleResponse()
    for tokens, logprobs, reason in sequences:
        sequence = message.sequences.add()
        sequence.stop_reason = reasons[reason]
        sequence.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        if logprobs is not None:
            sequence.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        values = [np.nan if v is None else v for v in prompt_logprobs]
        message.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    return message.SerializeToString()
