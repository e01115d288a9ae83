"""The root of the config tree: every section, and the rules that span sections (a layout the
batch can hold, a critic where GAE needs one, an environment or an agent but not both, ...), each
raising one line that names the keys; and what the run derives from them (``episodic``,
``tool_parser``, ``longest_sequence``, ...)."""

from __future__ import annotations

from typing import Any

from pydantic import model_validator

from rltrain.config.generation import (
    AgentConfig,
    DataConfig,
    EnvConfig,
    EvalConfig,
    RewardConfig,
    RolloutConfig,
    SFTWarmupConfig,
)
from rltrain.config.optimization import (
    SFT_FROM_ENV,
    VERIFIERS,
    AlgorithmConfig,
    CriticConfig,
    LearnerConfig,
    LossConfig,
    ModelConfig,
    Section,
)
from rltrain.config.run import AUTO_MISMATCH_KL, RunConfig
from rltrain.config.serve import ServeConfig
from rltrain.config.spellings import respell


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
    serve: ServeConfig = ServeConfig()
    """`rltrain serve`: the Tinker API on the learners and engines (rltrain.serve)."""

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
        if not self.episodic and parser not in (None, "tag"):
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
        if not self.episodic:
            return None
        return "agent" if self.agent.entrypoint is not None else "env"

    @property
    def episodic(self) -> bool:
        """The run has episodes: each rollout is an episode opened from a data row, an environment's
        (``env.name``) or a black-box agent's (``agent.entrypoint``). The one place this is decided."""
        return self.env.name is not None or self.agent.entrypoint is not None

    @property
    def tool_parser(self) -> str:
        """The parser in use: ``rollout.tool_parser`` or its default."""
        return self.rollout.tool_parser or ("hermes" if self.episodic else "tag")

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
        if lc.prefix_sharing is True:
            raise ValueError(
                f"learner.prefix_sharing=true does not run with learner.sequence_parallel_size={sp}: "
                "set one of them off (auto shares only without sequence parallelism)"
            )
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
