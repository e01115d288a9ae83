"""A causal LM's forward in each layout the learners run (pure torch): padded rows, one packed row
of several documents, and up to what log-probs need, its last hidden states and its output head
(:func:`head_forward`) where the model's logits are that head applied to them.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rltrain.loss import recurrent


def head_forward(
    model: torch.nn.Module, forward: Callable[..., Any], from_hidden: bool = True
) -> tuple[torch.Tensor, torch.nn.Module | None]:
    """``forward(**extra)`` (the model's padded or packed forward, :func:`padded_forward`,
    :func:`packed_forward`) up to what the log-probs need: ``(last hidden states [B, T, H], the
    output head)`` where the model's logits are its output head applied to its decoder's last hidden
    state (with the family's logit transform, :func:`logit_transform`, folded into the head), or
    ``(logits [B, T, V], None)`` where they are not (a transform rltrain does not know, a model
    without ``logits_to_keep``: :func:`output_head` says which) or ``from_hidden`` is false.

    ``model`` may be a DeepSpeed engine or a peft model around the causal LM: the call goes through
    it as any forward does (its hooks run), asking the LM to keep no logits, while a hook on the
    decoder takes its output."""
    parts = output_head(model) if from_hidden else None
    if parts is None:
        return forward().logits, None
    decoder, head = parts
    taken: list[torch.Tensor] = []
    hook = decoder.register_forward_hook(lambda _module, _args, out: taken.append(out[0]))
    try:
        forward(logits_to_keep=torch.zeros(0, dtype=torch.long, device=head.weight.device))
    finally:
        hook.remove()
    return taken[-1], head


@dataclass(frozen=True)
class LogitTransform:
    """What a family does to its output head's logits: ``z * multiplier`` (Falcon-H1's
    ``lm_head_multiplier``, Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``), then
    ``softcap * tanh(z / softcap)`` (Gemma's ``final_logit_softcapping``)."""

    multiplier: float = 1.0
    softcap: float | None = None


def logit_transform(config) -> LogitTransform:
    """The transform ``config`` (or its ``text_config``: Gemma 4's, a vision-language model's) names."""
    text = getattr(config, "text_config", None)

    def read(name: str):
        value = getattr(config, name, None)
        return getattr(text, name, None) if value is None and text is not None else value

    multiplier = 1.0
    for name in ("lm_head_multiplier", "logit_scale"):
        multiplier *= float(read(name) or 1.0)
    multiplier /= float(read("logits_scaling") or 1.0)
    softcap = read("final_logit_softcapping") or read("logits_soft_cap")  # (Gemma's; RecurrentGemma's)
    return LogitTransform(multiplier, float(softcap) if softcap else None)


class TransformedHead(torch.nn.Module):
    """A model's output head followed by its family's :class:`LogitTransform`: the head module
    itself runs (its hooks, a ZeRO-3 gather, LoRA), so its parameters get their gradients."""

    def __init__(self, head: torch.nn.Module, transform: LogitTransform):
        super().__init__()
        self.head, self.transform = head, transform

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        z = self.head(hidden)
        if self.transform.multiplier != 1.0:
            z = z * self.transform.multiplier
        if self.transform.softcap is not None:
            z = torch.tanh(z / self.transform.softcap) * self.transform.softcap
        return z


# each language model's (decoder, head) once it has been probed, or None where its logits are not
# its transformed head's output on its last hidden states
_HEADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
PROBE_TOKENS = 8
PROBE_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-9}  # relative; 1e-2 in half precisions


def output_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """``(decoder, head)`` where the model's logits are ``head(decoder's last hidden state)``, the
    head carrying the family's logit transform; None where the model has no such parts or they do
    not give its logits. Checked once per model on a probe of :data:`PROBE_TOKENS` tokens: its own
    logits against the head applied to its hidden states (a transform rltrain does not know keeps
    the full-logits path). Under ZeRO-3 the probe is a forward every rank runs: each does, at its
    first call, which every rank makes at the same point."""
    lm = causal_lm(model)
    if lm in _HEADS:
        return _HEADS[lm]
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    parts = None
    if (
        head is not None
        and hasattr(head, "weight")
        and decoder not in (None, lm)
        and _keeps_logits_on_request(type(lm))
    ):
        transform = logit_transform(model_config(lm))
        parts = decoder, head if transform == LogitTransform() else TransformedHead(head, transform)
        if not _probe(model, *parts):
            parts = None
    _HEADS[lm] = parts
    return parts


