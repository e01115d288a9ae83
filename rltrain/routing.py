"""A mixture of experts' routers, as transformers builds them: found by the model's own declaration
of where its router logits come from (transformers' ``_can_record_outputs["router_logits"]``, the
recorder behind ``output_router_logits``), captured per forward by hooks, and routing replay: the
experts the engine chose for each token put in place of the router's own top-k. The learners'
forwards and the transformers generation backend both use it; the rows a forward's router sees
are the learner's business (:mod:`rltrain.learner.routers`).

Replay (``rollout.routing_replay``): a router of transformers' top-k kind returns ``(logits,
scores, indices)``; the hook keeps the logits (so the router keeps its gradients and the
load-balancing loss its probabilities), takes the replayed ``indices`` and gathers their scores
from the softmax as the router does (renormalized where it renormalizes its top-k). Rows without a
recorded route (padding, a sequence's last token, which the engine never ran) keep the router's
own choice.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from rltrain.batch import ROUTE_UNKNOWN


def _recorder(model: torch.nn.Module):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft
    for module in (base, getattr(base, "model", None)):
        recorder = getattr(type(module), "_can_record_outputs", None) or {}
        if "router_logits" in recorder:
            return recorder["router_logits"]
    return None


def find_routers(model: torch.nn.Module, recorder=None) -> list[torch.nn.Module]:
    """The model's routers in layer order; empty for a dense model (``recorder``: its
    ``router_logits`` declaration, looked up where not given)."""
    recorder = recorder or _recorder(model)
    if recorder is None or recorder.target_class is None:
        return []
    return [m for m in model.modules() if isinstance(m, recorder.target_class)]


class RouterTap:
    """Forward hooks on every router; inside :meth:`capture` each forward appends its layers'
    ``[N, E]`` router logits (the router's output ``index``) and the ``[N, k]`` experts each row
    went to, to the lists it yields. Outside it the hooks record nothing (a recomputation under
    gradient checkpointing, a reference forward). With :attr:`routes` set (``[N, L, k]``, the
    forward's rows), every forward replays them, recomputations included, until it is set again."""

    def __init__(self, model: torch.nn.Module):
        recorder = _recorder(model)
        self.routers = find_routers(model, recorder)
        self.index = 0 if recorder is None else recorder.index
        config = getattr(model, "config", None)
        first = self.routers[0] if self.routers else None
        self.top_k = int(getattr(first, "top_k", None) or getattr(config, "num_experts_per_tok", 0) or 0)
        self.num_experts = int(getattr(first, "num_experts", None) or config_experts(config))
        self._logits: list[torch.Tensor] | None = None
        self._chosen: list[torch.Tensor] = []
        self._measure = False
        self.routes: torch.Tensor | None = None  # [N, L, k] integer, ROUTE_UNKNOWN where not recorded
        self.mismatch = torch.zeros(2, dtype=torch.float64)  # (rows replayed elsewhere, rows replayed)
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(functools.partial(self._hook, layer))

    def _hook(self, layer: int, module, args, output):
        logits = output[self.index] if isinstance(output, tuple) else output
        logits = logits.reshape(-1, logits.shape[-1])
        replayed = None
        if self.routes is not None:
            replayed = output = self._replay(module, output, logits, self.routes[:, layer])
        if self._logits is not None:
            self._logits.append(logits)
            self._chosen.append(output[2].detach() if isinstance(output, tuple) else None)
        return replayed

    def _replay(self, module, output, logits_NE: torch.Tensor, routes_Nk: torch.Tensor):
        """``output`` with the recorded experts in place of the router's own top-k."""
        if routes_Nk.shape[0] != logits_NE.shape[0]:
            raise RuntimeError(
                f"routing replay: {routes_Nk.shape[0]} recorded rows for a router forward of {logits_NE.shape[0]}"
            )
        _, scores, own = output[:3]
        known_N = (routes_Nk < ROUTE_UNKNOWN).all(-1)
        chosen = torch.where(known_N[:, None], routes_Nk.to(own.dtype), own)
        if self._measure:
            elsewhere_N = known_N & (chosen.sort(-1).values != own.sort(-1).values).any(-1)
            self.mismatch += torch.stack([elsewhere_N.sum(), known_N.sum()]).double().cpu()
        picked = torch.softmax(logits_NE.float(), dim=-1).gather(-1, chosen)
        if getattr(module, "norm_topk_prob", True):  # (Mixtral's router always renormalizes)
            picked = picked / picked.sum(-1, keepdim=True)
        return (output[0], picked.to(scores.dtype), chosen, *output[3:])

    @contextlib.contextmanager
    def capture(self, measure: bool = False) -> Iterator[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Yields (router logits, experts chosen) of every router forward inside it, in order;
        ``measure``: count the replayed rows whose experts the router would not have chosen
        (:meth:`take_mismatch`)."""
        self._logits, self._chosen = captured, chosen = [], []
        self._measure = measure
        try:
            yield captured, chosen
        finally:
            self._logits, self._measure = None, False

    def take_mismatch(self) -> torch.Tensor:
        """(rows whose replayed experts differ from the router's own top-k, rows replayed) since
        the last call, over every layer."""
        out, self.mismatch = self.mismatch, torch.zeros(2, dtype=torch.float64)
        return out


def replay_problem(model: torch.nn.Module) -> str | None:
    """Why routing replay cannot patch ``model``'s routers, or None: it has none (not a mixture of
    experts), or its router does not return transformers' top-k ``(logits, scores, indices)``.
    Runs the first router once on two rows (on the meta device: no compute)."""
    routers = find_routers(model)
    if not routers:
        return "it is not a mixture of experts (no router)"
    router, top_k = routers[0], getattr(routers[0], "top_k", None)
    hidden = (
        getattr(router, "hidden_dim", None) or getattr(getattr(router, "weight", None), "shape", [0, 0])[-1]
    )
    name = type(router).__name__
    try:
        weight = next(router.parameters())
        with torch.no_grad():
            out = router(torch.zeros(2, hidden, device=weight.device, dtype=weight.dtype))
    except Exception as e:  # noqa: BLE001 - any failure means the replay cannot drive it
        return f"its router {name} does not run on [tokens, hidden] rows ({type(e).__name__}: {e})"
    ok = (
        isinstance(out, tuple) and len(out) >= 3 and top_k is not None
        and not out[2].is_floating_point() and tuple(out[2].shape) == (2, top_k)
        and tuple(out[1].shape) == (2, top_k)
    )  # fmt: skip
    if not ok:
        return f"its router {name} does not return transformers' top-k (logits, scores, indices)"
    return None


def config_experts(config) -> int:
    """How many routed experts a transformers config says its MoE layers have (0: dense)."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    return 0
