"""The typed, validated config tree: YAML file + dotted ``section.key=value`` overrides.

- :mod:`~rltrain.config.root`: the root :class:`Config` and its cross-section rules;
  :mod:`~rltrain.config.optimization` (model, learner, loss, algorithm, critic), :mod:`~rltrain.config.run` and
  :mod:`~rltrain.config.generation` (rollout, data, reward, environments, agents, evaluation): the
  sections; :mod:`~rltrain.config.spellings`: older spellings of keys;
- :mod:`~rltrain.config.loading`: :func:`load_config`, one :class:`ConfigError` line per problem;
- :mod:`~rltrain.config.help`: ``--help-config``.

Unknown keys and bad values fail before any actor starts. Importing it is cheap: no ray, deepspeed
or vllm. This module only exports.
"""

# ruff: noqa: I001  (the exports, wrapped: one name a line would be most of the file)
from rltrain.config.generation import (AgentConfig, DataConfig, DifficultySampling, EnvConfig, EvalConfig,
                                      JudgeConfig, RewardConfig, RolloutConfig, SandboxConfig,
                                      SFTWarmupConfig, ToolsConfig)  # fmt: skip
from rltrain.config.help import describe
from rltrain.config.loading import dump, load_config, validate
from rltrain.config.optimization import (BUILTIN_MODELS, BUILTIN_TASK, DENOMINATOR_KEY, SFT_FROM_ENV,
                                         TINY_MODEL, TINY_MOE_MODEL, VERIFIERS, Aggregation,
                                         AlgorithmConfig, ConfigError, CriticConfig, CriticLearnerConfig,
                                         Denominator, FrozenLearnerConfig, LearnerConfig, LoraConfig,
                                         LossConfig, ModelConfig, RolloutCorrectionConfig,
                                         Section, first_line, resolve_denominator)  # fmt: skip
from rltrain.config.root import Config
from rltrain.config.run import AUTO_MISMATCH_KL, RunConfig
from rltrain.config.spellings import RESPELLED, describe_respelled

__all__ = ["AUTO_MISMATCH_KL", "BUILTIN_MODELS", "BUILTIN_TASK", "DENOMINATOR_KEY", "RESPELLED", "SFT_FROM_ENV", "TINY_MODEL",
           "TINY_MOE_MODEL", "VERIFIERS", "AgentConfig", "Aggregation", "AlgorithmConfig", "Config",
           "ConfigError", "CriticConfig", "CriticLearnerConfig", "DataConfig", "Denominator",
           "DifficultySampling", "EnvConfig", "EvalConfig", "FrozenLearnerConfig", "JudgeConfig",
           "LearnerConfig", "LoraConfig", "LossConfig", "ModelConfig", "RewardConfig", "RolloutConfig",
           "RolloutCorrectionConfig", "RunConfig", "SFTWarmupConfig", "SandboxConfig", "Section",
           "ToolsConfig", "describe", "describe_respelled", "dump", "first_line", "load_config",
           "resolve_denominator", "validate"]  # fmt: skip
