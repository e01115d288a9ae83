"""The head from the last hidden states: a causal LM's forward up to what log-probs need (its
decoder's last hidden states and its output head, :func:`head_forward`), with the family's logit
transform folded into the head, and the check of each model's head path on a probe
(:func:`output_head`)."""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rltrain.forward import structure
from rltrain.forward.layouts import packed_forward
from rltrain.forward.model import causal_lm, model_config


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


def probing(model: torch.nn.Module) -> bool:
    """Whether the forward of ``model`` running now is :func:`output_head`'s probe (hooks that
    record a forward's internals, a mixture's router taps, pass it over)."""
    found = structure.context(causal_lm(model))
    return found is not None and found.probing


@torch.no_grad()
def _probe(model: torch.nn.Module, decoder: torch.nn.Module, head: torch.nn.Module) -> bool:
    vocab = int(getattr(head.weight, "ds_shape", head.weight.shape)[0])
    device = head.weight.device
    ids = torch.arange(PROBE_TOKENS, device=device)[None] % vocab
    taken: list[torch.Tensor] = []
    hook = decoder.register_forward_hook(lambda _module, _args, out: taken.append(out[0]))
    context = structure.attach(model)
    context.probing = True
    try:
        logits = packed_forward(model, ids, torch.arange(PROBE_TOKENS, device=device)[None]).logits
    finally:
        context.probing = False
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
