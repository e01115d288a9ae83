"""The typed, validated config tree: YAML file + dotted ``section.key=value`` overrides.

Unknown keys and bad values fail here, before any actor starts, with one line that names the key,
the value and what is allowed (:class:`ConfigError`). Importing this module is cheap: no ray,
deepspeed or vllm.
"""

from __future__ import annotations

import difflib
import os
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError, model_validator

from rltrain.config.generation import (
    AgentConfig,
    DataConfig,
    EnvConfig,
    EvalConfig,
    JudgeConfig,
    RewardConfig,
    RolloutConfig,
    SandboxConfig,
    SFTWarmupConfig,
    ToolsConfig,
)
from rltrain.config.optimization import (
    AUTO_MISMATCH_KL,
    BUILTIN_TASK,
    DENOMINATOR_KEY,
    SFT_FROM_ENV,
    TINY_MODEL,
    TINY_MOE_MODEL,
    VERIFIERS,
    Aggregation,
    AlgorithmConfig,
    ConfigError,
    CriticConfig,
    CriticLearnerConfig,
    Denominator,
    FrozenLearnerConfig,
    LearnerConfig,
    LoraConfig,
    LossConfig,
    ModelConfig,
    RolloutCorrectionConfig,
    RunConfig,
    Section,
    first_line,
    resolve_denominator,
)
from rltrain.config.spellings import RESPELLED, UNSET, describe_respelled, respell, respell_key


