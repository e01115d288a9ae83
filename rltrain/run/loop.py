"""The training loop, top to bottom: generate, score, compute advantages, train, sync; log and
checkpoint. An actor that dies or stops answering restarts every actor from the newest checkpoint,
up to ``run.max_restarts`` times; past that the run stops with one line saying how to resume.

Checks live in :mod:`rltrain.run.preflight`, the Ray connection and the actors' start-up in :mod:`rltrain.run.launch` (shared with
:mod:`rltrain.run.eval`); the generation pipeline (steps in flight, policy versions, staleness) in
:mod:`rltrain.run.orchestrator`. The command line is :mod:`rltrain.train`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from rltrain.config import Config, ConfigError
from rltrain.run import checkpoint
from rltrain.run.eval import evaluate
from rltrain.run.launch import Run, start_run
from rltrain.run.preflight import Inputs, preflight
from rltrain.run.scoring import build_batch, drop_failed, with_distillation, with_gae
from rltrain.run.user_code import UserCodeFailures

if TYPE_CHECKING:
    from rltrain.run.tracking import Tracker


class RunFailed(RuntimeError):
    """Actors kept failing past ``run.max_restarts``; the message says how to resume."""


def write_stacks(run: Run, step: int) -> Path | None:
    """``hangs/step_<step>.txt``: the Python stacks of every actor of the run (placement.json)."""
    from rltrain.remote import write_stacks as dump

    try:
        places = json.loads((run.out / "placement.json").read_text())
        return dump(places, run.out / "hangs" / f"step_{step}.txt")
    except OSError as e:
        print(f"rltrain: could not write the actors' stacks ({e})", file=sys.stderr, flush=True)
        return None


def train(config: Config, inputs: Inputs | None = None) -> Path:
    """Run the training loop; when an actor dies or stops answering, start every actor afresh from
    the newest checkpoint (up to ``run.max_restarts`` times) and go on."""
    from rltrain.learner.prefix_tree import LayoutMismatch
    from rltrain.remote import ActorFailure, StartupTimeout
    from rltrain.run.weight_sync import SyncFailed

    inputs = inputs or preflight(config)
    before = checkpoint.latest_marker(inputs.out)
    for restart in range(config.run.max_restarts + 1):
        try:
            if config.sft_warmup.steps:  # RL starts from the warmed-up model (kept in the run folder)
                warm, generators = warmed_up(config, inputs)
                return train_once(config, dataclasses.replace(inputs, model_path=warm), generators)
            return train_once(config, inputs)
        except (StartupTimeout, LayoutMismatch) as e:  # nothing to restart: the same would happen again
            raise RunFailed(str(e)) from None
        except SyncFailed as e:  # a call raised (its traceback printed): a restart would raise it again
            raise RunFailed(
                f"{e}; stopped (not restarted: the same weights would fail the same way)"
            ) from None
        except ActorFailure as failure:
            if failure.recurs:  # its start-up raised what a fresh start raises again
                raise ConfigError(f"{failure}; not restarted (the same settings fail the same way)") from None
            tag = checkpoint.latest_tag(inputs.out)
            # a restart resumes what this run saved or resumed from, never an older run's checkpoint
            resumable = config.run.resume or checkpoint.latest_marker(inputs.out) != before
            where = f"checkpoint {tag}" if resumable and tag else "the first step (no checkpoint yet)"
            stacks = f"; every actor's stacks: {failure.stacks}" if failure.stacks else ""
            if restart == config.run.max_restarts:
                raise RunFailed(
                    f"{failure}{stacks}; stopping after {restart} restart(s) (run.max_restarts={config.run.max_restarts}); "
                    f"last checkpoint: {inputs.out / 'checkpoints' / tag if tag else 'none'}; {resume_hint(inputs.out)}"
                ) from failure
            print(f"rltrain: {failure}{stacks}; restarting every actor from {where} "
                  f"(restart {restart + 1} of {config.run.max_restarts})", file=sys.stderr, flush=True)  # fmt: skip
            config = config.model_copy(update={"run": config.run.model_copy(update={"resume": resumable})})
    raise AssertionError("unreachable")


def warmed_up(config: Config, inputs: Inputs):
    """The warm start (:func:`~rltrain.run.warm_start.warm_start`): the warmed-up model's folder, and
    the engines RL generates with where they were started first, so that they were checked against
    the warm start's learners before it trained (None where it was done already, or with LoRA: the
    adapters' base is the warmed-up model, which fresh engines load)."""
    from rltrain.rollout import GeneratorPool
    from rltrain.run.launch import engines_agree
    from rltrain.run.warm_start import BadExamples, warm_start, warmed

    if warmed(config, inputs.model_path, inputs.out):
        return warmed(config, inputs.model_path, inputs.out), None
    generators = GeneratorPool(config, inputs.model_path, lora=config.model.lora.rank > 0)
    # (the engines loaded the model's files: no sync to check yet, their log-probs are checked)
    check = (
        partial(engines_agree, config, inputs, generators=generators, synced=False)
        if config.run.check_sync
        else None
    )
    try:
        warm = warm_start(config, inputs.model_path, inputs.rows, inputs.tokenizer, inputs.out, check)
    except BadExamples as e:
        generators.shutdown()
        raise RunFailed(str(e)) from None
    except BaseException:
        generators.shutdown()
        raise
    if config.model.lora.rank:
        generators.shutdown()
        generators = None
    return warm, generators


