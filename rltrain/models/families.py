"""What a model's layers need from the learner's forwards, read from the loaded model's config (and its
``text_config``) and from what each kind of layer is made of, not from a list of class names; and
which layouts can honour it.

Each decoder layer has a kind (the config's ``layer_types``, ``layers_block_type`` or
``block_types``; plain attention where it names none), and each kind is read for what it is:

- **attention** (``full_attention``, ``sliding_attention``, ``attention``): windows, attention-logit
  soft-capping, attention sinks, the query scaling reach :mod:`rltrain.forward.attention` with every
  call, honoured in padded, packed and tree rows and under sequence parallelism. A model whose
  attention is its own runs padded rows alone, on that attention (:func:`own_attention`): one that
  does not go through transformers' attention functions (Bloom, MPT: their masks are built over the
  whole row), one that reads or builds a mask of its own making (Doge's dynamic mask, the indexers
  of DeepSeek-V3.2's sparse attention), one that passes its attention function arguments rltrain's
  would not know (Inkling's position bias);
- **MLP and mixture-of-experts** (``mlp``, ``moe``, ``dense``, ``sparse``): nothing along the row;
- **recurrent** (``linear_attention``, ``mamba``, ``conv``, ``recurrent``, ``hybrid``): layers that
  carry a state along the row. A kind is *followed* where its layers run their convolution and scan
  through the functions :mod:`rltrain.forward.recurrent` keeps per sequence (Gated DeltaNet, Mamba-2,
  LFM2's short convolution): exact in packed and tree rows. A kind whose layers call a state function
  rltrain does not follow (Mamba-1's selective scan, Kimi's delta attention) or carry state in code
  of their own (RecurrentGemma's RG-LRU) runs padded rows alone, its padding after each sequence
  (:attr:`ModelNeeds.trailing_padding`, where rltrain cannot know that the layer ignores padding);
- **unknown** kinds (a name none of the above, Llama 4's ``chunked_attention``): padded rows alone,
  for the same reason.

Beside the layers: the head (the family's logit transform, folded into the head on the hidden-state
path and checked on a probe, :func:`rltrain.forward.head.output_head`), multi-axis rotary positions
(Qwen2-VL's M-RoPE), and ALiBi position biases (found from the model: its config's switch, or a
modeling module that builds them with no switch to turn them off), built from a mask over the row:
padded rows alone. docs/models.md has the table of families.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from dataclasses import dataclass, field

from rltrain.forward.head import LogitTransform, logit_transform
from rltrain.forward.model import causal_lm, multi_axis_positions
from rltrain.forward.recurrent import DECODING, FOLLOWED, FUSED, UNFOLLOWED, wrappable

ATTENTION_KINDS = ("full_attention", "sliding_attention", "attention")  # what rltrain's attention runs
MLP_KINDS = ("mlp", "moe", "dense", "sparse")  # nothing along the row
RECURRENT_KINDS = ("linear_attention", "mamba", "conv", "recurrent", "hybrid")  # a state along the row
# config keys that name each layer's kind, in the order they are read (RecurrentGemma's block_types
# repeat over the layers)
KIND_KEYS = ("layer_types", "layers_block_type", "block_types")


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
    # kinds whose layers' state (or what they do) packed and tree rows would run across sequences,
    # each with the reason; read from the model itself (None: only its config was read)
    unfollowed: dict[str, str] | None = None
    # kinds whose handling of padding rltrain cannot know (state in code of their own, unknown kinds)
    own_state: tuple[str, ...] = ()
    own_attention: str | None = None  # why its attention is its own (None: rltrain's runs it)
    position_bias: bool = False  # ALiBi
    state_functions: tuple[str, ...] = ()  # the recurrent layers' functions (rltrain.forward.recurrent)

    @property
    def recurrence_followed(self) -> bool | None:
        """Whether every layer that carries state runs through functions rltrain keeps per sequence
        (None: only the config was read)."""
        if not self.recurrent:
            return None
        return None if self.unfollowed is None else not self.unfollowed

    @property
    def attention_interface(self) -> bool:
        """Its attention goes through transformers' attention functions as rltrain's can run them."""
        return self.own_attention is None

    @property
    def trailing_padding(self) -> bool:
        """Padded rows put their padding after each sequence: a layer whose handling of padding
        rltrain cannot know (an unknown kind, state in code of its own, attention of its own) never
        reads it."""
        return bool(self.own_state) or self.own_attention is not None

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
        if not self.attention_interface:
            out.append("attention of its own")
        if self.position_bias:
            out.append("ALiBi position biases")
        return out

    def blocked(self) -> list[str]:
        """What packed rows and prefix trees cannot keep per sequence, in words."""
        out = [f"{kind} layers ({why})" for kind, why in (self.unfollowed or {}).items()]
        if self.own_attention is not None:
            out.append(self.own_attention)
        if self.position_bias:
            out.append("ALiBi position biases (built from a mask over the row)")
        return out


def _read(config, name: str):
    value = getattr(config, name, None)
    text = getattr(config, "text_config", None)
    return getattr(text, name, None) if value is None and text is not None else value


def layer_kinds(config) -> tuple[str, ...]:
    """Each decoder layer's kind, as the config names it (empty where it names none: attention)."""
    layers = _read(config, "num_hidden_layers")
    for key in KIND_KEYS:
        kinds = _read(config, key)
        if kinds:
            kinds = [str(k) for k in kinds]
            return tuple(kinds[i % len(kinds)] for i in range(layers or len(kinds)))
    return ()


