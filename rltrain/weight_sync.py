"""Weight sync from the learners to the generators, behind one interface.

``ObjectStoreSync`` (the one implemented): learner rank 0 gathers the full weights (under ZeRO-3
every rank takes part in the gather), puts them in the Ray object store once, and every engine
reloads them in place through its model's checkpoint loader. It works on CPU and GPU alike; on
GPU a broadcast over NCCL between learner rank 0 and the engines would skip the host copy, and
belongs behind this same interface.
"""

from __future__ import annotations

import time
from typing import Protocol

from rltrain.learner import LearnerGroup
from rltrain.rollout import GeneratorPool


class WeightSync(Protocol):
    def push(self, learners: LearnerGroup, generators: GeneratorPool, version: int) -> float:
        """Make the generators hold the learners' current weights, policy ``version`` (the
        training steps behind them, which the engines stamp on every token they sample); with
        ``rollout.inflight_updates`` they take them at their next chunk boundary. Returns seconds
        taken."""
        ...


class ObjectStoreSync:
    def push(self, learners: LearnerGroup, generators: GeneratorPool, version: int) -> float:
        start = time.perf_counter()
        # the reference goes to the engines without a round trip through the driver
        generators.load_weights(learners.gathered_state_ref(), version)
        return time.perf_counter() - start
