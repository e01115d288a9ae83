"""Learners driven call by call (the Tinker API, :mod:`rltrain.serve`): ``forward_backward`` adds
the gradient of a loss **sum** (:mod:`rltrain.loss.sums`) to what earlier calls left, and
``optim_step`` takes one AdamW step with the call's own hyperparameters, then clears them.

Exact whatever the layout: a sum needs no denominator, so every rank backpropagates its own
micro-batches' sum times the number of ranks, which undoes DeepSpeed's mean over data-parallel ranks,
and never divides by accumulation steps (the engine's config has one). Gradients accumulate across
calls with the accumulation boundary off; ``optim_step`` first runs a blank micro-batch (its loss 0)
with the boundary on, so ZeRO-1/2 reduce what every call accumulated (they keep only the last
micro-batch's gradient otherwise), then steps. No learning-rate schedule: each step's rate is the
call's. A rank without datums in a call runs a blank micro-batch, so every rank issues the same
collectives.

Several models on one set of learners (:mod:`rltrain.serve.shared`): the learners hold one model's
state at a time (:meth:`ServedLearner.hold`), the others' set aside whole, so each model's calls
give the weights they give alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import ray
import torch

from rltrain import forward
from rltrain.config import Config
from rltrain.learner.group import LearnerGroup
from rltrain.learner.policy import PolicyLearner
from rltrain.learner.prefix_tree import LayoutMismatch
from rltrain.loss.sums import token_losses
from rltrain.plan import plan_micro_batches, plan_packed_micro_batches

STATE_FILE = "state.pt"  # a saved state's weights and optimizer, layout-free


@dataclass
class Datums:
    """Datums of the Tinker API as tensors: ``[N, T]`` input tokens (right-padded), their mask, each
    position's target token, and each loss input (``weights``, ``logprobs``, ``advantages``, ...)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def of(cls, tokens: list[list[int]], targets: list[list[int]], inputs: list[dict]) -> Datums:
        """``N`` datums' tokens, targets and loss inputs (each a list of equal length) as tensors."""
        n, width = len(tokens), max(1, max(len(t) for t in tokens))
        ids = torch.zeros(n, width, dtype=torch.long)
        mask, target = torch.zeros_like(ids), torch.zeros_like(ids)
        names = sorted({k for d in inputs for k in d})
        values = {k: torch.zeros(n, width) for k in names}
        for i, (t, y, d) in enumerate(zip(tokens, targets, inputs)):
            ids[i, : len(t)], target[i, : len(t)], mask[i, : len(t)] = torch.tensor(t), torch.tensor(y), 1
            for k, v in d.items():
                values[k][i, : len(t)] = torch.tensor(v, dtype=torch.float32)
        return cls(ids, mask, target, values)

    def select(self, idx: torch.Tensor) -> Datums:
        return Datums(self.input_ids[idx], self.attention_mask[idx], self.targets[idx],
                      {k: v[idx] for k, v in self.inputs.items()})  # fmt: skip

    def trim(self) -> Datums:
        width = max(1, int(self.attention_mask.sum(-1).max())) if len(self) else 1
        return Datums(self.input_ids[:, :width], self.attention_mask[:, :width], self.targets[:, :width],
                      {k: v[:, :width] for k, v in self.inputs.items()})  # fmt: skip

    def to(self, device) -> Datums:
        return Datums(*(getattr(self, f.name).to(device) for f in fields(self)[:3]),
                      {k: v.to(device) for k, v in self.inputs.items()})  # fmt: skip

    @classmethod
    def blank(cls, names=()) -> Datums:
        """One 2-token datum that counts nothing (flagged by its ``blank`` input), with zero inputs
        of ``names``: a forward and backward every rank runs together."""
        zeros = torch.zeros(1, 2, dtype=torch.long)
        return cls(zeros, torch.ones_like(zeros), zeros,
                   {k: torch.zeros(1, 2) for k in names} | {"blank": torch.ones(1, 2)})  # fmt: skip

    def nonempty(self) -> Datums:
        """An empty share as :meth:`blank`."""
        return self if len(self) else Datums.blank(self.inputs)


def _compared(mb: Datums) -> torch.Tensor:
    """Where a layout check compares a micro-batch's log-probs: every token but a blank datum's."""
    return mb.attention_mask.bool() & ("blank" not in mb.inputs)


