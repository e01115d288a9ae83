"""A mixture of experts' routers, as transformers builds them: found by the model's own declaration
of where its router logits come from (transformers' ``_can_record_outputs["router_logits"]``, the
recorder behind ``output_router_logits``), captured per forward by hooks, and routing replay: the
experts the engine chose for each token put in place of the router's own top-k. The learners'
forwards and the transformers generation backend both use it; the rows a forward's router sees
are the learner's business (:mod:`rltrain.learner.route_rows`).

Replay (``rollout.routing_replay``): a router of transformers' top-k kind returns ``(logits,
scores, indices)``; the hook keeps the logits (so the router keeps its gradients and the
load-balancing loss its probabilities), takes the replayed ``indices`` and weights them as the
router itself weights the experts it chose (:data:`SCORINGS`): a softmax over every expert,
renormalized over the top-k or not (Mixtral, Qwen-MoE), or each expert's sigmoid, renormalized
or not and times ``routed_scaling_factor`` (DeepSeek-V3, GLM-4-MoE: their correction bias and
group limit steer the choice only, not the weights). Which one a router uses is not read from its
class: it is found by running a copy of the router on random rows (random weights and bias) and
comparing each scoring of the router's own top-k with the router's own weights
(:func:`own_scoring`); a router none reproduces is refused before the run, in one line. Rows
without a recorded route (padding, a sequence's last token, which the engine never ran) keep the
router's own choice.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator

import torch

from rltrain.batch import MAX_ROUTED_EXPERTS
from rltrain.forward.head import probing

PROBE_ROWS = 64  # random rows a router's copy scores to find its scoring


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
        self.routes: torch.Tensor | None = None  # [N, L, k] integer, negative where not recorded
        # [N]: the sequences each row stands for in the measured counts (a prefix tree's shared
        # prompt token, once per member, as in the unshared forward); None: one each
        self.row_weights: torch.Tensor | None = None
        # the routers' own weighting of their top-k, or why replay cannot reproduce it (raised at a replay)
        self.scoring = own_scoring(first) if first is not None else None
        self.mismatch = torch.zeros(2, dtype=torch.float64)  # (rows replayed elsewhere, rows replayed)
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(functools.partial(self._hook, layer))

    def _hook(self, layer: int, module, args, output):
        if probing():  # (the head path's probe: no forward of a batch)
            return None
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
        known_N = (routes_Nk >= 0).all(-1)
        chosen = torch.where(known_N[:, None], routes_Nk.to(own.dtype), own)
        if self._measure:
            elsewhere_N = known_N & (chosen.sort(-1).values != own.sort(-1).values).any(-1)
            w_N = (
                self.row_weights
                if self.row_weights is not None
                else torch.ones_like(known_N, dtype=torch.long)
            )
            counts = torch.stack([(elsewhere_N * w_N).sum(), (known_N * w_N).sum()])
            self.mismatch += counts.double().cpu()
        if not isinstance(self.scoring, tuple):
            raise RuntimeError(f"routing replay: {self.scoring}")
        weights = self.scoring[1](module, logits_NE, chosen)
        return (output[0], weights.to(scores.dtype), chosen, *output[3:])

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


def _softmax(router, logits_NE: torch.Tensor, chosen_Nk: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits_NE.float(), dim=-1).gather(-1, chosen_Nk)


def _softmax_renormalized(router, logits_NE: torch.Tensor, chosen_Nk: torch.Tensor) -> torch.Tensor:
    picked = _softmax(router, logits_NE, chosen_Nk)
    return picked / picked.sum(-1, keepdim=True)


def _sigmoid(router, logits_NE: torch.Tensor, chosen_Nk: torch.Tensor) -> torch.Tensor:
    picked = logits_NE.float().sigmoid().gather(-1, chosen_Nk)
    return picked * getattr(router, "routed_scaling_factor", 1.0)


def _sigmoid_renormalized(router, logits_NE: torch.Tensor, chosen_Nk: torch.Tensor) -> torch.Tensor:
    picked = logits_NE.float().sigmoid().gather(-1, chosen_Nk)
    picked = picked / (picked.sum(-1, keepdim=True) + 1e-20)  # (DeepSeek-V3's guard, kept exact)
    return picked * getattr(router, "routed_scaling_factor", 1.0)


# how a router weights the experts it chose, from its logits [N, E] and the chosen ids [N, k]
SCORINGS: dict[str, Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "softmax renormalized over the top-k": _softmax_renormalized,  # Mixtral, Qwen-MoE (norm_topk_prob)
    "softmax": _softmax,
    "sigmoid renormalized over the top-k, scaled": _sigmoid_renormalized,  # DeepSeek-V3, GLM-4-MoE
    "sigmoid, scaled": _sigmoid,
}


def _random_copy(module: torch.nn.Module, generator: torch.Generator) -> torch.nn.Module:
    """A copy of ``module`` on the CPU with random floating-point weights and buffers (the original,
    on the meta device, a GPU or partitioned by ZeRO-3, is left as it is); its forward is its own."""
    out = copy.copy(module)
    shape = lambda t: tuple(getattr(t, "ds_shape", None) or t.shape)  # noqa: E731  (ZeRO-3: the full shape)

    def fresh(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return torch.randn(shape(t), generator=generator, dtype=torch.float32).to(t.dtype)
        return torch.zeros(shape(t), dtype=t.dtype)

    out._parameters = {n: None if p is None else torch.nn.Parameter(fresh(p), requires_grad=False)
                       for n, p in module._parameters.items()}  # fmt: skip
    out._buffers = {n: None if b is None else fresh(b) for n, b in module._buffers.items()}
    out._modules = {n: None if m is None else _random_copy(m, generator) for n, m in module._modules.items()}
    for key, value in vars(module).items():  # none of the original's hooks (a RouterTap's among them)
        if key.endswith("hooks") and isinstance(value, dict):
            setattr(out, key, type(value)())
    return out


def own_scoring(router: torch.nn.Module) -> tuple[str, Callable] | str:
    """``(name, scoring)``: the first of :data:`SCORINGS` that gives the router's own weights for
    its own top-k on random rows (a copy of the router with random weights and bias), or why
    replay cannot drive the router (one line)."""
    name, top_k = type(router).__name__, getattr(router, "top_k", None)
    hidden = (
        getattr(router, "hidden_dim", None) or getattr(getattr(router, "weight", None), "shape", [0, 0])[-1]
    )
    generator = torch.Generator().manual_seed(0)
    try:
        probe = _random_copy(router, generator)
        rows = torch.randn(PROBE_ROWS, hidden, generator=generator)
        dtype = next((p.dtype for p in probe.parameters() if p.is_floating_point()), torch.float32)
        with torch.no_grad():
            out = probe(rows.to(dtype))
    except Exception as e:  # noqa: BLE001 - any failure means the replay cannot drive it
        return f"its router {name} does not run on [tokens, hidden] rows ({type(e).__name__}: {e})"
    ok = (
        isinstance(out, tuple) and len(out) >= 3 and top_k is not None
        and not out[2].is_floating_point() and tuple(out[2].shape) == (PROBE_ROWS, top_k)
        and tuple(out[1].shape) == (PROBE_ROWS, top_k)
    )  # fmt: skip
    if not ok:
        return f"its router {name} does not return transformers' top-k (logits, scores, indices)"
    logits, scores, chosen = out[0].reshape(PROBE_ROWS, -1), out[1].float(), out[2].long()
    for kind, scoring in SCORINGS.items():
        replayed = scoring(probe, logits, chosen).to(out[1].dtype).float()
        if torch.allclose(replayed, scores, rtol=1e-4, atol=1e-6):
            return kind, scoring
    return (
        f"its router {name} weights the experts it chooses in a way routing replay does not reproduce "
        f"(none of: {'; '.join(SCORINGS)}): replayed forwards would mix experts with other weights"
    )


def replay_problem(model: torch.nn.Module) -> str | None:
    """Why routing replay cannot drive ``model``'s routers, or None: it has none (not a mixture of
    experts), more experts than route ids hold, or a router that does not return transformers'
    top-k ``(logits, scores, indices)`` or whose weighting of its own top-k no replay scoring
    reproduces (:func:`own_scoring`, on a random copy of its first router)."""
    routers = find_routers(model)
    if not routers:
        return "it is not a mixture of experts (no router)"
    experts = int(getattr(routers[0], "num_experts", None) or config_experts(getattr(model, "config", None)))
    if experts > MAX_ROUTED_EXPERTS:
        return f"its {experts} experts are more than routing replay's expert ids hold ({MAX_ROUTED_EXPERTS})"
    found = own_scoring(routers[0])
    return found if isinstance(found, str) else None


def config_experts(config) -> int:
    """How many routed experts a transformers config says its MoE layers have (0: dense)."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    return 0