def train_once(config: Config, inputs: Inputs, generators=None) -> Path:
    """The loop: generate, score, compute advantages, train, sync; log and checkpoint."""
    from rltrain.run.tracking import Tracker

    run = start_run(config, inputs, generators)  # (every actor it starts is shut down on any way out below)
    generators, orchestrator = run.generators, run.orchestrator
    step = trained = last_saved = run.start_step  # trained: the last step whose update was issued
    sync_unchecked = config.run.check_sync  # the run's first sync of an update is checked
    user_code = UserCodeFailures(run.out, config.run.max_user_failure_steps)
    try:
        tracker = Tracker(run.out, config, run.start_step)
    except BaseException:
        run.shutdown()
        raise
    interrupt = CtrlC()
    try:
        if inputs.eval_prompts and run.start_step == 0:  # the starting point of the held-out curve
            tracker.log(0, held_out(run, config, inputs), advance=False)
        busy_s = generators.busy_seconds()  # the engines' time in rollouts, for their busy share
        for step in range(run.start_step + 1, config.run.steps + 1):
            t0 = time.perf_counter()
            scored = orchestrator.next_batch(step)  # generated ahead (rollout.max_staleness) and refilled
            scored.metrics.update(user_code.check(step, scored.calls))  # its failures shown and bounded
            generate_s = time.perf_counter() - t0
            scored = trainable(run.out, config, step, scored, user_code)
            batch = None  # (none: every sample failed, was stale, or had no reward variance)
            if scored.completions:
                batch = build_batch(scored, config, run.tokenizer.pad_token_id, version=step - 1)
                metrics = {} if batch.routes is None else {"perf/routes_bytes": float(batch.routes.numel())}
            if batch is not None and run.teacher is not None:  # distillation: the teacher scores every token
                batch = taught(run, config, batch, scored, metrics)
            last = step in (config.run.steps, config.run.stop_after)  # (a skipped step ends a run too)
            if batch is None:
                skip(run, tracker, step, scored.metrics, user_code.note)
            else:
                trained = step
                with interrupt.deferred():  # an update issued: its step is logged before a Ctrl-C saves it
                    metrics |= update(run, config, step, batch, scored.rewards)
                    sync_s = push(run, step, batch, metrics, check=sync_unchecked)
                    sync_unchecked = sync_unchecked and "sync/probe_gap" not in metrics
                    step_s = time.perf_counter() - t0
                    busy_now = generators.busy_seconds()
                    engines_busy_s, busy_s = busy_now - busy_s, busy_now
                    if inputs.eval_prompts and (last or step % config.run.eval_every == 0):
                        metrics |= held_out(run, config, inputs)
                    times = {"time/generate_s": generate_s, "time/sync_s": sync_s, "time/step_s": step_s,
                             "perf/engine_busy_share": engines_busy_s / (step_s * generators.size)}  # fmt: skip
                    tracker.log(step, step_row(scored, metrics, times, len(batch)), note=user_code.note)
                check_mismatch(config, step, metrics, run)  # logged first, so the row shows it
            if last or (config.run.checkpoint_every and step % config.run.checkpoint_every == 0):
                if saved(config, run.out, step, partial(save_checkpoint, run, config, step, interrupt)):
                    last_saved = step
            interrupt.check()  # a Ctrl-C whose exception something swallowed, or one during the save
            if step == config.run.stop_after:
                break
        if step == config.run.steps:
            if trained == run.start_step < step:  # (a step trained nothing, and so did every other)
                raise RunFailed(f"steps {run.start_step + 1}-{step} trained on nothing: every sample "
                                "failed, was stale or had no reward variance; see the step lines")  # fmt: skip
            export_final(run, config, step)
    except KeyboardInterrupt:
        raise Interrupted(
            saved_on_interrupt(run, config, tracker, trained, last_saved, interrupt), run.out
        ) from None
    except BaseException as error:
        if getattr(error, "timed_out", False):  # an actor hung: where every actor was, before the restart
            error.stacks = write_stacks(run, step)
        run.shutdown()
        raise
    finally:
        tracker.close()
        interrupt.restore()
    run.shutdown()
    return run.out


