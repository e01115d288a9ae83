"""Policy learners: Ray actors that each own one DeepSpeed engine, driven together by LearnerGroup.

One training step on a global batch of scored rollouts:

1. The group plans the layout: accumulation groups (one optimizer step each), a share per rank,
   micro-batches per share, and empty micro-batches so every rank runs the same number of
   forwards (ZeRO-3 gathers and the token all-reduce are collectives). With ``learner.packing``
   (:func:`rltrain.batch.plan_packed_micro_batches`) shares balance tokens and micro-batches are
   bounded by a token budget and run as one padding-free row each; without it
   (:func:`rltrain.batch.plan_micro_batches`) they hold ``micro_batch_size`` padded sequences.
2. In ``token`` mode, every rank counts its loss tokens per accumulation group and sums them over
   ranks in one all-reduce (:func:`rltrain.masked_mean.group_token_totals`).
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
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rltrain import attention, sequence_parallel
from rltrain.batch import TrainBatch, plan_micro_batches, plan_packed_micro_batches
from rltrain.config import Config
from rltrain.logprobs import sequence_logprobs
from rltrain.losses import PolicyLossSettings, policy_loss
from rltrain.masked_mean import group_token_totals

METRIC_SUMS = ["pg_loss", "kl", "clipped", "ratio", "entropy", "tokens"]
# counted once per step (not per PPO epoch): tokens the model ran on (padding included) and real ones
TOKEN_COUNTS = ["forward_tokens", "sequence_tokens"]


class PolicyLearner:
    """One data-parallel rank. Created by :class:`LearnerGroup` as a Ray actor."""

    def __init__(self, config: Config, model_path: str, rank: int, world_size: int):
        self.config, self.model_path = config, model_path
        self.rank, self.world_size = rank, world_size
        self.use_cuda = torch.cuda.is_available()
        if not self.use_cuda:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
            torch.set_num_threads(max(1, int(config.learner.cpus_per_learner)))
        loss = config.loss
        self.loss_settings = PolicyLossSettings(
            kind=loss.kind, clip_low=loss.clip_low, clip_high=loss.clip_high, dual_clip=loss.dual_clip,
            kl_beta=loss.kl_beta, kl_estimator=loss.kl_estimator, tis_cap=loss.tis_cap,
        )  # fmt: skip
        self.engine = None
        self.ref_model = None
        self.optimizer_steps = 0
        # sequence parallelism: ranks [g*sp, (g+1)*sp) share every micro-batch, each a slice of its row
        self.sp = config.learner.sequence_parallel_size
        self.sp_rank = rank % self.sp
        self.attn_implementation = None

    def node_address(self) -> tuple[str, int]:
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, master_addr: str, master_port: int, total_optimizer_steps: int) -> None:
        import deepspeed
        from transformers import AutoModelForCausalLM, get_scheduler

        lc = self.config.learner
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
        model = self._load_model(AutoModelForCausalLM)
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
        if self.config.loss.kl_beta > 0:
            # the frozen reference lives beside the policy on every learner: its forward runs on the
            # rank's own shard only, so no extra actors and no transfer of log-probs are needed
            self.ref_model = self._load_model(AutoModelForCausalLM).to(self.engine.device).eval()
            self.ref_model.requires_grad_(False)

    def _sequence_parallel_group(self):
        """This rank's group of ``sp`` consecutive ranks (every rank creates every group, in order)."""
        import torch.distributed as dist

        groups = [dist.new_group(list(range(g, g + self.sp))) for g in range(0, self.world_size, self.sp)]
        return groups[self.rank // self.sp]

    def _load_model(self, auto_cls):
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        extra = {"attn_implementation": self.attn_implementation} if self.attn_implementation else {}
        return auto_cls.from_pretrained(
            self.model_path, dtype=dtype, trust_remote_code=self.config.model.trust_remote_code, **extra
        )

    def _logprobs(self, model, mb: TrainBatch, with_entropy: bool = False):
        """Per-token log-probs ``[B, T]`` of a micro-batch: padded, packed, or this rank's share of a
        sequence-parallel packed row."""
        temperature, packed = self.config.rollout.temperature, self.config.learner.packing
        if self.sp > 1:
            return sequence_parallel.sequence_logprobs(
                model, mb.input_ids, mb.attention_mask, temperature, with_entropy, self.sp, self.sp_rank
            )
        return sequence_logprobs(model, mb.input_ids, mb.attention_mask, temperature, with_entropy, packed)

    # ------------------------------------------------------------------ training

    def train_step(self, groups: list[list[TrainBatch]]) -> dict[str, float]:
        """Train on this rank's share: ``groups[g]`` are the micro-batches of accumulation group g."""
        import torch.distributed as dist

        start = time.perf_counter()
        cfg, lc = self.config, self.config.learner
        if self.use_cuda:
            torch.cuda.reset_peak_memory_stats()
        groups = [[self._to_device(self._own_tokens(self._nonempty(mb))) for mb in group] for group in groups]
        groups = self._add_reference_and_old_logprobs(groups)
        flat = [mb for group in groups for mb in group]
        totals = None
        if cfg.loss.masked_mean_denominator == "token":
            # one collective for every accumulation group of the step (the same over PPO epochs);
            # with packing, groups may hold different numbers of micro-batches
            totals = group_token_totals(
                [mb.response_mask for mb in flat], [len(g) for g in groups], [mb.tool_mask for mb in flat]
            )
        sums = torch.zeros(len(METRIC_SUMS) + len(TOKEN_COUNTS), dtype=torch.float64)
        sums[len(METRIC_SUMS) :] = torch.tensor(
            [
                sum(self._forward_tokens(mb) for mb in flat),
                sum(mb.attention_mask.sum().item() for mb in flat) / self.sp,
            ]
        )
        grad_norms, lrs = [], []
        for _epoch in range(lc.ppo_epochs):
            for g, group in enumerate(groups):
                for i, mb in enumerate(group):
                    loss, metrics = self._micro_batch_loss(mb, totals, g, len(group))
                    self.engine.set_gradient_accumulation_boundary(i == len(group) - 1)
                    self.engine.backward(loss)
                    sums[: len(METRIC_SUMS)] += torch.tensor(
                        [float(metrics.get(k, 0.0)) for k in METRIC_SUMS], dtype=torch.float64
                    )
                lrs.append(self.engine.get_lr()[0])
                self.engine.step()
                self.optimizer_steps += 1
                norm = self.engine.get_global_grad_norm()
                if norm is not None:
                    grad_norms.append(float(norm))
        dist.all_reduce(sums)  # one collective for every metric: global token sums
        tokens = max(sums[METRIC_SUMS.index("tokens")].item(), 1.0)
        out = {f"train/{k}": sums[i].item() / tokens for i, k in enumerate(METRIC_SUMS) if k != "tokens"}
        out["train/clip_fraction"] = out.pop("train/clipped")
        out["train/tokens"] = sums[METRIC_SUMS.index("tokens")].item() / lc.ppo_epochs
        forward_tokens, sequence_tokens = sums[len(METRIC_SUMS) :].tolist()
        out["perf/forward_tokens"] = forward_tokens
        out["perf/padding_fraction"] = 1.0 - sequence_tokens / max(forward_tokens, 1.0)
        out["perf/peak_memory_mib"] = self._peak_memory_mib()
        out["train/lr"] = lrs[-1]
        out["train/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
        out["train/optimizer_steps"] = float(self.optimizer_steps)
        out["time/train_s"] = time.perf_counter() - start
        return out

    def _micro_batch_loss(self, mb: TrainBatch, totals, group: int, micro_batches_in_group: int):
        cfg = self.config
        logprobs, entropy = self._logprobs(self.engine, mb, with_entropy=True)
        mode = cfg.loss.masked_mean_denominator
        if mode == "token":
            # the group's global token count / world size: DeepSpeed averages gradients over ranks,
            # which the factor world_size cancels; no /accumulation_steps (the count covers them all)
            denominator = totals[group].to(logprobs.device) / self.world_size
        else:
            denominator = mode  # None (this micro-batch's own count) or a constant
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
            axis=cfg.loss.masked_mean_axis,
        )
        if mode != "token":
            loss = loss / micro_batches_in_group
        keep = mb.response_mask.bool() & mb.tool_mask.bool()
        metrics["entropy"] = torch.where(keep, entropy, 0.0).sum()
        return loss, metrics

    @torch.no_grad()
    def _add_reference_and_old_logprobs(self, groups: list[list[TrainBatch]]) -> list[list[TrainBatch]]:
        """Reference log-probs (KL) and, when the batch takes several optimizer steps, the
        pre-update policy's log-probs, so every step's ratio is against the same old policy."""
        lc = self.config.learner
        needs_old = lc.num_mini_batches > 1 or lc.ppo_epochs > 1
        out = []
        for group in groups:
            new_group = []
            for mb in group:
                changes = {}
                if self.ref_model is not None:
                    changes["ref_logprobs"], _ = self._logprobs(self.ref_model, mb)
                if needs_old:
                    changes["old_logprobs"], _ = self._logprobs(self.engine, mb)
                new_group.append(mb.replace(**changes))
            out.append(new_group)
        return out

    def _nonempty(self, mb: TrainBatch) -> TrainBatch:
        """An empty micro-batch becomes one 2-token row with every mask 0 except attention: it runs
        the forward/backward every rank must run together, and contributes exactly zero (two
        tokens, so one prediction links the loss to the parameters)."""
        if len(mb) > 0:
            return mb
        zeros = torch.zeros(1, 2, dtype=torch.long)
        return TrainBatch(
            input_ids=zeros,
            attention_mask=torch.ones_like(zeros),
            response_mask=zeros,
            tool_mask=zeros,
            advantages=torch.zeros(1),
            generator_logprobs=None if mb.generator_logprobs is None else torch.zeros(1, 2),
            old_logprobs=None if mb.old_logprobs is None else torch.zeros(1, 2),
        )

    def _own_tokens(self, mb: TrainBatch) -> TrainBatch:
        """Under sequence parallelism, the loss tokens of this rank are those whose log-prob it
        computes: each token then counts once in the losses, the metrics and the token totals."""
        if self.sp == 1:
            return mb
        owned = sequence_parallel.owned_positions(mb.attention_mask, self.sp, self.sp_rank)
        return mb.replace(response_mask=mb.response_mask * owned)

    def _forward_tokens(self, mb: TrainBatch) -> float:
        """Tokens the model runs on for this micro-batch on this rank: its slice of the packed row,
        or every padded cell."""
        if not self.config.learner.packing:
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
        """Full weights on rank 0 (None elsewhere); under ZeRO-3 every rank must call this together."""
        import deepspeed

        module = self.engine.module
        state = {}
        for name, param in module.named_parameters():
            with deepspeed.zero.GatheredParameters([param], enabled=self.config.learner.zero_stage == 3):
                if self.rank == 0:
                    state[name] = param.detach().to("cpu", copy=True)
        return state if self.rank == 0 else None

    def save_hf(self, out_dir: str) -> None:
        from transformers import AutoTokenizer

        state = self.gathered_state_dict()
        if self.rank == 0:
            self.engine.module.save_pretrained(out_dir, state_dict=state)
            AutoTokenizer.from_pretrained(self.model_path).save_pretrained(out_dir)

    def save_checkpoint(self, ckpt_dir: str, tag: str, client_state: dict[str, Any]) -> None:
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        state = {"client": client_state, "rng": rng, "optimizer_steps": self.optimizer_steps}
        self.engine.save_checkpoint(ckpt_dir, tag=tag, client_state={"rltrain": state})

    def load_checkpoint(self, ckpt_dir: str, tag: str) -> dict[str, Any]:
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


class LearnerGroup:
    """Starts ``learner.num_learners`` :class:`PolicyLearner` actors in one placement group, forms
    their torch.distributed group, and calls every rank at once."""

    def __init__(
        self, config: Config, model_path: str, total_optimizer_steps: int, learner_cls: type = PolicyLearner
    ):
        lc = config.learner
        self.config = config
        bundle = {"CPU": lc.cpus_per_learner} | ({"GPU": lc.gpus_per_learner} if lc.gpus_per_learner else {})
        self.placement_group = placement_group([bundle] * lc.num_learners, strategy="PACK")
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
        addr, port = ray.get(self.actors[0].node_address.remote())
        self._all("setup", addr, port, total_optimizer_steps)

    def _all(self, method: str, *args: Any) -> list[Any]:
        return ray.get([getattr(actor, method).remote(*args) for actor in self.actors])

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        batch.validate()
        lc = self.config.learner
        sp = lc.sequence_parallel_size
        data_parallel = lc.num_learners // sp  # the ranks of a sequence-parallel group share one share
        if lc.packing:
            plan = plan_packed_micro_batches(
                batch.sequence_lengths(),
                data_parallel,
                lc.num_mini_batches,
                self.config.micro_batch_token_budget,
            )
        else:
            plan = plan_micro_batches(len(batch), data_parallel, lc.num_mini_batches, lc.micro_batch_size)
        shards = [[[batch.select(idx).trim() for idx in group] for group in rank] for rank in plan.groups]
        results = ray.get([a.train_step.remote(shards[i // sp]) for i, a in enumerate(self.actors)])
        metrics = results[0]  # every rank holds the same all-reduced metrics, except its own memory
        metrics["perf/peak_memory_mib"] = max(r["perf/peak_memory_mib"] for r in results)
        metrics["train/micro_batches"] = float(sum(plan.micro_batches_per_group()))
        metrics["train/oversized_sequences"] = float(plan.oversized)
        return metrics

    def gathered_state_ref(self) -> ray.ObjectRef:
        """Rank 0's full weights as an object reference, gathered with every rank taking part
        (ZeRO-3); the weights stay in the object store, so they can go to generators directly."""
        refs = [actor.gathered_state_dict.remote() for actor in self.actors]
        ray.wait(refs, num_returns=len(refs))
        return refs[0]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return ray.get(self.gathered_state_ref())

    def save_hf(self, out_dir: str | Path) -> None:
        self._all("save_hf", str(out_dir))

    def save_checkpoint(self, ckpt_dir: str | Path, tag: str, client_state: dict[str, Any]) -> None:
        self._all("save_checkpoint", str(ckpt_dir), tag, client_state)

    def load_checkpoint(self, ckpt_dir: str | Path, tag: str) -> dict[str, Any]:
        return self._all("load_checkpoint", str(ckpt_dir), tag)[0]

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.placement_group)