class Config(Section):
    model: ModelConfig = ModelConfig()
    learner: LearnerConfig = LearnerConfig()
    loss: LossConfig = LossConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    rollout: RolloutConfig = RolloutConfig()
    data: DataConfig = DataConfig()
    reward: RewardConfig = RewardConfig()
    env: EnvConfig = EnvConfig()
    """Multi-turn environments: each rollout is an episode (rltrain.envs)."""
    agent: AgentConfig = AgentConfig()
    """Black-box agents through an OpenAI-compatible gateway: each rollout is an episode of the
    user's own agent code (rltrain.episodes.gateway)."""
    critic: CriticConfig | None = None
    """A learned value model (PPO with GAE); needs algorithm.advantage=gae."""
    sft_warmup: SFTWarmupConfig = SFTWarmupConfig()
    """Supervised warm start before RL."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation: greedy decoding through the generators, math-verify correctness, tool use."""
    run: RunConfig = RunConfig()

    @model_validator(mode="before")
    @classmethod
    def _older_spellings(cls, raw: Any) -> Any:
        """Older spellings of keys are read as their new ones (rltrain.config.spellings)."""
        return respell(raw)

    @model_validator(mode="after")
    def _layout(self) -> Config:
        batch = self.algorithm.prompts_per_step * self.algorithm.group_size
        if self.learner.num_mini_batches > batch:
            raise ValueError(
                f"learner.num_mini_batches={self.learner.num_mini_batches} exceeds the global batch of "
                f"{batch} sequences (algorithm.prompts_per_step * algorithm.group_size)"
            )
        budget, longest = self.learner.max_tokens_per_micro_batch, self.longest_sequence
        if budget is not None and not self.learner.packing:
            raise ValueError(
                f"learner.max_tokens_per_micro_batch={budget} needs learner.packing=true "
                "(without packing, micro-batches hold learner.micro_batch_size sequences)"
            )
        if budget is not None and budget < longest:
            raise ValueError(
                f"learner.max_tokens_per_micro_batch={budget} cannot hold one sequence of up to {longest} "
                f"tokens ({self.prompt_limit_key} + rollout.max_new_tokens); raise it or lower those"
            )
        if longest > self.rollout.max_model_len:
            raise ValueError(
                f"{self.prompt_limit_key} + rollout.max_new_tokens = {self.max_prompt_tokens} + "
                f"{self.rollout.max_new_tokens} = {longest} exceeds rollout.max_model_len={self.rollout.max_model_len}"
            )
        self._check_sequence_parallel()
        self._check_critic()
        self._check_env()
        self._check_lora()
        self._check_scorers()
        return self

    def _check_scorers(self) -> None:
        alg, reward = self.algorithm, self.reward
        if alg.advantage == "distill" and alg.teacher is None:
            raise ValueError(
                "algorithm.advantage=distill needs algorithm.teacher (the teacher model's folder)"
            )
        if alg.teacher is not None and alg.advantage != "distill":
            raise ValueError(
                f"algorithm.teacher: set, but algorithm.advantage={alg.advantage} ignores it "
                "(use algorithm.advantage=distill, or remove the teacher)"
            )
        for name, what, value in [("judge", "verdict", reward.judge), ("model", "score", reward.model)]:
            if (name in reward.functions) == (value is not None):
                continue
            if value is None:
                raise ValueError(f"reward.functions: `{name}` is reward.{name}'s {what}; set both or neither")
            raise ValueError(
                f"reward.{name}: set, but reward.functions ({', '.join(reward.functions)}) has no `{name}` weight"
            )

    def _check_env(self) -> None:
        if self.sft_warmup.source == SFT_FROM_ENV and self.env.name is None:
            raise ValueError(
                "sft_warmup.source=env: the environment's demonstrations need env.name "
                "(an agent's run warms up on a .jsonl of conversations)"
            )
        if "env" in self.reward.functions and self.env.name is None:
            raise ValueError("reward.functions: `env` is the environment's reward; it needs env.name")
        self._check_agent()
        parser = self.rollout.tool_parser
        if self.env.name is None and self.agent.entrypoint is None and parser not in (None, "tag"):
            raise ValueError(
                f"rollout.tool_parser={parser} needs an environment (env.name=builtin:calculator gives "
                "the built-in task with native calls); without one, rollout.tools uses the tag format"
            )

    @property
    def verifiers(self) -> bool:
        """``env.name: verifiers:<taskset id>``: a verifiers taskset's episodes, through the gateway."""
        return (self.env.name or "").startswith(VERIFIERS)

    @property
    def gateway_episodes(self) -> bool:
        """Episodes that run through the gateway: a black-box agent's or a verifiers environment's."""
        return self.agent.entrypoint is not None or self.verifiers

    @property
    def episode_reward(self) -> str | None:
        """The reward an episode gives itself: ``agent`` (the agent's returned one), ``env`` (an
        environment's), or None (no episodes)."""
        return "agent" if self.agent.entrypoint is not None else "env" if self.env.name is not None else None

    @property
    def episodic(self) -> bool:
        """Each rollout is an episode opened from a data row: an environment's, or a black-box agent's."""
        return self.env.name is not None or self.agent.entrypoint is not None

    @property
    def tool_parser(self) -> str:
        """The parser in use: ``rollout.tool_parser`` or its default."""
        return self.rollout.tool_parser or ("hermes" if self.env.name or self.agent.entrypoint else "tag")

    def _check_agent(self) -> None:
        agent = self.agent.entrypoint
        if "agent" in self.reward.functions and agent is None:
            raise ValueError(
                "reward.functions: `agent` is the agent's returned reward; it needs agent.entrypoint"
            )
        if not self.gateway_episodes:
            return
        if agent is not None and self.env.name is not None:
            raise ValueError(
                f"agent.entrypoint={agent} and env.name={self.env.name}: an episode is one or the other"
            )
        key = f"env.name={self.env.name}" if agent is None else "agent.entrypoint"
        if self.rollout.tool_parser == "tag":
            raise ValueError(
                f"rollout.tool_parser=tag with {key}: the gateway returns tool calls as OpenAI "
                "tool_calls, whose results come back as tool messages; use hermes or one of vLLM's parsers"
            )
        if self.rollout.tools.enabled and agent is not None:  # (an environment's: a note, see checks)
            raise ValueError(
                "rollout.tools.enabled with agent.entrypoint: the agent runs its own tools; remove rollout.tools"
            )
        if self.algorithm.advantage == "gae":
            raise ValueError(
                f"{key} with algorithm.advantage=gae is not supported yet (an episode may split "
                "into several sequences); use grpo, rloo or dr_grpo"
            )

    def _check_lora(self) -> None:
        rank = self.model.lora.rank
        if not rank:
            return
        if self.learner.sequence_parallel_size > 1:
            raise ValueError(
                f"model.lora.rank={rank} with learner.sequence_parallel_size={self.learner.sequence_parallel_size} "
                "is not supported yet (adapters are tested under ZeRO 0-3 and packing); use 1"
            )

    def _check_critic(self) -> None:
        gae = self.algorithm.advantage == "gae"
        if gae and self.critic is None:
            raise ValueError("algorithm.advantage=gae needs a critic section (critic: {} for the defaults)")
        if self.critic is not None and not gae:
            raise ValueError(
                f"critic: set, but algorithm.advantage={self.algorithm.advantage} ignores it "
                "(use algorithm.advantage=gae, or remove the critic section)"
            )
        if self.algorithm.kl_in_reward > 0 and not gae:
            raise ValueError("algorithm.kl_in_reward shapes GAE rewards; it needs algorithm.advantage=gae")
        if self.critic is not None and self.critic.learners.sequence_parallel_size > 1:
            raise ValueError(
                "critic.learners.sequence_parallel_size: the critic runs without sequence parallelism (1)"
            )

    def _check_sequence_parallel(self) -> None:
        lc, sp = self.learner, self.learner.sequence_parallel_size
        if sp == 1:
            return
        if lc.num_learners % sp:
            raise ValueError(
                f"learner.sequence_parallel_size={sp} does not divide learner.num_learners={lc.num_learners}"
            )
        if not lc.packing:
            raise ValueError(
                f"learner.sequence_parallel_size={sp} needs learner.packing=true (it splits packed rows)"
            )

    @property
    def mismatch_limit(self) -> float | None:
        """``run.max_mismatch_kl`` with ``auto`` resolved (see there)."""
        limit, rc = self.run.max_mismatch_kl, self.rollout
        if limit != "auto":
            return limit
        return AUTO_MISMATCH_KL if rc.max_staleness == 0 or rc.inflight_updates else None

    @property
    def longest_sequence(self) -> int:
        """The most tokens (prompt + completion) one training sequence can have."""
        return self.max_prompt_tokens + self.rollout.max_new_tokens

    @property
    def eval_functions(self) -> dict[str, float]:
        """What held-out completions are scored by: eval.reward_functions, or the run's own
        reward.functions (a reward model's and a judge's with eval.model_rewards only)."""
        if self.eval.reward_functions is not None:
            return dict(self.eval.reward_functions)
        costly = () if self.eval.model_rewards else ("model", "judge")
        kept = {name: weight for name, weight in self.reward.functions.items() if name not in costly}
        return kept or {"math": 1.0}

    @property
    def prompt_limit_key(self) -> str:
        agent = self.agent.entrypoint is not None and self.agent.max_prompt_tokens is not None
        return "agent.max_prompt_tokens" if agent else "data.max_prompt_tokens"

    @property
    def max_prompt_tokens(self) -> int:
        """The most tokens a sequence's prompt may take: an agent's own bound, or the data's."""
        agent = self.agent.max_prompt_tokens if self.agent.entrypoint is not None else None
        return agent or self.data.max_prompt_tokens

    @property
    def aggregation_norm(self) -> float:
        """The constant of ``seq-mean-token-sum-norm``: ``loss.aggregation_norm`` or the generation budget."""
        return self.loss.aggregation_norm or float(self.rollout.max_new_tokens)

    def token_budget(self, lc: LearnerConfig) -> int:
        """``max_tokens_per_micro_batch`` of a learner section (the policy's or the critic's), or
        its default."""
        return lc.max_tokens_per_micro_batch or lc.micro_batch_size * self.longest_sequence


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """Read YAML, apply ``a.b=value`` overrides (values parsed as YAML), validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError as e:
            raise ConfigError(f"config file {str(path)!r} does not exist") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}".replace("\n", " ")) from e
        if not isinstance(raw, dict):
            raise ConfigError(
                f"config file {str(path)!r} holds a {type(raw).__name__}, expected a mapping of sections "
                "(model:, learner:, loss:, ...)"
            )
    raw = _as_config_error(respell, raw)  # (an override then wins over the file's value in either spelling)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
        try:
            node[leaf] = yaml.safe_load(value) if value else ""
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or type(e).__name__
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({problem})") from None
        _check_mapping_value(item, key, node[leaf])
        new_key, new_value = _as_config_error(respell_key, key, node[leaf])
        if new_key != key:  # an older spelling: moved to its new key
            del node[leaf]
            if new_value is not UNSET:
                section, new_leaf = new_key.split(".")
                raw[section] = {**(raw.get(section) or {}), new_leaf: new_value}
    return validate(raw)


def _as_config_error(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, its ValueError (an older spelling's bad value, or two that disagree) a ConfigError."""
    try:
        return fn(*args)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_mapping_value(item: str, key: str, value: Any) -> None:
    """YAML reads ``{env:1.0}`` (no space after the colon) as the key ``env:1.0`` without a value."""
    if isinstance(value, dict):
        for k, v in value.items():
            if v is None and isinstance(k, str) and ":" in k:
                name, _, number = k.rpartition(":")
                raise ConfigError(
                    f"override {item!r}: YAML reads {{{k}}} as the key {k!r} with no value; put a space "
                    f"after the colon: {key}={{{name}: {number}}}"
                )


