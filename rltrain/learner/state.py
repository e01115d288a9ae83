"""A learner's weights and files: the full weights for the weight sync and the Hugging Face export,
DeepSpeed's checkpoint of this layout, and the layout-free state that resumes on another one.

The files a learner section writes beside its DeepSpeed state (the driver's side of a checkpoint,
the atomic save and ``latest``, is :mod:`rltrain.run.checkpoint`):

- ``layout.json``: the layout that wrote it (:func:`layout`);
- ``layout_free.pt``: with ``run.layout_free_checkpoints``, every trained parameter's fp32 weights
  and optimizer moments, whole and by name (with LoRA, the adapters').

A rank whose write fails records the error instead of raising it, goes on through the save's
collectives with its peers, and every rank then learns whether any failed.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from rltrain.learner.sender import WeightSender
from rltrain.models import adapters
from rltrain.models.images import has_processor

GATHER_BUCKET_BYTES = 64 * 2**20  # the parameters gathered at once for a whole state dict (ZeRO-3)
LAYOUT = "layout.json"  # beside each learner section's DeepSpeed state: the layout that wrote it
LAYOUT_FREE = (
    "layout_free.pt"  # beside it too: the same state without the layout (run.layout_free_checkpoints)
)


def layout(lc) -> dict[str, int]:
    """What a DeepSpeed checkpoint of a learner section depends on (a ``LearnerConfig``): ranks
    and ZeRO stage. Packing, token budgets and sequence parallelism change how a step is cut, not
    the state."""
    return {"num_learners": lc.num_learners, "zero_stage": lc.zero_stage}


def write_layout(folder: Path, lc) -> None:
    (folder / LAYOUT).write_text(json.dumps(layout(lc)))


def saved_layout(folder: Path) -> dict[str, int] | None:
    """The layout that wrote the learner section in ``folder``; None for a checkpoint written before
    layouts were recorded (or without its file): DeepSpeed's own load decides then."""
    try:
        return json.loads((folder / LAYOUT).read_text())
    except (OSError, ValueError):
        return None


