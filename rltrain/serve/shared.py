"""Learners shared by several models, as Tinker serves many LoRA models on one base: models whose
learner configs are the same (the base model, the adapters' rank and modules, the seed, the
layout) take seats on one set of learners, up to ``serve.models_per_learners`` a set. A call holds
the set's lock and has the learners hold its model's state first
(:meth:`rltrain.learner.served.ServedLearner.hold`: weights, AdamW's moments and step, and the
gradient its calls added since its last step, each model's alone), so one model's calls never
touch another's."""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from rltrain.config import Config

# what a model calls on its learners (ServedModel), each with the model's state held first
CALLS = ("forward_backward", "optim_step", "save_state", "load_state", "gathered_state_ref", "save_adapter",
         "save_hf")  # fmt: skip


def config_key(config: Config) -> str:
    """Models whose learner configs have the same key can share learners."""
    return config.model_dump_json()


def groups_needed(configs: list[Config], per_group: int) -> list[Config]:
    """One config for each set of learners ``configs``' models need, ``per_group`` models a set."""
    counts = Counter(config_key(c) for c in configs)
    first = {config_key(c): c for c in configs}
    return [first[k] for k, n in counts.items() for _ in range(math.ceil(n / per_group))]


class Shared:
    """One set of learners (a :class:`~rltrain.learner.served.ServedGroup`) and its seats."""

    def __init__(self, group, config: Config, model_path: str):
        self.group, self.config, self.model_path = group, config, model_path
        self.key = config_key(config)
        self.lock = threading.Lock()  # one call on these learners at a time
        self.seats: dict[str, Seat] = {}
        self.generation = 0  # restarts so far (after a learner died)


class Seat:
    """A model's place on shared learners: what :class:`~rltrain.serve.models.ServedModel` calls on
    its learners, each call with the model's state held first. ``lost``: why the learners were
    started again since the model's last call (it has to be restored), or None."""

    def __init__(self, shared: Shared, model_id: str):
        self.shared, self.model_id = shared, model_id
        self.lost: str | None = None

    @property
    def names(self) -> list[str]:
        return self.shared.group.names

    def where(self) -> list[dict[str, Any]]:
        return self.shared.group.where()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name not in CALLS:
            raise AttributeError(name)

        def call(*args, **kwargs):
            with self.shared.lock:
                self.shared.group.hold(self.model_id)
                return getattr(self.shared.group, name)(*args, **kwargs)

        return call


class Seating:
    """The server's shared learners: a model takes a seat beside models of the same learner config
    where a set has room, or on a new set (from the server's kept learners); it gives its seat back
    at its release, and the last to leave gives the set back."""

    def __init__(self, kept, per_group: int):
        self.kept, self.per_group = kept, per_group
        self.sets: list[Shared] = []
        self.lock = threading.Lock()  # (placing and leaving; a set's calls hold its own lock)

    def seat(self, model_id: str, config: Config, model_path: str) -> Seat:
        from rltrain.learner.served import ServedLearner

        with self.lock:
            key = config_key(config)
            shared = next((s for s in self.sets if s.key == key and len(s.seats) < self.per_group), None)
            if shared is None:
                shared = Shared(self.kept.take(config, model_path, 1, ServedLearner), config, model_path)
                self.sets.append(shared)
            seat = shared.seats[model_id] = Seat(shared, model_id)
            return seat

    def leave(self, seat: Seat) -> None:
        """The model's state leaves its learners; the last model's learners go back to the kept ones."""
        shared = seat.shared
        with self.lock, shared.lock:
            shared.seats.pop(seat.model_id, None)
            if shared.seats:
                shared.group.forget(seat.model_id)
                return
            self.sets.remove(shared)
            self.kept.give(shared.group)

    def restart(self, seat: Seat, generation: int, failure) -> None:
        """A learner of ``seat``'s set died (or hung) in a call made at ``generation``: the set is
        started again (once, whichever of its models' calls saw it first) and every other model on
        it is told at its next call (``Seat.lost``)."""
        from rltrain.learner.served import ServedLearner

        shared = seat.shared
        with self.lock, shared.lock:
            if shared.generation != generation:
                return
            try:
                shared.group.shutdown()
            except Exception:  # noqa: BLE001 (a dead group's shutdown may fail; it is replaced)
                pass
            shared.group = self.kept.take(shared.config, shared.model_path, 1, ServedLearner)
            shared.generation += 1
            for other in shared.seats.values():
                if other is not seat:
                    other.lost = f"{failure} during another model's call on the same learners"