def taught(run: Run, config: Config, batch, scored, metrics: dict[str, float]):
    """Distillation: the batch with the teacher's log-probs of every token, or None where its
    actors failed (they start afresh: no update this step)."""
    teacher_logprobs = run.teacher.per_token(batch)
    scored.metrics["distill/teacher_failures"] = float(teacher_logprobs is None)
    if teacher_logprobs is None:
        return None
    batch, distill_metrics = with_distillation(batch, teacher_logprobs, config.algorithm)
    metrics |= distill_metrics
    return batch


def held_out(run: Run, config: Config, inputs: Inputs) -> dict[str, float]:
    """The held-out evaluation, scored by the run's own reward functions (eval.reward_functions)."""
    models = run.orchestrator.model_scorers if config.eval.model_rewards else None
    return evaluate(
        run.generators, inputs.eval_prompts, run.scorer, config.episode_reward, config.eval_functions, models
    )


def trainable(out: Path, config: Config, step: int, scored, user_code: UserCodeFailures):
    """The step's samples to train on: written to ``rollouts/`` where asked (those that failed
    outside the policy marked), and with ``reward.on_failure: drop`` without them (their groups too
    where fewer than two remain); empty where nothing is left, which ``run.max_user_failure_steps``
    bounds when failures emptied it. (Under GAE a group keeps any sample that did not fail: a
    critic's baseline needs no group.)"""
    from rltrain.run.tracking import write_rollouts

    drop = config.reward.on_failure == "drop"
    if scored.completions and config.run.save_rollouts_every and step % config.run.save_rollouts_every == 0:
        write_rollouts(out / "rollouts" / f"step_{step}.jsonl", scored, drop)
    if scored.completions and drop:
        scored = drop_failed(
            scored, config.algorithm.group_size, 1 if config.algorithm.advantage == "gae" else 2
        )
    if scored.completions:
        user_code.trained()
    else:
        user_code.nothing_to_train(step, scored.metrics)
    return scored


def saved_on_interrupt(
    run: Run, config: Config, tracker, trained: int, last_saved: int, interrupt: CtrlC
) -> int:
    """After a Ctrl-C: the checkpoint of the last issued update (an update already issued completes
    on the learners before the save queued behind it, as actors run calls in order, so it holds
    exactly ``trained`` steps); returns the newest checkpoint's step."""
    if trained <= last_saved:
        return last_saved
    tracker.bar.write(f"interrupted: saving a checkpoint of step {trained} (Ctrl-C again waits for it)")
    write = partial(save_checkpoint, run, config, trained, interrupt)
    return trained if saved(config, run.out, trained, write, on_error="continue") else last_saved


