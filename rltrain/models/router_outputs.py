"""What a mixture of experts' router returns, read by its shape: one entry of :data:`ROUTER_KINDS`
for each kind of output transformers' MoE families have (the table is in :mod:`rltrain.models.routers`,
which finds the routers and runs them), and how a router weights the experts it chose
(:class:`Scoring`, what routing replay reproduces). Pure torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PROBE_ROWS = 64  # random rows a router's copy scores to find its kind and scoring


@dataclass(frozen=True)
class TopK:
    """``(..., logits [N, E], weights [N, k], experts [N, k], ...)`` in any order (transformers'
    top-k routers; Granite's returns experts first, Inkling's a fourth tensor)."""

    logits_at: int
    weights_at: int
    chosen_at: int
    name = "top-k"

    def read(self, output, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return output[self.logits_at], output[self.chosen_at]

    def weights(self, output, chosen_Nk: torch.Tensor) -> torch.Tensor:
        return output[self.weights_at]

    def with_choice(self, output, chosen_Nk: torch.Tensor, weights_Nk: torch.Tensor):
        out = list(output)
        out[self.weights_at] = weights_Nk.to(output[self.weights_at].dtype)
        out[self.chosen_at] = chosen_Nk.to(output[self.chosen_at].dtype)
        return tuple(out)


@dataclass(frozen=True)
class DenseScores:
    """``(scores [N, E], logits [N, E])``: every expert's weight, zero off the chosen (Llama 4)."""

    scores_at: int
    logits_at: int
    name = "dense scores"

    def read(self, output, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return output[self.logits_at], output[self.scores_at].detach().topk(top_k, dim=-1).indices

    def weights(self, output, chosen_Nk: torch.Tensor) -> torch.Tensor:
        return output[self.scores_at].gather(-1, chosen_Nk)

    def with_choice(self, output, chosen_Nk: torch.Tensor, weights_Nk: torch.Tensor):
        scores = output[self.scores_at]
        out = list(output)
        out[self.scores_at] = torch.zeros_like(scores).scatter(-1, chosen_Nk, weights_Nk.to(scores.dtype))
        return tuple(out)


@dataclass(frozen=True)
class Sorted:
    """``(positions [N k] of the flat top-k sorted by expert, their rows [N k], their gates [N k],
    tokens per expert, logits [N, E])`` (JetMoE's gating, for its attention and its MLP experts)."""

    name = "sorted"

    def read(self, output, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        order, _, _, sizes, logits = output[:5]
        experts = torch.repeat_interleave(torch.arange(len(sizes), device=order.device),
                                          torch.as_tensor(sizes, device=order.device))  # fmt: skip
        flat = torch.empty_like(order).scatter_(0, order, experts)
        return logits, flat.view(-1, top_k)

    def weights(self, output, chosen_Nk: torch.Tensor) -> torch.Tensor:
        order, _, gates = output[:3]
        return torch.empty_like(gates).scatter_(0, order, gates).view(chosen_Nk.shape)

    def with_choice(self, output, chosen_Nk: torch.Tensor, weights_Nk: torch.Tensor):
        order, rows, gates, sizes, logits = output[:5]
        k = chosen_Nk.shape[-1]
        _, order = chosen_Nk.flatten().sort(0)
        counts = torch.bincount(chosen_Nk.flatten(), minlength=logits.shape[-1])
        new_sizes = counts.tolist() if isinstance(sizes, list) else counts
        return (order, order.div(k, rounding_mode="trunc"), weights_Nk.flatten()[order].to(gates.dtype),
                new_sizes, logits, *output[5:])  # fmt: skip


@dataclass(frozen=True)
class LogitsAlone:
    """The logits ``[N, E]`` alone (Jamba's router is a linear layer): its block chooses their top-k
    (as transformers' load-balancing loss reads them); a replay cannot reach that choice."""

    name = "logits alone"

    def read(self, output, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return output, output.detach().topk(top_k, dim=-1).indices

    def weights(self, output, chosen_Nk: torch.Tensor) -> None:
        return None

    with_choice = None


ROUTER_KINDS = (TopK, DenseScores, Sorted, LogitsAlone)
RouterKind = TopK | DenseScores | Sorted | LogitsAlone


def output_kind(output, logits_at: int, top_k: int | None) -> RouterKind | str:
    """The kind of a router's ``output`` on :data:`PROBE_ROWS` rows, whose logits its recorder puts at
    ``logits_at``; or what it returns, in words, where no kind reads it."""

    def shape(t) -> tuple:
        return tuple(t.shape) if isinstance(t, torch.Tensor) else ()

    def described() -> str:
        parts = output if isinstance(output, tuple) else (output,)
        return ", ".join(f"{'int' if not p.is_floating_point() else 'float'} {list(p.shape)}"
                         if isinstance(p, torch.Tensor) else type(p).__name__ for p in parts)  # fmt: skip

    if isinstance(output, torch.Tensor):
        if output.is_floating_point() and output.dim() == 2 and output.shape[0] == PROBE_ROWS and top_k:
            return LogitsAlone()
        return f"returns {described()}, not one logit an expert for each row"
    if not isinstance(output, tuple) or not -len(output) <= logits_at < len(output):
        return f"returns {type(output).__name__}"
    logits_at %= len(output)
    logits = output[logits_at]
    if not (isinstance(logits, torch.Tensor) and logits.is_floating_point() and shape(logits)[:1] == (PROBE_ROWS,)
            and logits.dim() == 2):  # fmt: skip
        return f"returns ({described()}): its logits are not one an expert for each row"
    experts = logits.shape[-1]
    others = [(i, p) for i, p in enumerate(output) if i != logits_at and isinstance(p, torch.Tensor)]
    chosen = [i for i, p in others if not p.is_floating_point() and p.dim() == 2 and p.shape[0] == PROBE_ROWS]
    weights = [i for i, p in others if p.is_floating_point() and p.dim() == 2 and p.shape[0] == PROBE_ROWS]
    if len(chosen) == 1 and any(shape(output[i]) == shape(output[chosen[0]]) for i in weights):
        weights_at = next(i for i in weights if shape(output[i]) == shape(output[chosen[0]]))
        return TopK(logits_at, weights_at, chosen[0])
    if not chosen and len(weights) == 1 and shape(output[weights[0]]) == (PROBE_ROWS, experts):
        return DenseScores(weights[0], logits_at)
    if (logits_at == 4 and len(output) >= 5 and all(shape(output[i])[:1] == shape(output[0])[:1] for i in (1, 2))
            and len(output[3]) == experts and shape(output[0])[0] % PROBE_ROWS == 0):  # fmt: skip
        return Sorted()
    return f"returns ({described()}), which no kind of router rltrain reads has"


@dataclass(frozen=True)
class Scoring:
    """A router's weights of the experts it chose: a ``softmax`` over every expert or each
    expert's ``sigmoid`` (or ``sqrt-softplus``), ``renormalized`` over the chosen or not, times
    ``scale`` (DeepSeek's ``routed_scaling_factor``: a constant of the router)."""

    activation: str
    renormalized: bool
    scale: float = 1.0

    def agrees(self, other: Scoring) -> bool:
        return (self.activation, self.renormalized) == (other.activation, other.renormalized) and abs(
            self.scale - other.scale
        ) <= 1e-4 * abs(self.scale)

    def __call__(self, logits_NE: torch.Tensor, chosen_Nk: torch.Tensor) -> torch.Tensor:
        logits = logits_NE.float()
        if self.activation == "softmax":
            scores = torch.softmax(logits, dim=-1)
        elif self.activation == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = torch.nn.functional.softplus(logits).sqrt()
        picked = scores.gather(-1, chosen_Nk.long())
        if self.renormalized:
            picked = picked / (picked.sum(-1, keepdim=True) + 1e-20)  # (DeepSeek-V3's guard, kept exact)
        return picked * self.scale

    def __str__(self) -> str:
        renormalized = " renormalized over the chosen" if self.renormalized else ""
        scale = f", times {self.scale:g}" if self.scale != 1.0 else ""
        return f"{self.activation}{renormalized}{scale}"


def own_scoring(logits_NE: torch.Tensor, chosen_Nk: torch.Tensor, weights_Nk: torch.Tensor) -> Scoring | None:
    """The scoring that gives ``weights`` from ``logits`` and ``chosen`` (a router's own, on random
    rows), its constant fitted; None where none does."""
    weights = weights_Nk.float()
    for activation in ("softmax", "sigmoid", "sqrt-softplus"):
        for renormalized in (True, False):
            unscaled = Scoring(activation, renormalized)(logits_NE, chosen_Nk)
            scale = (weights.sum() / unscaled.sum()).item() if unscaled.sum() != 0 else 1.0
            scale = 1.0 if abs(scale - 1.0) < 1e-6 else scale
            scoring = Scoring(activation, renormalized, scale)
            if torch.allclose(scoring(logits_NE, chosen_Nk), weights, rtol=1e-4, atol=1e-6):
                return scoring
    return None
