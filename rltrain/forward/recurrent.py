"""Recurrent layers of hybrid models in packed and prefix-tree rows: each sequence's state its own.

Gated DeltaNet's linear attention (Qwen3.5, Qwen3-Next) and Mamba-2's state-space layers (Falcon-H1,
Nemotron-H) carry two things along the sequence: a short causal convolution's window of inputs and
a recurrent state. transformers computes them with two functions of the model's own module, a
convolution (``causal_conv1d_fn``) and a chunked scan (``torch_chunk_gated_delta_rule``,
``mamba2_chunk_scan``); on CPU their torch versions take no sequence boundaries, so in a packed row
the state ran across documents, and in a tree row each branch continued from its sibling instead of
its prompt (prime-rl, verl, SkyRL and slime shipped the same for packing).

Those functions of the model's modules are replaced, once, by ones that follow the sequences of the
row :func:`rltrain.forward.layouts.packed_forward` runs (:func:`expect`; the row's structure from its
position ids, :class:`rltrain.forward.structure.Row`), in that forward and in its recomputation in the
backward (gradient checkpointing), until the model's next forward; any other forward (padded rows,
generation) runs them as they were:

- the **convolution** of each token reads the inputs of its own sequence's previous tokens (zeros
  before a sequence's start; for a branch, the end of the prompt it continues): each piece of the row
  with the ``K - 1`` inputs before it prepended, one depthwise ``conv1d`` over all of them (memory and
  time linear in the row, as the padded forward's);
- the **scan** runs piece by piece (a piece ends at every token another piece continues from), each
  from its parent's final state, zero for a document's first piece, with the model's own scan and
  its own chunking: a shared prompt's state is computed once and carried into each of its branches,
  and its gradient sums over them. The cost stays linear in every sequence's length.

A fused kernel that would run the row whole (Mamba-2's ``mamba2_split_conv1d_scan_combined`` with
``mamba_ssm`` installed) is turned off for such a row, so the two functions above run. Each patched function
calls the implementation transformers picked (flash-linear-attention's, where installed) once per
piece, with the piece's initial state.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from rltrain.forward import structure
from rltrain.forward.model import causal_lm
from rltrain.forward.structure import Row

CONVOLUTIONS = ("causal_conv1d_fn",)
# a chunked scan's name -> (its initial-state keyword, its final-state keyword, whether it returns
# (output, state) even when the final state is not asked for)
SCANS = {"torch_chunk_gated_delta_rule": ("initial_state", "output_final_state", True),
         "mamba2_chunk_scan": ("initial_states", "return_final_states", False)}  # fmt: skip
FUSED = ("mamba2_split_conv1d_scan_combined",)  # would run the row whole: off (None: not fused)
# what a modeling module calls to carry state along a row, that rltrain does not keep per sequence
# (Mamba-1's selective scan, Kimi's delta attention); the decoding steps' functions (one token
# after a cache) never run in the learners' forwards
UNFOLLOWED = ("selective_scan_fn", "mamba_selective_scan", "mamba_inner_fn", "chunk_kimi_delta_attention",
              "chunk_kda")  # fmt: skip
DECODING = ("causal_conv1d_update", "mamba2_selective_state_update", "mamba_selective_state_update",
            "selective_state_update", "torch_recurrent_gated_delta_rule", "recurrent_kimi_delta_attention")  # fmt: skip
FOLLOWED = (*CONVOLUTIONS, *SCANS, *FUSED)


def recurrent_modules(model: torch.nn.Module) -> list:
    """The modeling modules (files) of ``model``'s layers that define a convolution or scan above."""
    names = {type(m).__module__ for m in model.modules()}
    found = [sys.modules[n] for n in sorted(names) if n in sys.modules]
    return [m for m in found if any(hasattr(m, f) for f in (*CONVOLUTIONS, *SCANS))]


def expect(model: torch.nn.Module, position_ids_1L: torch.Tensor | None) -> None:
    """The next forward of ``model`` runs the row these position ids describe (``[1, L]``; None: rows
    of their own, as a padded batch): :func:`rltrain.forward.structure.expect`, and a hybrid model's
    recurrent layers follow that row's sequences (their functions replaced once, here)."""
    lm = causal_lm(model)
    if not getattr(lm, "_rltrain_recurrent", False):
        modules = recurrent_modules(lm)
        for module in modules:
            _wrap(module)
        _follow(lm, {module.__name__ for module in modules})
        lm._rltrain_recurrent = True
    structure.expect(lm, position_ids_1L)


