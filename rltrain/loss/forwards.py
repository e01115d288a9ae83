"""A causal LM's forward in each layout the learners run (pure torch): padded rows, one packed row
of several documents, and up to what log-probs need, its last hidden states and its output head
(:func:`head_forward`) where the model's logits are that head applied to them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch


def head_forward(
    model: torch.nn.Module, forward: Callable[..., Any], from_hidden: bool = True
) -> tuple[torch.Tensor, torch.nn.Module | None]:
    """``forward(**extra)`` (the model's padded or packed forward, :func:`padded_forward`,
    :func:`packed_forward`) up to what the log-probs need: ``(last hidden states [B, T, H], the
    output head)`` where the model's logits are its output head applied to its decoder's last hidden
    state, or ``(logits [B, T, V], None)`` where they are not (a head with soft-capping or a logit
    scale, a model without ``logits_to_keep``) or ``from_hidden`` is false.

    ``model`` may be a DeepSpeed engine or a peft model around the causal LM: the call goes through
    it as any forward does (its hooks run), asking the LM to keep no logits, while a hook on the
    decoder takes its output."""
    parts = _decoder_and_head(model) if from_hidden else None
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


UNFOLDED_HEADS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    lm = getattr(model, "module", model)  # a DeepSpeed engine's model
    lm = lm.get_base_model() if hasattr(lm, "get_base_model") else lm  # a peft model's
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    config = getattr(lm, "config", None)
    if (
        head is None
        or not hasattr(head, "weight")
        or not hasattr(lm, "get_decoder")
        or not _keeps_logits_on_request(type(lm))
        or any(getattr(config, name, None) not in (None, 1, 1.0) for name in UNFOLDED_HEADS)
    ):
        return None
    decoder = lm.get_decoder()
    return (decoder, head) if decoder is not lm else None


@functools.cache
def _keeps_logits_on_request(lm_class: type) -> bool:
    """Whether the model class's forward takes ``logits_to_keep`` (read once per class)."""
    return "logits_to_keep" in inspect.signature(lm_class.forward).parameters


def padded_forward(
    model: torch.nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, **extra
):
    """The model's output for padded rows (left-padded prompts: positions count attended tokens);
    ``extra``: more keyword arguments of the model's forward."""
    position_ids = (attention_mask_BT.long().cumsum(-1) - 1).clamp(min=0)
    return model(
        input_ids=input_ids_BT, attention_mask=attention_mask_BT, position_ids=position_ids, use_cache=False,
        **extra,
    )  # fmt: skip


def token_outputs(
    model: torch.nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, packed: bool = False
) -> torch.Tensor:
    """The model's per-position output ``logits`` ``[B, T, C]`` for a head with few outputs (a value
    head), computed padded or on one packed row and laid out like the input (0 on padding)."""
    if not packed:
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
    ``extra``: more keyword arguments of the model's forward.
    """
    return model(
        input_ids=input_ids_1L, position_ids=position_ids_1L, attention_mask=None, use_cache=False, **extra
    )