_probing = [False]


def probing() -> bool:
    """Whether the forward running now is :func:`output_head`'s probe (hooks that record a
    forward's internals, a mixture's router taps, pass it over)."""
    return _probing[0]


@torch.no_grad()
def _probe(model: torch.nn.Module, decoder: torch.nn.Module, head: torch.nn.Module) -> bool:
    vocab = int(getattr(head.weight, "ds_shape", head.weight.shape)[0])
    device = head.weight.device
    ids = torch.arange(PROBE_TOKENS, device=device)[None] % vocab
    taken: list[torch.Tensor] = []
    hook = decoder.register_forward_hook(lambda _module, _args, out: taken.append(out[0]))
    _probing[0] = True
    try:
        logits = packed_forward(model, ids, torch.arange(PROBE_TOKENS, device=device)[None]).logits
    finally:
        _probing[0] = False
        hook.remove()
    mine = head(taken[-1]).float()
    # the same products in the same precision: a transform the head misses shows above rounding (a
    # soft-cap of 30 on logits of ~1 changes them by ~1e-4)
    tolerance = PROBE_TOLERANCE.get(logits.dtype, 1e-2)
    return bool(
        (mine - logits.float()).abs().max() <= tolerance * max(1.0, float(logits.float().abs().max()))
    )


@functools.cache
def _keeps_logits_on_request(lm_class: type) -> bool:
    """Whether the model class's forward takes ``logits_to_keep`` (read once per class)."""
    return "logits_to_keep" in inspect.signature(lm_class.forward).parameters


def padded_forward(
    model: torch.nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, **extra
):
    """The model's output for padded rows (left-padded prompts: positions count attended tokens);
    ``extra``: more keyword arguments of the model's forward (``position_ids`` among them replace
    the text positions, as :func:`rltrain.loss.vision.forward_inputs` builds them for images)."""
    position_ids = extra.pop("position_ids", None)
    recurrent.expect(model, None)  # (each row its own sequence)
    if position_ids is None:
        position_ids = text_positions(attention_mask_BT)
        if multi_axis_positions(model):  # (as packed_forward: the text axis first, then the rotary axes)
            position_ids = position_ids[None].expand(4, *position_ids.shape)
    return model(
        input_ids=input_ids_BT, attention_mask=attention_mask_BT, position_ids=position_ids, use_cache=False,
        **extra,
    )  # fmt: skip


def trailing_order(model: torch.nn.Module, attention_mask_BT: torch.Tensor) -> torch.Tensor | None:
    """``[B, T]``: for a model whose padded rows keep their padding after each sequence (a layer
    whose handling of padding rltrain cannot know, :attr:`rltrain.models.families.ModelNeeds.trailing_padding`,
    set on the model at load), each row's columns with its attended ones first; None where the rows
    are laid out so already or the model reads padding as padding."""
    if not getattr(causal_lm(model), "_rltrain_trailing_padding", False):
        return None
    order = torch.sort(~attention_mask_BT.bool(), dim=-1, stable=True).indices
    return None if bool((order == torch.arange(order.shape[1], device=order.device)).all()) else order