def needs(config, model=None) -> ModelNeeds:
    """The needs of the model whose transformers ``config`` this is (a loaded model's ``.config``);
    ``model`` (loaded, or built on the meta device) tells what each kind of layer is made of."""
    kinds = layer_kinds(config)
    recurrent = [k for k in dict.fromkeys(kinds) if k not in ATTENTION_KINDS + MLP_KINDS]
    unfollowed, own, functions = None, (), ()
    if model is not None:
        unfollowed, own, functions = _read_layers(model, kinds)
    window = _read(config, "sliding_window")
    if _read(config, "use_sliding_window") is False:  # (Qwen2's config keeps a window it does not use)
        window = None
    return ModelNeeds(
        family=str(getattr(config, "model_type", "?")),
        layer_types=tuple(_read(config, "layer_types") or ()),
        sliding_window=window,
        attention_softcap=_read(config, "attn_logit_softcapping"),
        logit_transform=logit_transform(config),
        multi_axis_positions=multi_axis_positions(config),
        recurrent=tuple(recurrent),
        unfollowed=unfollowed,
        own_state=own,
        own_attention=own_attention(config, model),
        position_bias=alibi(config, model),
        state_functions=functions,
    )


def attention_interface(config, model=None) -> bool:
    """Whether rltrain's attention can run the model's attention: its decoder layers' modeling
    modules (of ``model``, or of the classes ``config`` and its ``text_config`` load as) call
    transformers' attention functions, with transformers' mask and nothing the function would not
    know (:func:`own_attention`). A module whose source cannot be read is taken at its word."""
    return own_attention(config, model) is None


def own_attention(config, model=None) -> str | None:
    """Why the model's attention is its own, in words (packed rows and prefix trees cannot run it;
    padded rows run it on its own arithmetic), or None: it does not go through transformers'
    attention functions (Bloom, MPT), reads or builds a mask of its own making (Doge's dynamic
    mask, the indexers of DeepSeek-V3.2's sparse attention, which read the mask's cells), or passes
    its attention function what rltrain's would not know (Inkling's ``position_bias``). Read from
    the classes of the decoder layers of ``model`` (or of the model ``config`` builds, on the meta
    device); a class whose source cannot be read is taken at its word."""
    if model is None:
        model = _meta_model(config)
    layers = decoder_layers(model) if model is not None else []
    classes = {type(m) for layer in layers for m in layer.modules()}
    modules = {c.__module__ for c in classes if c.__module__.startswith("transformers.models.")}
    if modules and not any(_calls_attention_functions(name) for name in modules):
        return "attention that does not go through transformers' attention functions (its mask is built over the whole row)"  # fmt: skip
    reasons = [why for cls in sorted(classes, key=lambda c: c.__name__) if (why := _attention_own(cls))]
    return "; ".join(dict.fromkeys(reasons)) or None


def _meta_model(config):
    """The model ``config`` describes, built on the meta device (no weights), or None."""
    import torch

    try:
        with torch.device("meta"):
            return causal_lm_class(config).from_config(config)
    except Exception:  # noqa: BLE001 - a config transformers cannot build: nothing to read
        return None


@functools.cache
def _calls_attention_functions(module_name: str) -> bool:
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(sys.modules[module_name])
    except (KeyError, OSError, TypeError):
        return True


