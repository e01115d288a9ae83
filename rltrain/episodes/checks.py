"""Checks of a run's episodes before anything starts: the environment loads, takes its settings,
opens an episode from the first row and steps it; its tools have schemas and the chat template
renders what they add; the tool parser builds for the policy's tokenizer; an agent imports; a
verifiers taskset loads (its rows). Each problem raises one line naming the key (the run's
preflight, :mod:`rltrain.run.preflight`, calls them).
"""

from __future__ import annotations

import difflib

from rltrain.config import BUILTIN_TASK, SFT_FROM_ENV, Config, ConfigError, first_line
from rltrain.episodes.parsers import BUILT_IN, get_parser, registered_parsers
from rltrain.loading import with_deadline
from rltrain.models.images import not_with_images


def check_agent(config: Config, tokenizer) -> None:
    """``agent.entrypoint`` imports as ``async def run(row, base_url, api_key, model)`` (a verifiers
    environment loaded already, in :func:`verifiers_rows`), and the tool parser is built for the
    policy's tokenizer."""
    from rltrain.episodes.agents import load_agent

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
        from rltrain.episodes import verifiers_env
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


def check_environment(config: Config, row: dict, tokenizer, images=None) -> None:
    """``env.name`` loads, takes ``env.kwargs``, opens an episode from the first row (its images
    checked, and rendered by ``images``: a vision-language model's
    :class:`~rltrain.models.images.ImageInputs`), and its tools' schemas and the chat template's
    rendering of the additions work; raises ValueError naming the key."""
    from rltrain.episodes.chat import ChatRenderer, TemplateError, message_images, render_problem
    from rltrain.episodes.environments import load_environment, tool_schemas
    from rltrain.media import checked_message

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
    opening = [
        checked_message(m, f"env.name: {env.name}.reset", config.data.max_image_pixels) for m in opening
    ]
    if message_images(opening):
        if images is None:
            raise ValueError(f"env.name: {env.name}.reset opens with images, and model.name_or_path="
                             f"{config.model.name_or_path} takes none: images need a vision-language model")  # fmt: skip
        if setting := not_with_images(config):
            raise ValueError(
                f"env.name: {env.name}.reset opens with images, which are not taken with {setting} yet"
            )
    renderer = ChatRenderer(tokenizer, schemas, env.render, images)
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
    problem = render_problem(tokenizer, schemas, opening, env.render, images)
    if problem is not None:
        other = "last_turn" if env.render == "full" else "full"
        if render_problem(tokenizer, schemas, opening, other, images) is not None:
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
    from rltrain.episodes.environments import GYM_HINT, Step

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


def check_tools(config: Config) -> None:
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
        from rltrain.sandbox import isolation_problem

        problem = isolation_problem()
        if problem is not None:
            raise ConfigError(
                f"rollout.tools.enabled: the python tool cannot be isolated on this machine ({problem}); "
                "set rollout.tools.sandbox.require_isolation=false to run it with resource limits only"
            )


# set by `ray job submit` for the job's entrypoint: its runtime_env (the --working-dir Ray copied)
