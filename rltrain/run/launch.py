"""Run set-up, shared by training and evaluation: checks before anything starts, the Ray
connection, the actors.

- :func:`~rltrain.run.preflight.preflight` checks every input before any actor starts;
- :func:`connect_ray` joins ``RAY_ADDRESS`` or starts a local instance, and checks the layout fits;
- :func:`start_run` starts the learners, the critic and the generators, restored from the newest
  checkpoint when resuming.

:mod:`rltrain.train` (the loop) and :mod:`rltrain.run.eval` both build on it; neither imports the other's
set-up.
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rltrain.config import Config, ConfigError, dump, first_line
from rltrain.models.resolve import load_tokenizer
from rltrain.prompt_sampler import PromptSampler
from rltrain.rewards.functions import JUDGE, MODEL, RewardScorer
from rltrain.run import checkpoint
from rltrain.run.orchestrator import Orchestrator
from rltrain.run.preflight import Inputs


def quiet_console() -> None:
    """Settings that keep notices of the stack's auto-detection off a normal run's console."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed: said, not guessed (and warned)


MIN_OBJECT_STORE = 512 * 2**20


def object_store_bytes(model_path: str | None) -> int:
    """The object store of a run's own Ray instance: twice the weights a full sync puts there (the
    model's weight files; fp32 on CPU) and room besides, at least 512 MiB, at most 30% of memory."""
    import psutil

    files = (
        [f for f in Path(model_path).glob("*") if f.suffix in (".safetensors", ".bin")] if model_path else []
    )
    weights = sum(f.stat().st_size for f in files)
    return int(min(max(MIN_OBJECT_STORE, 2 * weights + 256 * 2**20), 0.3 * psutil.virtual_memory().total))


def connect_ray(config: Config, model_path: str | None = None) -> None:
    """Join the cluster in RAY_ADDRESS, or start a local instance of the run's own (never one that
    something else started), its object store sized for the weights of ``model_path``; then check
    the layout fits. A cluster that cannot be reached or an instance that does not start raises a
    one-line ConfigError."""
    import ray

    address = os.environ.get("RAY_ADDRESS")
    try:
        if not address:
            have_cpu = config.run.ray_num_cpus or os.cpu_count() or 1
            _check_fits(have_cpu, _local_gpus(), config)
            os.environ.setdefault("RAY_DEDUP_LOGS", "1")
            # Ray enables token authentication for a local instance by default and says so on every
            # start; we keep the default and drop the notice
            logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(
                logging.ERROR
            )
            ray.init(
                address="local",  # a new instance: ray.init() alone joins any running on this machine
                num_cpus=have_cpu,
                include_dashboard=False,
                log_to_driver=False,
                object_store_memory=object_store_bytes(model_path),
                logging_level=logging.WARNING,
            )
            return
        problem = _unreachable(address)
        if problem:
            raise ConnectionError(problem)
        ray.init(log_to_driver=False, logging_level=logging.WARNING)
    except ConfigError:
        raise
    except Exception as e:
        where = (
            f"cannot join the Ray cluster at RAY_ADDRESS={address}"
            if address
            else "cannot start a local Ray instance"
        )
        raise ConfigError(
            f"{where} ({first_line(e)}); unset RAY_ADDRESS to start one of the run's own"
        ) from None
    resources = ray.cluster_resources()
    _check_fits(resources.get("CPU", 0), resources.get("GPU", 0), config)


def _unreachable(address: str) -> str | None:
    """Why nothing answers at a ``host:port`` RAY_ADDRESS (Ray itself retries for minutes), or None;
    ``auto`` and ``ray://`` addresses are left to Ray."""
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return None
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=5):
            return None
    except OSError as e:
        return f"nothing answers at {address}: {e.strerror or e}"


def _local_gpus() -> int:
    return torch.cuda.device_count()