def write_failure(error: BaseException, path: str | Path) -> str:
    """One line for a write that failed: the OS's reason and the free space where it went. torch's
    zip writer hides the reason (``unexpected pos 576 vs 534`` for a full disk); no free space
    then names it."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        free = None
    if isinstance(error, OSError) and error.strerror:
        reason = error.strerror
    elif free is not None and free < 2**20:
        reason = "No space left on device"
    else:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    space = f"{free / 2**20:.1f} MiB free there" if free is not None else "free space unknown"
    return f"writing {path} failed ({reason}; {space})"


@contextmanager
def recorded_deepspeed_write_errors(engine: Any) -> Iterator[list[str]]:
    """:func:`recorded_write_errors` over everything a DeepSpeed engine's ``save_checkpoint`` writes:
    its checkpoint engine's ``makedirs`` and ``save``, and (rank 0) the copy of its recovery scripts
    (``zero_to_fp32.py``) beside the ZeRO state, which a full disk can refuse too."""
    with recorded_write_errors(engine.checkpoint_engine) as errors:
        with recorded_write_errors(engine, ("_copy_recovery_script",), errors):
            yield errors


@contextmanager
def recorded_write_errors(
    engine: Any, names: tuple[str, ...] = ("makedirs", "save"), errors: list[str] | None = None
) -> Iterator[list[str]]:
    """Within the block, a failing ``engine.<name>(...)`` call (DeepSpeed's checkpoint engine:
    ``makedirs``, ``save``) is recorded in the yielded list (``errors``, when given) instead of
    raised, and later calls write nothing: the rank goes on through the save's collectives with its
    peers."""
    errors = [] if errors is None else errors
    originals = {name: getattr(engine, name) for name in names}
    own = {name: vars(engine)[name] for name in names if name in vars(engine)}

    def guarded(write: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if errors:
                return None
            try:
                return write(*args, **kwargs)
            except Exception as e:  # torch's writer raises RuntimeError for what the OS refused
                path = kwargs.get("path") or next((a for a in args if isinstance(a, (str, Path))), "?")
                errors.append(write_failure(e, path))
                return None

        return call

    for name, write in originals.items():
        setattr(engine, name, guarded(write))
    try:
        yield errors
    finally:
        for name in originals:
            if name in own:
                setattr(engine, name, own[name])
            else:
                delattr(engine, name)  # the class's method again


class LearnerState(WeightSender):
    """The weights-and-files half of :class:`~rltrain.learner.engine.EngineLearner` (which sets
    ``engine``, ``lc``, ``rank``, ``config``, ``model_path`` and ``optimizer_steps``)."""

    trains_adapters = False  # the policy's learners with model.lora.rank (PolicyLearner)
    sent_bytes = 0  # of the last weights or adapters gathered

    def _gathered(self, adapters_only: bool = False, synced: bool = False) -> dict[str, torch.Tensor] | None:
        """What a sync sends (:meth:`_sent_names`; ``synced`` false: every weight), whole, on rank 0
        (None elsewhere), by every name the model's own state dict has, gathered a bucket at a time
        as the collective sync does. Under ZeRO-3 every rank must call this together."""
        layout = self.weight_layout(adapters_only, GATHER_BUCKET_BYTES, synced)
        tensors = self._bucketed(adapters_only, layout)
        state = {name: tensor.to("cpu", copy=True) for name, tensor in tensors if self.rank == 0}
        if self.rank != 0:
            return None
        state |= {alias: state[name] for alias, name in layout.aliases.items()}  # a tied head
        self.sent_bytes = sum(t.numel() * t.element_size() for t in state.values())
        return state

    def gathered_state_dict(self, synced: bool = False) -> dict[str, torch.Tensor] | None:
        """Full weights on rank 0 (None elsewhere) by the base model's names; with LoRA, each
        adapted weight merged with its adapter; ``synced``: what a sync sends (a frozen vision side
        left out). Under ZeRO-3 every rank must call this together."""
        state = self._gathered(synced=synced)
        if state is not None and self.lora_rank:
            state = adapters.merged(state, self.config.model.lora)
        return state

    def adapter_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The LoRA adapters alone on rank 0, by peft's file names: what an adapter sync sends."""
        return self._gathered(adapters_only=True)

    def get_sent_bytes(self) -> int:
        return self.sent_bytes

    @property
    def lora_rank(self) -> int:
        return self.config.model.lora.rank if self.trains_adapters else 0

    def save_hf(self, out_dir: str) -> str | None:
        """The model in Hugging Face format (with LoRA: merged), written by rank 0; why it could
        not be, or None."""
        from transformers import AutoProcessor, AutoTokenizer

        state = self.gathered_state_dict()
        if self.rank == 0:
            module = self.engine.module
            try:
                (module.get_base_model() if self.lora_rank else module).save_pretrained(
                    out_dir, state_dict=state
                )
                # its tokenizer, or a vision-language model's processor (its tokenizer and what
                # renders its images)
                preprocess = AutoProcessor if has_processor(self.model_path) else AutoTokenizer
                preprocess.from_pretrained(self.model_path).save_pretrained(out_dir)
            except (OSError, RuntimeError) as e:
                return write_failure(e, out_dir)
        return None

    def save_adapter(self, out_dir: str) -> str | None:
        """The LoRA adapter as a peft folder (loads onto the base model with ``PeftModel``), written
        by rank 0; why it could not be, or None."""
        state = self.adapter_state_dict()
        if self.rank == 0:
            try:
                adapters.write_adapter(Path(out_dir), state, self.config.model.lora, self.model_path)
            except (OSError, RuntimeError) as e:
                return write_failure(e, out_dir)
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
        with recorded_deepspeed_write_errors(self.engine) as errors:
            # no DeepSpeed `latest` file: rltrain.run.checkpoint moves its own pointer once a save is complete
            # with LoRA: the adapters and their optimizer state, not the frozen base (it is the model's)
            self.engine.save_checkpoint(ckpt_dir, tag=tag, client_state={"rltrain": state}, save_latest=False,
                                        exclude_frozen_parameters=self.lora_rank > 0)  # fmt: skip
        free = self._layout_free_state() if self.config.run.layout_free_checkpoints else None  # all ranks
        folder = Path(ckpt_dir) / tag
        if self.rank == 0 and not errors:
            try:
                if free is not None:
                    torch.save({**free, "client": client_state, "optimizer_steps": self.optimizer_steps},
                               folder / LAYOUT_FREE)  # fmt: skip
                write_layout(folder, self.lc)
            except (OSError, RuntimeError) as e:
                errors.append(write_failure(e, folder))
        failed = torch.tensor([float(len(errors))])
        dist.all_reduce(failed)
        if failed.item() == 0:
            return None
        return errors[0] if errors else ""

    def load_checkpoint(self, ckpt_dir: str, tag: str) -> dict[str, Any]:
        """Restore from DeepSpeed's checkpoint when it was written by this layout, otherwise from
        its layout-free state (:meth:`_load_layout_free`)."""
        folder = Path(ckpt_dir) / tag
        saved = saved_layout(folder)
        if saved is not None and saved != layout(self.lc):
            state = torch.load(folder / LAYOUT_FREE, map_location="cpu", weights_only=True)
            self._load_layout_free(state)
            return state["client"]
        path, state = self.engine.load_checkpoint(
            ckpt_dir, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True,
            load_module_strict=self.lora_rank == 0,  # with LoRA it holds the adapters alone
        )  # fmt: skip
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

    def _trained_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """The parameters the optimizer updates, by name (with LoRA, the adapters)."""
        return ((n, p) for n, p in self.engine.module.named_parameters() if p.requires_grad)

    def _layout_free_state(self) -> dict[str, Any] | None:
        """Every parameter's fp32 weights and optimizer moments, whole and by name, the optimizer's
        step count and the schedule, on rank 0 (None elsewhere). Every rank takes part: gathering a
        partitioned parameter (ZeRO 1-3) is a collective."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        inner = self._torch_optimizer()
        keys = self._moment_keys() if any(inner.state.values()) else []  # none before a first step
        weights, moments = {}, {k: {} for k in keys}
        keep = self.rank == 0  # every rank gathers; rank 0 alone keeps a copy
        for name, p in self._trained_parameters():
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
                "scheduler": None if self.engine.lr_scheduler is None else self.engine.lr_scheduler.state_dict()}  # fmt: skip

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
        for name, p in self._trained_parameters():
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
        if state["scheduler"] is not None and self.engine.lr_scheduler is not None:
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