def validate(raw: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_one_line(e)) from None


TYPE_TAGS = {"int", "float", "str", "bool", "list", "dict", "none"}  # a union member's place in `loc`


def _key(loc: tuple) -> str:
    """The dotted key of an error's ``loc``, without the union members pydantic adds to it
    (``constrained-float``, ``literal['auto']``)."""
    return ".".join(
        str(p) for p in loc if not isinstance(p, str) or (p.isidentifier() and p not in TYPE_TAGS)
    )


def _one_line(error: ValidationError) -> str:
    errors = error.errors()
    first = errors[0]
    key = _key(first["loc"])
    # the members of one union field fail together: one line with each member's message
    same = [e for e in errors if _key(e["loc"]) == key and e["loc"] != first["loc"]]
    message = "; or ".join(dict.fromkeys(e["msg"].removeprefix("Value error, ") for e in [first, *same]))
    errors = [e for e in errors if e is first or e not in same]
    unknown = [e for e in error.errors() if e["type"] == "extra_forbidden"]
    if unknown:
        return "; ".join(_unknown_key(_key(e["loc"])) for e in unknown) + " (see `rltrain --help-config`)"
    if message.startswith("masked_mean_denominator:"):  # (the message names its key)
        section = key.removesuffix(message.split(":")[0]).removesuffix(".")
        return f"{section + '.' if section else ''}{message}"
    if first["type"] == "value_error" and not key:
        return message  # a cross-section check names its keys itself; its input is the whole config
    if first.get("input", "") is None and first["type"] != "missing":
        message += " (YAML reads null, ~ and a key without a value as None)"
    shown = "" if first["type"] == "missing" else f"got {first['input']!r}; "
    more = f" (+{len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"{key or 'config'}: {shown}{message}{more}"


