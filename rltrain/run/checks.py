"""Checks before anything starts: every input a run reads (config beyond its schema, data rows,
model, lengths, the user's reward functions, tools and environment, output folder), each raising a
one-line :class:`~rltrain.config.ConfigError` before any actor starts (:func:`preflight`). The
user's own code is called once here, with a deadline.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from rltrain.config import (
    BUILTIN_TASK,
    SFT_FROM_ENV,
    TINY_MODEL,
    TINY_MOE_MODEL,
    Config,
    ConfigError,
    first_line,
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
from rltrain.pretrained import model_folder
from rltrain.rollout.parsers import BUILT_IN, get_parser, registered_parsers
from rltrain.rollout.rewards import GIVEN, load_reward_fn, score_value, takes_batches
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
    if (
        config.eval.reward_functions
        and {"model", "judge"} & set(config.eval.reward_functions)
        and not config.eval.model_rewards
    ):
        raise ConfigError(
            "eval.reward_functions: a reward model's or judge's score needs eval.model_rewards=true"
        )
    for key, source in [("data.source", config.data.source), ("eval.source", config.eval.source),
                        ("sft_warmup.source", config.sft_warmup.source)]:  # fmt: skip
        looks_local = source is not None and source.startswith(("/", "./", "../", "~"))
        if looks_local and not Path(source).expanduser().exists():
            raise ConfigError(f"{key}: {source!r} does not exist")
    _check_tools(config)
    _check_backend(config)
    _check_tracking(config)
    out = _output_folder(config)
    model_path = resolve_model(config, out)
    _check_model(config, model_path)
    if config.run.resume:
        config_json = Path(model_path).expanduser() / "config.json"
        model_config = json.loads(config_json.read_text()) if config_json.is_file() else None
        problem = checkpoint.resume_problem(out, model_config, config)
        if problem:
            raise ConfigError(f"run.resume: {problem}")
    tokenizer = load_tokenizer(config, "model.name_or_path", model_path)
    _check_scoring_models(config, tokenizer)
    try:
        rows, held_out = verifiers_rows(config) if config.verifiers else load_rows(config.data), []
        if config.run.eval_every:  # (a verifiers taskset's rows: its own, not data.source's)
            data = (
                config.data.model_copy(update={"source": config.env.name})
                if config.verifiers
                else config.data
            )
            rows, held_out = split_held_out(rows, data, config.eval)
        check_reward_functions(config, rows[0])
        if config.gateway_episodes:
            check_agent(config, tokenizer)
        if config.env.name is not None and not config.verifiers:
            check_environment(config, rows[0], tokenizer)
        if config.episodic:
            prompts = episode_prompts(rows, config.data)
            eval_prompts = episode_prompts(held_out, config.data) if held_out else []
        else:
            prompts = tokenize_prompts(rows, tokenizer, config.data)
            eval_prompts = tokenize_prompts(held_out, tokenizer, config.data) if held_out else []
        if config.env.name is not None:
            check_environment_fit(config)
        if config.sft_warmup.steps and config.sft_warmup.source != SFT_FROM_ENV:
            check_sft_source(config, rows, tokenizer)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return Inputs(out, model_path, tokenizer, prompts, rows, eval_prompts)


def check_sft_source(config: Config, rows: list[dict], tokenizer) -> None:
    """The warm start's examples load now (they are used after Ray starts); a file of conversations
    renders through the policy's chat template."""
    from rltrain.rollout.chat import render_conversations

    written = sft_conversations(config.sft_warmup.source)
    if written is None:
        sft_examples(config.sft_warmup, rows, config.run.seed)
        return
    try:  # the first few through the template (the warm start renders every one, and names any that fails)
        render_conversations(written[:8], tokenizer, config.env.render)
    except ValueError as e:
        raise ValueError(f"sft_warmup.source {config.sft_warmup.source!r}: {e}") from None


