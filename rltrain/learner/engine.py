"""The engine loop: a Ray actor owning one DeepSpeed engine, driven with its peers by
:class:`~rltrain.learner.group.LearnerGroup`. :class:`EngineLearner` is the path every trained
model takes (the policy, :mod:`rltrain.learner.policy`; the critic, :mod:`rltrain.learner.critic`;
the warm start, :mod:`rltrain.learner.sft`); its weights, checkpoints and export are
:class:`~rltrain.learner.state.LearnerState`.

One training step on a global batch of scored rollouts:

1. The group plans the layout: accumulation groups (one optimizer step each), a share per rank,
   micro-batches per share, and empty micro-batches so every rank runs the same number of
   forwards (ZeRO-3 gathers and the token all-reduce are collectives). With ``learner.packing``
   (:func:`rltrain.batch.plan_packed_micro_batches`) shares balance tokens and micro-batches are
   bounded by a token budget and run as one padding-free row each; without it
   (:func:`rltrain.batch.plan_micro_batches`) they hold ``micro_batch_size`` padded sequences.
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

import functools
import os
import time
from typing import Any

import torch

from rltrain.batch import TrainBatch, nonempty
from rltrain.config import Config, LearnerConfig
from rltrain.learner import attention, sequence_parallel
from rltrain.learner.prefix_tree import PrefixSharing
from rltrain.learner.state import LearnerState
from rltrain.loss import logprobs
from rltrain.loss.forwards import output_head
from rltrain.loss.masked_mean import step_totals
from rltrain.models import families
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


def deepspeed_config(lc: LearnerConfig, world_size: int, bf16: bool) -> dict[str, Any]:
    """A trained model's DeepSpeed config: the optimizer and scheduler are the learner's own."""
    return {
        "train_micro_batch_size_per_gpu": lc.micro_batch_size,
        "train_batch_size": lc.micro_batch_size * world_size,
        # accumulation is manual (boundaries set per micro-batch) so DeepSpeed never divides by it
        "gradient_accumulation_steps": 1,
        "gradient_clipping": lc.max_grad_norm,
        "zero_optimization": {"stage": lc.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def most_over_ranks(count: int, use_cuda: bool) -> int:
    """The largest ``count`` any rank of the default group passes (every rank calls it together)."""
    import torch.distributed as dist

    most = torch.tensor([count], device="cuda" if use_cuda else "cpu")
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


def load_pretrained(auto_cls, path: str, trust: bool, dtype, attn_implementation, key: str, lc, **kwargs):
    """``(model, whether a prefix tree can run it)``: ``auto_cls`` (a causal LM: the class that loads
    the model's config as one, :func:`rltrain.models.families.causal_lm_class`) from ``path``, once
    the model's needs fit the layout of config section ``key`` (:mod:`rltrain.models.families`; a
    layout that cannot run it exactly raises its one line)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
    if auto_cls is AutoModelForCausalLM:
        auto_cls = families.causal_lm_class(model_config)
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = auto_cls.from_pretrained(path, dtype=dtype, trust_remote_code=trust, **extra, **kwargs)
    loaded = model[0] if isinstance(model, tuple) else model  # (with output_loading_info)
    model_needs = families.needs(model_config, loaded)
    sp = getattr(lc, "sequence_parallel_size", 1)
    if problem := families.layout_problem(model_needs, key, lc.packing, lc.prefix_sharing, sp):
        raise ValueError(problem)
    return model, families.shares(model_needs)


def load_scalar_head(load_model, path: str | None) -> tuple[torch.nn.Module, set[str]]:
    """A model with one output per position (token classification) from ``path``, loaded by a
    learner's ``_load_model``; the weights the folder lacks (a new head) start at 0. Returns the
    model and their names."""
    from transformers import AutoModelForTokenClassification

    model, info = load_model(AutoModelForTokenClassification, path, num_labels=1, output_loading_info=True)
    missing = set(info["missing_keys"])
    for name, param in model.named_parameters():
        if name in missing:
            torch.nn.init.zeros_(param)
    return model, missing


