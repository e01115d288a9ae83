"""What a model's layers need from the learner's forwards, read from the loaded model's config (and its
``text_config``), not from a list of class names; and which layouts can honour it.

Each need and where it is honoured (docs/models.md has the table of families):

- **attention per layer**: ``layer_types`` (full and sliding), ``sliding_window``, attention-logit
  soft-capping, attention sinks, the query scaling: the layer passes each to its attention function
  on every call, and :mod:`rltrain.learner.attention` honours them in padded, packed and tree rows
  and under sequence parallelism (or raises, naming what it does not know);
- **the head**: the family's logit transform (a multiplier, a soft-cap,
  :class:`~rltrain.loss.forwards.LogitTransform`), folded into the head on the hidden-state path and
  checked on a probe, or the full-logits path (:func:`rltrain.loss.forwards.output_head`);
- **positions**: multi-axis rotary positions (Qwen2-VL's M-RoPE) built for packed and tree rows as
  the model's own ``get_rope_index`` builds them for text (:func:`rltrain.loss.forwards.packed_forward`);
- **recurrent layers** (Gated DeltaNet's linear attention, Mamba-2's state-space layers): their
  convolution and scan follow each sequence of a packed row and are carried into each branch of a
  tree (:mod:`rltrain.loss.recurrent`); a model whose recurrent layers run through functions rltrain
  does not know runs padded rows only (each row its own sequence) and refuses packed and tree rows in
  one line (:func:`layout_problem`), as sequence parallelism is refused for all of them (the state
  would have to cross ranks);
- **position biases** (ALiBi): built from a mask over the row, which packed and tree rows do not
  have: refused there too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rltrain.loss.forwards import LogitTransform, logit_transform, multi_axis_positions
from rltrain.loss.recurrent import follows

ATTENTION_KINDS = ("full_attention", "sliding_attention")  # what rltrain's attention knows a layer as
# config keys of layers that carry a state along the sequence, by the kind they name
RECURRENT_KEYS = {"mamba_": "mamba", "ssm_": "mamba", "linear_attn_config": "linear_attention",
                  "linear_num_value_heads": "linear_attention"}  # fmt: skip


@dataclass(frozen=True)
class ModelNeeds:
    """What one model's forward needs (see the module docstring)."""

    family: str
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    attention_softcap: float | None = None
    logit_transform: LogitTransform = field(default_factory=LogitTransform)
    multi_axis_positions: bool = False
    recurrent: tuple[str, ...] = ()  # kinds of layers that carry a state along the row
    # their state runs through scans rltrain keeps per sequence (rltrain.loss.recurrent); read from
    # the model itself (None: only its config was read)
    recurrence_followed: bool | None = None
    position_bias: bool = False  # ALiBi

    def features(self) -> list[str]:
        """The needs beyond a plain causal decoder, in words (docs, notes)."""
        out = []
        if self.sliding_window is not None and "sliding_attention" in (
            self.layer_types or ("sliding_attention",)
        ):
            out.append(f"sliding windows of {self.sliding_window}")
        if self.attention_softcap:
            out.append("attention soft-capping")
        if self.logit_transform != LogitTransform():
            out.append("a logit transform")
        if self.multi_axis_positions:
            out.append("multi-axis rotary positions")
        out += [f"{kind} layers" for kind in self.recurrent]
        if self.position_bias:
            out.append("ALiBi position biases")
        return out


def _read(config, name: str):
    value = getattr(config, name, None)
    text = getattr(config, "text_config", None)
    return getattr(text, name, None) if value is None and text is not None else value


def needs(config, model=None) -> ModelNeeds:
    """The needs of the model whose transformers ``config`` this is (a loaded model's ``.config``);
    ``model`` (loaded, or built on the meta device) tells whether rltrain keeps its recurrent
    layers' state per sequence."""
    layer_types = tuple(_read(config, "layer_types") or ())
    recurrent = [kind for kind in dict.fromkeys(layer_types) if kind not in ATTENTION_KINDS]
    for c in (config, getattr(config, "text_config", None)):
        for key in vars(c) if c is not None else ():
            kind = next((k for prefix, k in RECURRENT_KEYS.items() if key.startswith(prefix)), None)
            if kind is not None and kind not in recurrent and getattr(c, key) is not None:
                recurrent.append(kind)
    window = _read(config, "sliding_window")
    if _read(config, "use_sliding_window") is False:  # (Qwen2's config keeps a window it does not use)
        window = None
    return ModelNeeds(
        family=str(getattr(config, "model_type", "?")),
        layer_types=layer_types,
        sliding_window=window,
        attention_softcap=_read(config, "attn_logit_softcapping"),
        logit_transform=logit_transform(config),
        multi_axis_positions=multi_axis_positions(config),
        recurrent=tuple(recurrent),
        recurrence_followed=None if model is None or not recurrent else follows(model),
        position_bias=bool(_read(config, "alibi")) or _read(config, "position_embedding_type") == "alibi",
    )


def layout_problem(
    model_needs: ModelNeeds, key: str, packing: bool, sharing: bool | str, sequence_parallel: int = 1
) -> str | None:
    """Why the learners of ``key`` (a config section: ``learner``, ``critic.learners``, ...) cannot
    run this model exactly with these settings, in one line naming the feature and the settings
    that would work; None where they can. ``sharing``: ``learner.prefix_sharing`` (auto shares
    nothing that this refuses, so it never is the problem)."""
    if model_needs.recurrent and model_needs.recurrence_followed and sequence_parallel > 1:
        return (f"{model_needs.family} has {' and '.join(model_needs.recurrent)} layers, whose state runs along "
                f"the whole row, which sequence parallelism splits over ranks: set {key}.sequence_parallel_size=1")  # fmt: skip
    blocked = [] if model_needs.recurrence_followed else [
        f"{kind} layers (their state would run across the row's sequences)" for kind in model_needs.recurrent
    ]  # fmt: skip
    if model_needs.position_bias:
        blocked.append("ALiBi position biases (built from a mask over the row)")
    if not blocked:
        return None
    wanted = [f"{key}.packing=false"] if packing else []
    if sharing is True:
        wanted.append(f"{key}.prefix_sharing=false")
    if not wanted:
        return None
    return (f"{model_needs.family} has {' and '.join(blocked)}, which packed rows and prefix trees do not keep "
            f"per sequence: set {' and '.join(wanted)} (padded rows run it exactly)")  # fmt: skip


def shares(model_needs: ModelNeeds) -> bool:
    """Whether a prefix tree can run this model (``learner.prefix_sharing: auto`` shares only then)."""
    return not model_needs.position_bias and (
        not model_needs.recurrent or bool(model_needs.recurrence_followed)
    )


def causal_lm_class(config):
    """The transformers auto class that loads this config as a model with a language-model head: a
    causal LM, or a vision-language model's (Qwen2.5-VL, Gemma 3/4, Qwen3.5 are registered as image
    text-to-text models), which runs text rows the same way."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if getattr(config, "model_type", None) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or getattr(
        config, "auto_map", None
    ):
        return AutoModelForCausalLM
    return AutoModelForImageTextToText