def check_agent(config: Config, tokenizer) -> None:
    """``agent.entrypoint`` imports as ``async def run(row, base_url, api_key, model)`` (a verifiers
    environment loaded already, in :func:`verifiers_rows`), and the tool parser is built for the
    policy's tokenizer."""
    from rltrain.rollout.agents import load_agent

    if config.agent.entrypoint is not None:
        try:
            load_agent(config.agent.entrypoint)
        except ValueError as e:
            raise ValueError(f"agent.entrypoint: {e}") from None
    _check_parser(config, tokenizer)


def verifiers_rows(config: Config) -> list[dict]:
    """``env.name: verifiers:<taskset id>``'s tasks as rows (at most data.size); what stops the
    taskset or its environment from loading raises ValueError in one line, naming the key."""
    if config.sft_warmup.steps and config.sft_warmup.source == SFT_FROM_ENV:
        raise ValueError(f"sft_warmup.source=env: env.name={config.env.name} has no demonstrations; "
                         "warm up on a .jsonl of conversations or set sft_warmup.steps=0")  # fmt: skip
    try:
        from rltrain.rollout import verifiers_env
    except ImportError as e:
        raise ValueError(
            f"env.name={config.env.name} needs verifiers (pip install 'rltrain[verifiers]'): {e}"
        ) from None
    env = config.env
    try:
        rows = verifiers_env.task_rows(
            verifiers_env.load_env(env.name, env.kwargs, env.max_turns), config.data.size
        )
    except Exception as e:  # noqa: BLE001  (the taskset's own code: shown in one line)
        message = " ".join(str(e).split())
        raise ValueError(f"env.name={env.name} (env.kwargs {env.kwargs}) does not load: "
                         f"{type(e).__name__}: {message}") from None  # fmt: skip
    if not rows:
        raise ValueError(f"env.name={env.name}: the taskset holds no tasks")
    return rows


def _check_parser(config: Config, tokenizer, schemas: list[dict] | None = None) -> None:
    """``rollout.tool_parser`` builds for the policy's tokenizer."""
    try:
        get_parser(config.tool_parser, tokenizer, schemas)
    except Exception as e:  # noqa: BLE001  (vLLM's parsers check the tokenizer for their format's tokens)
        raise ValueError(f"rollout.tool_parser={config.tool_parser}: {first_line(e)}") from None


