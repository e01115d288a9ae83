"""A mixture of experts' routers, read by what they return.

Where: the modules transformers records as ``router_logits`` (the model's
``_can_record_outputs["router_logits"]``, the recorders behind ``output_router_logits``: a class,
narrowed by a layer name where given; a recorder whose module holds another recorder's, as JetMoE's
attention holds its experts' router, is the same router seen twice and is left out).

What: a router's output is read by its shape, once per router class, on a copy of the router with
random weights run on random rows (:func:`inspect_router`; a router that takes more than the rows,
as MiniMax-M2's and Hunyuan-V3's take their block's score-correction bias, gets a random one of
the block's). Each kind of output is one entry of :data:`ROUTER_KINDS`:

=========================  ==========================================  ===========================
kind                        families (transformers 5.19)                experts chosen, read from
=========================  ==========================================  ===========================
top-k                       Qwen-MoE, Mixtral, OLMoE, gpt-oss; the      the integer ``[N, k]``
                            sigmoid routers with a score-correction     (the bias steers the choice,
                            bias and group limits (DeepSeek-V3, GLM-4.5, not the weights)
                            MiniMax-M2, LFM2-MoE); Granite's order
                            (experts, weights, logits)
dense scores                Llama 4 (``[N, E]`` scores, zero off the    the non-zero scores
                            experts chosen)
sorted                      JetMoE (positions sorted by expert, their   the positions and the
                            rows, gates and sizes), two routers a        tokens per expert
                            layer (attention experts and MLP experts)
logits alone                Jamba (a linear layer; its block takes the  the top-k of the logits
                            top-k)
=========================  ==========================================  ===========================

Every kind gives the logits ``[N, E]`` (the load-balancing loss's probabilities and the router
metrics) and the experts each row went to ``[N, k]`` (the loss's assignment counts, the recorded
routes). Shared experts are not routers: every token goes to them. A router none of the kinds
reads (Doge's product keys score ``2 x sqrt(E)`` keys, not the experts; Zaya's takes the previous
layer's router state) is refused for the load-balancing loss and routing replay in one line
(:func:`moe_problem`).

Routing replay (``rollout.routing_replay``): the experts the engine chose for each token go in place
of the router's own, weighted as the router weights the experts it chooses (:class:`Scoring`: a
softmax over every expert or each expert's sigmoid, renormalized over the chosen or not, times a
constant), found by comparing each scoring with the router's own weights on the same random rows.
The logits keep their gradient, so the router still learns. A kind that returns no weights (logits
alone: its block chooses) cannot be replayed. Rows without a recorded route (padding, a sequence's
last token, which the engine never ran) keep the router's own choice. The rows a forward's router
sees are the learner's business (:mod:`rltrain.learner.route_rows`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rltrain.batch import MAX_ROUTED_EXPERTS
from rltrain.forward.head import probing
from rltrain.models.router_outputs import PROBE_ROWS, RouterKind, Scoring, output_kind, own_scoring


def _recorders(model: torch.nn.Module) -> list:
    """The model's ``router_logits`` recorders (as transformers normalizes them), or []."""
    from transformers.utils.output_capturing import OutputRecorder

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft
    for module in (base, getattr(base, "model", None), getattr(base, "language_model", None)):
        found = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
        if found is not None:
            found = found if isinstance(found, list) else [found]
            return [r if isinstance(r, OutputRecorder) else
                    OutputRecorder(target_class=None if isinstance(r, str) else r, index=1,
                                   class_name=r if isinstance(r, str) else None) for r in found]  # fmt: skip
    return []


def _matches(recorder, name: str, module: torch.nn.Module) -> bool:
    by_class = recorder.target_class is not None and isinstance(module, recorder.target_class)
    by_name = recorder.class_name is not None and name.endswith(recorder.class_name)
    if not (by_class or by_name):
        return False
    return recorder.layer_name is None or f".{recorder.layer_name.strip('.')}." in f".{name}."


def find_routers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, int]]:
    """``(name, router, where its output holds the logits)`` of every router, in the model's module
    order (the order they run in); empty for a dense model. A recorded module that holds another
    recorded one is the inner router seen again (JetMoE's attention and its experts' gating)."""
    recorders = _recorders(model)
    found = [(name, module, recorder.index) for name, module in model.named_modules()
             for recorder in recorders if _matches(recorder, name, module)]  # fmt: skip
    names = [name for name, _, _ in found]
    return [entry for entry in found if not any(other.startswith(entry[0] + ".") for other in names)]


