"""A mixture of experts' routers as the learner sees them: found by the model's own declaration of
where its router logits come from (transformers' ``_can_record_outputs["router_logits"]``, the
recorder behind ``output_router_logits``), captured per forward by hooks, and the rows of a
forward that count (:mod:`rltrain.loss.moe` says which)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from rltrain.batch import TrainBatch
from rltrain.learner import sequence_parallel


def _recorder(model: torch.nn.Module):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft
    for module in (base, getattr(base, "model", None)):
        recorder = getattr(type(module), "_can_record_outputs", None) or {}
        if "router_logits" in recorder:
            return recorder["router_logits"]
    return None


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's routers in layer order; empty for a dense model."""
    recorder = _recorder(model)
    if recorder is None or recorder.target_class is None:
        return []
    return [m for m in model.modules() if isinstance(m, recorder.target_class)]


class RouterTap:
    """Forward hooks on every router; inside :meth:`capture` each forward appends its layers'
    ``[N, E]`` router logits (the router's output ``index``) to the list it yields. Outside it the
    hooks record nothing (a recomputation under gradient checkpointing, a reference forward)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = find_routers(model)
        recorder = _recorder(model)
        self.index = 0 if recorder is None else recorder.index
        config = getattr(model, "config", None)
        first = self.routers[0] if self.routers else None
        self.top_k = int(getattr(first, "top_k", None) or getattr(config, "num_experts_per_tok", 0) or 0)
        self.num_experts = int(getattr(first, "num_experts", None) or _config_experts(config))
        self._logits: list[torch.Tensor] | None = None
        for router in self.routers:
            router.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        if self._logits is not None:
            logits = output[self.index] if isinstance(output, tuple) else output
            self._logits.append(logits.reshape(-1, logits.shape[-1]))

    @contextlib.contextmanager
    def capture(self) -> Iterator[list[torch.Tensor]]:
        self._logits = captured = []
        try:
            yield captured
        finally:
            self._logits = None


def _config_experts(config) -> int:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    return 0


def router_rows(mb: TrainBatch, packed: bool, sp: int, sp_rank: int) -> torch.Tensor:
    """Which rows of a forward on ``mb`` the router sees are real tokens: ``[N]`` bool, in the
    forward's order (padded: every cell; packed: the attended tokens in one row; sequence-parallel:
    this rank's slice of that row, padded to a multiple of ``sp``). An empty micro-batch's stand-in
    row (``mb.blank``) has none."""
    keep_BT = mb.attention_mask.bool()
    if mb.blank is not None:
        keep_BT = keep_BT & ~mb.blank.bool()[:, None]
    if not packed and sp == 1:
        return keep_BT.reshape(-1)
    real_L = keep_BT[mb.attention_mask.bool()]  # the packed row's tokens, in order
    if sp == 1:
        return real_L
    part = sequence_parallel.row_slice(len(real_L), sp, sp_rank)
    padded = torch.cat([real_L, real_L.new_zeros(max(part.stop - len(real_L), 0))])
    return padded[part]
