"""Recurrent layers of hybrid models in packed and prefix-tree rows: each sequence's state its own
(pure torch).

Gated DeltaNet's linear attention (Qwen3.5, Qwen3-Next) and Mamba-2's state-space layers (Falcon-H1,
Nemotron-H) carry two things along the sequence: a short causal convolution's window of inputs and
a recurrent state. transformers computes them with two functions of the model's own module, a
convolution (``causal_conv1d_fn``) and a chunked scan (``torch_chunk_gated_delta_rule``,
``mamba2_chunk_scan``); on CPU their torch versions take no sequence boundaries, so in a packed row
the state ran across documents, and in a tree row each branch continued from its sibling instead of
its prompt (prime-rl, verl, SkyRL and slime shipped the same for packing).

Those functions of the model's modules are replaced, once, by ones that follow the sequences of the
row :func:`rltrain.loss.forwards.packed_forward` runs (:func:`expect`; the row's structure from its
position ids, :func:`rltrain.loss.rows.parents`), in that forward and in its recomputation in the
backward (gradient checkpointing), until the model's next forward; any other forward (padded rows,
generation) runs them as they were:

- the **convolution** of each token reads the inputs of its own sequence's previous tokens (zeros
  before a sequence's start; for a branch, the end of the prompt it continues);
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

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from rltrain.loss.rows import parents

CONVOLUTIONS = ("causal_conv1d_fn",)
# a chunked scan's name -> (its initial-state keyword, its final-state keyword, whether it returns
# (output, state) even when the final state is not asked for)
SCANS = {"torch_chunk_gated_delta_rule": ("initial_state", "output_final_state", True),
         "mamba2_chunk_scan": ("initial_states", "return_final_states", False)}  # fmt: skip
FUSED = ("mamba2_split_conv1d_scan_combined",)  # would run the row whole: off (None: not fused)
_row: list = [None]  # the row the recurrent layers follow now (None: each row its own sequence)
_next: list = [None]  # the row of the forward packed_forward is starting


def recurrent_modules(model: torch.nn.Module) -> list:
    """The modeling modules (files) of ``model``'s layers that define a convolution or scan above."""
    names = {type(m).__module__ for m in model.modules()}
    found = [sys.modules[n] for n in sorted(names) if n in sys.modules]
    return [m for m in found if any(hasattr(m, f) for f in (*CONVOLUTIONS, *SCANS))]


def follows(model: torch.nn.Module) -> bool:
    """Whether ``model``'s recurrent layers run through a scan this module keeps per sequence."""
    return any(hasattr(m, name) for m in recurrent_modules(model) for name in SCANS)


def expect(model: torch.nn.Module, position_ids_1L: torch.Tensor | None) -> None:
    """The next forward of ``model`` runs the row these position ids describe (``[1, L]``; None: rows
    of their own, as a padded batch): its recurrent layers, and their recomputation in the backward
    (gradient checkpointing), follow that row's sequences until the model's next forward starts.
    Nothing happens for a model without such layers."""
    lm = getattr(model, "module", model)
    lm = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    if not getattr(lm, "_rltrain_rows", False):
        modules = recurrent_modules(lm)
        for module in modules:
            _wrap(module)
        lm._rltrain_rows = True
        lm._rltrain_recurrent = bool(modules)
        if modules:
            lm.register_forward_pre_hook(_take_row)
    if lm._rltrain_recurrent:
        _next[0] = None if position_ids_1L is None else Row(position_ids_1L[0])


def _take_row(*_) -> None:
    """A forward of the model starts: its recurrent layers follow the row :func:`expect` set for
    it, or each row its own sequence (a forward rltrain did not start: generation, say)."""
    _row[0], _next[0] = _next[0], None


def _wrap(module) -> None:
    """Replace the module's convolution, scans and fused paths, once, by ones that follow
    :data:`_row` where it is set and its length is the input's."""
    if getattr(module, "_rltrain_wrapped", False):
        return
    for name in CONVOLUTIONS:
        if hasattr(module, name):
            setattr(module, name, _convolution(getattr(module, name)))
    for name, keys in SCANS.items():
        if hasattr(module, name):
            setattr(module, name, _scan(getattr(module, name), *keys))
    for name in FUSED:
        if hasattr(module, name):
            setattr(module, name, _unless_row(getattr(module, name)))
    module._rltrain_wrapped = True