@dataclass(frozen=True)
class RouterRead:
    """What one class of router returns: its kind (or why none reads it), how it weights the experts it
    chose (or why replay cannot reproduce it), its top-k and experts."""

    name: str
    kind: RouterKind | str
    scoring: Scoring | str
    top_k: int
    num_experts: int


def _parents(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    return {id(child): module for module in model.modules() for child in module.children()}


def _random_copy(
    module: torch.nn.Module, generator: torch.Generator, zero_buffers: bool = False
) -> torch.nn.Module:
    """A copy of ``module`` on the CPU with random floating-point weights and buffers (zero buffers
    where asked; the original, on the meta device, a GPU or partitioned by ZeRO-3, is left as it
    is); its forward is its own."""
    out = copy.copy(module)
    out._parameters = {n: None if p is None else torch.nn.Parameter(_fresh(p, generator), requires_grad=False)
                       for n, p in module._parameters.items()}  # fmt: skip
    out._buffers = {
        n: None if b is None else _fresh(b, generator, zero_buffers) for n, b in module._buffers.items()
    }
    out._modules = {n: None if m is None else _random_copy(m, generator, zero_buffers)
                    for n, m in module._modules.items()}  # fmt: skip
    for key, value in vars(module).items():  # none of the original's hooks (a RouterTap's among them)
        if key.endswith("hooks") and isinstance(value, dict):
            setattr(out, key, type(value)())
    return out


PROBE_SCALE = 0.2  # of the random weights: logits of a few units, sigmoids short of saturation


def _fresh(t: torch.Tensor, generator: torch.Generator, zero: bool = False) -> torch.Tensor:
    shape = tuple(getattr(t, "ds_shape", None) or t.shape)  # (ZeRO-3: the full shape)
    if t.is_floating_point() and not zero:
        return (PROBE_SCALE * torch.randn(shape, generator=generator, dtype=torch.float32)).to(t.dtype)
    return torch.zeros(shape, dtype=t.dtype)


def _probe_inputs(
    router: torch.nn.Module, parent, hidden: int, generator, zero_buffers: bool = False
) -> list | str:
    """Random rows and, for each further argument the router's forward takes, its block's tensor of
    that name (random) or the argument's default; or why the router cannot be run alone."""
    rows = torch.randn(PROBE_ROWS, hidden, generator=generator)
    args: list = [rows]
    for p in list(inspect.signature(router.forward).parameters.values())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        value = getattr(parent, p.name, None)
        if isinstance(value, torch.Tensor):
            args.append(_fresh(value, generator, zero_buffers))
        elif value is not None or p.default is not p.empty:
            args.append(value if value is not None else p.default)
        else:
            return f"takes {p.name}, which its block does not hold"
    return args


def _hidden_size(router: torch.nn.Module, model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    if getattr(router, "hidden_dim", None):
        return int(router.hidden_dim)
    weight = getattr(router, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(getattr(weight, "ds_shape", weight.shape)[-1])
    return int(text.hidden_size)


def inspect_router(model: torch.nn.Module, name: str, router: torch.nn.Module, logits_at: int,
                   parent: torch.nn.Module | None = None) -> RouterRead:  # fmt: skip
    """Run random copies of ``router`` on random rows and read its output (module docstring): twice,
    its buffers random (a score-correction bias steering the choice) and zero (a bias that leaves
    each expert its chance: Zaya's skip expert); both must read alike."""
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    top_k = int(getattr(router, "top_k", None) or config_top_k(text))
    experts = int(getattr(router, "num_experts", None) or config_experts(text))
    reads = [_probe(model, router, logits_at, parent, top_k, seed, zero_buffers=seed == 1) for seed in (0, 1)]
    for read in reads:
        if isinstance(read, str):
            return RouterRead(name, f"its router {type(router).__name__} {read}", "", top_k, experts)
    (kind, scoring, k, e), (_, other, _, _) = reads
    if isinstance(scoring, Scoring) and (not isinstance(other, Scoring) or not scoring.agrees(other)):
        scoring = other if isinstance(other, str) else _UNREPRODUCED
    if isinstance(scoring, str):
        scoring = f"its router {type(router).__name__} {scoring}"
    return RouterRead(name, kind, scoring, k, e)


_UNREPRODUCED = (
    "weights the experts it chooses in a way routing replay does not reproduce (a softmax or sigmoid of "
    "its logits, renormalized or not, times a constant): replayed forwards would mix experts with other weights"
)


def _probe(model, router, logits_at: int, parent, top_k: int, seed: int, zero_buffers: bool):
    """``(kind, scoring or why not, top-k, experts)`` of one random copy's output, or why it cannot
    be read."""
    generator = torch.Generator().manual_seed(seed)
    try:
        probe = _random_copy(router, generator, zero_buffers)
        inputs = _probe_inputs(router, parent, _hidden_size(router, model), generator, zero_buffers)
        if isinstance(inputs, str):
            return inputs
        dtype = next((p.dtype for p in probe.parameters() if p.is_floating_point()), torch.float32)
        rows = inputs[0].to(dtype)
        with torch.no_grad():
            try:
                output = probe(rows, *inputs[1:])
            except Exception:  # noqa: BLE001 - a router of [batch, tokens, hidden] (Doge's)
                output = probe(rows[None], *inputs[1:])
    except Exception as e:  # noqa: BLE001 - any failure means rltrain cannot read it
        line = str(e).splitlines()[0] if str(e) else ""
        return f"does not run on [tokens, hidden] rows ({type(e).__name__}: {line})"
    kind = output_kind(output, logits_at, top_k)
    if isinstance(kind, str):
        return kind
    logits, chosen = kind.read(output, top_k)
    logits, chosen = logits.reshape(-1, logits.shape[-1]), chosen.reshape(-1, chosen.shape[-1])
    weights = kind.weights(output, chosen.long())
    if weights is None:
        scoring = "returns its logits alone (the experts are chosen outside it)"
    else:
        scoring = own_scoring(logits, chosen.long(), weights.reshape(chosen.shape)) or _UNREPRODUCED
        if isinstance(scoring, Scoring) and scoring.scale != 1.0:  # the router's own constant, exactly
            constants = [v for v in vars(router).values() if isinstance(v, float)]
            near = [v for v in constants if abs(v - scoring.scale) <= 1e-5 * abs(v)]
            scoring = Scoring(scoring.activation, scoring.renormalized, near[0]) if near else scoring
    return kind, scoring, chosen.shape[-1], logits.shape[-1]


def read_routers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, RouterRead]]:
    """Every router with what it returns (one inspection for each class of router)."""
    found, parents, reads = find_routers(model), _parents(model), {}
    out = []
    for name, router, logits_at in found:
        key = (type(router), logits_at)
        if key not in reads:
            reads[key] = inspect_router(model, name, router, logits_at, parents.get(id(router)))
        out.append((router, reads[key]))
    return out


def moe_problem(model: torch.nn.Module, feature: str) -> str | None:
    """Why ``feature`` (the load-balancing loss ``aux``, routing ``replay``, the router ``metrics``)
    cannot read ``model``'s routers, in words, or None."""
    return _problem(read_routers(model), feature)


def _problem(routers: list[tuple[torch.nn.Module, RouterRead]], feature: str) -> str | None:
    if not routers:
        return "it is not a mixture of experts (no router)"
    reads = list(dict.fromkeys(read for _, read in routers))
    for read in reads:
        if isinstance(read.kind, str):
            return read.kind
    if len({(r.top_k, r.num_experts) for r in reads}) > 1:
        shapes = sorted({f"top-{r.top_k} of {r.num_experts}" for r in reads})
        return f"its routers choose different numbers of experts ({', '.join(shapes)})"
    if feature == "replay":
        if reads[0].num_experts > MAX_ROUTED_EXPERTS:
            return f"its {reads[0].num_experts} experts are more than routing replay's expert ids hold ({MAX_ROUTED_EXPERTS})"  # fmt: skip
        for read in reads:
            if isinstance(read.scoring, str):
                return read.scoring
    return None


def replay_problem(model: torch.nn.Module) -> str | None:
    """Why routing replay cannot drive ``model``'s routers, or None (:func:`moe_problem`)."""
    return moe_problem(model, "replay")


def own_aux_loss(model) -> bool:
    """Whether the model's own transformers code adds a load-balancing loss (its modeling module has
    ``load_balancing_loss_func``); families that balance otherwise (DeepSeek-V3's score-correction
    bias) do not."""
    import sys

    from rltrain.forward.model import causal_lm

    modules = {type(causal_lm(model)).__module__, type(model).__module__}
    return any(hasattr(sys.modules.get(m), "load_balancing_loss_func") for m in modules)


def aux_coef(model, configured: float | None) -> float:
    """The load-balancing loss's weight: ``configured`` (``loss.moe_aux_coef``), or where unset the
    model config's ``router_aux_loss_coef`` if its transformers code adds the loss, else 0."""
    if configured is not None:
        return configured
    if not own_aux_loss(model):
        return 0.0
    config = getattr(model, "config", None)
    for section, key in ((config, "router_aux_loss_coef"), (getattr(config, "text_config", None), "router_aux_loss_coef"),
                         (getattr(config, "ffn_config", None), "moe_loss_weight")):  # fmt: skip
        if getattr(section, key, None) is not None:
            return float(getattr(section, key))
    return 0.0


def config_top_k(config) -> int:
    """How many experts a transformers config says each token goes to (0: not said)."""
    if getattr(config, "ffn_config", None) is not None:  # (DBRX's)
        config = config.ffn_config
    for key in ("num_experts_per_tok", "moe_topk", "moe_top_k"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value:
            return value
    return 0


def config_experts(config) -> int:
    """How many routed experts a transformers config says its MoE layers have (0: dense); DBRX
    says so in its ``ffn_config``."""
    if getattr(config, "ffn_config", None) is not None:
        config = config.ffn_config
    for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value:
            return value
        if isinstance(value, (list, tuple)) and value:  # (one number a layer)
            return int(max(value))
    return 0


class RouterTap:
    """Forward hooks on every router; inside :meth:`capture` each forward appends its routers'
    ``[N, E]`` logits and the ``[N, k]`` experts each row went to, to the lists it yields. Outside
    it the hooks record nothing (a recomputation under gradient checkpointing, a reference forward).
    With :attr:`routes` set (``[N, L, k]``, the forward's rows), every forward replays them,
    recomputations included, until it is set again. A model whose routers no kind reads has a tap
    with no routers (:attr:`problem` says why)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        found = read_routers(model)
        self.problem = _problem(found, "metrics") if found else None
        reads = [read for _, read in found]
        self.routers = [router for router, _ in found] if self.problem is None else []
        self.top_k = reads[0].top_k if reads else 0
        self.num_experts = reads[0].num_experts if reads else 0
        self._logits: list[torch.Tensor] | None = None
        self._chosen: list[torch.Tensor] = []
        self._measure = False
        self.routes: torch.Tensor | None = None  # [N, L, k] integer, negative where not recorded
        # [N]: the sequences each row stands for in the measured counts (a prefix tree's shared
        # prompt token, once per member, as in the unshared forward); None: one each
        self.row_weights: torch.Tensor | None = None
        self.mismatch = torch.zeros(2, dtype=torch.float64)  # (rows replayed elsewhere, rows replayed)
        # each router's place in the routes: the order they first run in (JetMoE registers its MLP's
        # router before its attention's, which runs first)
        self._layer: dict[int, int] = {}
        for router, read in found if self.problem is None else []:
            router.register_forward_hook(functools.partial(self._hook, read))

    def _hook(self, read: RouterRead, module, args, output):
        if probing(self.model):  # (the head path's probe: no forward of a batch)
            return None
        layer = self._layer.setdefault(id(module), len(self._layer))
        logits, own = read.kind.read(output, self.top_k)
        logits, own = logits.reshape(-1, logits.shape[-1]), own.reshape(-1, self.top_k)
        replayed, chosen = None, own
        if self.routes is not None:
            replayed, chosen = self._replay(read, output, logits, own, self.routes[:, layer])
        if self._logits is not None:
            self._logits.append(logits)
            self._chosen.append(chosen.detach().long())
        return replayed

    def _replay(self, read: RouterRead, output, logits_NE, own_Nk, routes_Nk: torch.Tensor):
        """``output`` with the recorded experts in place of the router's own, and those experts."""
        if routes_Nk.shape[0] != logits_NE.shape[0]:
            raise RuntimeError(
                f"routing replay: {routes_Nk.shape[0]} recorded rows for a router forward of {logits_NE.shape[0]}"
            )
        if isinstance(read.scoring, str) or read.kind.with_choice is None:
            raise RuntimeError(f"routing replay: {read.scoring}")
        known_N = (routes_Nk >= 0).all(-1)
        chosen = torch.where(known_N[:, None], routes_Nk.to(own_Nk.device).long(), own_Nk.long())
        if self._measure:
            elsewhere_N = known_N & (chosen.sort(-1).values != own_Nk.long().sort(-1).values).any(-1)
            w_N = (
                self.row_weights
                if self.row_weights is not None
                else torch.ones_like(known_N, dtype=torch.long)
            )
            counts = torch.stack([(elsewhere_N * w_N).sum(), (known_N * w_N).sum()])
            self.mismatch += counts.double().cpu()
        return read.kind.with_choice(output, chosen, read.scoring(logits_NE, chosen)), chosen

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