def _unknown_key(key: str) -> str:
    """``key: unknown key``, with the closest known keys of its section."""
    *parents, leaf = key.split(".")
    model: Any = Config
    for part in parents:
        field = model.model_fields.get(part) if isinstance(model, type) else None
        if field is None:
            break
        model = next((a for a in (field.annotation, *get_args(field.annotation))
                      if isinstance(a, type) and issubclass(a, BaseModel)), None)  # fmt: skip
    known = list(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else []
    close = difflib.get_close_matches(leaf, known, n=2, cutoff=0.6)
    hint = f" (did you mean {' or '.join('.'.join([*parents, c]) for c in close)}?)" if close else ""
    return f"{key}: unknown key{hint}"


def dump(config: Config, path: str | os.PathLike) -> None:
    Path(path).write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))


def describe(
    config: Config | None = None, section: str | None = None, builtins: dict[str, list[str]] | None = None
) -> str:
    """Every key (under ``section``, a dotted prefix) with its type's allowed values, its value
    (``config``'s: the values a run would use; the defaults otherwise) and its docstring, for
    ``--help-config``. ``builtins``: the built-in names the code offers for a key, listed with it."""
    lines = []

    def walk(model: type[BaseModel], prefix: str, values: BaseModel | None) -> None:
        for name, field in model.model_fields.items():
            # an optional section (`critic`) is described like a present one
            annotation = next(
                (a for a in get_args(field.annotation) if a is not type(None)), field.annotation
            )
            value = getattr(values, name) if values is not None else field.default
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                walk(annotation, f"{prefix}{name}.", value if isinstance(value, BaseModel) else None)
                continue
            key = f"{prefix}{name}"
            if section and not (key == section or key.startswith(section + ".")):
                continue
            doc = (field.description or "").strip()
            choices = _choices(field.annotation)
            if choices:
                alone = get_origin(field.annotation) is Literal or all(
                    get_origin(a) is Literal or a is type(None) for a in get_args(field.annotation)
                )
                doc += f"\n{'One of' if alone else 'Besides a value of its type'}: {', '.join(choices)}."
            if builtins and key in builtins:
                doc += f"\nBuilt-ins: {', '.join(builtins[key])}."
            lines.append(f"{key} = {value!r}\n{textwrap.indent(doc, '    ')}")

    walk(Config, "", config)
    if section and not lines:
        sections = ", ".join(Config.model_fields)
        raise ConfigError(f"--help-config {section}: no such key or section (sections: {sections})")
    return "\n".join(lines)


def _choices(annotation: Any) -> list[str]:
    """The values a ``Literal`` (alone or in a union) allows, as YAML writes them."""
    if get_origin(annotation) is Literal:
        return [
            yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()
            for v in get_args(annotation)
        ]
    if get_origin(annotation) in (Union, UnionType):
        found = [c for a in get_args(annotation) for c in _choices(a)]
        if found and type(None) in get_args(annotation):
            found.append("null")
        return found
    return []


__all__ = [
    "AUTO_MISMATCH_KL",
    "Aggregation",
    "AlgorithmConfig",
    "BUILTIN_TASK",
    "Config",
    "ConfigError",
    "first_line",
    "CriticConfig",
    "CriticLearnerConfig",
    "DENOMINATOR_KEY",
    "DataConfig",
    "RESPELLED",
    "Denominator",
    "EnvConfig",
    "EvalConfig",
    "FrozenLearnerConfig",
    "JudgeConfig",
    "LearnerConfig",
    "LossConfig",
    "ModelConfig",
    "LoraConfig",
    "RewardConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "RunConfig",
    "SFTWarmupConfig",
    "SFT_FROM_ENV",
    "SandboxConfig",
    "Section",
    "TINY_MODEL",
    "TINY_MOE_MODEL",
    "ToolsConfig",
    "describe",
    "describe_respelled",
    "dump",
    "load_config",
    "resolve_denominator",
    "validate",
]