def _unless_row(original: Callable) -> Callable:
    def fused(*args, **kwargs):
        return None if _row[0] is not None else original(*args, **kwargs)

    return fused


def _convolution(original: Callable) -> Callable:
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        row = _row[0]
        if row is None or tuple(hidden_states.shape[::2]) != (1, len(row.parent)):
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        return row.convolve(hidden_states, weight, bias, activation)

    return causal_conv1d_fn


def _scan(original: Callable, initial_key: str, final_key: str, pair: bool) -> Callable:
    def scan(*args, **kwargs):
        row = _row[0]
        first = next(a for a in args if torch.is_tensor(a))
        if (
            row is None
            or tuple(first.shape[:2]) != (1, len(row.parent))
            or kwargs.get(initial_key) is not None
        ):
            return original(*args, **kwargs)
        out, state = row.scan(original, initial_key, final_key, args, kwargs)
        return (out, state if kwargs.get(final_key) else None) if pair or kwargs.get(final_key) else out

    return scan


class Row:
    """One packed or tree row's sequences: each token's parent (:func:`rltrain.loss.rows.parents`)
    and the pieces the scans run (runs of consecutive tokens, cut after every token a later piece
    continues from)."""

    def __init__(self, position_ids_L: torch.Tensor):
        self.parent = parents(position_ids_L)
        length = len(self.parent)
        continued = {p for i, p in enumerate(self.parent) if p >= 0 and p != i - 1}
        starts = [i for i in range(length) if i == 0 or self.parent[i] != i - 1 or (i - 1) in continued]
        self.pieces = list(zip(starts, [*starts[1:], length]))
        self.device = position_ids_L.device
        self._windows: dict[int, torch.Tensor] = {}

    def window(self, kernel: int) -> torch.Tensor:
        """``[L, kernel]``: the row indices of each token's ``kernel - 1`` predecessors in its own
        sequence, oldest first, then its own; ``L`` (a zero column) before a sequence's start."""
        if kernel not in self._windows:
            length = len(self.parent)
            index = torch.empty(length, kernel, dtype=torch.long)
            for i in range(length):
                j = i
                for k in range(kernel - 1, -1, -1):
                    index[i, k] = j if j >= 0 else length
                    j = self.parent[j] if j >= 0 else -1
            self._windows[kernel] = index.to(self.device)
        return self._windows[kernel]

    def convolve(self, hidden_states, weight, bias, activation) -> torch.Tensor:
        """``[1, C, L]`` through the depthwise causal convolution ``weight`` ``[C, K]``, each token over
        its own sequence's inputs, then the activation (as ``causal_conv1d_fn`` does)."""
        from transformers.activations import ACT2FN

        x = F.pad(hidden_states[0].to(weight.dtype), (0, 1))  # [C, L + 1]: the zero column
        out = (x[:, self.window(weight.shape[-1])] * weight[:, None, :]).sum(-1)  # [C, L, K] -> [C, L]
        if bias is not None:
            out = out + bias[:, None]
        if activation is not None:
            out = ACT2FN[activation](out)
        return out[None].to(hidden_states.dtype)

    def scan(self, original: Callable, initial_key: str, final_key: str, args, kwargs):
        """``original`` once per piece, from its parent piece's final state: (output, the last
        piece's final state)."""
        length = len(self.parent)

        def cut(value, s: int, e: int):  # a sequence-shaped tensor's part: [1, L, ...] -> [1, n, ...]
            along = torch.is_tensor(value) and value.dim() >= 3 and tuple(value.shape[:2]) == (1, length)
            return value[:, s:e] if along else value

        states: dict[int, torch.Tensor] = {}  # a piece's last index -> its final state
        outs = []
        for s, e in self.pieces:
            before = self.parent[s]
            piece_kwargs = {k: cut(v, s, e) for k, v in kwargs.items()}
            piece_kwargs |= {initial_key: states.get(before) if before >= 0 else None, final_key: True}
            out, state = original(*(cut(a, s, e) for a in args), **piece_kwargs)
            states[e - 1] = state
            outs.append(out)
        return torch.cat(outs, dim=1), states[self.pieces[-1][1] - 1]