def _check_fits(have_cpu: float, have_gpu: float, config: Config) -> None:
    lc, rc = config.learner, config.rollout
    # (what, how many, CPUs each, GPUs each)
    parts = [
        ("learners", lc.num_learners, lc.cpus_per_learner, lc.gpus_per_learner),
        ("engines", rc.num_engines, rc.cpus_per_engine, rc.gpus_per_engine),
    ]
    extra = {"critic learners": config.critic.learners if config.critic is not None else None,
             "teacher actors": config.algorithm.teacher_learners if config.algorithm.teacher else None,
             "reward model actors": config.reward.model_learners if config.reward.model else None}  # fmt: skip
    for what, section in extra.items():
        if section is not None:
            parts.append((what, section.num_learners, section.cpus_per_learner, section.gpus_per_learner))
    if config.reward.judge is not None and config.reward.judge.model is not None:
        parts.append(("judge engines", rc.num_engines, rc.cpus_per_engine, rc.gpus_per_engine))
    need_cpu = sum(n * cpus for _, n, cpus, _ in parts)
    need_gpu = sum(n * gpus for _, n, _, gpus in parts)
    if need_cpu > have_cpu:
        spelled = " + ".join(f"{n} {what} x {cpus} CPU" for what, n, cpus, _ in parts)
        raise ConfigError(
            f"learner.num_learners: {spelled} need {need_cpu:g} CPUs, the cluster has {have_cpu:g} "
            "(lower learner.num_learners, learner.cpus_per_learner or rollout.cpus_per_engine)"
        )
    if need_gpu > have_gpu:
        raise ConfigError(
            f"learner.gpus_per_learner: the layout needs {need_gpu:g} GPUs, the cluster has {have_gpu:g}"
        )


@dataclass
class Run:
    """Everything a training run holds, built by :func:`start_run`."""

    out: Path
    tokenizer: Any
    orchestrator: Orchestrator  # the sampler, the steps generated ahead, the data order
    scorer: RewardScorer
    learners: Any  # rltrain.learner.group.LearnerGroup
    generators: Any  # rltrain.rollout.GeneratorPool
    weight_sync: Any  # rltrain.run.weight_sync.WeightSync
    start_step: int
    critic: Any = None  # a LearnerGroup of rltrain.learner.critic.CriticLearner (PPO with GAE), or None
    teacher: Any = None  # a rltrain.run.frozen_models.Teacher (its actors' group; distillation), or None
    reward_model: Any = None  # a rltrain.run.frozen_models.RewardModel (its actors' group), or None
    judge_engines: Any = None  # a GeneratorPool of reward.judge.model, or None
    startup: dict | None = None  # the start-up check's figures (sync/startup_gap, sync/startup_kl)
    gap_checked: bool = False  # run.max_first_step_gap, at the first step that measures a gap

    @property
    def groups(self) -> list[Any]:
        """Every group of actors the run holds."""
        parts = (
            self.learners,
            self.generators,
            self.critic,
            self.teacher,
            self.reward_model,
            self.judge_engines,
        )
        return [part for part in parts if part is not None]

    def shutdown(self) -> None:
        """Stop every actor, the scoring thread and the reward workers (also after a failure:
        nothing is left running)."""
        for part in self.groups:
            part.shutdown()
        self.orchestrator.close()
        self.scorer.close()


