"""The learner actors of one model, driven together: placement, the torch.distributed group, the
plan of every batch over the ranks (:mod:`rltrain.batch`), and every rank called at once (driving
them one after another deadlocks under ZeRO-3)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rltrain.batch import TrainBatch
from rltrain.config import Config
from rltrain.learner.engine import EngineLearner
from rltrain.learner.policy import PolicyLearner
from rltrain.learner.prefix_tree import LayoutMismatch
from rltrain.plan import (
    MicroBatchPlan,
    plan_micro_batches,
    plan_packed_micro_batches,
    plan_skipping,
    shared_prefix_lengths,  # fmt: skip
)
from rltrain.remote import gather, wait_placed


def placement_of(lc: Any) -> tuple:
    """What a learner group's processes are started with: groups that agree on it can run each
    other's configs (:meth:`LearnerGroup.restart`)."""
    return (lc.num_learners, lc.cpus_per_learner, lc.gpus_per_learner, lc.placement)


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
        self.learner_cls = learner_cls
        lc = self._configure(config)
        self.names = [f"{learner_cls.ROLE} {i}" for i in range(lc.num_learners)]
        bundle = {"CPU": lc.cpus_per_learner} | ({"GPU": lc.gpus_per_learner} if lc.gpus_per_learner else {})
        bundles = [bundle] * lc.num_learners
        self.placement_group = placement_group(bundles, strategy=lc.placement)
        self.actors: list[Any] = []
        try:  # what started is stopped again if the rest does not
            wait_placed(self.placement_group, f"the {learner_cls.ROLE}s", bundles, lc.placement,
                        config.run.startup_timeout_s)  # fmt: skip
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
        except BaseException:
            self.shutdown()
            raise

    def _configure(self, config: Config) -> Any:
        lc = self.lc = self.learner_cls.section(config)
        self.config, self.timeout_s = config, config.run.actor_timeout_s
        # learner.prefix_sharing: whether batches are planned as prefix trees (a tree travels whole);
        # under auto, until the learners' check has decided (:meth:`_check_layouts`)
        self.sharing: bool | None = None if lc.prefix_sharing == "auto" else bool(lc.prefix_sharing)
        if lc.sequence_parallel_size > 1:
            self.sharing = False
        # packed rows and trees are checked against padded rows at the first call that runs them
        self.layouts_checked = self.sharing is False and not (lc.packing and lc.sequence_parallel_size == 1)
        # why a sequence of advantage 0 could move the weights (None: it cannot, and is skipped);
        # False until the learners are asked
        self.skip_proof: str | None | bool = False
        return lc

    def restart(self, config: Config, total_optimizer_steps: int, model_path: str | None = None) -> None:
        """Start every rank over from the weights at ``model_path`` (the group's model by default)
        on ``config``, in the same processes: :meth:`EngineLearner.restart`. ``config`` places the
        group as this one's did (:func:`placement_of`); its other learner keys (ZeRO stage,
        micro-batches, packing, sharing, sequence parallelism, optimizer), the loss and the model
        may differ."""
        if placement_of(self.learner_cls.section(config)) != placement_of(self.lc):
            raise ValueError(f"the {self.learner_cls.ROLE}s restart where they are placed: "
                             f"{placement_of(self.learner_cls.section(config))} against {placement_of(self.lc)}")  # fmt: skip
        self._configure(config)
        self._all("restart", config, total_optimizer_steps, model_path)

    def _all(self, method: str, *args: Any) -> list[Any]:
        return self._gather([getattr(actor, method).remote(*args) for actor in self.actors])

    def _gather(self, refs: list[ray.ObjectRef]) -> list[Any]:
        """Every rank's result; a rank that dies or passes run.actor_timeout_s raises ActorFailure."""
        return gather(refs, self.names, self.timeout_s)

    def where(self) -> list[dict[str, Any]]:
        """Node, address and pid of every rank."""
        return [{"actor": name, **w} for name, w in zip(self.names, self._all("where"))]

    def _plan(
        self, batch: TrainBatch, num_mini_batches: int, skipped: torch.Tensor | None = None
    ) -> MicroBatchPlan:
        """Micro-batches per data-parallel rank (the ranks of a sequence-parallel group share one);
        ``skipped`` sequences counted in their group's totals, not run (:func:`plan_skipping`)."""
        lc = self.lc
        data_parallel = lc.num_learners // lc.sequence_parallel_size
        if skipped is not None and skipped.any():
            return plan_skipping(len(batch), num_mini_batches, skipped, data_parallel,
                                 lambda kept: self._plan(batch.select(kept), 1))  # fmt: skip
        if lc.packing:
            budget = self.config.token_budget(lc)
            # a group's prefix tree travels whole, and counts its shared prefix once against the budget
            shared = shared_prefix_lengths(batch) if self.sharing is not False else None
            return plan_packed_micro_batches(
                batch.sequence_lengths(), data_parallel, num_mini_batches, budget, shared
            )
        return plan_micro_batches(len(batch), data_parallel, num_mini_batches, lc.micro_batch_size)

    def _check_layouts(self, batch: TrainBatch) -> None:
        """Before the group's first forward in a layout other than padded rows (a prefix tree, a
        packed row), every rank runs its models in that layout and padded on its share of ``batch``
        (:meth:`EngineLearner.check_layouts`). ``learner.prefix_sharing: auto``: where they differ,
        sharing is off for the group, and batches are planned unshared from then on (within the
        token budget of the unshared forward); a layout the config asks for stops the run
        (:class:`~rltrain.learner.prefix_tree.LayoutMismatch`). A layout with nothing to compare in
        ``batch`` is checked at the next call."""
        if self.layouts_checked:
            return
        sp = self.lc.sequence_parallel_size
        plan = self._plan(batch, 1)
        shards = [[batch.select(idx).trim() for idx in rank[0]] for rank in plan.groups]
        try:
            sharing, unchecked = self._gather(
                [a.check_layouts.remote(shards[i // sp]) for i, a in enumerate(self.actors)]
            )[0]
        except ray.exceptions.RayTaskError as error:
            if isinstance(error.cause, LayoutMismatch):  # one line, not the actor's traceback
                raise LayoutMismatch(str(error.cause)) from None
            raise
        if self.sharing is None:
            self.sharing = sharing
        self.layouts_checked = not unchecked

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One training step on ``batch``: planned over the ranks, every rank at once. Sequences
        whose gradient the objective proves zero (:meth:`EngineLearner.zero_gradient_proof`) are
        not run: they travel to rank 0 as counts alone, in their accumulation group's totals."""
        batch.validate()
        self._check_layouts(batch)
        sp = self.lc.sequence_parallel_size
        if self.skip_proof is False:  # asked once (a restart asks again)
            self.skip_proof = self._gather([self.actors[0].zero_gradient_proof.remote()])[0]
        skipped = batch.zero_advantage() if self.skip_proof is None else None
        plan = self._plan(batch, self.lc.num_mini_batches, skipped)
        shards = [[[batch.select(idx).trim() for idx in group] for group in rank] for rank in plan.groups]
        counted = [batch.select(idx).trim() if len(idx) else None for idx in plan.counted_only] or None
        results = self._gather([a.train_step.remote(shards[i // sp], counted if i == 0 else None)
                                for i, a in enumerate(self.actors)])  # fmt: skip
        metrics = results[0]  # every rank holds the same all-reduced metrics, except its own memory
        prefix, perf = self.learner_cls.PREFIX, self.learner_cls.PERF
        metrics[f"perf/{perf}peak_memory_mib"] = max(r[f"perf/{perf}peak_memory_mib"] for r in results)
        metrics[f"{prefix}/micro_batches"] = float(sum(plan.micro_batches_per_group()))
        metrics[f"{prefix}/oversized_sequences"] = float(plan.oversized)
        if self.skip_proof is None:  # the share of the step's sequences counted but not run
            metrics[f"perf/{perf}skipped_sequences"] = float(skipped.sum()) / len(batch)
        return metrics

    def per_token(self, batch: TrainBatch, own: bool = False) -> torch.Tensor:
        """The learners' per-token output for the whole batch, ``[N, T]`` (a critic's values), with
        every rank running its micro-batches at the same time (``own``: see the actors' method)."""
        self._check_layouts(batch)
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

    def gathered_state_ref(self, adapters_only: bool = False, synced: bool = False) -> ray.ObjectRef:
        """Rank 0's full weights (``adapters_only``: its LoRA adapters; ``synced``: what a sync
        sends) as an object reference, gathered with every rank taking part (ZeRO-3); the weights
        stay in the object store, so they can go to generators directly."""
        if adapters_only:
            refs = [actor.adapter_state_dict.remote() for actor in self.actors]
        else:
            refs = [actor.gathered_state_dict.remote(synced) for actor in self.actors]
        self._gather(refs[1:])  # None each (cheap to fetch); rank 0's weights stay in the store
        ray.wait(refs[:1], timeout=self.timeout_s, fetch_local=False)
        return refs[0]

    def device_key(self) -> str | None:
        """Rank 0's GPU (:func:`rltrain.weight_transfer.device_key`)."""
        return gather([self.actors[0].device_key.remote()], self.names[:1], self.timeout_s)[0]

    def shared_memory_free(self) -> int:
        """Bytes free in /dev/shm on rank 0's node."""
        return gather([self.actors[0].shared_memory_free.remote()], self.names[:1], self.timeout_s)[0]

    def weight_layout(self, adapters_only: bool, bucket_bytes: int) -> Any:
        """What a collective sync sends (:meth:`LearnerState.weight_layout`)."""
        return gather([self.actors[0].weight_layout.remote(adapters_only, bucket_bytes)], self.names[:1],
                      self.timeout_s)[0]  # fmt: skip

    def open_weight_group(
        self, world_size: int, backend: str, timeout_s: float
    ) -> tuple[tuple[str, int], ray.ObjectRef]:
        """Rank 0 opens the weight group on a free port of its node: the address and the call, to
        be awaited together with the receivers' joining it."""
        address = gather([self.actors[0].node_address.remote()], self.names[:1], self.timeout_s)[0]
        return address, self.actors[0].open_weight_group.remote(*address, world_size, backend, timeout_s)

    def broadcast_weights(self, adapters_only: bool, layout: Any) -> list[ray.ObjectRef]:
        """Every rank gathers, rank 0 sends (the calls, awaited with the receivers')."""
        return [actor.broadcast_weights.remote(adapters_only, layout) for actor in self.actors]

    def sent_bytes(self) -> int:
        """The size of the weights or adapters rank 0 gathered last."""
        return gather([self.actors[0].get_sent_bytes.remote()], self.names[:1], self.timeout_s)[0]

    def save_adapter(self, out_dir: str | Path) -> str | None:
        """Rank 0 writes the LoRA adapter as a peft folder; why it could not, or None."""
        return next((e for e in self._all("save_adapter", str(out_dir)) if e), None)

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


def resources_of(lc: Any) -> dict[str, float]:
    """The CPUs and GPUs a learner group of section ``lc`` holds of the cluster."""
    return {"CPU": lc.num_learners * lc.cpus_per_learner, "GPU": lc.num_learners * lc.gpus_per_learner}


class KeptLearners:
    """Learner groups kept started between uses: a group given back (:meth:`give`) is restarted in
    its processes by the next :meth:`take` placed alike (:func:`placement_of`, the same learner
    class), on that one's config and model (:meth:`LearnerGroup.restart`: a fresh group's start,
    bit for bit), instead of new processes paying their imports, torch.distributed group and
    DeepSpeed start again (seconds against a fraction of one). At most ``limit`` are kept (None: no
    limit), the oldest stopped first; kept groups give their CPUs and GPUs back when a group about
    to start needs more than the cluster has free, or while another group waits to start. A kept
    group that fails its restart (a process died while it was kept) is stopped and a new one
    started. ``start(config, model_path, total_optimizer_steps, learner_cls)`` starts a new group."""

    def __init__(self, limit: int | None = None, start: Callable[..., LearnerGroup] = LearnerGroup) -> None:
        self.limit, self.start = limit, start
        self.idle: list[tuple[tuple, LearnerGroup]] = []  # (learner class and placement, group), oldest first
        self.starting = 0
        self.lock = threading.Lock()

    def take(self, config: Config, model_path: str, total_optimizer_steps: int,
             learner_cls: type[EngineLearner] = PolicyLearner) -> LearnerGroup:  # fmt: skip
        lc = learner_cls.section(config)
        key = (learner_cls, placement_of(lc))
        with self.lock:
            kept = next((entry for entry in self.idle if entry[0] == key), None)
            if kept is not None:
                self.idle.remove(kept)
        if kept is not None:
            try:
                kept[1].restart(config, total_optimizer_steps, model_path)
                return kept[1]
            except Exception:  # (the config's own error, if it is one, comes again from a new group)
                kept[1].shutdown()
        with self.lock:
            self.starting += 1
            freed = self._room_for(resources_of(lc))
        try:
            for group in freed:
                group.shutdown()
            return self.start(config, model_path, total_optimizer_steps, learner_cls)
        finally:
            with self.lock:
                self.starting -= 1

    def _room_for(self, need: dict[str, float]) -> list[LearnerGroup]:
        """(Holding the lock.) Kept groups to stop, oldest first, until the cluster's free
        resources hold ``need``."""
        free = ray.available_resources()
        freed = []
        while self.idle and any(free.get(r, 0) < n for r, n in need.items() if n):
            _, group = self.idle.pop(0)
            freed.append(group)
            for r, n in resources_of(group.lc).items():
                free[r] = free.get(r, 0) + n
        return freed

    def give(self, group: LearnerGroup) -> None:
        """Keep ``group`` for the next use placed alike, unless another group waits to start (or
        none is to be kept)."""
        with self.lock:
            if not self.starting and self.limit != 0:
                self.idle.append(((group.learner_cls, placement_of(group.lc)), group))
                over = self.idle[: -self.limit] if self.limit else []
                del self.idle[: len(over)]
            else:
                over = [(None, group)]
        for _, old in over:
            old.shutdown()

    def held(self) -> list[dict[str, float]]:
        """What each kept group holds of the cluster, oldest first."""
        with self.lock:
            return [resources_of(group.lc) for _, group in self.idle]

    def stop_oldest(self) -> None:
        with self.lock:
            _, group = self.idle.pop(0)
        group.shutdown()

    def close(self) -> None:
        """Stop every kept group."""
        with self.lock:
            idle, self.idle = self.idle, []
        for _, group in idle:
            group.shutdown()
