"""The rows of a learner's forward that a mixture's routers see, in the forward's order (padded,
packed or a sequence-parallel slice): which of them count in the load-balancing loss
(:mod:`rltrain.loss.moe` says which) and the routes replayed on them. The routers themselves,
their hooks and the replay are :mod:`rltrain.models.routers`."""

from __future__ import annotations

import torch

from rltrain.batch import ROUTE_UNKNOWN, TrainBatch
from rltrain.forward.layouts import ordered, row_slice
from rltrain.forward.tree import PrefixTree
from rltrain.loss.moe import expert_load_max


def in_forward_order(
    values_BT: torch.Tensor,
    attention_BT: torch.Tensor,
    packed: bool,
    sp: int,
    sp_rank: int,
    fill,
    tree: PrefixTree | None = None,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, T, ...]`` per-token values as the rows of a forward on the micro-batch: padded, every
    cell (laid out by ``order`` where the model keeps its padding after each sequence:
    :func:`rltrain.forward.layouts.trailing_order`; ignored in the other layouts); packed, the attended tokens in one row; a prefix
    tree, its row's tokens (a shared token takes its first member's); sequence-parallel, this rank's
    slice of that row, padded with ``fill`` to a multiple of ``sp``."""
    if tree is not None:
        return tree.in_row_order(values_BT)
    if not packed and sp == 1:
        if order is not None:
            values_BT = ordered(values_BT, order)
        return values_BT.reshape(-1, *values_BT.shape[2:])
    real = values_BT[attention_BT.bool()]  # the packed row's tokens, in order
    if sp == 1:
        return real
    part = row_slice(len(real), sp, sp_rank)
    padding = real.new_full((max(part.stop - len(real), 0), *real.shape[1:]), fill)
    return torch.cat([real, padding])[part]


def router_rows(
    mb: TrainBatch, packed: bool, sp: int, sp_rank: int, tree: PrefixTree | None = None,
    order: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Which rows of a forward on ``mb`` the router sees are real tokens: ``[N]`` bool, in the
    forward's order (:func:`in_forward_order`); through a prefix ``tree``, ``[N]`` int64, how many
    sequences each row stands for (a shared prompt token counts once per member, as in the
    unshared forward). An empty micro-batch's stand-in row (``mb.blank``) has none."""
    keep_BT = mb.attention_mask.bool()
    if mb.blank is not None:
        keep_BT = keep_BT & ~mb.blank.bool()[:, None]
    if tree is not None:
        return torch.bincount(tree.cell_BT[keep_BT], minlength=tree.tokens)
    return in_forward_order(keep_BT, mb.attention_mask, packed, sp, sp_rank, False, order=order)


def replayed_routes(
    mb: TrainBatch, packed: bool, sp: int, sp_rank: int, tree: PrefixTree | None = None,
    order: torch.Tensor | None = None,
) -> torch.Tensor | None:  # fmt: skip
    """``mb.routes`` as the rows of its forward, ``[N, L, k]`` int64 (None: no routes); a shared
    prompt token takes its first member's routes."""
    if mb.routes is None:
        return None
    return in_forward_order(
        mb.routes, mb.attention_mask, packed, sp, sp_rank, ROUTE_UNKNOWN, tree, order
    ).long()


def moe_metrics(
    totals: dict[str, torch.Tensor], layers: int, aux_steps: int | None, replay: bool
) -> dict[str, float]:
    """The logged router metrics from a step's global totals (``PolicyLearner.METRIC_TOTALS``):
    entropy per row, the busiest expert's share per layer, the load-balancing loss per optimizer
    step (``aux_steps``: None where it is off), and under replay the share of replayed rows the
    router would have sent elsewhere."""
    load_L = expert_load_max(totals["expert_load"].view(layers, -1))
    rows = max(totals["router_rows"].item(), 1.0)
    out = {
        "moe/router_entropy": totals["router_entropy"].item() / rows,
        "moe/expert_load_max": load_L.max().item(),
    }
    out |= {f"moe/expert_load_max/layer_{i}": v for i, v in enumerate(load_L.tolist())}
    if aux_steps:
        out["moe/aux_loss"] = totals["moe_aux"].item() / aux_steps
    if replay:
        elsewhere, replayed = totals["routing_mismatch"].tolist()
        out["moe/routing_mismatch"] = elsewhere / max(replayed, 1.0)
        # rows whose experts came from the engine (each sequence's last token never ran there):
        # near 1, where 0 would mean a replay that silently did nothing
        out["moe/routes_replayed"] = replayed / rows
    return out
