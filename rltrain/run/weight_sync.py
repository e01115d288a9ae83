"""Weight sync from the learners to the generators, behind one interface, and its check.

``CollectiveSync`` (``rollout.weight_sync: collective``, the default): learner rank 0 and every
engine form one process group at start-up (:mod:`rltrain.weight_transfer`: NCCL where each holds a
GPU of its own, gloo through host memory otherwise, its buckets through shared memory where all run
on one node) and rank 0 broadcasts the weights in buckets of ``rollout.weight_sync_bucket_mb``,
gathered bucket by bucket under ZeRO-3 (every rank takes part
in the gathers). An engine with no rollout in flight loads each bucket as it arrives, overlapping
the transfer; one with rollouts in flight receives beside them and takes the weights where the
object store's would have been taken. A generator that dies or sticks in a sync is named and
the run restarts, forming the group afresh. A call that raises (a receiver's load, a sender's name
or shape check) is named at once with its exception, its traceback printed to the run's log,
instead of its peers timing out in the collective it left: deterministic, it stops the run in one
line (:class:`SyncFailed`) rather than restarting into it. Where the group cannot be formed at all
the run says so in one line, with that cause, and uses the object store.

``ObjectStoreSync`` (``rollout.weight_sync: object_store``): rank 0 gathers the full weights, puts
them in the Ray object store once, and every engine reloads them from there.

Both send the weights by every name the model's state dict has, a tied output head included, and
every engine reloads them in place through its model's checkpoint loader. With ``model.lora.rank``
both send the LoRA adapters alone (``adapters_only``).

:func:`check_sync`: after a run's first sync, every engine and the learners score the same probe
sequences; a gap beyond the numerical noise measured before the update stops the run with one line
that names the engine parameters no sent weight loads, or says that none is known to differ.
"""

from __future__ import annotations

import sys
import time
from typing import Protocol

import ray
import torch
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from rltrain.batch import ImagePrompt, TrainBatch
from rltrain.learner.group import LearnerGroup
from rltrain.remote import ActorFailure, describe, raise_dead_peer
from rltrain.rollout import GeneratorPool

PROBE_SEQUENCES = 4
MIN_TOLERANCE = 1e-4  # fp32 engines and learners agree to ~1e-6 on the built-in model
NOISE_FACTOR = 10.0  # the tolerance over the gap measured before the update


class SyncFailed(RuntimeError):
    """A call of the collective sync raised (not a dead or hung actor): named with its exception's
    line; the same weights would fail the same way, so the run stops instead of restarting."""


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
    """The full weights (``adapters_only``: the LoRA adapters) through the object store (see the
    module docstring)."""

    def __init__(self, adapters_only: bool = False):
        self.adapters_only = adapters_only

    def push(self, learners: LearnerGroup, generators: GeneratorPool, version: int) -> float:
        start = time.perf_counter()
        # the reference goes to the engines without a round trip through the driver
        generators.load_weights(learners.gathered_state_ref(self.adapters_only, synced=True), version)
        return time.perf_counter() - start


class CollectiveSync:
    """The weights broadcast over the weight group (see the module docstring)."""

    def __init__(self, learners: LearnerGroup, generators: GeneratorPool, adapters_only: bool, rc) -> None:
        self.adapters_only, self.timeout_s = adapters_only, rc.weight_sync_timeout_s
        self.layout = learners.weight_layout(adapters_only, int(rc.weight_sync_bucket_mb * 2**20))
        keys = [learners.device_key(), *generators.device_keys()]
        self.backend = "nccl" if all(keys) and len(set(keys)) == len(keys) else "gloo"
        nodes = {place["node_id"] for place in [*learners.where()[:1], *generators.where()]}
        # two slots of the largest bucket, where /dev/shm holds them (a container's is often 64 MiB)
        room = 2 * self.layout.largest_bucket <= learners.shared_memory_free()
        if self.backend == "gloo" and rc.weight_sync_shared_memory and len(nodes) == 1 and room:
            self.backend = "shm"  # gloo for the signals, the buckets through shared memory
        address, sender = learners.open_weight_group(generators.size + 1, self.backend, self.timeout_s)
        receivers = generators.open_weight_group(*address, self.backend, self.timeout_s)
        self._await(learners.names[:1], [sender], generators, receivers, "joining the weight group")

    def push(self, learners: LearnerGroup, generators: GeneratorPool, version: int) -> float:
        start = time.perf_counter()
        receivers, loaded = generators.receive_weights(self.layout, version)
        senders = learners.broadcast_weights(self.adapters_only, self.layout)
        self._await(learners.names, senders, generators, receivers, "the weight sync")
        if not loaded:
            generators.take_received(version)  # in order with the rollouts, as the object store's
        return time.perf_counter() - start

    def _await(self, sender_names, senders, generators: GeneratorPool, receivers, what: str) -> None:
        """Every call of a collective step, within ``rollout.weight_sync_timeout_s``, taken as each
        finishes: the first that raised is named with its exception (:class:`SyncFailed`, its
        traceback on stderr) before its peers, blocked in the collective it left, time out; a
        generator that dies is named (its peers' errors are its doing), and so is one that does not
        finish (the learners wait on it)."""
        refs, names = [*receivers, *senders], [*generators.names, *sender_names]
        index = {ref: i for i, ref in enumerate(refs)}
        pending, deadline = list(refs), time.monotonic() + self.timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                waiting = [names[index[ref]] for ref in pending]
                # the generators that answer nothing, else every generator still waiting, else the learners
                engines = [name for name in waiting if name in generators.names]
                named = generators.silent(engines) or engines or waiting
                raise ActorFailure(", ".join(named), f"did not finish {what} within rollout.weight_sync_timeout_s="
                                   f"{self.timeout_s:g}s", timed_out=True)  # fmt: skip
            try:
                ray.get(ready[0])
            except RayTaskError as error:
                raise_dead_peer(pending, index, names)  # a peer that died broke the collective: the cause
                raise sync_failed(names[index[ready[0]]], error, what) from None
            except (RayActorError, ActorUnavailableError) as error:
                raise ActorFailure(names[index[ready[0]]], describe(error)) from error


