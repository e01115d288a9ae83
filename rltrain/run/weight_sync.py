"""Weight sync from the learners to the generators, behind one interface, and its check.

``ObjectStoreSync``: learner rank 0 gathers the full weights (under ZeRO-3
every rank takes part in the gather), puts them in the Ray object store once, and every engine
reloads them in place through its model's checkpoint loader. The weights go by every name the
model's state dict has, a tied output head included. It works on CPU and GPU alike; on GPU a
broadcast over NCCL between learner rank 0 and the engines would skip the host copy, and belongs
behind this same interface.

``AdapterSync`` (with ``model.lora.rank``): the same path with the LoRA adapters alone.

:func:`check_sync`: after a run's first sync, every engine and the learners score the same probe
sequences; a gap beyond the numerical noise measured before the update stops the run with one line
that names the engine parameters no sent weight loads, or says that none is known to differ.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from rltrain.batch import TrainBatch
from rltrain.learner.group import LearnerGroup
from rltrain.rollout import GeneratorPool

PROBE_SEQUENCES = 4
MIN_TOLERANCE = 1e-4  # fp32 engines and learners agree to ~1e-6 on the built-in model
NOISE_FACTOR = 10.0  # the tolerance over the gap measured before the update


class SyncCheckFailed(RuntimeError):
    """The engines do not compute what the learners do after a weight sync."""


class WeightSync(Protocol):
    def push(self, learners: LearnerGroup, generators: GeneratorPool, version: int) -> float:
        """Make the generators hold the learners' current weights, policy ``version`` (the
        training steps behind them, which the engines stamp on every token they sample); with
        ``rollout.inflight_updates`` they take them at their next chunk boundary. Returns seconds
        taken."""
        ...


class ObjectStoreSync:
    """The full weights through the object store (see the module docstring)."""

    adapters_only = False

    def push(self, learners: LearnerGroup, generators: GeneratorPool, version: int) -> float:
        start = time.perf_counter()
        # the reference goes to the engines without a round trip through the driver
        generators.load_weights(learners.gathered_state_ref(self.adapters_only), version)
        return time.perf_counter() - start


class AdapterSync(ObjectStoreSync):
    """``model.lora``: the LoRA adapters alone (megabytes, not the base model's gigabytes). A vLLM
    engine serves each version as a LoRA adapter over its unchanged base, keeping the versions
    that rollouts still in flight need; the transformers backend loads it through peft."""

    adapters_only = True


def weight_sync(config) -> WeightSync:
    """The sync for the run: adapters with ``model.lora.rank``, else the full weights."""
    return AdapterSync() if config.model.lora.rank else ObjectStoreSync()


def probe_gap(learners: LearnerGroup, generators: GeneratorPool, probe: TrainBatch) -> float:
    """The largest ``|engine - learner|`` log-prob over every engine and every predicted token of
    the probe's first sequences (the model's own distribution, temperature 1)."""
    probe = probe.select(torch.arange(min(len(probe), PROBE_SEQUENCES)))
    learner_BT = learners.per_token(probe, own=True)
    positions = [row.nonzero().squeeze(-1) for row in probe.attention_mask]
    sequences = [ids[at].tolist() for ids, at in zip(probe.input_ids, positions)]
    gap = 0.0
    for engine in generators.prompt_logprobs(sequences, every=True):
        for engine_logprobs, values, at in zip(engine, learner_BT, positions):
            # position 0 of a sequence has no prefix: the engine gives it 0
            diff = torch.tensor(engine_logprobs[1:]) - values[at[1:]]
            gap = max(gap, diff.abs().max().item() if diff.numel() else 0.0)
    return gap


def check_sync(
    learners: LearnerGroup, generators: GeneratorPool, probe: TrainBatch, noise: float, step: int
) -> float:
    """After a sync: raise :class:`SyncCheckFailed` when the engines' log-probs on the probe differ
    from the learners' by more than ``NOISE_FACTOR`` times ``noise`` (the largest gap measured
    while both held the same weights: the step's ``rollout/mismatch_max``), and at least
    ``MIN_TOLERANCE``. Returns the gap."""
    gap, tolerance = probe_gap(learners, generators, probe), max(NOISE_FACTOR * noise, MIN_TOLERANCE)
    if gap <= tolerance:
        return gap
    missing = generators.weights_not_loaded()
    cause = (
        f"the sync loads no weight into the engine's {', '.join(missing[:3])}"
        + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        if missing
        else "no parameter is known to differ (the engine may compute in another precision or with "
        "other kernels than the learners)"
    )
    raise SyncCheckFailed(
        f"step {step}: after the weight sync the engines' log-probs differ from the learners' by up to "
        f"{gap:.3g} on {min(len(probe), PROBE_SEQUENCES)} probe sequences (tolerance {tolerance:.3g}, "
        f"from a gap of {noise:.3g} before the update): {cause}; stopped (run.check_sync=false skips "
        "this check)"
    )