# the row the recurrent layer running now follows, set from its own model's context by that layer's
# hooks for the length of its forward (:func:`_follow`): the replaced functions take no module, and
# two models in one process (or one thread each) never read each other's rows
_LAYER_ROW: contextvars.ContextVar[Row | None] = contextvars.ContextVar("rltrain_layer_row", default=None)


def _follow(lm: torch.nn.Module, modeling: set[str]) -> None:
    """Each layer of ``lm`` whose class calls a replaced function (one of ``modeling``'s) runs it
    with its model's row: a pre-hook sets the row its model's forward announced, a hook that runs
    even when the forward raises puts back what was there, around the layer's forward and its
    recomputation in the backward alike."""
    context = structure.attach(lm)
    for layer in lm.modules():
        if type(layer).__module__ in modeling and _calls_followed(type(layer)):
            held: list[contextvars.Token] = []
            layer.register_forward_pre_hook(functools.partial(_enter, context, held))
            layer.register_forward_hook(functools.partial(_leave, held), always_call=True)


def _enter(context: structure.RowContext, held: list, *_) -> None:
    held.append(_LAYER_ROW.set(context.row))


def _leave(held: list, *_) -> None:
    _LAYER_ROW.reset(held.pop())


@functools.cache
def _calls_followed(layer_class: type) -> bool:
    """Whether the class (or a base of it) names a function :func:`_wrap` replaces."""
    for klass in layer_class.__mro__:
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if any(name in source for name in FOLLOWED):
            return True
    return False


# what a function must take to be followed: the convolution's arguments, a scan's state keywords
EXPECTED = {"causal_conv1d_fn": ("hidden_states", "weight", "bias", "activation")} | {
    name: keys[:2] for name, keys in SCANS.items()
}


def _takes(function: Callable, name: str) -> bool:
    """Whether ``function`` (a modeling module's ``name``) takes what its replacement passes it:
    another transformers that changed its signature leaves it unwrapped (its kind is then not
    followed: :func:`wrappable`), never called with the wrong arguments."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return name not in EXPECTED or all(p in parameters for p in EXPECTED[name])


def wrappable(module, name: str) -> bool:
    """Whether the modeling ``module``'s function ``name`` is one rltrain follows per sequence."""
    function = getattr(module, "_rltrain_originals", {}).get(name, getattr(module, name, None))
    return function is not None and _takes(function, name)


def _wrap(module) -> None:
    """Replace the module's convolution, scans and fused paths, once, by ones that follow the
    row of the layer that calls them (:func:`_follow`) where it is set and its length is the
    input's; each checked to take what its replacement passes (:func:`wrappable`), the originals kept
    (:func:`unwrap`). The one place rltrain changes a transformers module."""
    if getattr(module, "_rltrain_wrapped", False):
        return
    originals = {}
    for names, replace in [(CONVOLUTIONS, _convolution), (FUSED, _unless_row)]:
        for name in names:
            if hasattr(module, name) and (name in FUSED or wrappable(module, name)):
                originals[name] = getattr(module, name)
                setattr(module, name, replace(originals[name]))
    for name, keys in SCANS.items():
        if hasattr(module, name) and wrappable(module, name):
            originals[name] = getattr(module, name)
            setattr(module, name, _scan(originals[name], *keys))
    module._rltrain_originals, module._rltrain_wrapped = originals, True


def unwrap(module) -> None:
    """Put the module's own functions back (:func:`_wrap` undone)."""
    for name, original in getattr(module, "_rltrain_originals", {}).items():
        setattr(module, name, original)
    module._rltrain_originals, module._rltrain_wrapped = {}, False


def _unless_row(original: Callable) -> Callable:
    def fused(*args, **kwargs):
        return None if _LAYER_ROW.get() is not None else original(*args, **kwargs)

    return fused