def sync_failed(name: str, error: RayTaskError, what: str) -> SyncFailed:
    """The one line for an actor's call that raised in the sync; its traceback goes to stderr."""
    cause = getattr(error, "cause", None) or error
    text = str(cause).strip()
    line = f"{type(cause).__name__}: {text.splitlines()[0]}" if text else type(cause).__name__
    print(f"rltrain: {name} raised in {what}:\n{error}", file=sys.stderr, flush=True)
    return SyncFailed(f"{name} raised {line} in {what}")


def weight_sync(config, learners: LearnerGroup, generators: GeneratorPool) -> WeightSync:
    """The run's sync: ``rollout.weight_sync``, and the object store where the weight group cannot
    be formed (said in one line)."""
    adapters_only = config.model.lora.rank > 0
    if config.rollout.weight_sync == "collective":
        try:
            return CollectiveSync(learners, generators, adapters_only, config.rollout)
        except ActorFailure as e:
            if not e.timed_out:  # an actor died: the run restarts
                raise
            why = str(e)
        except SyncFailed as e:  # a member could not join (its own error, named)
            why = str(e)
        except (RuntimeError, OSError) as e:  # what gloo, NCCL and the store raise (a bug propagates)
            why = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        print(
            f"rltrain: note: rollout.weight_sync=collective could not be set up ({why}); the weights go "
            "through the object store (rollout.weight_sync=object_store)",
            file=sys.stderr,
            flush=True,
        )
    return ObjectStoreSync(adapters_only)


def probe_gap(
    learners: LearnerGroup, generators: GeneratorPool, probe: TrainBatch, beyond: float | None = None
):
    """The largest ``|engine - learner|`` log-prob over every engine and every predicted token of
    the probe's first sequences (the model's own distribution, temperature 1); with ``beyond``:
    ``(largest, mean k3, share of tokens whose gap passes beyond)``, ``k3 = exp(d) - d - 1`` and
    ``d = learner - engine`` (as ``rollout/mismatch_kl`` measures a step's sampled tokens)."""
    probe = probe.select(torch.arange(min(len(probe), PROBE_SEQUENCES)))
    # both sides route with the weights they hold (a rollout's routes came from the older ones)
    probe = probe.replace(routes=None)
    learner_BT = learners.per_token(probe, own=True)
    positions = [row.nonzero().squeeze(-1) for row in probe.attention_mask]
    sequences = [ids[at].tolist() for ids, at in zip(probe.input_ids, positions)]
    if probe.images is not None:  # (each with its images)
        sequences = [ImagePrompt(seq, im, probe.image_token) if im else seq
                     for seq, im in zip(sequences, probe.images)]  # fmt: skip
    gap, k3, off, tokens = 0.0, 0.0, 0, 0
    for engine in generators.prompt_logprobs(sequences, every=True):
        for engine_logprobs, values, at in zip(engine, learner_BT, positions):
            # position 0 of a sequence has no prefix: the engine gives it 0
            diff = torch.tensor(engine_logprobs[1:]) - values[at[1:]]
            gap = max(gap, diff.abs().max().item() if diff.numel() else 0.0)
            d = (-diff).double().clamp(-20, 20)
            k3, tokens = k3 + (torch.expm1(d) - d).sum().item(), tokens + diff.numel()
            off += int((diff.abs() > (beyond or 0.0)).sum())
    return gap if beyond is None else (gap, k3 / max(tokens, 1), off / max(tokens, 1))


