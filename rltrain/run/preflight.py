"""Checks before anything starts: every input a run reads (config beyond its schema, data rows,
model, lengths, the user's reward functions, tools and environment, output folder), each raising a
one-line :class:`~rltrain.config.ConfigError` before any actor starts (:func:`preflight`). The
user's own code is called once here, with a deadline.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rltrain.config import (
    BUILTIN_TASK,
    SFT_FROM_ENV,
    Config,
    ConfigError,
)
from rltrain.data import (
    Prompt,
    episode_prompts,
    load_rows,
    sft_conversations,
    sft_examples,
    split_held_out,
    tokenize_prompts,
)
from rltrain.episodes.checks import (
    check_agent,
    check_environment,
    check_environment_fit,
    check_tools,
    verifiers_rows,
)
from rltrain.models.images import check_teacher_images, run_images, vision_inputs
from rltrain.models.resolve import check_model, check_scoring_models, load_tokenizer, resolve_model
from rltrain.rewards.functions import GIVEN, check_reward_functions, load_reward_fn
from rltrain.run import checkpoint


@dataclass
class Inputs:
    """What a run reads, checked by :func:`preflight` before any actor starts."""

    out: Path
    model_path: str
    tokenizer: Any
    prompts: list[Prompt]  # training prompts
    rows: list[dict]  # their rows (the supervised warm-up's questions)
    eval_prompts: list[Prompt]  # held out: never trained on (empty without evaluation)


def preflight(config: Config) -> Inputs:
    """Every check that needs more than the schema (reward and tool specs, output folder, model,
    lengths, every data row), before anything starts; a problem raises a one-line ConfigError."""
    for key, functions in [("reward.functions", config.reward.functions),
                           ("eval.reward_functions", config.eval.reward_functions or {})]:  # fmt: skip
        for spec in functions:
            if spec in GIVEN:
                continue  # the environment's reward or the reward model's: both are checked below
            try:
                load_reward_fn(spec)
            except ValueError as e:
                raise ConfigError(f"{key}: {e}") from None
    given = {"env": config.env.name, "agent": config.agent.entrypoint, "model": config.reward.model,
             "judge": config.reward.judge}  # fmt: skip
    for spec in config.eval.reward_functions or {}:
        if spec in given and given[spec] is None:
            raise ConfigError(f"eval.reward_functions: `{spec}` needs what reward.functions' `{spec}` needs "
                              f"({'env.name' if spec == 'env' else 'agent.entrypoint' if spec == 'agent' else 'reward.' + spec})")  # fmt: skip
    if {"model", "judge"} & set(config.eval.reward_functions or {}) and not config.eval.model_rewards:
        raise ConfigError(
            "eval.reward_functions: a reward model's or judge's score needs eval.model_rewards=true"
        )
    for key, source in [("data.source", config.data.source), ("eval.source", config.eval.source),
                        ("sft_warmup.source", config.sft_warmup.source)]:  # fmt: skip
        looks_local = source is not None and source.startswith(("/", "./", "../", "~"))
        if looks_local and not Path(source).expanduser().exists():
            raise ConfigError(f"{key}: {source!r} does not exist")
    check_tools(config)
    _check_backend(config)
    _check_tracking(config)
    out = _output_folder(config)
    model_path = resolve_model(config, out)
    check_model(config, model_path)
    if config.run.resume:
        config_json = Path(model_path).expanduser() / "config.json"
        model_config = json.loads(config_json.read_text()) if config_json.is_file() else None
        problem = checkpoint.resume_problem(out, model_config, config)
        if problem:
            raise ConfigError(f"run.resume: {problem}")
    tokenizer = load_tokenizer(config, "model.name_or_path", model_path)
    check_scoring_models(config, tokenizer)
    try:
        rows, held_out = verifiers_rows(config) if config.verifiers else load_rows(config.data), []
        if config.run.eval_every:  # (a verifiers taskset's rows: its own, not data.source's)
            data = (
                config.data.model_copy(update={"source": config.env.name})
                if config.verifiers
                else config.data
            )
            rows, held_out = split_held_out(rows, data, config.eval)
        # a vision-language model's processor, loaded once: the rows', the environment's and the
        # warm start's images render through it
        images = run_images(config, model_path) or vision_inputs(config, model_path)
        check_teacher_images(config, images)
        check_reward_functions(config.reward.functions, config.reward.timeout_s, rows[0])
        if config.gateway_episodes:
            check_agent(config, tokenizer)
        if config.env.name is not None and not config.verifiers:
            check_environment(config, rows[0], tokenizer, images)
        if config.episodic:
            prompts = episode_prompts(rows, config.data)
            eval_prompts = episode_prompts(held_out, config.data) if held_out else []
        else:
            prompts = tokenize_prompts(rows, tokenizer, config.data, images)
            eval_prompts = tokenize_prompts(held_out, tokenizer, config.data, images) if held_out else []
        if config.env.name is not None:
            check_environment_fit(config)
        if config.sft_warmup.steps and config.sft_warmup.source != SFT_FROM_ENV:
            check_sft_source(config, rows, tokenizer, images)
        sft = config.sft_warmup
        if sft.steps and sft.copy_fraction and sft.source != BUILTIN_TASK:
            print(f"rltrain: note: sft_warmup.copy_fraction={sft.copy_fraction:g} applies to sft_warmup.source="
                  f"{BUILTIN_TASK} alone: the warm start trains on sft_warmup.source={sft.source}'s examples as "
                  "they are", file=sys.stderr, flush=True)  # fmt: skip
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return Inputs(out, model_path, tokenizer, prompts, rows, eval_prompts)


def check_sft_source(config: Config, rows: list[dict], tokenizer, images=None) -> None:
    """The warm start's examples load now (they are used after Ray starts); a file of conversations
    renders through the policy's chat template (its images through ``images``, the processor's)."""
    from rltrain.episodes.chat import render_conversations

    written = sft_conversations(config.sft_warmup.source)
    if written is None:
        sft_examples(config.sft_warmup, rows, config.run.seed)
        return
    try:  # the first few through the template (the warm start renders every one, and names any that fails)
        render_conversations(written[:8], tokenizer, config.env.render, images, config.data.max_image_pixels)
    except ValueError as e:
        raise ValueError(f"sft_warmup.source {config.sft_warmup.source!r}: {e}") from None


RAY_JOB_CONFIG = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def _output_folder(config: Config) -> Path:
    """The run's folder, written to once to check it, as an absolute path (the last line prints it)."""
    out = Path(config.run.output_dir).expanduser()
    if not out.is_absolute() and (job_dir := _job_working_dir()) is not None:
        # the entrypoint runs in Ray's temporary copy of --working-dir, which goes with the job
        # (the folder the job was submitted from is not known here)
        raise ConfigError(
            f"run.output_dir={config.run.output_dir} is relative, and this run is a Ray job whose working "
            f"directory is Ray's temporary copy of --working-dir ({job_dir}), where outputs would be lost; "
            "give an absolute path on the cluster, e.g. run.output_dir=$PWD/" + str(config.run.output_dir)
        )
    if out.exists() and not out.is_dir():
        raise ConfigError(f"run.output_dir: {str(out)!r} is a file, expected a folder (or a new path)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write_test").write_text("")
        (out / ".write_test").unlink()
    except OSError as e:
        raise ConfigError(f"run.output_dir: cannot write to {str(out)!r} ({e.strerror})") from None
    return out.resolve()


def _job_working_dir() -> str | None:
    """The working directory of a ``ray job submit`` entrypoint given ``--working-dir`` (Ray's copy
    of it), or None when this run is no such job."""
    try:
        runtime_env = json.loads(os.environ.get(RAY_JOB_CONFIG, "{}")).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return None
    return os.getcwd() if runtime_env.get("working_dir") else None


def _check_tracking(config: Config) -> None:
    import importlib.util

    if config.run.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "run.wandb_project: wandb is not installed (pip install 'rltrain[wandb]'; "
            "WANDB_MODE=offline logs without an account)"
        )
    if config.run.trackio_project and importlib.util.find_spec("trackio") is None:
        raise ConfigError(
            "run.trackio_project: trackio is not installed (pip install 'rltrain[trackio]'; it logs "
            "to a local file, no account needed)"
        )


def _check_backend(config: Config) -> None:
    if config.rollout.backend == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(
                "rollout.backend: 'vllm' is not installed (install vllm, or set rollout.backend=hf)"
            )