def unordered(values_BT: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Values of rows laid out by ``order`` (:func:`trailing_order`) back in the input's columns."""
    index = order.reshape(*order.shape, *[1] * (values_BT.dim() - 2)).expand_as(values_BT)
    return values_BT.new_zeros(values_BT.shape).scatter(1, index, values_BT)


def token_outputs(
    model: torch.nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, packed: bool = False
) -> torch.Tensor:
    """The model's per-position output ``logits`` ``[B, T, C]`` for a head with few outputs (a value
    head), computed padded or on one packed row and laid out like the input (0 on padding)."""
    if not packed:
        if (order := trailing_order(model, attention_mask_BT)) is not None:
            out = token_outputs(model, input_ids_BT.gather(1, order), attention_mask_BT.gather(1, order))
            return unordered(out, order)
        return padded_forward(model, input_ids_BT, attention_mask_BT).logits
    keep_BT = attention_mask_BT.bool()
    out_1LC = packed_forward(model, *pack_sequences(input_ids_BT, attention_mask_BT)).logits
    out_BTC = out_1LC.new_zeros(*keep_BT.shape, out_1LC.shape[-1])
    return out_BTC.masked_scatter(keep_BT[..., None], out_1LC[0])


# ---------------------------------------------------------------------------- packed rows


def pack_sequences(
    input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attended tokens of every row, concatenated into one row: ``(input_ids_1L, position_ids_1L)``.

    Position ids restart at 0 for each sequence; that is how transformers tells the documents of
    a packed row apart. Each row's attended tokens must be contiguous (left-padded prompt,
    right-padded completion), as :func:`rltrain.batch.collate` lays them out.
    """
    keep_BT = attention_mask_BT.bool()
    position_ids_BT = attention_mask_BT.long().cumsum(-1) - 1
    return input_ids_BT[keep_BT][None], position_ids_BT[keep_BT][None]


def packed_forward(
    model: torch.nn.Module, input_ids_1L: torch.Tensor, position_ids_1L: torch.Tensor, **extra
):
    """The model's output for a packed row, every document attending only to itself.

    transformers builds the block-diagonal causal mask from position ids that restart at 0, but only
    when it is given **no attention mask and no KV cache**: a 2-D mask (even all ones) or a cache
    object (Qwen2's config turns ``use_cache`` on) makes it fall back to one causal mask over the
    whole row, and documents silently attend to each other. Hence both are passed explicitly here.
    ``extra``: more keyword arguments of the model's forward (``position_ids`` among them: the four
    axes of an image's rows, :func:`rltrain.loss.vision.forward_inputs`, ``position_ids_1L`` first).
    """
    recurrent.expect(model, position_ids_1L)  # a hybrid model's recurrent layers: state per sequence
    position_ids = extra.pop("position_ids", None)
    if position_ids is None:
        position_ids = position_ids_1L
        if multi_axis_positions(model):  # the text axis (documents, tree branches), then the 3 rotary axes
            position_ids = position_ids_1L[None].expand(
                4, *position_ids_1L.shape
            )  # (a text token's: its position)
    return model(
        input_ids=input_ids_1L, position_ids=position_ids, attention_mask=None, use_cache=False, **extra
    )


def text_positions(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """The positions of padded rows (left-padded prompts): each attended token's count of attended
    tokens before it, 0 on padding."""
    return (attention_mask_BT.long().cumsum(-1) - 1).clamp(min=0)


def model_config(model: torch.nn.Module):
    """The config of a causal LM, also inside a DeepSpeed engine or a peft model."""
    return getattr(causal_lm(model), "config", None)


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model itself, also inside a DeepSpeed engine or a peft model."""
    lm = getattr(model, "module", model)  # a DeepSpeed engine's model
    return lm.get_base_model() if hasattr(lm, "get_base_model") else lm  # a peft model's


def multi_axis_positions(model_or_config) -> bool:
    """Whether the model's rotary positions have several axes (Qwen2-VL's M-RoPE: time, height and
    width; a text token's three are its position): its forward then takes ``[4, B, L]`` position
    ids, the text positions that tell documents apart first, as its own ``get_rope_index`` builds
    them for a packed batch."""
    config = (
        model_or_config if not isinstance(model_or_config, torch.nn.Module) else model_config(model_or_config)
    )
    for c in (config, getattr(config, "text_config", None)):
        for name in ("rope_parameters", "rope_scaling"):
            rope = getattr(c, name, None)
            if isinstance(rope, dict) and "mrope_section" in rope:
                return True
    return False
