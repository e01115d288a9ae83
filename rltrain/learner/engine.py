"""The engine loop: a Ray actor owning one DeepSpeed engine, driven with its peers by
:class:`~rltrain.learner.group.LearnerGroup`. :class:`EngineLearner` is the path every trained
model takes (the policy, :mod:`rltrain.learner.policy`; the critic, :mod:`rltrain.learner.critic`;
the warm start, :mod:`rltrain.learner.sft`); its weights, checkpoints and export are
:class:`~rltrain.learner.state.LearnerState`.

One training step on a global batch of scored rollouts:

1. The group plans the layout: accumulation groups (one optimizer step each), a share per rank,
   micro-batches per share, and empty micro-batches so every rank runs the same number of
   forwards (ZeRO-3 gathers and the token all-reduce are collectives). With ``learner.packing``
   (:func:`rltrain.plan.plan_packed_micro_batches`) shares balance tokens and micro-batches are
   bounded by a token budget and run as one padding-free row each; without it
   (:func:`rltrain.plan.plan_micro_batches`) they hold ``micro_batch_size`` padded sequences.
2. In ``token`` mode, every rank counts its loss tokens and sequences per accumulation group and
   sums them over ranks in one all-reduce (:func:`rltrain.loss.masked_mean.step_totals`); the loss's
   ``loss.aggregation`` picks which count divides it.
3. Forward/backward per micro-batch, with the accumulation boundary set explicitly: DeepSpeed's
   ZeRO-1/2 keep only the last micro-batch's gradient under manual accumulation otherwise.
   Loss scaling per ``masked_mean_denominator`` mode is documented in :mod:`rltrain.loss.masked_mean`.
4. One optimizer step per group; metrics are token sums reduced over micro-batches and ranks in
   one all-reduce, so logged means are global token means.

All ranks are always called together (``ray.get`` on every actor at once): driving them one after
another deadlocks under ZeRO-3.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from rltrain import forward
from rltrain.batch import TrainBatch, nonempty
from rltrain.config import Config, LearnerConfig
from rltrain.forward.layouts import row_slice
from rltrain.forward.model import causal_lm
from rltrain.forward.vision import Images
from rltrain.learner import sequence_parallel
from rltrain.learner.prefix_tree import PrefixSharing
from rltrain.learner.start import EngineStart, most_over_ranks
from rltrain.learner.state import LearnerState
from rltrain.loss.masked_mean import step_totals
from rltrain.models.images import ImageInputs, blank_image, is_vision_parameter
from rltrain.remote import node_address, where

# counted once per step (not per PPO epoch): tokens the unshared layout runs on (padding included),
# real ones, and tokens the model ran on (a shared prefix once)
TOKEN_COUNTS = ["forward_tokens", "sequence_tokens", "tokens_forwarded"]


def peak_memory_mib(use_cuda: bool) -> float:
    """GPU: peak allocated during this step; CPU: the process's peak resident memory so far."""
    if use_cuda:
        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux


class StepMetrics:
    """One rank's metrics of a step, reduced over ranks in one all-reduce (and one for maxima):
    token sums (logged as global token means), maxima, raw totals of given sizes, and the tokens
    the model ran on (:data:`TOKEN_COUNTS`, set by the caller)."""

    def __init__(self, sums: list[str], maxes: list[str], totals: dict[str, int]):
        self.sum_names, self.max_names, self.total_sizes = sums, maxes, totals
        n, t = len(sums), len(TOKEN_COUNTS)
        self.values = torch.zeros(n + t + sum(totals.values()), dtype=torch.float64)
        self.token_counts = self.values[n : n + t]  # a view: set in place
        self.maxes = torch.zeros(len(maxes), dtype=torch.float64)
        self.tokens = 0.0

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        n = len(self.sum_names)
        self.values[:n] += torch.tensor([float(metrics.get(k, 0.0)) for k in self.sum_names])
        offset = n + len(TOKEN_COUNTS)
        for k, size in self.total_sizes.items():
            if k in metrics:
                self.values[offset : offset + size] += metrics[k].detach().reshape(-1).cpu().double()
            offset += size
        self.maxes = torch.maximum(
            self.maxes, torch.tensor([float(metrics.get(k, 0.0)) for k in self.max_names])
        )

    def reduce(self) -> tuple[dict[str, float], dict[str, float], dict[str, torch.Tensor], list[float]]:
        """Global (token means, maxima, totals, token counts); :attr:`tokens` the global loss tokens."""
        import torch.distributed as dist

        dist.all_reduce(self.values)  # one collective for every metric: global token sums
        if self.max_names:
            dist.all_reduce(self.maxes, op=dist.ReduceOp.MAX)
        n, t = len(self.sum_names), len(TOKEN_COUNTS)
        self.tokens = max(self.values[self.sum_names.index("tokens")].item(), 1.0)
        means = {
            k: self.values[i].item() / self.tokens for i, k in enumerate(self.sum_names) if k != "tokens"
        }
        maxes = {k: self.maxes[i].item() for i, k in enumerate(self.max_names)}
        ends = torch.tensor([0, *self.total_sizes.values()]).cumsum(0) + n + t
        totals = {k: self.values[ends[j] : ends[j + 1]] for j, k in enumerate(self.total_sizes)}
        return means, maxes, totals, self.values[n : n + t].tolist()