# what rltrain's attention takes from an attention layer's call (:mod:`rltrain.forward.attention`)
KNOWN_ATTENTION_ARGUMENTS = {"dropout", "scaling", "sliding_window", "softcap", "s_aux", "position_ids",
                             "attention_mask", "is_causal", "output_attentions", "use_cache"}  # fmt: skip


@functools.cache
def _attention_own(cls: type) -> str | None:
    """For an attention class whose forward calls an attention function: why that call is its own
    (a mask it reads or builds, arguments rltrain's attention would not know), or None. A line that
    hands the mask to another attention path of the class's own (GPT-2's upcast attention, chosen
    by a config switch) or a cross-attention's mask does not count."""
    from rltrain.forward.attention import PASSED_OVER

    source = _code(getattr(cls, "forward", None))
    call = _attention_call(source)
    if call is None:
        return None
    uses = [line.strip() for line in _body(source.replace(call, "")).splitlines()
            if re.search(r"\battention_mask\b", line)]  # fmt: skip
    own = [line for line in uses if not re.fullmatch(r"attention_mask\s*=\s*encoder_attention_mask", line)]
    alternatives = re.findall(r"self\.\w*att\w*\([^)]*\)", _body(source), flags=re.S)
    own = [line for line in own if not any(line in alt for alt in alternatives)]
    passed = set(re.findall(r"\b(\w+)\s*=(?!=)", call))
    other_mask = re.search(r"\battention_mask\s*=\s*(?!attention_mask\b)\w", call)
    unknown = sorted(passed - KNOWN_ATTENTION_ARGUMENTS - PASSED_OVER)
    if own or other_mask:
        return f"attention with a mask of its own making ({cls.__name__} reads or builds the mask)"
    if unknown:
        return f"attention that passes its attention function {', '.join(unknown)} ({cls.__name__})"
    return None


def _code(function) -> str:
    """A function's source without its docstrings and comments ('' where it cannot be read)."""
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return ""
    source = re.sub(r'("""|\'\'\')(.|\n)*?\1', "", source)
    return re.sub(r"#[^\n]*", "", source)


def _body(source: str) -> str:
    """A function's source after its signature."""
    start = source.find("(")
    end = _closing(source, start) if start >= 0 else None
    return source if end is None else source[source.index(":", end) + 1 :]