class EngineLearner(LearnerState):
    """One data-parallel rank owning a DeepSpeed engine: set-up, the accumulation loop (explicit
    boundaries, the one token-total collective, one metrics all-reduce), checkpoints and export.

    Subclasses say which config section lays them out (:meth:`section`), build the model
    (:meth:`_build_model`) and give the loss of one micro-batch (:meth:`_loss`); the policy and the
    critic share everything else. Created by :class:`LearnerGroup` as Ray actors.
    """

    ROLE = "policy learner"  # how errors and placement.json name its ranks
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
        self.sharing = PrefixSharing(
            self.lc.prefix_sharing if self.sp == 1 else False
        )  # learner.prefix_sharing
        self.group_counts: torch.Tensor | None = None  # the accumulation group's _step_counts, summed

    def node_address(self) -> tuple[str, int]:
        return node_address()

    def where(self) -> dict[str, Any]:
        return where()

    def setup(self, master_addr: str, master_port: int, total_optimizer_steps: int) -> None:
        self._join_group(master_addr, master_port)
        self._start_engine(total_optimizer_steps)

    def restart(self, config: Config, total_optimizer_steps: int) -> None:
        """Start over from the weights at ``model_path`` on ``config`` in this process, whose
        torch.distributed group stays (the same ranks; sequence-parallel groups are formed anew): a
        fresh engine, optimizer, schedule and state, without a new process's imports. Every rank at once."""
        if (n := self.section(config).num_learners) != self.world_size:
            raise ValueError(
                f"{self.ROLE} {self.rank}: a restart keeps the ranks: {n} learners against {self.world_size}"
            )
        if hasattr(self.engine, "destroy"):  # (a frozen model without ZeRO-3 runs as a plain module)
            self.engine.destroy()
        type(self).__init__(self, config, self.model_path, self.rank, self.world_size)
        self._set_layout()
        self._start_engine(total_optimizer_steps)

    def _start_engine(self, total_optimizer_steps: int) -> None:
        """The model, its optimizer and schedule in a DeepSpeed engine."""
        import deepspeed
        from transformers import get_scheduler

        lc = self.lc
        torch.manual_seed(self.config.run.seed)  # the same start in a fresh process and a restarted one
        model = self._build_model()
        if self.config.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        trained = [p for p in model.parameters() if p.requires_grad]  # with LoRA: the adapters alone
        if lc.optimizer == "adamw":
            optimizer = torch.optim.AdamW(trained, lr=lc.lr, betas=lc.betas, weight_decay=lc.weight_decay)
        else:
            optimizer = torch.optim.SGD(trained, lr=lc.lr)
        scheduler = get_scheduler(
            lc.lr_schedule,
            optimizer,
            num_warmup_steps=lc.warmup_steps,
            num_training_steps=total_optimizer_steps,
        )
        self.engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler,
            config=deepspeed_config(lc, self.world_size, self.bf16),
        )  # fmt: skip
        for scored in (self.engine, getattr(self, "ref_model", None)):  # every rank at once (ZeRO-3)
            if scored is not None:
                output_head(scored)  # the head path checked on a probe, before any forward takes it

    def _join_group(self, master_addr: str, master_port: int) -> None:
        """Join the group's torch.distributed group, then :meth:`_set_layout`."""
        import deepspeed

        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            # Ray narrows CUDA_VISIBLE_DEVICES to this actor's GPU, so it is device 0 there
            LOCAL_RANK="0" if self.use_cuda else str(self.rank),
        )
        deepspeed.init_distributed(dist_backend="nccl" if self.use_cuda else "gloo", auto_mpi_discovery=False)
        self._set_layout()

    def _set_layout(self) -> None:
        """Packed or sequence-parallel attention, the precision, the head's chunks under ZeRO-3."""
        lc = self.lc
        if self.sp > 1:
            self.attn_implementation = sequence_parallel.use_group(self._sequence_parallel_group())
        elif lc.packing or self.sharing.setting is not False:
            # document by document and branch by branch (prefix trees): no [L, L] mask, attention
            # work grows with each sequence, not the row; padded batches run on sdpa
            self.attn_implementation = attention.register()
        self.bf16 = lc.precision == "bf16" or (lc.precision == "auto" and self.use_cuda)
        agree = lc.zero_stage == 3 and self.world_size > 1  # the head's chunks gather alike on every rank
        logprobs.agree_head_chunks(
            functools.partial(most_over_ranks, use_cuda=self.use_cuda) if agree else None
        )

    def _build_model(self) -> torch.nn.Module:
        raise NotImplementedError

    def _sequence_parallel_group(self):
        """This rank's group of ``sp`` consecutive ranks (every rank creates every group, in order)."""
        import torch.distributed as dist

        groups = [dist.new_group(list(range(g, g + self.sp))) for g in range(0, self.world_size, self.sp)]
        return groups[self.rank // self.sp]

    def _load_model(self, auto_cls, path: str | None = None, **kwargs):
        """:func:`load_pretrained` in this learner's precision and attention (auto shares only what a tree runs)."""
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        model, shares = load_pretrained(auto_cls, path or self.model_path, self.config.model.trust_remote_code,
                                        dtype, self.attn_implementation, self.KEY, self.lc, **kwargs)  # fmt: skip
        if not shares:
            self.sharing.on = False
        return model

    # ------------------------------------------------------------------ training

    def train_step(self, groups: list[list[TrainBatch]]) -> dict[str, float]:
        """Train on this rank's share: ``groups[g]`` are the micro-batches of accumulation group g."""

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
            # with packing, groups may hold different numbers of micro-batches
            counted = None if self.sp == 1 else [mb.counted for mb in flat]
            totals = step_totals([mb.response_mask for mb in flat], [len(g) for g in groups],
                                 [mb.loss_tool_mask() for mb in flat], counted, extra=extra)  # fmt: skip
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
    def check_sharing(self, micro_batches: list[TrainBatch]) -> bool | None:
        """``learner.prefix_sharing: auto``'s check of every model this rank runs, on its share of a
        batch, every rank at once (:meth:`~rltrain.learner.prefix_tree.PrefixSharing.check`)."""
        self.sharing.clear()
        mbs = [self._to_device(nonempty(mb)) for mb in micro_batches]
        return self.sharing.check(
            self._shared_forwards(), mbs, self._compared_positions, self.bf16, self.rank
        )

    def _shared_forwards(self) -> dict[str, Any]:
        """Each model's ``[B, T]`` outputs that a shared forward must reproduce, by name."""
        return {self.ROLE: lambda mb: self._per_token(mb, own=True)}

    def _compared_positions(self, mb: TrainBatch) -> torch.Tensor:
        """Where the outputs count: the loss tokens."""
        return mb.response_mask.bool() & mb.loss_tool_mask().bool()

    def _forward_tokens(self, mb: TrainBatch) -> float:
        """Tokens the model runs on for this micro-batch on this rank without sharing: its slice of
        the packed row, or every padded cell."""
        if not self.lc.packing:
            return mb.input_ids.numel()
        return sequence_parallel.row_slice(int(mb.attention_mask.sum()), self.sp, 0).stop

    def _to_device(self, mb: TrainBatch) -> TrainBatch:
        device = self.engine.device
        return mb.replace(**{k: v.to(device) for k, v in vars(mb).items() if v is not None})