def step_row(scored, metrics: dict[str, float], times: dict[str, float], sequences: int) -> dict[str, float]:
    """A step's metrics row: scoring's, training's, the timings and the throughput."""
    generated = sum(len(c.token_ids) for c in scored.completions)
    step_s = times["time/step_s"]
    return {**scored.metrics, **metrics, **times, "perf/tokens_per_s": generated / step_s,
            "perf/learner_busy_share": metrics.get("time/train_s", 0.0) / step_s,
            "train/sequences": float(sequences)}  # fmt: skip


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run; ``step``: the newest checkpoint (0: none)."""

    def __init__(self, step: int, out: Path):
        super().__init__(step, out)
        self.step, self.out = step, out

    def __str__(self) -> str:
        if not self.step:
            return "interrupted before any step was trained; nothing to resume"
        return f"interrupted; the newest checkpoint is step_{self.step}; {resume_hint(self.out)}"


class CtrlC:
    """Ctrl-C, always honoured. Its handler raises KeyboardInterrupt and records it; the loop checks
    the record at every step's end, so an interrupt whose exception a library swallowed (Python
    drops one raised inside a finalizer or a callback) still stops the run. While a checkpoint is
    written, or a step whose update was issued finishes and is logged (:meth:`deferred`), a Ctrl-C
    is recorded only, and so is a second one: the save or the step completes, then the run stops
    (so every step a checkpoint holds has its row in metrics.jsonl). A third stops at once."""

    def __init__(self):
        self.count, self.deferring = 0, False
        main = threading.current_thread() is threading.main_thread()
        self.previous = signal.signal(signal.SIGINT, self._on_sigint) if main else None

    def _on_sigint(self, signum, frame) -> None:
        self.count += 1
        if self.count >= 3 or (self.count == 1 and not self.deferring):
            raise KeyboardInterrupt
        if self.count == 1:
            print("rltrain: interrupted; what is under way finishes first (a third Ctrl-C stops at once)",
                  file=sys.stderr, flush=True)  # fmt: skip

    @contextlib.contextmanager
    def deferred(self):
        """A Ctrl-C inside waits for the block's end (then :meth:`check` raises it); nested blocks
        (a save within a step) keep deferring until the outermost ends."""
        outer = self.deferring
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = outer

    def check(self) -> None:
        if self.count:
            raise KeyboardInterrupt

    def restore(self) -> None:
        """The previous handler again, unless a Ctrl-C came: then this one stays to the end of the
        process, so a second one while the run winds down waits too (and a third stops at once)."""
        if self.previous is not None and not self.count:
            signal.signal(signal.SIGINT, self.previous)


def update(run: Run, config: Config, step: int, batch, rewards) -> dict[str, float]:
    """The step's updates: PPO's critic (on GAE from its values) and the policy (once the critic's
    warm-up steps are over); their metrics (the first, with the start-up check's figures)."""
    metrics, run.startup = dict(run.startup or {}), None
    if run.critic is not None:
        ref_logprobs = run.learners.per_token(batch) if config.algorithm.kl_in_reward else None
        values = run.critic.per_token(batch)
        batch = with_gae(batch, rewards, values, config.algorithm, ref_logprobs)
        metrics = run.critic.train_step(batch)
    if run.critic is None or step > config.critic.warmup_steps:
        metrics |= run.learners.train_step(batch)
    return metrics


def push(run: Run, step: int, probe, metrics: dict[str, float], check: bool) -> float:
    """The weight sync after an update; returns its seconds. ``check``: the engines against the
    learners on the weights just synced (:func:`~rltrain.run.weight_sync.check_sync`, logged as
    ``sync/probe_gap``), so a sync that leaves a parameter behind stops the run here, not after many
    off-policy steps; it needs the step's engine-learner gap (the policy was updated)."""
    from rltrain.run.weight_sync import SyncCheckFailed, check_sync

    seconds = run.weight_sync.push(run.learners, run.generators, step)
    metrics["sync/seconds"], metrics["sync/bytes"] = seconds, float(run.learners.sent_bytes())
    if check and "rollout/mismatch_max" in metrics:
        try:
            metrics["sync/probe_gap"] = check_sync(
                run.learners, run.generators, probe, metrics["rollout/mismatch_max"], step
            )
        except SyncCheckFailed as e:
            raise RunFailed(str(e)) from None
    return seconds


def export_final(run: Run, config: Config, step: int) -> None:
    """``final_model/`` (with LoRA merged, and the adapter alone in ``final_adapter/``) and
    ``final_critic/``."""
    adapter = run.out / "final_adapter" if config.model.lora.rank else None
    saved(
        config, run.out, step, partial(checkpoint.export_hf, run.learners, run.out / "final_model", adapter)
    )
    if run.critic is not None:
        saved(config, run.out, step, partial(checkpoint.export_hf, run.critic, run.out / "final_critic"))


def skip(run: Run, tracker: Tracker, step: int, metrics: dict[str, float], note: str = "") -> None:
    """A step without an update, logged with ``metrics`` and ``train/skipped``: the engines hold
    the learners' weights still, now as policy version ``step``, so what they sample next is not
    counted a version old (and dropped as stale)."""
    if run.weight_sync.adapters_only:  # (an engine serves each version as an adapter: it gets one)
        run.weight_sync.push(run.learners, run.generators, step)
    else:
        run.generators.bump_version(step)  # the weights it holds, unchanged: nothing sent but the number
    tracker.log(step, {**metrics, "train/skipped": 1.0}, note=note)


def saved(
    config: Config, out: Path, step: int, write: Callable[[], object], on_error: str | None = None
) -> bool:
    """Run ``write`` (a checkpoint or a model export). One that fails leaves the previous
    checkpoint as the latest and, as ``on_error`` (by default ``run.on_save_error``) says, stops the
    run with one line or says so in one line and goes on; returns whether it was written."""
    try:
        write()
        return True
    except checkpoint.SaveFailed as e:
        if (on_error or config.run.on_save_error) == "stop":
            raise RunFailed(
                f"step {step}: {e}; stopping (run.on_save_error=stop); {resume_hint(out)}"
            ) from None
        print(
            f"rltrain: step {step}: {e}; going on (run.on_save_error=continue)", file=sys.stderr, flush=True
        )
        return False


def save_checkpoint(run: Run, config: Config, step: int, interrupt: CtrlC | None = None) -> None:
    """The checkpoint of ``step``; a Ctrl-C while it is written waits for it (``interrupt``)."""
    state = {"data": run.orchestrator.state(step)}
    with interrupt.deferred() if interrupt is not None else contextlib.nullcontext():
        checkpoint.save(run.learners, run.out, step, state, run.critic, config.run.keep_checkpoints)


def resume_hint(out: Path) -> str:
    return f"resume with: python -m rltrain.train --config {out / 'config.yaml'} run.resume=true"


def check_first_gap(config: Config, step: int, metrics: dict[str, float]) -> None:
    """``run.max_first_step_gap``: the first step's engine-learner gap, where both sides compute in
    fp32 on the same weights, says whether the learners run the model exactly in their layout."""
    limit, gap = config.run.max_first_step_gap, metrics.get("rollout/mismatch_max")
    lc, rc = config.learner, config.rollout
    fp32 = lc.gpus_per_learner == 0 and lc.precision != "bf16" and rc.gpus_per_engine == 0
    experts = any(key.startswith("moe/") for key in metrics)
    if limit is None or gap is None or not fp32 or experts or gap <= limit:
        return
    layouts = [text for used, text in [(lc.packing, "packed rows (learner.packing=true)"),
               (metrics.get("perf/prefix_shared_fraction", 0.0) > 0, "prefix trees (learner.prefix_sharing)")] if used]  # fmt: skip
    avoid = ("set learner.packing=false learner.prefix_sharing=false (padded rows)" if layouts else
             "padded rows already: this model is not one the learners run exactly")  # fmt: skip
    raise RunFailed(
        f"step {step}: the engine's log-probs differ from the learners' by {gap:.3g} (rollout/mismatch_max) on "
        f"the weights both loaded, in fp32 (> run.max_first_step_gap = {limit:g}), with "
        f"{' and '.join(layouts) or 'padded rows'}: {avoid}; stopped without saving this step"
    )


def check_mismatch(config: Config, step: int, metrics: dict[str, float], run: Run) -> None:
    """``run.max_mismatch_kl``: stop, in one line, a run whose engine is evidently not sampling
    from the learner's weights, instead of training on what it samples; at the run's first step
    that measures a gap (tokens its weights sampled: a resumed asynchronous run's first batches
    may all come from older weights), :func:`check_first_gap` too."""
    out = run.out
    if not run.gap_checked and metrics.get("rollout/mismatch_measured", 1.0) > 0:
        check_first_gap(config, step, metrics)
        run.gap_checked = True
    limit, value = config.mismatch_limit, metrics.get("rollout/mismatch_kl")
    if limit is None or value is None or value <= limit:
        return
    tag = checkpoint.latest_tag(out)
    setting = "auto: " if config.run.max_mismatch_kl == "auto" else ""
    raise RunFailed(
        f"step {step}: rollout/mismatch_kl = {value:.3g} > run.max_mismatch_kl = {setting}{limit:g} "
        f"(largest per-token log-prob gap {metrics.get('rollout/mismatch_max', float('nan')):.3g}): the "
        "engine is not sampling from the learner's weights; likely a weight sync that did not arrive, "
        "or the engine computing in another precision than the learner; stopped without saving this "
        f"step; last checkpoint: {checkpoint.checkpoint_root(out) / tag if tag else 'none'}"
    )