# a mixture of experts in fp32: the share of the probe's tokens that may differ past
# run.max_first_step_gap (a near-tie routed apart on one side changes a token or two)
NEAR_TIES = 0.1


class EnginesDisagree(RuntimeError):
    """Before any work, an engine does not compute what the learners do on the weights both hold."""


# the start-up probe's sequences beside the data's first prompts (an environment's prompts are
# rendered per episode): plain text, through the model's own tokenizer
STARTUP_TEXTS = ("What is 17 + 25? Add the tens, then the ones: 17 + 25 = 42.",
                 "The quick brown fox jumps over the lazy dog, and the dog sleeps on.")  # fmt: skip


def startup_probe(prompts, tokenizer) -> TrainBatch:
    """A few fixed sequences (up to two of the data's prompts and :data:`STARTUP_TEXTS`) as a batch
    of prompts alone, for :func:`check_engines`."""
    from rltrain.batch import Completion, collate

    sequences = [p.token_ids for p in prompts if p.token_ids][:2]
    sequences += [tokenizer.encode(text, add_special_tokens=False) for text in STARTUP_TEXTS]
    sequences = [s for s in sequences if len(s) > 1][:PROBE_SEQUENCES]
    return collate(sequences, [Completion() for _ in sequences], torch.zeros(len(sequences)),
                   tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)  # fmt: skip


def check_engines(config, learners: LearnerGroup, generators: GeneratorPool, probe: TrainBatch,
                  experts: bool, synced: bool = True) -> dict[str, float]:  # fmt: skip
    """Before any work, on the weights the engines and the learners both hold: every engine holds
    every weight a sync sends (the sync loads all of its model: parameters and persistent buffers),
    and its log-probs of the probe's sequences are the learners'. Where both compute in fp32 (CPU
    engines and learners), the largest gap must stay within ``run.max_first_step_gap`` (for a
    mixture of experts, where a near-tie may route a token apart, the share of tokens past it within
    :data:`NEAR_TIES`); otherwise the mean k3 within ``run.max_mismatch_kl``. A gap past them raises :class:`EnginesDisagree`, one line naming the
    gap, the engine and the way that runs. Returns ``sync/startup_gap`` and ``sync/startup_kl``.
    ``synced`` false: the engines loaded the model's files themselves (no sync to check yet)."""
    rc, lc, backend = config.rollout, config.learner, config.rollout.backend
    if synced and (missing := generators.weights_not_loaded()):
        names = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise EnginesDisagree(f"the weight sync loads nothing into the engine's {names} (rollout.backend="
                              f"{backend}); stopped before any step")  # fmt: skip
    fp32 = lc.gpus_per_learner == 0 and lc.precision != "bf16" and rc.gpus_per_engine == 0
    first = config.run.max_first_step_gap
    gap, kl, off = probe_gap(learners, generators, probe, beyond=first or 0.0)
    if fp32 and first is not None and not experts:
        limit, what, value = first, "largest log-prob gap", gap
    elif fp32 and first is not None:  # a near-tie may route a token apart; a wrong model, most tokens
        limit, what, value = NEAR_TIES, f"share of tokens past {first:g}", off
    else:
        limit, what, value = config.mismatch_limit, "mean k3 KL", kl
    if limit is None or value <= limit:
        return {"sync/startup_gap": gap, "sync/startup_kl": kl}
    layout = [
        text for on, text in [(lc.packing, "packed rows"), (lc.prefix_sharing is True, "prefix trees")] if on
    ]
    if backend == "hf":  # the engine runs each sequence alone under the model's own forward
        advice = (f"the learners do not run this model exactly in their layout ({' and '.join(layout) or 'padded rows'}"
                  f"{': set learner.packing=false learner.prefix_sharing=false' if layout else ''})")  # fmt: skip
    else:
        advice = (
            "vLLM computes this model otherwise; rollout.backend=hf generates with transformers' own forward"
        )
    raise EnginesDisagree(
        f"before any step, on the weights both hold, the engine's (rollout.backend={backend}) log-probs of "
        f"{len(probe)} fixed sequences differ from the learners' by {gap:.3g} at most (mean k3 KL {kl:.3g}; "
        f"{what} limit {limit:g}): {advice}"
    )


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