def perf_metrics(token_counts: list[float], perf: str, use_cuda: bool) -> dict[str, float]:
    """``perf/<perf>...``: tokens the unshared layout runs on (padding included), the padding's share,
    tokens the model ran on and the share a shared prefix saved (:data:`TOKEN_COUNTS`), peak memory."""
    forward_tokens, sequence_tokens, forwarded = token_counts
    return {
        f"perf/{perf}forward_tokens": forward_tokens,
        f"perf/{perf}padding_fraction": 1.0 - sequence_tokens / max(forward_tokens, 1.0),
        f"perf/{perf}tokens_forwarded": forwarded,
        f"perf/{perf}prefix_shared_fraction": 1.0 - forwarded / max(forward_tokens, 1.0),
        f"perf/{perf}peak_memory_mib": peak_memory_mib(use_cuda),
    }


class EngineLearner(EngineStart, LearnerState):
    """One data-parallel rank owning a DeepSpeed engine: set-up, the accumulation loop (explicit
    boundaries, the one token-total collective, one metrics all-reduce), checkpoints and export.

    Subclasses say which config section lays them out (:meth:`section`), build the model
    (:meth:`_build_model`) and give the loss of one micro-batch (:meth:`_loss`); the policy and the
    critic share everything else. Created by :class:`LearnerGroup` as Ray actors.
    """

    ROLE = "policy learner"  # how errors and placement.json name its ranks
    trains_tower = True  # a vision-language model's tower trains unless model.freeze_vision
    KEY = "learner"  # the config section that lays it out (errors name its keys)
    PREFIX = "train"  # of the logged metrics: train/..., time/train_s
    PERF = ""  # of the logged cost metrics: perf/forward_tokens, ...
    METRIC_SUMS: list[str] = ["tokens"]  # token sums :meth:`_loss` reports; logged as global token means
    METRIC_MAXES: list[str] = []  # maxima :meth:`_loss` reports; logged as the global maximum
    # tensors of the given sizes :meth:`_loss` reports, summed globally for :meth:`_finish_totals`
    METRIC_TOTALS: dict[str, int] = {}

    @staticmethod
    def section(config: Config) -> LearnerConfig:
        return config.learner

    def __init__(self, config: Config, model_path: str, rank: int, world_size: int):
        self.config, self.model_path = config, model_path
        self.rank, self.world_size = rank, world_size
        self.lc = self.section(config)
        self.use_cuda = torch.cuda.is_available()
        if not self.use_cuda:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
            torch.set_num_threads(max(1, int(self.lc.cpus_per_learner)))
        self.engine = None
        self.optimizer_steps = 0
        # sequence parallelism: ranks [g*sp, (g+1)*sp) share every micro-batch, each a slice of its row
        self.sp = self.lc.sequence_parallel_size
        self.sp_rank = rank % self.sp
        self.attn_implementation = None
        # learner.prefix_sharing and packing (packed rows checked against padded ones, but not under
        # sequence parallelism, whose rows are split over ranks)
        self.sharing = PrefixSharing(
            self.lc.prefix_sharing if self.sp == 1 else False, self.lc.packing, self.KEY, self.sp == 1
        )
        self.group_counts: torch.Tensor | None = None  # the accumulation group's _step_counts, summed
        self.image_inputs: ImageInputs | None = None  # a vision-language model's, at its first images
        self.tower_collective: bool | None = None  # see _tower_everywhere
        self.agree_chunks = None  # ZeRO-3 over several ranks: the head's chunk count over ranks (_set_layout)

    def node_address(self) -> tuple[str, int]:
        return node_address()

    def where(self) -> dict[str, Any]:
        return where()

    # ------------------------------------------------------------------ training

    def train_step(
        self, groups: list[list[TrainBatch]], counted: list[TrainBatch | None] | None = None
    ) -> dict[str, float]:
        """Train on this rank's share: ``groups[g]`` are the micro-batches of accumulation group g;
        ``counted[g]`` (rank 0 alone): group g's sequences that count in its totals but are not run
        (their gradient is exactly zero: :meth:`zero_gradient_proof`)."""

        start = time.perf_counter()
        lc, mode = self.lc, self.config.loss.masked_mean_denominator
        aggregation = self.config.loss.aggregation
        if self.use_cuda:
            torch.cuda.reset_peak_memory_stats()
        groups = [
            [
                self._to_device(sequence_parallel.own_tokens(nonempty(mb), self.sp, self.sp_rank))
                for mb in group
            ]
            for group in groups
        ]
        self.sharing.clear()
        groups = self._before_training(groups)
        flat = [mb for group in groups for mb in group]
        totals, extra = None, self._step_counts(flat)
        if mode == "token" or extra is not None:
            # one collective for every accumulation group of the step (the same over PPO epochs);
            # with packing, groups may hold different numbers of micro-batches; the sequences not run
            # count on rank 0, whole (each once, its own rank under sequence parallelism)
            ghosts = [[c] if c is not None else [] for c in (counted or [None] * len(groups))]
            counts = [mb for group, ghost in zip(groups, ghosts) for mb in [*group, *ghost]]
            owners = None if self.sp == 1 else [mb.counted for mb in counts]  # (a sequence not run: whole)
            totals = step_totals([mb.response_mask for mb in counts], [len(g) + len(x) for g, x in zip(groups, ghosts)],
                                 [mb.loss_tool_mask() for mb in counts], owners, extra=extra)  # fmt: skip
        step = StepMetrics(self.METRIC_SUMS, self.METRIC_MAXES, self.METRIC_TOTALS)
        real_tokens = sum(mb.attention_mask.sum().item() for mb in flat) / self.sp
        unshared = [self._forward_tokens(mb) for mb in flat]
        forwarded = [self.sharing.tokens_forwarded(mb, n) for mb, n in zip(flat, unshared)]
        step.token_counts[:] = torch.tensor([sum(unshared), real_tokens, sum(forwarded)])
        grad_norms, lrs = [], []
        for _epoch in range(lc.ppo_epochs):
            for g, group in enumerate(groups):
                self.group_counts = None if totals is None or totals.extra is None else totals.extra[g]
                for i, mb in enumerate(group):
                    if mode == "token":
                        # the group's global count (tokens, or sequences for a per-sequence
                        # aggregation) / world size: DeepSpeed averages gradients over ranks, which
                        # the factor world_size cancels; no /accumulation_steps (the count covers them all)
                        denominator = totals.denominator(g, aggregation, self.world_size)
                    else:
                        denominator = mode  # None (this micro-batch's own count) or a constant
                    loss, metrics = self._loss(mb, denominator)
                    if mode != "token":
                        loss = loss / len(group)
                    loss = loss + self._scaled_loss(len(group), metrics)
                    self.engine.set_gradient_accumulation_boundary(i == len(group) - 1)
                    self.engine.backward(loss)
                    step.add(metrics)
                lrs.append(self.engine.get_lr()[0])
                self.engine.step()
                self.optimizer_steps += 1
                norm = self.engine.get_global_grad_norm()
                if norm is not None:
                    grad_norms.append(float(norm))
        means, maxes, totals, counts = step.reduce()
        p, tokens = self.PREFIX, step.tokens
        out = self._finish_metrics({f"{p}/{k}": v for k, v in (means | maxes).items()})
        out |= self._finish_totals(totals, optimizer_steps=lc.ppo_epochs * len(groups))
        out |= perf_metrics(counts, self.PERF, self.use_cuda)
        out[f"{p}/tokens"] = tokens / lc.ppo_epochs
        out[f"{p}/lr"] = lrs[-1]
        out[f"{p}/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
        out[f"{p}/optimizer_steps"] = float(self.optimizer_steps)
        out[f"time/{p}_s"] = time.perf_counter() - start
        return out

    def _loss(self, mb: TrainBatch, denominator) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of one micro-batch reduced with ``denominator`` and its token sums."""
        raise NotImplementedError

    def zero_gradient_proof(self) -> str | None:
        """Why a sequence whose every loss token has advantage 0 could still move the weights under
        this learner's objective, or None where it cannot (it is then counted, not run)."""
        return f"the {self.ROLE}'s loss reads more than the advantages"

    def _before_training(self, groups: list[list[TrainBatch]]) -> list[list[TrainBatch]]:
        """What every micro-batch needs from the pre-update model (nothing by default)."""
        return groups

    def _step_counts(self, flat: list[TrainBatch]) -> list[torch.Tensor] | None:
        """Int64 ``[K]`` counts per micro-batch, summed per accumulation group into ``group_counts``."""
        return None

    def _scaled_loss(self, accumulation_steps: int, metrics: dict[str, torch.Tensor]) -> torch.Tensor | float:
        """A term of the last forward scaled for the layout already (never divided by accumulation)."""
        return 0.0

    def _finish_metrics(self, out: dict[str, float]) -> dict[str, float]:
        return out

    def _finish_totals(self, totals: dict[str, torch.Tensor], optimizer_steps: int) -> dict[str, float]:
        """Logged metrics from the global :attr:`METRIC_TOTALS` (none by default)."""
        return {}

    @torch.no_grad()
    def per_token(self, micro_batches: list[TrainBatch], own: bool = False) -> list[torch.Tensor]:
        """:meth:`_per_token` of each micro-batch (``[B, T]`` each, on the CPU); every rank runs its
        micro-batches at the same time (ZeRO-3 gathers are collectives). ``own``: the trained
        model's output where a role has another (the policy's log-probs, not its reference's)."""
        self.sharing.clear()
        return [self._per_token(self._to_device(nonempty(mb)), own).cpu() for mb in micro_batches]

    def _per_token(self, mb: TrainBatch, own: bool = False) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def check_layouts(self, micro_batches: list[TrainBatch]) -> tuple[bool | None, bool]:
        """The check of prefix trees and packed rows against padded rows, of every model this rank
        runs, on its share of a batch, every rank at once
        (:meth:`~rltrain.learner.prefix_tree.PrefixSharing.check`): whether sharing is on (None:
        undecided) and whether a layout is still unchecked."""
        self.sharing.clear()
        mbs = [self._to_device(nonempty(mb)) for mb in micro_batches]
        on = self.sharing.check(self._shared_forwards(), mbs, self._compared_positions, self.bf16, self.rank)
        return on, bool(self.sharing.unchecked)

    def _shared_forwards(self) -> dict[str, Any]:
        """Each model's ``[B, T]`` outputs that a shared forward must reproduce, by name."""
        return {self.ROLE: lambda mb: self._per_token(mb, own=True)}

    def _compared_positions(self, mb: TrainBatch) -> torch.Tensor:
        """Where the outputs count: the loss tokens."""
        return mb.response_mask.bool() & mb.loss_tool_mask().bool()

    def _forward_tokens(self, mb: TrainBatch) -> float:
        """Tokens the model runs on for this micro-batch on this rank without sharing: its slice of
        the packed row, or every padded cell."""
        if not self.sharing.packed():
            return mb.input_ids.numel()
        return row_slice(int(mb.attention_mask.sum()), self.sp, 0).stop

    def _images(self, mb: TrainBatch) -> tuple[list[Images | None] | None, Images | None]:
        """Each sequence's images as the model's forward takes them (its own image processor's
        patches, on the model's device), None without images; and the image the vision tower runs
        on where this rank's micro-batch has none while another rank's has
        (:func:`rltrain.forward.vision.forward_inputs`'s ``idle``). Called once per forward on every
        rank: where the tower's forward or backward is a collective (:meth:`_tower_everywhere`), the
        ranks first agree in one all-reduce whether any of them has images."""
        has = mb.images is not None and any(im is not None for im in mb.images)
        anyone = bool(most_over_ranks(int(has), self.use_cuda)) if self._tower_everywhere() else has
        if not anyone:
            return None, None
        if self.image_inputs is None:  # (the scored model's own processor)
            self.image_inputs = ImageInputs(self._scored_path(), self.config.model.trust_remote_code)
        device = self.engine.device
        if not has:
            return [None] * len(mb), self.image_inputs((blank_image(),)).to(device)
        return [None if im is None else self.image_inputs(im).to(device) for im in mb.images], None

    def _row(self, mb: TrainBatch, images: bool = True) -> forward.RowLayout:
        """How ``mb`` runs through the model: a prefix tree, one packed row or padded rows
        (:attr:`sharing`), this rank's share of the packed row under sequence parallelism, with its
        images (``images``: :meth:`_images`, a collective where the tower is)."""
        seen, idle = self._images(mb) if images else (None, None)
        return forward.RowLayout(mb.input_ids, mb.attention_mask, self.sharing.packed() or self.sp > 1,
                                 self.sharing.tree(mb), seen, idle, (self.sp, self.sp_rank))  # fmt: skip

    def _tower_everywhere(self) -> bool:
        """Whether the model's vision tower runs on every rank whenever it runs on one: its forward
        gathers its weights under ZeRO-3, and a trained tower's backward reduces its gradients."""
        if self.tower_collective is None:
            trained = self.trains_tower and not self.config.model.freeze_vision
            self.tower_collective = (
                self.world_size > 1
                and (self.lc.zero_stage == 3 or trained)
                and any(is_vision_parameter(name) for name, _ in causal_lm(self.engine).named_parameters())
            )
        return self.tower_collective

    def _scored_path(self) -> str:
        """The folder of the model this learner runs (its processor renders its images)."""
        return self.model_path

    def _to_device(self, mb: TrainBatch) -> TrainBatch:
        device = self.engine.device
        return mb.replace(**{k: v.to(device) for k, v in vars(mb).items() if isinstance(v, torch.Tensor)})