class ServedLearner(PolicyLearner):
    """A policy rank (LoRA adapters or every weight, ``model.lora``) driven call by call."""

    ROLE = "served learner"

    def __init__(self, config: Config, model_path: str, rank: int, world_size: int):
        super().__init__(config, model_path, rank, world_size)
        self.layout_problem: str | None = None  # a layout check's failure: every later call fails alike
        # several models on these learners (:meth:`hold`): the one whose state the engine holds, the
        # others' set aside, and the state the learners started with (a new model's)
        self.held: str | None = None
        self.aside: dict[str, Aside] = {}
        self.fresh: Aside | None = None
        self.pending: dict[str, torch.Tensor] | None = None  # the held model's gradient set aside before
        self.accumulated = False  # a call added a gradient to the engine's since the last step

    def _scheduler(self, optimizer, total_optimizer_steps: int):
        return None  # each optim_step's learning rate is the call's

    @torch.no_grad()
    def _check_layout(self, micro_batches: list[Datums]) -> None:
        """``learner.packing``: the first call's packed rows against padded rows, as a training run
        checks them (:meth:`~rltrain.learner.prefix_tree.PrefixSharing.check`, every rank at once,
        the positions compared: each datum's tokens). Where they differ this call fails naming the
        setting that avoids it, and so does every later call of this model."""
        if self.layout_problem is None and self.sharing.unchecked:
            device = self.engine.device
            try:
                self.sharing.check({self.ROLE: self._target_logprobs}, [mb.nonempty().to(device) for mb in micro_batches],
                                   _compared, self.bf16, self.rank, lambda empty: empty.nonempty().to(device))  # fmt: skip
            except LayoutMismatch as mismatch:
                self.layout_problem = str(mismatch)
        if self.layout_problem is not None:
            raise LayoutMismatch(self.layout_problem)

    def forward_backward(
        self, micro_batches: list[Datums], loss_fn: str, settings: dict[str, float], forward_only: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each micro-batch's ``[n, T]`` target log-probs and per-token losses (on the CPU); unless
        ``forward_only``, their sum's gradient added to the parameters' (no step)."""
        self._check_layout(micro_batches)
        out = []
        for mb in micro_batches:
            mb = mb.nonempty().to(self.engine.device)
            blank = "blank" in mb.inputs
            with torch.set_grad_enabled(not forward_only):
                logprobs = self._target_logprobs(mb)
                mask = mb.attention_mask.float() * (0.0 if blank else 1.0)
                losses = token_losses(loss_fn, logprobs, {**mb.inputs, "mask": mask}, settings)
                if not forward_only:
                    # a sum: x world_size undoes DeepSpeed's mean over ranks; the boundary stays off
                    # until optim_step, so every call's gradient accumulates
                    self.engine.set_gradient_accumulation_boundary(False)
                    self.engine.backward(losses.sum() * self.world_size)
                    self.accumulated = True
            out.append((logprobs.detach().cpu(), losses.detach().cpu()))
        return out

    def _target_logprobs(self, mb: Datums) -> torch.Tensor:
        """``[n, T]``: each position's target log-prob, through padded rows or one packed row."""
        row = forward.RowLayout(mb.input_ids, mb.attention_mask, self.sharing.packed())
        return forward.target_logprobs(self.engine, row, mb.targets, self.agree_chunks)

    def optim_step(self, adam: dict[str, float]) -> dict[str, float]:
        """One AdamW step with ``adam`` (``learning_rate``, ``beta1``, ``beta2``, ``eps``,
        ``weight_decay``, ``grad_clip_norm``: 0 is none) on the gradients every call since the last
        step added; the gradient norm before clipping. Every rank at once."""
        self._reduce()
        if self.pending is not None:  # what the calls added before the model was last set aside
            from deepspeed.utils import safe_set_local_grad

            params = dict(self._trained_parameters())
            for name, g in self._local_grads().items():
                if g is None:
                    continue
                if hasattr(params[name], "ds_id"):  # (ZeRO-3)
                    safe_set_local_grad(params[name], g + self.pending[name])
                else:
                    g.add_(self.pending[name])
            self.pending = None
        for group in self.engine.optimizer.param_groups:
            group.update(lr=adam["learning_rate"], betas=(adam["beta1"], adam["beta2"]), eps=adam["eps"],
                         weight_decay=adam["weight_decay"])  # fmt: skip
        clip = float(adam["grad_clip_norm"])
        self.engine._config.gradient_clipping = clip  # (stage 0 reads the config at each step,
        if hasattr(self.engine.optimizer, "clip_grad"):  # ZeRO's optimizers their own copy)
            self.engine.optimizer.clip_grad = clip
        self.engine.step()
        self.optimizer_steps += 1
        self.accumulated = False
        norm = self.engine.get_global_grad_norm()
        return {"grad_norm": float("nan") if norm is None else float(norm)}

    def _reduce(self) -> None:
        """Every call's gradient since the last step reduced over the ranks (a blank micro-batch
        with the accumulation boundary on: ZeRO-1/2 keep only the last micro-batch's otherwise)."""
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.backward(0.0 * self._target_logprobs(Datums.blank().to(self.engine.device)).sum())

    # ------------------------------------------------------------------ several models

    def hold(self, model: str) -> None:
        """The engine holds ``model``'s state, every rank at once: the model it held is set aside
        whole (its weights, AdamW's moments and step, and the gradient its calls added since its
        last step: under ZeRO 0-1 each rank's own, under ZeRO 2-3 this rank's share of it reduced
        over the ranks), and ``model``'s is put in its place (a model new to these learners: the
        state they started with). One model's calls never touch another's."""
        if self.held == model:
            return
        if self.fresh is None:  # the first model: the engine holds the state the learners started with
            self.fresh = Aside(self._state_now(), None, None)
        else:
            if self.held is not None:
                self.aside[self.held] = self._set_aside()
            elif self.accumulated:
                self._set_aside()  # (a forgotten model's gradient: cleared)
            kept = self.aside.pop(model, None) or self.fresh
            self._put_state(kept.state)
            self.pending = kept.pending
            if kept.local is not None:
                for name, p in self._trained_parameters():
                    p.grad = kept.local[name]
                self.accumulated = True
        self.held = model

    def forget(self, model: str) -> None:
        """``model`` leaves these learners: its state is dropped (the engine's, where it is held,
        is replaced at the next :meth:`hold`)."""
        self.aside.pop(model, None)
        if self.held == model:
            self.held, self.pending = None, None

    def _state_now(self) -> dict:
        """The held model's weights and optimizer state as this rank holds them. Under ZeRO 0-2,
        copies of this rank's own tensors that a step writes (no collective): the trained
        parameters (whole on every rank), ZeRO's fp32 partitions and AdamW's state of the tensors it
        steps. Under ZeRO-3, whose parameters are gathered whole and partitioned again as the
        forward goes, :meth:`_layout_free_state`, gathered on every rank."""
        if self.lc.zero_stage == 3:
            rank, self.rank = self.rank, 0  # (every rank gathers; each keeps a copy)
            try:
                return {**self._layout_free_state(), "optimizer_steps": self.optimizer_steps}
            finally:
                self.rank = rank
        tensors, stepped = self._own_tensors()
        inner = self._torch_optimizer()
        return {"tensors": [t.detach().clone() for t in tensors],
                "moments": [{k: v.clone() if torch.is_tensor(v) else v for k, v in inner.state.get(t, {}).items()}
                            for t in stepped],
                "optimizer_steps": self.optimizer_steps}  # fmt: skip

    def _put_state(self, state: dict) -> None:
        """Set what :meth:`_state_now` took (a state before any step: zero moments and step, which
        is what a fresh AdamW starts from)."""
        if self.lc.zero_stage == 3:
            self._load_layout_free(_with_moments(state, self._moment_keys()))
            return
        tensors, stepped = self._own_tensors()
        with torch.no_grad():
            for t, saved in zip(tensors, state["tensors"]):
                t.copy_(saved)
        inner = self._torch_optimizer()
        if any(state["moments"]) and not any(inner.state.get(t) for t in stepped):
            self._create_optimizer_state()
        for t, saved in zip(stepped, state["moments"]):
            for k, v in inner.state.get(t, {}).items():
                if torch.is_tensor(v):
                    v.copy_(saved[k]) if saved else v.zero_()
                else:
                    inner.state[t][k] = saved[k] if saved else 0
        self.optimizer_steps = state["optimizer_steps"]

    def _local_grads(self) -> dict[str, torch.Tensor | None]:
        """(ZeRO 2-3, after the boundary's reduction) This rank's share of each trained parameter's
        reduced gradient, as the step reads it (None: no share here); no collective."""
        from deepspeed.utils import safe_get_local_grad

        out = {}
        for name, p in self._trained_parameters():
            if hasattr(p, "ds_id"):
                out[name] = safe_get_local_grad(p)
            elif getattr(p, "_hp_mapping", None) is not None:
                out[name] = p._hp_mapping.get_lp_grad_fragment(p._index_in_param_group)
            else:
                out[name] = None
        return out

    def _own_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(ZeRO 0-2) This rank's tensors that a step writes, and those the torch optimizer steps
        (ZeRO's fp32 partitions, or the parameters themselves without ZeRO)."""
        params = [p for _, p in self._trained_parameters()]
        masters = list(getattr(self.engine.optimizer, "single_partition_of_fp32_groups", None) or [])
        return params + masters, masters or params

    def _set_aside(self) -> Aside:
        """The held model's state, and its gradient taken out of the engine (with what was set aside
        before); the engine's gradient cleared by a step whose result the next model's state
        replaces."""
        if self.lc.zero_stage <= 1:  # each rank's own gradient stays in the parameters until the step:
            local = {n: p.grad for n, p in self._trained_parameters()} if self.accumulated else None
            for _, p in self._trained_parameters():  # it is set aside as it is, and put back
                p.grad = None
            self.accumulated = False
            return Aside(self._state_now(), self.pending, local)
        pending = self.pending
        if self.accumulated:
            self._reduce()
            grads = {n: None if g is None else g.detach().clone() for n, g in self._local_grads().items()}
            pending = grads if pending is None else {n: _plus(g, pending[n]) for n, g in grads.items()}
        state = self._state_now()
        if self.accumulated:
            self.engine.step()
            self.accumulated = False
        return Aside(state, pending, None)

    def save_state(self, folder: str) -> None:
        """The trained weights and AdamW's moments and step, whole and by name (layout-free: they
        load on any number of learners and ZeRO stage), and the adapter as a peft folder, written
        by rank 0 under ``folder``. Every rank at once (gathering is a collective)."""
        state = self._layout_free_state()
        failure = self.save_adapter(str(Path(folder) / "adapter"))
        if failure:
            raise OSError(failure)
        if self.rank == 0:
            torch.save({**state, "optimizer_steps": self.optimizer_steps}, Path(folder) / STATE_FILE)

    def load_state(self, folder: str, optimizer: bool) -> None:
        """The weights :meth:`save_state` wrote; AdamW's moments and step with ``optimizer``,
        otherwise zero moments (a fresh optimizer). Every rank at once."""
        state = torch.load(Path(folder) / STATE_FILE, map_location="cpu", weights_only=True)
        if not optimizer:
            state |= {"moments": {}, "optimizer_steps": 0}
        self._load_layout_free(_with_moments(state, self._moment_keys()))


@dataclass
class Aside:
    """A model's state while another's is in the engine (:meth:`ServedLearner.hold`)."""

    state: dict
    pending: dict[str, torch.Tensor] | None  # its calls' gradient since its last step, reduced
    local: dict[str, torch.Tensor] | None  # (ZeRO 0-1) this rank's, not yet reduced


def _plus(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return b if a is None else a if b is None else a + b


def _with_moments(state: dict, keys: list[str]) -> dict:
    """``state``, with zero moments and step where it has none (a state saved before any step, or
    without its optimizer): what a fresh AdamW starts from."""
    if state["moments"]:
        return state
    zeros = {k: {n: torch.zeros_like(w) for n, w in state["weights"].items()} for k in keys}
    return {**state, "moments": zeros, "optimizer_step": 0.0}


class ServedGroup(LearnerGroup):
    """The served learners of one model, every rank called at once: a call's datums planned over
    the ranks (padded micro-batches, or packed under the token budget), the outputs put back in the
    datums' order."""

    def __init__(self, config, model_path: str):
        super().__init__(config, model_path, total_optimizer_steps=1, learner_cls=ServedLearner)
        self.held: str | None = None  # the model whose state the learners hold

    def forward_backward(
        self, datums: Datums, loss_fn: str, settings: dict[str, float], forward_only: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each datum's target log-probs and per-token losses (its own length)."""
        lc = self.lc
        lengths = datums.attention_mask.sum(-1)
        if lc.packing:
            plan = plan_packed_micro_batches(lengths, lc.num_learners, 1, self.config.token_budget(lc))
        else:
            plan = plan_micro_batches(len(datums), lc.num_learners, 1, lc.micro_batch_size)
        shards = [[datums.select(idx).trim() for idx in rank[0]] for rank in plan.groups]
        try:
            results = self._gather([a.forward_backward.remote(shards[i], loss_fn, settings, forward_only)
                                    for i, a in enumerate(self.actors)])  # fmt: skip
        except ray.exceptions.RayTaskError as error:
            if isinstance(error.cause, LayoutMismatch):  # one line, not the actor's traceback
                raise LayoutMismatch(str(error.cause)) from None
            raise
        logprobs: list = [None] * len(datums)
        losses: list = [None] * len(datums)
        for rank, rank_results in zip(plan.groups, results):
            for idx, (lp, loss) in zip(rank[0], rank_results):
                for row, i in enumerate(idx.tolist()):
                    n = int(lengths[i])
                    logprobs[i], losses[i] = lp[row, :n], loss[row, :n]
        return logprobs, losses

    def optim_step(self, adam: dict[str, float]) -> dict[str, float]:
        return self._all("optim_step", adam)[0]

    def restart(self, *args, **kwargs) -> None:
        super().restart(*args, **kwargs)
        self.held = None

    def hold(self, model: str) -> None:
        """The learners hold ``model``'s state (:meth:`ServedLearner.hold`)."""
        if self.held != model:
            self._all("hold", model)
            self.held = model

    def forget(self, model: str) -> None:
        self._all("forget", model)
        if self.held == model:
            self.held = None

    def save_state(self, folder: str | Path) -> None:
        self._all("save_state", str(folder))

    def load_state(self, folder: str | Path, optimizer: bool) -> None:
        self._all("load_state", str(folder), optimizer)