def start_run(config: Config, inputs: Inputs, generators=None) -> Run:
    """Actors, prompts and rewards; restored from the newest checkpoint when resuming; the engines
    then take the learners' weights and are checked against them before any work
    (:func:`~rltrain.run.weight_sync.check_engines`). ``generators``: engines started already (on
    another checkpoint: before the warm start, which they were checked against)."""
    # ray, deepspeed and vllm load here, not at import: --help stays instant
    from rltrain.learner.group import LearnerGroup
    from rltrain.rollout import GeneratorPool
    from rltrain.run.weight_sync import weight_sync

    out = inputs.out
    dump(config, out / "config.yaml")
    random.seed(config.run.seed)
    torch.manual_seed(config.run.seed)
    sampler = PromptSampler(inputs.prompts, config.run.seed, config.data.difficulty_sampling)
    scorer = RewardScorer(config.reward.functions, config.reward.timeout_s, config.reward.workers)
    parts: dict[str, Any] = {}
    try:  # a failure while starting still stops what did start
        # engines first: they load in their own actors (not waited for here) while the learner
        # groups below set up one after another
        parts["generators"] = generators or GeneratorPool(
            config, inputs.model_path, lora=config.model.lora.rank > 0
        )
        judge = config.reward.judge
        if judge is not None and judge.model is not None:
            parts["judge_engines"] = GeneratorPool(config, judge.model)
        parts["learners"] = LearnerGroup(
            config, inputs.model_path, total_optimizer_steps(config, config.learner)
        )
        if config.critic is not None:
            from rltrain.learner.critic import CriticLearner

            steps = total_optimizer_steps(config, config.critic.learners)
            parts["critic"] = LearnerGroup(config, inputs.model_path, steps, CriticLearner)
        if config.algorithm.teacher is not None:
            from rltrain.learner.frozen import TeacherLearner
            from rltrain.run.frozen_models import Teacher

            parts["teacher"] = Teacher(partial(LearnerGroup, config, inputs.model_path, 0, TeacherLearner))
        if config.reward.model is not None:
            from rltrain.learner.frozen import RewardModelLearner
            from rltrain.run.frozen_models import RewardModel

            parts["reward_model"] = RewardModel(
                partial(LearnerGroup, config, inputs.model_path, 0, RewardModelLearner)
            )
        sync = weight_sync(config, parts["learners"], parts["generators"])
    except BaseException:
        for part in parts.values():
            part.shutdown()
        scorer.close()
        raise
    orchestrator = Orchestrator(
        config, sampler, parts["generators"], scorer, model_scorers(config, inputs, parts)
    )
    run = Run(out, inputs.tokenizer, orchestrator, scorer, parts["learners"], parts["generators"],
              sync, start_step=0, critic=parts.get("critic"), teacher=parts.get("teacher"),
              reward_model=parts.get("reward_model"), judge_engines=parts.get("judge_engines"))  # fmt: skip
    try:
        record_placement(run)
        if config.run.resume and checkpoint.latest_tag(out) is not None:
            state = checkpoint.load(run.learners, out, run.critic)
            run.start_step = state["step"]
            orchestrator.load_state(state["data"], run.start_step)
        # the engines hold what the learners hold, the whole state (a checkpoint's buffers too),
        # and compute what they compute, before any work
        run.weight_sync.push(run.learners, run.generators, run.start_step)
        if config.run.check_sync:
            run.startup = engines_agree(config, inputs, run.learners, run.generators)
    except BaseException:
        run.shutdown()
        raise
    return run


def engines_agree(
    config: Config, inputs: Inputs, learners, generators, synced: bool = True
) -> dict[str, float]:
    """:func:`~rltrain.run.weight_sync.check_engines` on a probe of the run's prompts; a gap stops
    the run in one line (:class:`~rltrain.config.ConfigError`: the same settings fail again)."""
    from transformers import AutoConfig

    from rltrain.models.routers import config_experts
    from rltrain.run.weight_sync import EnginesDisagree, check_engines, startup_probe

    experts = (
        config_experts(
            AutoConfig.from_pretrained(inputs.model_path, trust_remote_code=config.model.trust_remote_code)
        )
        > 0
    )
    try:
        probe = startup_probe(inputs.prompts, inputs.tokenizer)
        return check_engines(config, learners, generators, probe, experts, synced)
    except EnginesDisagree as e:
        raise ConfigError(f"{e} (run.check_sync=false skips this check)") from None


def model_scorers(config: Config, inputs: Inputs, parts: dict[str, Any]) -> dict[str, Any]:
    """The rewards that actors compute, by reward.functions name: the reward model's, the judge's."""
    scorers = {}
    if "reward_model" in parts:
        scorers[MODEL] = parts["reward_model"]
    judge = config.reward.judge
    if judge is not None:
        from rltrain.rewards.judge import Judge

        tokenizer = inputs.tokenizer
        if judge.model is not None:
            tokenizer = load_tokenizer(config, "reward.judge.model", judge.model)
        own = "judge_engines" in parts
        engines = parts["judge_engines"] if own else parts["generators"]
        max_prompt = config.rollout.max_model_len - judge.max_new_tokens
        scorers[JUDGE] = Judge(judge, tokenizer, engines, max_prompt, own_actors=own)
    return scorers


def record_placement(run: Run) -> None:
    """``placement.json``: the node, address and pid of every actor of the run."""
    places = [place for group in run.groups for place in group.where()]
    (run.out / "placement.json").write_text(json.dumps(places, indent=1))


def total_optimizer_steps(config: Config, lc) -> int:
    """Optimizer steps of the whole run for a learner section (the learning-rate schedule's length)."""
    return config.run.steps * lc.num_mini_batches * lc.ppo_epochs
