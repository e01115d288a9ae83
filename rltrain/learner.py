"""Learners: Ray actors that each own one DeepSpeed engine, driven together by LearnerGroup.
:class:`EngineLearner` is the path every trained model takes (the policy here, the critic in
:mod:`rltrain.critic`); :class:`PolicyLearner` adds log-probs, the policy loss and the reference.

One training step on a global batch of scored rollouts:

1. The group plans the layout: accumulation groups (one optimizer step each), a share per rank,
   micro-batches per share, and empty micro-batches so every rank runs the same number of
   forwards (ZeRO-3 gathers and the token all-reduce are collectives). With ``learner.packing``
   (:func:`rltrain.batch.plan_packed_micro_batches`) shares balance tokens and micro-batches are
   bounded by a token budget and run as one padding-free row each; without it
   (:func:`rltrain.batch.plan_micro_batches`) they hold ``micro_batch_size`` padded sequences.
2. In ``token`` mode, every rank counts its loss tokens and sequences per accumulation group and
   sums them over ranks in one all-reduce (:func:`rltrain.masked_mean.step_totals`); the loss's
   ``loss.aggregation`` picks which count divides it.
3. Forward/backward per micro-batch, with the accumulation boundary set explicitly: DeepSpeed's
   ZeRO-1/2 keep only the last micro-batch's gradient under manual accumulation otherwise.
   Loss scaling per ``masked_mean_denominator`` mode is documented in :mod:`rltrain.masked_mean`.
4. One optimizer step per group; metrics are token sums reduced over micro-batches and ranks in
   one all-reduce, so logged means are global token means.

All ranks are always called together (``ray.get`` on every actor at once): driving them one after
another deadlocks under ZeRO-3.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rltrain import attention, checkpoint, sequence_parallel
from rltrain.batch import MicroBatchPlan, TrainBatch, plan_micro_batches, plan_packed_micro_batches
from rltrain.config import Config, LearnerConfig
from rltrain.corrections import correction_mask
from rltrain.logprobs import sequence_logprobs
from rltrain.losses import PolicyLossSettings, policy_loss
from rltrain.masked_mean import step_totals
from rltrain.remote import gather, where

# counted once per step (not per PPO epoch): tokens the model ran on (padding included) and real ones
TOKEN_COUNTS = ["forward_tokens", "sequence_tokens"]


HANG_ENV = "RLTRAIN_TEST_HANG"  # fault injection for the hang-report test (tests/test_faults.py)


def _planted_hang(rank: int, optimizer_steps: int) -> None:
    """When the file named by ``$RLTRAIN_TEST_HANG`` says ``<rank> <optimizer steps> <seconds>`` for
    this rank and step, delete it (so a restarted run goes on) and sleep in :func:`planted_sleep`."""
    path = os.environ.get(HANG_ENV)
    if not path:
        return
    try:  # another rank may delete it between a check and the read
        want_rank, want_steps, seconds = Path(path).read_text().split()
    except FileNotFoundError:
        return
    if (int(want_rank), int(want_steps)) == (rank, optimizer_steps):
        os.unlink(path)
        planted_sleep(float(seconds))


def planted_sleep(seconds: float) -> None:
    time.sleep(seconds)


class EngineLearner:
    """One data-parallel rank owning a DeepSpeed engine: set-up, the accumulation loop (explicit
    boundaries, the one token-total collective, one metrics all-reduce), checkpoints and export.

    Subclasses say which config section lays them out (:meth:`section`), build the model
    (:meth:`_build_model`) and give the loss of one micro-batch (:meth:`_loss`); the policy and the
    critic share everything else. Created by :class:`LearnerGroup` as Ray actors.
    """

    ROLE = "policy learner"  # how errors and placement.json name its ranks
    PREFIX = "train"  # of the logged metrics: train/..., time/train_s
    PERF = ""  # of the logged cost metrics: perf/forward_tokens, ...
    METRIC_SUMS: list[str] = ["tokens"]  # token sums :meth:`_loss` reports; logged as global token means
    METRIC_MAXES: list[str] = []  # maxima :meth:`_loss` reports; logged as the global maximum

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

    def node_address(self) -> tuple[str, int]:
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def where(self) -> dict[str, Any]:
        return where()

    def setup(self, master_addr: str, master_port: int, total_optimizer_steps: int) -> None:
        import deepspeed
        from transformers import get_scheduler

        lc = self.lc
        self._join_group(master_addr, master_port)
        model = self._build_model()
        if self.config.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if lc.optimizer == "adamw":
            optimizer = torch.optim.AdamW(
                model.parameters(), lr=lc.lr, betas=lc.betas, weight_decay=lc.weight_decay
            )
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=lc.lr)
        scheduler = get_scheduler(
            lc.lr_schedule,
            optimizer,
            num_warmup_steps=lc.warmup_steps,
            num_training_steps=total_optimizer_steps,
        )
        ds_config = {
            "train_micro_batch_size_per_gpu": lc.micro_batch_size,
            "train_batch_size": lc.micro_batch_size * self.world_size,
            # accumulation is manual (boundaries set per micro-batch) so DeepSpeed never divides by it
            "gradient_accumulation_steps": 1,
            "gradient_clipping": lc.max_grad_norm,
            "zero_optimization": {"stage": lc.zero_stage},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": self.bf16},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        self.engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )

    def _join_group(self, master_addr: str, master_port: int) -> None:
        """Join the group's torch.distributed group; set up packed or sequence-parallel attention
        and the precision."""
        import deepspeed

        lc = self.lc
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            # Ray narrows CUDA_VISIBLE_DEVICES to this actor's GPU, so it is device 0 there
            LOCAL_RANK="0" if self.use_cuda else str(self.rank),
        )
        deepspeed.init_distributed(dist_backend="nccl" if self.use_cuda else "gloo", auto_mpi_discovery=False)
        if self.sp > 1:
            self.attn_implementation = sequence_parallel.use_group(self._sequence_parallel_group())
        elif lc.packing:
            # document by document: no [L, L] mask, attention work grows with each sequence, not the row
            self.attn_implementation = attention.register()
        self.bf16 = lc.precision == "bf16" or (lc.precision == "auto" and self.use_cuda)

    def _build_model(self) -> torch.nn.Module:
        raise NotImplementedError

    def _sequence_parallel_group(self):
        """This rank's group of ``sp`` consecutive ranks (every rank creates every group, in order)."""
        import torch.distributed as dist

        groups = [dist.new_group(list(range(g, g + self.sp))) for g in range(0, self.world_size, self.sp)]
        return groups[self.rank // self.sp]

    def _load_model(self, auto_cls, path: str | None = None, **kwargs):
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        extra = {"attn_implementation": self.attn_implementation} if self.attn_implementation else {}
        return auto_cls.from_pretrained(
            path or self.model_path, dtype=dtype, trust_remote_code=self.config.model.trust_remote_code,
            **extra, **kwargs,
        )  # fmt: skip

    def _load_scalar_head(self, path: str | None) -> tuple[torch.nn.Module, set[str]]:
        """A model with one output per position (token classification) from ``path``; the
        weights the folder lacks (a new head) start at 0. Returns the model and their names."""
        from transformers import AutoModelForTokenClassification

        model, info = self._load_model(
            AutoModelForTokenClassification, path, num_labels=1, output_loading_info=True
        )
        missing = set(info["missing_keys"])
        for name, param in model.named_parameters():
            if name in missing:
                torch.nn.init.zeros_(param)
        return model, missing

    # ------------------------------------------------------------------ training

    def train_step(self, groups: list[list[TrainBatch]]) -> dict[str, float]:
        """Train on this rank's share: ``groups[g]`` are the micro-batches of accumulation group g."""
        import torch.distributed as dist

        _planted_hang(self.rank, self.optimizer_steps)
        start = time.perf_counter()
        lc, mode = self.lc, self.config.loss.masked_mean_denominator
        aggregation = self.config.loss.aggregation
        if self.use_cuda:
            torch.cuda.reset_peak_memory_stats()
        groups = [[self._to_device(self._own_tokens(self._nonempty(mb))) for mb in group] for group in groups]
        groups = self._before_training(groups)
        flat = [mb for group in groups for mb in group]
        totals = None
        if mode == "token":
            # one collective for every accumulation group of the step (the same over PPO epochs);
            # with packing, groups may hold different numbers of micro-batches
            counted = None if self.sp == 1 else [mb.counted for mb in flat]
            totals = step_totals([mb.response_mask for mb in flat], [len(g) for g in groups],
                                 [mb.loss_tool_mask() for mb in flat], counted)  # fmt: skip
        n = len(self.METRIC_SUMS)
        sums = torch.zeros(n + len(TOKEN_COUNTS), dtype=torch.float64)
        real_tokens = sum(mb.attention_mask.sum().item() for mb in flat) / self.sp
        sums[n:] = torch.tensor([sum(self._forward_tokens(mb) for mb in flat), real_tokens])
        maxes = torch.zeros(len(self.METRIC_MAXES), dtype=torch.float64)
        grad_norms, lrs = [], []
        for _epoch in range(lc.ppo_epochs):
            for g, group in enumerate(groups):
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
                    self.engine.set_gradient_accumulation_boundary(i == len(group) - 1)
                    self.engine.backward(loss)
                    sums[:n] += torch.tensor([float(metrics.get(k, 0.0)) for k in self.METRIC_SUMS])
                    maxes = torch.maximum(
                        maxes, torch.tensor([float(metrics.get(k, 0.0)) for k in self.METRIC_MAXES])
                    )
                lrs.append(self.engine.get_lr()[0])
                self.engine.step()
                self.optimizer_steps += 1
                norm = self.engine.get_global_grad_norm()
                if norm is not None:
                    grad_norms.append(float(norm))
        dist.all_reduce(sums)  # one collective for every metric: global token sums
        if self.METRIC_MAXES:
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        tokens = max(sums[self.METRIC_SUMS.index("tokens")].item(), 1.0)
        p = self.PREFIX
        out = {f"{p}/{k}": sums[i].item() / tokens for i, k in enumerate(self.METRIC_SUMS) if k != "tokens"}
        out |= {f"{p}/{k}": maxes[i].item() for i, k in enumerate(self.METRIC_MAXES)}
        out = self._finish_metrics(out)
        out[f"{p}/tokens"] = tokens / lc.ppo_epochs
        forward_tokens, sequence_tokens = sums[n:].tolist()
        out[f"perf/{self.PERF}forward_tokens"] = forward_tokens
        out[f"perf/{self.PERF}padding_fraction"] = 1.0 - sequence_tokens / max(forward_tokens, 1.0)
        out[f"perf/{self.PERF}peak_memory_mib"] = self._peak_memory_mib()
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

    def _finish_metrics(self, out: dict[str, float]) -> dict[str, float]:
        return out

    @torch.no_grad()
    def per_token(self, micro_batches: list[TrainBatch], own: bool = False) -> list[torch.Tensor]:
        """:meth:`_per_token` of each micro-batch (``[B, T]`` each, on the CPU); every rank runs its
        micro-batches at the same time (ZeRO-3 gathers are collectives). ``own``: the trained
        model's output where a role has another (the policy's log-probs, not its reference's)."""
        return [self._per_token(self._to_device(self._nonempty(mb)), own).cpu() for mb in micro_batches]

    def _per_token(self, mb: TrainBatch, own: bool = False) -> torch.Tensor:
        raise NotImplementedError

    def _nonempty(self, mb: TrainBatch) -> TrainBatch:
        """An empty micro-batch becomes one 2-token row with every mask 0 except attention: it runs
        the forward/backward every rank must run together, and contributes exactly zero (two
        tokens, so one prediction links the loss to the parameters)."""
        if len(mb) > 0:
            return mb

        def blank(name: str, value: torch.Tensor | None) -> torch.Tensor | None:
            if value is None:
                return None
            shape = (1,) if value.dim() == 1 else (1, 2)
            return (
                torch.ones(shape, dtype=value.dtype)
                if name == "attention_mask"
                else torch.zeros(shape, dtype=value.dtype)
            )

        return TrainBatch(**{f.name: blank(f.name, getattr(mb, f.name)) for f in fields(mb)})

    def _own_tokens(self, mb: TrainBatch) -> TrainBatch:
        """Under sequence parallelism, the loss tokens of this rank are those whose log-prob it
        computes: each token then counts once in the losses, the metrics and the token totals. A
        per-sequence loss divides by the whole sequence's token count (``sequence_tokens``: every
        rank holds the whole row's masks), and the rank owning a sequence's first loss token counts
        the sequence (``counted``), so it counts once in the step's sequence total."""
        if self.sp == 1:
            return mb
        keep = mb.response_mask.bool() & mb.tool_mask.bool()
        owned = sequence_parallel.owned_positions(mb.attention_mask, self.sp, self.sp_rank)
        first = keep.float().argmax(-1, keepdim=True)  # the first loss token of each row
        counted = keep.any(-1) & owned.gather(-1, first).squeeze(-1)
        return mb.replace(
            response_mask=mb.response_mask * owned, sequence_tokens=keep.sum(-1), counted=counted.long()
        )

    def _forward_tokens(self, mb: TrainBatch) -> float:
        """Tokens the model runs on for this micro-batch on this rank: its slice of the packed row,
        or every padded cell."""
        if not self.lc.packing:
            return mb.input_ids.numel()
        return sequence_parallel.row_slice(int(mb.attention_mask.sum()), self.sp, 0).stop

    def _peak_memory_mib(self) -> float:
        """GPU: peak allocated during this step; CPU: the process's peak resident memory so far."""
        if self.use_cuda:
            return torch.cuda.max_memory_allocated() / 2**20
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux

    def _to_device(self, mb: TrainBatch) -> TrainBatch:
        device = self.engine.device
        return mb.replace(**{k: v.to(device) for k, v in vars(mb).items() if v is not None})

    # ------------------------------------------------------------------ weights and checkpoints

    def gathered_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full weights on rank 0 (None elsewhere), by every name the model's own state dict has:
        a tied output head is sent as ``lm_head.weight`` too (``named_parameters()`` names a shared
        parameter once, and an engine that reloads in place kept its first head). Under ZeRO-3
        every rank must call this together."""
        import deepspeed

        state: dict[str, torch.Tensor] = {}
        first_name: dict[int, str] = {}  # a shared parameter is gathered once, sent under each name
        for name, param in self.engine.module.named_parameters(remove_duplicate=False):
            if id(param) in first_name:
                if self.rank == 0:
                    state[name] = state[first_name[id(param)]]
                continue
            first_name[id(param)] = name
            with deepspeed.zero.GatheredParameters([param], enabled=self.lc.zero_stage == 3):
                if self.rank == 0:
                    state[name] = param.detach().to("cpu", copy=True)
        return state if self.rank == 0 else None

    def save_hf(self, out_dir: str) -> str | None:
        """The model in Hugging Face format, written by rank 0; why it could not be, or None."""
        from transformers import AutoTokenizer

        state = self.gathered_state_dict()
        if self.rank == 0:
            try:
                self.engine.module.save_pretrained(out_dir, state_dict=state)
                AutoTokenizer.from_pretrained(self.model_path).save_pretrained(out_dir)
            except (OSError, RuntimeError) as e:
                return checkpoint.write_failure(e, out_dir)
        return None

    def save_checkpoint(self, ckpt_dir: str, tag: str, client_state: dict[str, Any]) -> str | None:
        """DeepSpeed's checkpoint of this layout, the layout itself, and with
        ``run.layout_free_checkpoints`` the whole state without it (rank 0 writes both files).
        A rank whose write fails goes on through the save's collectives, writing nothing more; then
        every rank learns whether any failed. Returns why this rank's write failed, "" when only
        another rank's did, None when the save is complete."""
        import torch.distributed as dist

        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        state = {"client": client_state, "rng": rng, "optimizer_steps": self.optimizer_steps}
        with checkpoint.recorded_deepspeed_write_errors(self.engine) as errors:
            # no DeepSpeed `latest` file: rltrain.checkpoint moves its own pointer once a save is complete
            self.engine.save_checkpoint(ckpt_dir, tag=tag, client_state={"rltrain": state}, save_latest=False)
        free = self._layout_free_state() if self.config.run.layout_free_checkpoints else None  # all ranks
        folder = Path(ckpt_dir) / tag
        if self.rank == 0 and not errors:
            try:
                if free is not None:
                    torch.save({**free, "client": client_state, "optimizer_steps": self.optimizer_steps},
                               folder / checkpoint.LAYOUT_FREE)  # fmt: skip
                checkpoint.write_layout(folder, self.lc)
            except (OSError, RuntimeError) as e:
                errors.append(checkpoint.write_failure(e, folder))
        failed = torch.tensor([float(len(errors))])
        dist.all_reduce(failed)
        if failed.item() == 0:
            return None
        return errors[0] if errors else ""

    def load_checkpoint(self, ckpt_dir: str, tag: str) -> dict[str, Any]:
        """Restore from DeepSpeed's checkpoint when it was written by this layout, otherwise from
        its layout-free state (:meth:`_load_layout_free`)."""
        folder = Path(ckpt_dir) / tag
        saved = checkpoint.saved_layout(folder)
        if saved is not None and saved != checkpoint.layout(self.lc):
            state = torch.load(folder / checkpoint.LAYOUT_FREE, map_location="cpu", weights_only=True)
            self._load_layout_free(state)
            return state["client"]
        path, state = self.engine.load_checkpoint(
            ckpt_dir, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} in {ckpt_dir}")
        ours = state["rltrain"]
        torch.set_rng_state(ours["rng"]["torch"])
        random.setstate(ours["rng"]["python"])
        self.optimizer_steps = ours["optimizer_steps"]
        return ours["client"]

    # ------------------------------------------------------------------ layout-free state

    def _torch_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer: DeepSpeed's ZeRO optimizers wrap it, without ZeRO it is the engine's."""
        return getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)

    def _moment_keys(self) -> list[str]:
        return ["exp_avg", "exp_avg_sq"] if self.lc.optimizer == "adamw" else []  # plain SGD keeps none

    def _layout_free_state(self) -> dict[str, Any] | None:
        """Every parameter's fp32 weights and optimizer moments, whole and by name, the optimizer's
        step count and the schedule, on rank 0 (None elsewhere). Every rank takes part: gathering a
        partitioned parameter (ZeRO 1-3) is a collective."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        inner = self._torch_optimizer()
        keys = self._moment_keys() if any(inner.state.values()) else []  # none before a first step
        weights, moments = {}, {k: {} for k in keys}
        keep = self.rank == 0  # every rank gathers; rank 0 alone keeps a copy
        for name, p in self.engine.module.named_parameters():
            whole = safe_get_full_fp32_param(p)  # None without ZeRO: the parameter is whole
            if keep:
                weights[name] = (p.detach() if whole is None else whole).float().cpu().clone()
            for k in keys:
                whole = safe_get_full_optimizer_state(p, k)
                if keep:
                    moments[k][name] = (inner.state[p][k] if whole is None else whole).float().cpu().clone()
        if not keep:
            return None
        steps = [float(s["step"]) for s in inner.state.values() if "step" in s]
        return {"weights": weights, "moments": moments, "optimizer_step": steps[0] if steps else 0.0,
                "scheduler": self.engine.lr_scheduler.state_dict()}  # fmt: skip

    def _load_layout_free(self, state: dict[str, Any]) -> None:
        """Set this layout's engine to a :meth:`_layout_free_state`: each rank's share of the
        weights (the model's and the optimizer's fp32 copy), of the moments, the step counts and the
        schedule, and the learning rate the schedule had reached."""
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        inner = self._torch_optimizer()
        if state["moments"]:
            self._create_optimizer_state()
        zero3 = self.lc.zero_stage == 3
        for name, p in self.engine.module.named_parameters():
            whole = state["weights"][name]
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0, enabled=zero3), torch.no_grad():
                p.copy_(whole.to(p.dtype).view_as(p))  # the model's copy
            safe_set_full_fp32_param(p, whole)  # ZeRO's fp32 partition (nothing without ZeRO)
            for k, table in state["moments"].items():
                if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):
                    safe_set_full_optimizer_state(p, table[name], k)
                else:
                    inner.state[p][k].copy_(table[name].view_as(p))
        for s in inner.state.values():
            if "step" in s:
                s["step"] = torch.tensor(state["optimizer_step"], dtype=s["step"].dtype)
        self.engine.lr_scheduler.load_state_dict(state["scheduler"])
        for group, lr in zip(inner.param_groups, self.engine.lr_scheduler.get_last_lr()):
            group["lr"] = lr  # a scheduler's state sets the rate at its next step only
        self.optimizer_steps = state["optimizer_steps"]

    def _create_optimizer_state(self) -> None:
        """AdamW's state as its first step would create it (zero moments) for every tensor the
        torch optimizer updates (whole parameters, or ZeRO's flat partitions), linked to the
        parameters' fragments under ZeRO 1-2."""
        inner = self._torch_optimizer()
        # ZeRO-3 hands its flat partitions to the torch optimizer only for the length of a step
        flats = getattr(self.engine.optimizer, "fp32_partitioned_groups_flat", None)
        for t in flats or [t for group in inner.param_groups for t in group["params"]]:
            state = inner.state[t]
            state.setdefault("step", torch.tensor(0.0))
            for k in self._moment_keys():
                state.setdefault(k, torch.zeros_like(t))
        link = getattr(self.engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:  # ZeRO 1-2 link each parameter's fragment to the state after a first step
            link()


class PolicyLearner(EngineLearner):
    """A policy rank: per-token log-probs (padded, packed or sequence-parallel), the policy loss,
    a frozen reference model for the KL term."""

    METRIC_SUMS = ["pg_loss", "kl", "clipped", "ratio", "entropy", "mismatch_kl", "mismatch_tokens", "rejected",
                   "tokens"]  # fmt: skip
    METRIC_MAXES = ["mismatch_max"]
    TEMPERATURE: float | None = None  # of the log-probs; None: rollout.temperature (the sampling one)

    def __init__(self, config: Config, model_path: str, rank: int, world_size: int):
        super().__init__(config, model_path, rank, world_size)
        loss = config.loss
        self.loss_settings = PolicyLossSettings(
            kind=loss.kind, clip_low=loss.clip_low, clip_high=loss.clip_high, dual_clip=loss.dual_clip,
            kl_beta=loss.kl_beta, kl_estimator=loss.kl_estimator, correction=config.rollout_correction,
            aggregation=loss.aggregation, aggregation_norm=config.aggregation_norm,
        )  # fmt: skip
        self.ref_model = None

    def _build_model(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        if self.config.loss.kl_beta > 0 or self.config.algorithm.kl_in_reward > 0:
            # the frozen reference lives beside the policy on every learner: its forward runs on the
            # rank's own shard only, so no extra actors and no transfer of log-probs are needed
            device = "cuda" if self.use_cuda else "cpu"
            self.ref_model = self._load_model(AutoModelForCausalLM).to(device).eval().requires_grad_(False)
        return self._load_model(AutoModelForCausalLM)

    def _logprobs(self, model, mb: TrainBatch, with_entropy: bool = False, temperature: float | None = None):
        """Per-token log-probs ``[B, T]`` of a micro-batch: padded, packed, or this rank's share of a
        sequence-parallel packed row."""
        temperature = temperature or self.TEMPERATURE or self.config.rollout.temperature
        packed = self.lc.packing
        if self.sp > 1:
            return sequence_parallel.sequence_logprobs(
                model, mb.input_ids, mb.attention_mask, temperature, with_entropy, self.sp, self.sp_rank
            )
        return sequence_logprobs(model, mb.input_ids, mb.attention_mask, temperature, with_entropy, packed)

    def _per_token(self, mb: TrainBatch, own: bool = False) -> torch.Tensor:
        """The reference model's log-probs (for a KL penalty in the reward); ``own``: the policy's
        (at temperature 1, as an engine scores a prompt: the weight sync's check)."""
        if self.ref_model is None and not own:
            raise RuntimeError(
                "no reference model on the learners (loss.kl_beta and algorithm.kl_in_reward are 0)"
            )
        if own:
            logprobs_BT = self._logprobs(self.engine, mb, temperature=1.0)[0]
        else:
            logprobs_BT = self._logprobs(self.ref_model, mb)[0]
        # under sequence parallelism each rank holds the tokens it owns (0 elsewhere): the group's
        # sum is every token's log-prob, which the driver reads from the group's first rank
        return sequence_parallel.group_sum(logprobs_BT) if self.sp > 1 else logprobs_BT

    def _loss(self, mb: TrainBatch, denominator):
        logprobs, entropy = self._logprobs(self.engine, mb, with_entropy=True)
        old = mb.old_logprobs if mb.old_logprobs is not None else logprobs.detach()
        loss, metrics = policy_loss(
            logprobs,
            old,
            mb.advantages,
            mb.response_mask,
            denominator,
            self.loss_settings,
            tool_mask_BT=mb.tool_mask,
            ref_logprobs_BT=mb.ref_logprobs,
            generator_logprobs_BT=mb.generator_logprobs,
            sequence_tokens_B=mb.sequence_tokens,
            # GSPO's sequence ratio sums each sequence's log-ratios over the ranks sharing its row
            sequence_sum=sequence_parallel.group_sum if self.sp > 1 else None,
            fresh_BT=mb.fresh_mask,
        )
        keep = mb.response_mask.bool() & mb.loss_tool_mask().bool()
        metrics["entropy"] = torch.where(keep, entropy, 0.0).sum()
        return loss, metrics

    def _finish_metrics(self, out: dict[str, float]) -> dict[str, float]:
        out["train/clip_fraction"] = out.pop("train/clipped")
        # the engine's sampling log-probs against the learner's under the same weights: a rollout
        # matter; a mean over the tokens measured (both sums came divided by the loss tokens)
        measured = out.pop("train/mismatch_tokens")
        out["rollout/mismatch_kl"] = out.pop("train/mismatch_kl") / measured if measured > 0 else 0.0
        out["rollout/mismatch_max"] = out.pop("train/mismatch_max")
        rejected = out.pop("train/rejected")  # per kept token: the share of all is r / (1 + r)
        if self.loss_settings.correction is not None and self.loss_settings.correction.rejects:
            out["rollout/correction_rejected"] = rejected / (1.0 + rejected)
        return out

    @torch.no_grad()
    def _before_training(self, groups: list[list[TrainBatch]]) -> list[list[TrainBatch]]:
        """Reference log-probs (KL) and, when the batch takes several optimizer steps, the
        pre-update policy's log-probs, so every step's ratio is against the same old policy."""
        lc, correction = self.lc, self.loss_settings.correction
        rejects = correction is not None and correction.rejects
        # a rejecting correction decides before the step's token totals, on the pre-update policy
        needs_old = lc.num_mini_batches > 1 or lc.ppo_epochs > 1 or rejects
        out = []
        for group in groups:
            new_group = []
            for mb in group:
                changes = {}
                if self.ref_model is not None:
                    changes["ref_logprobs"], _ = self._logprobs(self.ref_model, mb)
                if needs_old:
                    changes["old_logprobs"], _ = self._logprobs(self.engine, mb)
                mb = mb.replace(**changes)
                if rejects and mb.generator_logprobs is not None:
                    mb = self._reject(mb, correction)
                new_group.append(mb)
            out.append(new_group)
        return out

    def _reject(self, mb: TrainBatch, correction) -> TrainBatch:
        """Fold the correction's rejections into ``correction_mask`` (the step's token totals honour
        it). Under sequence parallelism this rank decides on the tokens it owns, sequence ratios are
        summed over its group, and each sequence's token count and counting rank are redone."""
        keep = mb.response_mask.bool() & mb.tool_mask.bool()
        sequence_sum = sequence_parallel.sequence_sum if self.sp > 1 else None
        accept = correction_mask(mb.old_logprobs, mb.generator_logprobs, keep, correction, sequence_sum)
        mb = mb.replace(correction_mask=accept.to(mb.tool_mask.dtype))
        if self.sp == 1:
            return mb
        kept = accept.any(-1).float()  # [B]: whether this rank still holds a loss token of the sequence
        ranks = torch.zeros(len(mb), self.sp, device=kept.device)
        ranks[:, self.sp_rank] = kept
        ranks = sequence_sum(ranks)  # [B, sp]: which ranks hold one; the lowest holds the first token
        first = torch.where(ranks.any(-1), (ranks > 0).float().argmax(-1), -1)
        counted = (first == self.sp_rank).long()
        return mb.replace(sequence_tokens=sequence_sum(accept.sum(-1).float()).long(), counted=counted)


class LearnerGroup:
    """Starts the learner actors of one model (``learner_cls.section(config).num_learners`` of
    them, :class:`PolicyLearner` by default) in one placement group, forms their torch.distributed
    group, plans every batch over them and calls every rank at once."""

    def __init__(
        self,
        config: Config,
        model_path: str,
        total_optimizer_steps: int,
        learner_cls: type[EngineLearner] = PolicyLearner,
    ):
        lc = self.lc = learner_cls.section(config)
        self.config, self.learner_cls = config, learner_cls
        self.names = [f"{learner_cls.ROLE} {i}" for i in range(lc.num_learners)]
        self.timeout_s = config.run.actor_timeout_s
        bundle = {"CPU": lc.cpus_per_learner} | ({"GPU": lc.gpus_per_learner} if lc.gpus_per_learner else {})
        self.placement_group = placement_group([bundle] * lc.num_learners, strategy=lc.placement)
        ray.get(self.placement_group.ready())
        actor_cls = ray.remote(learner_cls)
        self.actors = [
            actor_cls.options(
                num_cpus=lc.cpus_per_learner,
                num_gpus=lc.gpus_per_learner,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, i),
            ).remote(config, model_path, i, lc.num_learners)
            for i in range(lc.num_learners)
        ]
        addr, port = gather([self.actors[0].node_address.remote()], self.names[:1])[0]
        gather([a.setup.remote(addr, port, total_optimizer_steps) for a in self.actors], self.names)

    def _all(self, method: str, *args: Any) -> list[Any]:
        return self._gather([getattr(actor, method).remote(*args) for actor in self.actors])

    def _gather(self, refs: list[ray.ObjectRef]) -> list[Any]:
        """Every rank's result; a rank that dies or passes run.actor_timeout_s raises ActorFailure."""
        return gather(refs, self.names, self.timeout_s)

    def where(self) -> list[dict[str, Any]]:
        """Node, address and pid of every rank."""
        return [{"actor": name, **w} for name, w in zip(self.names, self._all("where"))]

    def _plan(self, batch: TrainBatch, num_mini_batches: int) -> MicroBatchPlan:
        """Micro-batches per data-parallel rank (the ranks of a sequence-parallel group share one)."""
        lc = self.lc
        data_parallel = lc.num_learners // lc.sequence_parallel_size
        if lc.packing:
            budget = self.config.token_budget(lc)
            return plan_packed_micro_batches(
                batch.sequence_lengths(), data_parallel, num_mini_batches, budget
            )
        return plan_micro_batches(len(batch), data_parallel, num_mini_batches, lc.micro_batch_size)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        batch.validate()
        sp = self.lc.sequence_parallel_size
        plan = self._plan(batch, self.lc.num_mini_batches)
        shards = [[[batch.select(idx).trim() for idx in group] for group in rank] for rank in plan.groups]
        results = self._gather([a.train_step.remote(shards[i // sp]) for i, a in enumerate(self.actors)])
        metrics = results[0]  # every rank holds the same all-reduced metrics, except its own memory
        prefix, perf = self.learner_cls.PREFIX, self.learner_cls.PERF
        metrics[f"perf/{perf}peak_memory_mib"] = max(r[f"perf/{perf}peak_memory_mib"] for r in results)
        metrics[f"{prefix}/micro_batches"] = float(sum(plan.micro_batches_per_group()))
        metrics[f"{prefix}/oversized_sequences"] = float(plan.oversized)
        return metrics

    def per_token(self, batch: TrainBatch, own: bool = False) -> torch.Tensor:
        """The learners' per-token output for the whole batch, ``[N, T]`` (a critic's values), with
        every rank running its micro-batches at the same time (``own``: see the actors' method)."""
        sp = self.lc.sequence_parallel_size
        plan = self._plan(batch, 1)
        shards = [[batch.select(idx) for idx in rank[0]] for rank in plan.groups]
        results = self._gather([a.per_token.remote(shards[i // sp], own) for i, a in enumerate(self.actors)])
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for rank, rank_results in zip(plan.groups, results[::sp]):
            for idx, values in zip(rank[0], rank_results):
                if len(idx):  # an empty micro-batch ran as a placeholder row
                    out[idx] = values
        return out

    def gathered_state_ref(self) -> ray.ObjectRef:
        """Rank 0's full weights as an object reference, gathered with every rank taking part
        (ZeRO-3); the weights stay in the object store, so they can go to generators directly."""
        refs = [actor.gathered_state_dict.remote() for actor in self.actors]
        self._gather(refs[1:])  # None each (cheap to fetch); rank 0's weights stay in the store
        ray.wait(refs[:1], timeout=self.timeout_s, fetch_local=False)
        return refs[0]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return gather([self.gathered_state_ref()], self.names[:1], self.timeout_s)[0]

    def save_hf(self, out_dir: str | Path) -> str | None:
        """Rank 0 writes the Hugging Face model; why it could not, or None."""
        return next((e for e in self._all("save_hf", str(out_dir)) if e), None)

    def save_checkpoint(self, ckpt_dir: str | Path, tag: str, client_state: dict[str, Any]) -> str | None:
        """Every rank's share of the checkpoint; why a rank could not write it, or None."""
        return next((e for e in self._all("save_checkpoint", str(ckpt_dir), tag, client_state) if e), None)

    def load_checkpoint(self, ckpt_dir: str | Path, tag: str) -> dict[str, Any]:
        return self._all("load_checkpoint", str(ckpt_dir), tag)[0]

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.placement_group)