def with_deadline(timeout_s: float, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a thread: its value, what it raised, or TimeoutError after
    ``timeout_s`` (the user's code checked before any actor starts; a hung call is left behind)."""
    import threading

    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001  (handed to the caller)
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"did not return within {timeout_s:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def check_reward_functions(config: Config, row: dict) -> None:
    """Each reward function, called once on the first data row with its answer as the completion
    (both forms: ``fn(completion, answer)``, and TRL's ``fn(prompts=, completions=, **columns)``),
    returns a number or None (TRL's "does not apply"), and at least one function applies; raises
    ValueError naming the function otherwise."""
    answer = str(row.get("answer", ""))
    called = [spec for spec in config.reward.functions if spec not in GIVEN]
    none = []  # the functions that do not apply to the row
    for spec in called:
        fn = load_reward_fn(spec)
        if takes_batches(fn):
            columns = {k: [v] for k, v in row.items() if k not in ("prompt", "answer")}
            call = partial(
                fn, prompts=[row.get("prompt", "")], completions=[answer], answer=[answer], **columns
            )
            form = "fn(prompts=[...], completions=[...], answer=[...], <other columns>=[...])"
        else:
            call, form = partial(fn, answer, answer), "fn(completion, answer)"
        try:
            value = with_deadline(config.reward.timeout_s, call)
            if len(value if takes_batches(fn) else [value]) != 1:
                raise ValueError(f"returned {len(value)} scores for 1 completion")
            number = score_value(list(value)[0] if takes_batches(fn) else value)
            number = float("nan") if number is None else number
        except Exception as e:
            raise ValueError(
                f"reward.functions: {spec}, called as {form} on the first data row with its answer as the "
                f"completion, raised {first_line(e)}"
            ) from None
        if number != number:
            none.append(spec)
    if none and len(none) == len(config.reward.functions):  # (an episode's or a model's score applies)
        names = " and ".join(none) if len(none) < 3 else f"all {len(none)} of {', '.join(none)}"
        raise ValueError(
            f"reward.functions: {names} returned no score (None or NaN) on the first data row with its "
            "answer as the completion: no function applies to it"
        )


def check_environment(config: Config, row: dict, tokenizer) -> None:
    """``env.name`` loads, takes ``env.kwargs``, opens an episode from the first row, and its
    tools' schemas and the chat template's rendering of the additions work; raises ValueError
    naming the key."""
    from rltrain.rollout.chat import ChatRenderer, TemplateError, render_problem
    from rltrain.rollout.environments import load_environment, tool_schemas

    env = config.env
    try:
        instance = load_environment(env.name)(**env.kwargs)
    except TypeError as e:
        raise ValueError(f"env.kwargs: {env.name} does not take {env.kwargs} ({e})") from None
    except ValueError as e:
        raise ValueError(f"env.name: {e}") from None
    try:
        schemas = tool_schemas(instance.tools)
    except Exception as e:  # transformers: a tool without type hints or an Args: section
        raise ValueError(f"env.name: {env.name}'s tools have no JSON schema ({e})") from None
    try:
        opening = with_deadline(config.env.step_timeout_s, instance.reset, row)
    except Exception as e:
        raise ValueError(
            f"env.name: {env.name}.reset(first row of data.source) raised {type(e).__name__}: {e}"
        ) from None
    if (
        config.sft_warmup.steps
        and config.sft_warmup.source == SFT_FROM_ENV
        and not hasattr(instance, "demonstration")
    ):
        raise ValueError(f"sft_warmup.source=env: {env.name} has no demonstration(row) method")
    renderer = ChatRenderer(tokenizer, schemas, env.render)
    try:
        prompt = renderer.opening(opening)
    except TemplateError as e:
        raise ValueError(f"env.render: {e}") from None
    if len(prompt) > config.data.max_prompt_tokens:
        raise ValueError(
            f"data.max_prompt_tokens={config.data.max_prompt_tokens} is shorter than {env.name}'s opening "
            f"prompt for the first row ({len(prompt)} tokens, tool schemas and chat template included); "
            "every episode would end before its first turn"
        )
    _check_step(config, instance, opening, row)
    _check_parser(config, tokenizer, schemas)
    problem = render_problem(tokenizer, schemas, opening, env.render)
    if problem is not None:
        other = "last_turn" if env.render == "full" else "full"
        if render_problem(tokenizer, schemas, opening, other) is not None:
            fix = "; neither env.render mode renders it"
        else:
            fix = "" if f"env.render={other}" in problem else f"; set env.render={other}, which renders it"
        raise ValueError(f"env.render={env.render}: {problem}{fix}")


def check_environment_fit(config: Config) -> None:
    """Settings that do not fit an environment: a warm start on the built-in task's tag-format
    examples where the environment speaks hermes is refused (ValueError); tag-format tools and the
    overlong penalty get one line each on the console."""
    import sys

    name, parser = config.env.name, config.tool_parser
    if config.sft_warmup.steps and config.sft_warmup.source == BUILTIN_TASK and parser != "tag":
        own = "" if config.verifiers else "sft_warmup.source=env (its demonstrations), "
        raise ValueError(
            f"sft_warmup.source={BUILTIN_TASK} warms up on the built-in task's tag-format calculator answers, but "
            f"env.name={name} speaks rollout.tool_parser={parser}: set {own}sft_warmup.source to a file of "
            "your own, or sft_warmup.steps=0"
        )
    notes = []
    if config.rollout.tools.enabled:
        notes.append(f"rollout.tools.enabled={config.rollout.tools.enabled} is not used with env.name={name}: "
                     "an environment's tools are its own (Environment.tools, a verifiers task's toolsets)")  # fmt: skip
    if config.algorithm.overlong == "soft_penalty":
        notes.append(f"algorithm.overlong=soft_penalty adds up to -{config.algorithm.overlong_penalty:g} to the "
                     f"reward of long episodes of {name} (shown as `overlong` in the step line and the rollouts); "
                     "algorithm.overlong=none leaves the environment's reward alone")  # fmt: skip
    for note in notes:
        print(f"rltrain: note: {note}", file=sys.stderr, flush=True)


def _check_step(config: Config, instance, opening: list[dict], row: dict) -> None:
    """``step`` answers an assistant turn (the row's answer) with a Step, in time."""
    from rltrain.rollout.environments import GYM_HINT, Step

    turn = [*opening, {"role": "assistant", "content": str(row.get("answer", ""))}]
    try:
        step = with_deadline(config.env.step_timeout_s, instance.step, turn)
    except Exception as e:
        raise ValueError(
            f"env.name: {config.env.name}.step(messages) raised {first_line(e)} on the "
            "first row's opening and its answer as the assistant turn"
        ) from None
    if not isinstance(step, Step):
        raise ValueError(
            f"env.name: {config.env.name}.step returned {type(step).__name__}, not rltrain.envs.Step{GYM_HINT}"
        )


def _check_tools(config: Config) -> None:
    parser = config.rollout.tool_parser
    if parser is not None and parser not in BUILT_IN:
        known = registered_parsers()
        if parser not in known:
            close = difflib.get_close_matches(parser, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"rollout.tool_parser: unknown parser {parser!r} ({hint}built in: {', '.join(BUILT_IN)}; "
                f"vLLM's: {', '.join(n for n in known if n not in BUILT_IN)})"
            )
    tools = config.rollout.tools
    if "python" in tools.enabled and tools.sandbox.require_isolation:
        from rltrain.rollout.sandbox import isolation_problem

        problem = isolation_problem()
        if problem is not None:
            raise ConfigError(
                f"rollout.tools.enabled: the python tool cannot be isolated on this machine ({problem}); "
                "set rollout.tools.sandbox.require_isolation=false to run it with resource limits only"
            )


# set by `ray job submit` for the job's entrypoint: its runtime_env (the --working-dir Ray copied)
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


def _model_config(config: Config, key: str, model_path: str):
    """The transformers config of a local model folder or hub name (``key`` names it in errors),
    whose context must hold the longest sequence."""
    folder = Path(model_path).expanduser()
    local = folder.is_dir()
    if local and not (folder / "config.json").is_file():
        raise ConfigError(f"{key}: {model_path!r} has no config.json (not a transformers model folder)")
    from transformers import AutoConfig

    try:  # a hub name: its config.json alone is fetched (and cached) now
        model_config = AutoConfig.from_pretrained(
            folder if local else model_path, trust_remote_code=config.model.trust_remote_code
        )
    except Exception as e:
        if local:
            raise ConfigError(f"{key}: cannot read {str(folder / 'config.json')!r} ({e})") from None
        raise ConfigError(
            f"{key}: {model_path!r} is no local model folder and cannot be loaded from the hub ({first_line(e)})"
        ) from None
    context = getattr(model_config, "max_position_embeddings", None)
    if context is not None and config.longest_sequence > context:
        raise ConfigError(
            f"data.max_prompt_tokens + rollout.max_new_tokens = {config.longest_sequence} exceeds the "
            f"context of {context} tokens of {key} (max_position_embeddings in {model_path})"
        )
    return model_config


def load_tokenizer(config: Config, key: str, model_path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path, trust_remote_code=config.model.trust_remote_code)
    except Exception as e:  # a model folder without tokenizer files, say
        raise ConfigError(f"{key}: cannot load the tokenizer of {model_path!r} ({first_line(e)})") from None


def _check_scoring_models(config: Config, tokenizer) -> None:
    """The teacher and the reward model score the policy's token ids as sampled: each must share
    its tokenizer; the reward model must be a one-label sequence classifier with a chat template."""
    judge = config.reward.judge
    if (
        judge is not None and judge.model is not None
    ):  # a judge reads text: any tokenizer with a chat template
        _model_config(config, "reward.judge.model", judge.model)
        if load_tokenizer(config, "reward.judge.model", judge.model).chat_template is None:
            raise ConfigError(
                f"reward.judge.model: {judge.model!r} has no chat template to put the question in"
            )
    models = {"algorithm.teacher": config.algorithm.teacher, "reward.model": config.reward.model}
    for key, path in models.items():
        if path is None:
            continue
        model_config = _model_config(config, key, path)
        theirs = load_tokenizer(config, key, path)
        if theirs.get_vocab() != tokenizer.get_vocab():
            raise ConfigError(
                f"{key}: the tokenizer of {path!r} differs from the policy's ({len(theirs)} vs "
                f"{len(tokenizer)} tokens, or other ids); it must score the policy's token ids as sampled"
            )
        if key != "reward.model":
            continue
        architectures = getattr(model_config, "architectures", None) or []
        if not any(a.endswith("ForSequenceClassification") for a in architectures):
            raise ConfigError(
                f"reward.model: {path!r} is {', '.join(architectures) or 'no known architecture'}, "
                "expected a sequence-classification model (one score per sequence)"
            )
        if model_config.num_labels != 1:
            raise ConfigError(
                f"reward.model: {path!r} has {model_config.num_labels} labels, expected 1 (a score)"
            )
        if theirs.chat_template is None:
            raise ConfigError(
                f"reward.model: {path!r} has no chat template (it scores the prompt's chat rendering)"
            )


def _check_model(config: Config, model_path: str) -> None:
    """A local model folder must be a transformers model whose context holds the longest sequence."""
    model_config = _model_config(config, "model.name_or_path", model_path)
    sp = config.learner.sequence_parallel_size
    if sp > 1 and model_config.num_attention_heads % sp:
        raise ConfigError(
            f"learner.sequence_parallel_size={sp} does not divide the model's "
            f"{model_config.num_attention_heads} attention heads"
        )
    from rltrain.routing import config_experts

    experts = config_experts(model_config) > 0
    if experts and config.model.lora.rank and config.rollout.backend == "vllm":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                "model.lora.rank with a mixture of experts: vLLM's CPU engine cannot serve LoRA adapters "
                "on expert layers (its fused-MoE LoRA kernel needs Triton); train every weight "
                "(model.lora.rank=0) or generate with rollout.backend=hf"
            )
    if config.rollout.routing_replay:
        _check_replay(config, model_config, experts)
    if config.loss.moe_aux_coef and not experts:
        raise ConfigError(
            f"loss.moe_aux_coef={config.loss.moe_aux_coef}: {config.model.name_or_path} is not a mixture "
            "of experts (no load-balancing loss to weigh; leave it unset)"
        )


def _check_replay(config: Config, model_config, experts: bool) -> None:
    """Routing replay needs a mixture of experts whose router it can drive, and one generation per
    turn that it records (not an environment's episodes or an agent's calls)."""
    name = config.model.name_or_path
    if not experts:
        raise ConfigError(f"rollout.routing_replay: {name} is not a mixture of experts (no routes to replay)")
    for key, value in (("env.name", config.env.name), ("agent.entrypoint", config.agent.entrypoint)):
        if value is not None:
            raise ConfigError(
                f"rollout.routing_replay with {key}: the routes of an episode's turns are not recorded yet "
                "(single-turn generation and the tool loop are); set rollout.routing_replay=false"
            )
    import torch
    from transformers import AutoModelForCausalLM

    from rltrain.routing import replay_problem

    with torch.device("meta"):  # the architecture alone: no weights, no compute
        model = AutoModelForCausalLM.from_config(
            model_config, trust_remote_code=config.model.trust_remote_code
        )
    if problem := replay_problem(model):
        raise ConfigError(f"rollout.routing_replay: {name}: {problem}")


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


def resolve_model(config: Config, out: Path) -> str:
    if config.model.name_or_path in (TINY_MODEL, TINY_MOE_MODEL):
        from rltrain.tiny_model import build_tiny_model

        if config.model.name_or_path == TINY_MOE_MODEL:
            folder = build_tiny_model(out / "tiny_moe_model", seed=config.run.seed, family="qwen3_moe")
        else:
            folder = build_tiny_model(out / "tiny_model", seed=config.run.seed)
        return str(folder.resolve())
    try:
        return model_folder(config.model.name_or_path)
    except (ImportError, OSError, ValueError) as e:  # a .gguf that does not convert
        raise ConfigError(f"model.name_or_path: {config.model.name_or_path!r} does not load: {e}") from None
