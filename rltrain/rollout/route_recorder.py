"""Routing replay, the engine's side: the experts a vLLM engine's routers choose for every position
of every request, recorded where they are computed.

Each MoE layer's router calls a capture hook (``set_capture_fn``) with the ``[tokens, k]`` expert
ids of one forward, in the order of the engine's batch. The model runner says whose tokens those
rows are and at which positions (``req_indices`` and ``positions``, the batch as it runs), so each
row lands at its request's position: the prompt's positions in its prefill, each sampled token's
in the decode step that runs it (a sequence's last token is never run, so it has none). vLLM's
own routed-experts output (``enable_return_routed_experts``) needs Model Runner V2, which needs
Triton: the hook works on every runner, so one path serves both devices.

The prefix cache is off under replay: a prompt whose blocks were cached is not run again, and its
positions would have no routes.
"""

from __future__ import annotations

import functools
import re

import numpy as np

from rltrain.batch import ROUTE_DTYPE, ROUTE_UNKNOWN

_INTERNAL_SUFFIX = re.compile(r"-[0-9a-f]{8}$")  # vLLM's engine-side request id: <request id>-<8 hex>


class RouteRecorder:
    """Per request, ``int16 [positions, MoE layers, k]`` expert ids (``ROUTE_UNKNOWN`` where no
    forward ran the position). :meth:`install` runs in the engine's worker (``collective_rpc``;
    the in-process engine shares this object)."""

    def __init__(self):
        self._routes: dict[str, np.ndarray] = {}
        self._placed = None  # the current forward's rows, from its first MoE layer
        self.layers = 0
        self.top_k = 0

    def install(self, worker) -> int:
        """Hook every MoE layer's router of ``worker``'s model; returns how many."""
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        runner = worker.model_runner
        layers = [m for m in runner.get_model().modules() if isinstance(m, MoERunner)]
        order = {layer_id: i for i, layer_id in enumerate(sorted(m.layer_id for m in layers))}
        for module in layers:
            module.router.set_capture_fn(functools.partial(self._capture, runner, order[module.layer_id]))
        self.layers = len(layers)
        self.top_k = int(layers[0].router.top_k) if layers else 0
        return len(layers)

    def _capture(self, runner, layer: int, topk_ids) -> None:
        if layer == 0 or self._placed is None:  # the forward's first MoE layer: whose rows are where
            self._placed = self._placement(runner)
        total, placed = self._placed
        ids = topk_ids[:total].cpu().numpy().astype(ROUTE_DTYPE)
        for table, rows, at in placed:
            table[at, layer] = ids[rows]

    def _placement(self, runner) -> tuple[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
        """The forward's scheduled rows (no padding) and, per request, its table, its rows and their
        positions: the same for every MoE layer of one forward, so the first layer works it out."""
        batch = runner.input_batch
        total = int(runner.query_start_loc.np[batch.num_reqs])
        requests = runner.req_indices.np[:total]
        positions = runner.positions[:total].cpu().numpy()
        placed = []
        for j in np.unique(requests):
            rows = requests == j
            at = positions[rows]
            placed.append(
                (self._table(_INTERNAL_SUFFIX.sub("", batch.req_ids[j]), int(at.max()) + 1), rows, at)
            )
        return total, placed

    def _table(self, request_id: str, length: int) -> np.ndarray:
        table = self._routes.get(request_id)
        if table is None or len(table) < length:
            grown = np.full((max(length, 2 * len(table) if table is not None else 64), self.layers,
                             self.top_k), ROUTE_UNKNOWN, dtype=ROUTE_DTYPE)  # fmt: skip
            if table is not None:
                grown[: len(table)] = table
            self._routes[request_id] = table = grown
        return table

    def pop(self, request_id: str, length: int) -> np.ndarray:
        """The routes of the first ``length`` positions of a request (its id as given to vLLM)."""
        out = np.full((length, self.layers, self.top_k), ROUTE_UNKNOWN, dtype=ROUTE_DTYPE)
        table = self._routes.pop(request_id, None)
        if table is not None:
            out[: min(length, len(table))] = table[:length]
        return out

    def clear(self) -> None:
        """Drop what no caller took (a scoring call's requests)."""
        self._routes.clear()
        self._placed = None
