"""How a learner starts: it joins its group's torch.distributed group, lays out its attention and
precision, loads its model once the model's needs fit the layout (:mod:`rltrain.models.families`)
and wraps it in a DeepSpeed engine with its own optimizer and schedule; and how it starts over in
the same process (:meth:`EngineStart.restart`: a fresh engine without a new process's imports)."""

from __future__ import annotations

import functools
import gc
import os
from typing import Any

import torch

from rltrain.config import Config, LearnerConfig
from rltrain.forward import attention
from rltrain.forward.head import output_head
from rltrain.learner import sequence_parallel
from rltrain.models import families
from rltrain.models.images import is_vision_parameter


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
    # a model whose attention does not go through transformers' attention functions keeps its own
    # (it then runs padded rows alone: the layout check below)
    own = not families.attention_interface(model_config)
    extra = {"attn_implementation": attn_implementation} if attn_implementation and not own else {}
    model = auto_cls.from_pretrained(path, dtype=dtype, trust_remote_code=trust, **extra, **kwargs)
    loaded = model[0] if isinstance(model, tuple) else model  # (with output_loading_info)
    model_needs = families.needs(model_config, loaded)
    sp = getattr(lc, "sequence_parallel_size", 1)
    if problem := families.layout_problem(model_needs, key, lc.packing, lc.prefix_sharing, sp):
        raise ValueError(problem)
    families.prepare(loaded, model_needs)
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


class EngineStart:
    """The start-up half of :class:`~rltrain.learner.engine.EngineLearner` (which sets the
    attributes read here in its ``__init__``)."""

    def setup(self, master_addr: str, master_port: int, total_optimizer_steps: int) -> None:
        self._join_group(master_addr, master_port)
        self._start_engine(total_optimizer_steps)

    def restart(self, config: Config, total_optimizer_steps: int, model_path: str | None = None) -> None:
        """Start over from the weights at ``model_path`` (this learner's by default) on ``config``
        in this process, whose torch.distributed group stays (the same ranks; sequence-parallel
        groups are formed anew): a fresh engine, optimizer, schedule and state, without a new
        process's imports. Every rank at once."""
        if (n := self.section(config).num_learners) != self.world_size:
            raise ValueError(
                f"{self.ROLE} {self.rank}: a restart keeps the ranks: {n} learners against {self.world_size}"
            )
        if hasattr(self.engine, "destroy"):  # (a frozen model without ZeRO-3 runs as a plain module)
            self.engine.destroy()
        type(self).__init__(self, config, model_path or self.model_path, self.rank, self.world_size)
        # the old engine, model and optimizer state sit in reference cycles that only the cyclic
        # collector frees, which tensors' sizes never trigger: freed now, before the new ones load
        gc.collect()
        self._set_layout()
        self._start_engine(total_optimizer_steps)

    def _start_engine(self, total_optimizer_steps: int) -> None:
        """The model, its optimizer and schedule in a DeepSpeed engine."""
        import deepspeed

        lc = self.lc
        torch.manual_seed(self.config.run.seed)  # the same start in a fresh process and a restarted one
        model = self._build_model()
        if self.config.model.freeze_vision:  # a vision-language model's tower keeps its weights
            for name, param in model.named_parameters():
                if is_vision_parameter(name):
                    param.requires_grad_(False)
        if self.config.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        trained = [p for p in model.parameters() if p.requires_grad]  # with LoRA: the adapters alone
        if lc.optimizer == "adamw":
            optimizer = torch.optim.AdamW(trained, lr=lc.lr, betas=lc.betas, weight_decay=lc.weight_decay)
        else:
            optimizer = torch.optim.SGD(trained, lr=lc.lr)
        scheduler = self._scheduler(optimizer, total_optimizer_steps)
        self.engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler,
            config=deepspeed_config(lc, self.world_size, self.bf16),
        )  # fmt: skip
        for scored in (self.engine, getattr(self, "ref_model", None)):  # every rank at once (ZeRO-3)
            if scored is not None:
                output_head(scored)  # the head path checked on a probe, before any forward takes it

    def _scheduler(self, optimizer, total_optimizer_steps: int):
        """The learning-rate schedule over the run's optimizer steps (``learner.lr_schedule``)."""
        from transformers import get_scheduler

        lc = self.lc
        return get_scheduler(lc.lr_schedule, optimizer, num_warmup_steps=lc.warmup_steps,
                             num_training_steps=total_optimizer_steps)  # fmt: skip

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
        extra = {}
        if self.config.run.check_collectives:  # every collective's op and shapes compared across ranks first
            import datetime

            import torch.distributed as dist

            os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
            dist.set_debug_level_from_env()
            # a rank missing from a collective is named before the driver's own timeout names them all
            extra["timeout"] = datetime.timedelta(seconds=self.config.run.actor_timeout_s / 2)
        deepspeed.init_distributed(
            dist_backend="nccl" if self.use_cuda else "gloo", auto_mpi_discovery=False, **extra
        )
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
        self.agree_chunks = functools.partial(most_over_ranks, use_cuda=self.use_cuda) if agree else None

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