def _convolution(original: Callable) -> Callable:
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        row = _LAYER_ROW.get()
        if row is None or tuple(hidden_states.shape[::2]) != (1, len(row)):
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        return convolve(row, hidden_states, weight, bias, activation)

    return causal_conv1d_fn


def _scan(original: Callable, initial_key: str, final_key: str, pair: bool) -> Callable:
    def scan(*args, **kwargs):
        row = _LAYER_ROW.get()
        first = next(a for a in args if torch.is_tensor(a))
        if row is None or tuple(first.shape[:2]) != (1, len(row)) or kwargs.get(initial_key) is not None:
            return original(*args, **kwargs)
        out, state = piecewise_scan(row, original, initial_key, final_key, args, kwargs)
        return (out, state if kwargs.get(final_key) else None) if pair or kwargs.get(final_key) else out

    return scan


def crossing_windows(row: Row, kernel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens whose ``kernel``-wide window, taken along the row, would reach past where their
    sequence continues from (each segment's first ``kernel - 1`` tokens), and their true windows:
    ``(columns [F], windows [F, kernel])`` of row indices, oldest first, ``L`` (a zero column)
    before a sequence's start. Walked per segment, not per token."""
    columns, windows = [], []
    for s, e, _ in row.segments:
        chain, j = [], row.parent[s]
        for _ in range(kernel - 1):  # the K - 1 inputs before the segment, newest first
            chain.append(j if j >= 0 else len(row))
            j = row.parent[j] if j >= 0 else -1
        inputs = chain[::-1] + list(range(s, min(e, s + kernel - 1)))
        for i in range(min(e - s, kernel - 1)):
            columns.append(s + i)
            windows.append(inputs[i : i + kernel])  # (ending at the segment's token i)
    return torch.tensor(columns, dtype=torch.long), torch.tensor(windows, dtype=torch.long).view(-1, kernel)


def convolve(row: Row, hidden_states, weight, bias, activation) -> torch.Tensor:
    """``[1, C, L]`` through the depthwise causal convolution ``weight`` ``[C, K]``, each token over
    its own sequence's inputs, then the activation (as ``causal_conv1d_fn`` does): one ``conv1d``
    along the whole row, as the padded forward runs one along each sequence, and the few tokens
    whose window would cross into another sequence (each segment's first ``K - 1``,
    :func:`crossing_windows`) recomputed over their own: memory and time linear in the row."""
    from transformers.activations import ACT2FN

    kernel, length = weight.shape[-1], len(row)
    key = ("conv", kernel)
    if key not in row.cache:
        row.cache[key] = tuple(t.to(row.device) for t in crossing_windows(row, kernel))
    columns, windows = row.cache[key]
    x = hidden_states[0].to(weight.dtype)  # [C, L]
    out = F.conv1d(x[None], weight[:, None, :], bias, padding=kernel - 1, groups=weight.shape[0])[
        0, :, :length
    ]
    crossing = (F.pad(x, (0, 1))[:, windows] * weight[:, None, :]).sum(-1)  # [C, F]
    if bias is not None:
        crossing = crossing + bias[:, None]
    out = out.index_copy(1, columns, crossing)
    if activation is not None:
        out = ACT2FN[activation](out)
    return out[None].to(hidden_states.dtype)


def piecewise_scan(row: Row, original: Callable, initial_key: str, final_key: str, args, kwargs):
    """``original`` once per piece of the row, from its parent piece's final state: (output, the last
    piece's final state)."""
    length = len(row)

    def cut(value, s: int, e: int):  # a sequence-shaped tensor's part: [1, L, ...] -> [1, n, ...]
        along = torch.is_tensor(value) and value.dim() >= 3 and tuple(value.shape[:2]) == (1, length)
        return value[:, s:e] if along else value

    states: dict[int, torch.Tensor] = {}  # a piece's last index -> its final state
    outs = []
    for s, e in row.pieces:
        before = row.parent[s]
        piece_kwargs = {k: cut(v, s, e) for k, v in kwargs.items()}
        piece_kwargs |= {initial_key: states.get(before) if before >= 0 else None, final_key: True}
        out, state = original(*(cut(a, s, e) for a in args), **piece_kwargs)
        states[e - 1] = state
        outs.append(out)
    return torch.cat(outs, dim=1), states[row.pieces[-1][1] - 1]