def _closing(text: str, at: int) -> int | None:
    """Where the bracket opened at ``at`` closes."""
    depth = 0
    for i in range(at, len(text)):
        depth += {"(": 1, ")": -1, "[": 1, "]": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return None


def _attention_call(source: str) -> str | None:
    """The text of the attention function's call in a forward's source (``attention_interface(...)``
    or ``ALL_ATTENTION_FUNCTIONS[...](...)``), or None."""
    found = re.search(r"\battention_interface\s*\(|ALL_ATTENTION_FUNCTIONS\[[^\]]*\]\s*\(", source)
    end = None if found is None else _closing(source, found.end() - 1)
    return None if end is None else source[found.start() : end + 1]


def alibi(config, model=None) -> bool:
    """ALiBi position biases: the config's switch (Falcon's ``alibi``, MPT's ``attn_config.alibi``,
    ``position_embedding_type: alibi``), or a modeling module that builds them and has no switch
    (Bloom: every layer)."""
    attn = _read(config, "attn_config")
    switch = _read(config, "alibi")
    if switch or _read(config, "position_embedding_type") == "alibi" or getattr(attn, "alibi", None) is True:
        return True
    if isinstance(attn, dict) and attn.get("alibi"):
        return True
    if model is None or switch is not None or isinstance(attn, dict) or attn is not None:
        return False
    names = {type(m).__module__ for m in model.modules()}
    return any(hasattr(sys.modules.get(n), "build_alibi_tensor") for n in names)


def decoder_layers(model) -> list:
    """The model's decoder layers (the module list as long as its config's layer count)."""
    import torch

    lm = causal_lm(model)
    count = _read(lm.config, "num_hidden_layers")
    lists = [m for m in lm.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count]
    return list(lists[0]) if lists else []


def _read_layers(model, kinds: tuple[str, ...]) -> tuple[dict[str, str], tuple[str, ...], tuple[str, ...]]:
    """``(each kind packed rows cannot keep per sequence: why, the kinds among them whose state
    rltrain cannot read at all, the state functions the layers call)``, from what the layers of each
    kind are made of."""
    layers = decoder_layers(model)
    kinds = kinds or ("full_attention",) * len(layers)
    by_kind: dict[str, list] = {}
    for kind, layer in zip(kinds, layers):
        by_kind.setdefault(kind, []).append(layer)
    unfollowed, own, called = {}, [], set()
    for kind, members in by_kind.items():
        classes = {type(m) for layer in members for m in layer.modules()}
        functions = set().union(*(_state_functions(c) for c in classes)) - set(DECODING)
        # a followed function another transformers changed the signature of is not followed
        unwrappable = {n for n in functions & set(FOLLOWED) - set(FUSED) if not _wrappable_in(classes, n)}
        called |= functions
        convolutions = sorted(c.__name__ for c in classes if _own_convolution(c, classes))
        if functions & set(UNFOLLOWED) or unwrappable:
            names = ", ".join(sorted(functions & set(UNFOLLOWED) | unwrappable))
            unfollowed[kind] = f"{names}: a state rltrain does not keep per sequence"
        elif kind not in ATTENTION_KINDS + MLP_KINDS + RECURRENT_KINDS:
            unfollowed[kind] = "a kind of layer rltrain does not know"
            own.append(kind)
        elif functions & set(FOLLOWED):
            continue
        elif kind in RECURRENT_KINDS or convolutions:
            mixer = convolutions or sorted(
                c.__name__ for c in classes if c.__name__.startswith(_prefix(members))
            )
            unfollowed[kind] = (
                f"{', '.join(mixer[:2])}: a state carried in code of its own, which rltrain does not follow"
            )
            own.append(kind)
    return unfollowed, tuple(own), tuple(sorted(called))


def _wrappable_in(classes: set[type], name: str) -> bool:
    """Whether the modeling modules of ``classes`` that define ``name`` define one rltrain follows."""
    modules = {sys.modules.get(c.__module__) for c in classes} - {None}
    return all(wrappable(m, name) for m in modules if hasattr(m, name))


def _prefix(layers: list) -> str:
    """The family's prefix of class names (``RecurrentGemma`` of ``RecurrentGemmaDecoderLayer``)."""
    name = type(layers[0]).__name__
    return re.split(r"(?=Decoder|Layer|Block)", name)[0] or name


@functools.cache
def _source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


@functools.cache
def _state_functions(cls: type) -> frozenset[str]:
    """The known state functions (followed, unfollowed, decoding) a layer class calls."""
    source = _source(cls)
    return frozenset(n for n in (*FOLLOWED, *UNFOLLOWED, *DECODING) if re.search(rf"\b{n}\(", source))


def _own_convolution(cls: type, classes: set[type]) -> bool:
    """A class of the layer that runs a convolution along the row itself (``nn.Conv1d`` called as a
    module, not through a followed function)."""
    import torch

    if cls is torch.nn.Conv1d or not issubclass(cls, torch.nn.Module):
        return False
    holds = any(issubclass(c, torch.nn.Conv1d) for c in classes)
    source = _source(cls)
    return (
        holds
        and re.search(r"self\.\w*conv\w*\(", source) is not None
        and not _state_functions(cls) & set(FOLLOWED)
    )


def prepare(model, model_needs: ModelNeeds) -> None:
    """What the forwards read from a loaded model itself: padding after each sequence in padded rows
    where a layer's handling of padding is not known (:func:`rltrain.forward.layouts.trailing_order`)."""
    causal_lm(model)._rltrain_trailing_padding = model_needs.trailing_padding


def layout_problem(
    model_needs: ModelNeeds, key: str, packing: bool, sharing: bool | str, sequence_parallel: int = 1
) -> str | None:
    """Why the learners of ``key`` (a config section: ``learner``, ``critic.learners``, ...) cannot
    run this model exactly with these settings, in one line naming the feature and the settings
    that would work; None where they can. ``sharing``: ``learner.prefix_sharing`` (auto shares
    nothing that this refuses, so it never is the problem)."""
    blocked = model_needs.blocked()
    if sequence_parallel > 1 and (blocked or (model_needs.recurrent and model_needs.recurrence_followed)):
        why = (
            " and ".join(blocked)
            or f"{' and '.join(model_needs.recurrent)} layers, whose state runs along the row"
        )
        return (f"{model_needs.family} has {why}, which sequence parallelism splits over ranks: set "
                f"{key}.sequence_parallel_size=1{' and ' + key + '.packing=false' if blocked else ''}")  # fmt: skip
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
    return not model_needs.blocked() and (not model_needs.recurrent or model_needs.unfollowed is not None)


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
