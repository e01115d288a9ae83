"""The typed, validated config tree: YAML file + dotted ``section.key=value`` overrides.

Unknown keys and bad values fail here, before any actor starts, with one line that names the key,
the value and what is allowed (:class:`ConfigError`). Importing this module is cheap: no ray,
deepspeed or vllm.
"""

from __future__ import annotations

import math
import os
import textwrap
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

AUTO_MISMATCH_KL = 1e-2  # run.max_mismatch_kl: auto
# the loss library's aggregations (rltrain.loss.masked_mean.AGGREGATIONS: the config imports no
# other part of rltrain, and a test keeps the two lists equal)
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
Denominator = float | Literal["token"] | None
DENOMINATOR_KEY = "masked_mean_denominator"
_ACCEPTED = 'null (per-micro-batch mean), a positive number, or "token"'


def resolve_denominator(value: object, axis: int | None = None) -> Denominator:
    """Validate a ``masked_mean_denominator`` setting and return its canonical form.

    Accepts ``None``, a positive finite number (also as a numeric string, as YAML or the command
    line may give it) and ``"token"``. Raises ``ValueError`` whose message names
    the key, the bad value and the accepted forms. (``axis`` is accepted for compatibility: every
    aggregation now works in ``token`` mode.)
    """
    if value is None:
        resolved: Denominator = None
    elif value == "token":
        resolved = "token"
    elif _is_positive_number(value):
        resolved = float(value)  # type: ignore[arg-type]
    elif isinstance(value, str) and _is_positive_number(_parse_float(value)):
        resolved = float(value)
    else:
        raise ValueError(f"{DENOMINATOR_KEY}: got {value!r}; expected {_ACCEPTED}")
    return resolved


def _parse_float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _is_positive_number(value: object) -> bool:
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


TINY_MODEL = "builtin:tiny"
BUILTIN_TASK = "builtin:arithmetic"
SFT_FROM_ENV = "env"  # sft_warmup.source: the environment's demonstrations


class ConfigError(ValueError):
    """A one-line, user-facing config problem."""


class Section(BaseModel):
    # no NaN or infinity anywhere: a learning rate, weight or limit that is not finite cannot train
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True, allow_inf_nan=False
    )


class ModelConfig(Section):
    name_or_path: str = TINY_MODEL
    """A local model directory, a Hugging Face hub name, or `builtin:tiny` (a ~100k-parameter Qwen2
    model and byte-level tokenizer built locally, no download)."""
    trust_remote_code: bool = False
    """Passed to transformers when loading the model and tokenizer."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""

    @field_validator("name_or_path")
    @classmethod
    def _local_path_exists(cls, value: str) -> str:
        looks_local = value.startswith(("/", "./", "../", "~")) or os.sep * 2 in value
        if looks_local and not Path(value).expanduser().is_dir():
            raise ValueError(f"{value!r} is not a directory (give a local model folder or a hub name)")
        return value


class LearnerConfig(Section):
    num_learners: int = Field(2, ge=1)
    """Data-parallel learner actors (one DeepSpeed engine each)."""
    cpus_per_learner: float = Field(0.5, gt=0)
    """CPUs Ray reserves for each learner actor."""
    gpus_per_learner: float = Field(0, ge=0)
    """GPUs Ray reserves for each learner actor (0 on CPU machines)."""
    zero_stage: Literal[0, 1, 2, 3] = 2
    """DeepSpeed ZeRO stage."""
    micro_batch_size: int = Field(4, ge=1)
    """Sequences per forward/backward on one learner (without packing)."""
    packing: bool = True
    """Padding-free micro-batches: the sequences of a micro-batch are concatenated into one row
    (position ids restart per sequence, no attention mask, no KV cache) and bounded by
    max_tokens_per_micro_batch; false pads every micro-batch of micro_batch_size sequences to its
    longest sequence."""
    max_tokens_per_micro_batch: int | None = Field(None, ge=1)
    """Token budget of one packed forward/backward (prompt + completion tokens); null:
    micro_batch_size x (data.max_prompt_tokens + rollout.max_new_tokens), the padded worst case.
    Must hold the longest sequence; needs packing. With sequence parallelism this is the whole
    row, shared by sequence_parallel_size ranks."""
    sequence_parallel_size: int = Field(1, ge=1)
    """Ulysses sequence parallelism: groups of this many learners share each packed micro-batch,
    each holding a contiguous slice of the row (attention all-to-alls over the group). Must divide
    num_learners (data-parallel size = num_learners / this) and the model's attention heads; needs
    packing."""
    num_mini_batches: int = Field(1, ge=1)
    """Optimizer steps per training step: the global batch is cut into this many accumulation groups."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over the global batch per training step."""
    placement: Literal["PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    """Ray placement of the learners: `PACK` (as few nodes as possible), `SPREAD` (over nodes where
    possible), `STRICT_SPREAD` (every learner on a different node)."""
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """AdamW for training; plain SGD makes the update linear in the gradient (used by exactness tests)."""
    lr: float = Field(1e-5, gt=0)
    """Peak learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Shape of the learning rate after warm-up."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warm-up from 0."""
    max_grad_norm: float = Field(1.0, ge=0)
    """Gradient clipping threshold; 0 disables clipping."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """`auto`: bf16 on GPU, fp32 on CPU."""


class FrozenLearnerConfig(Section):
    """The actors of a model that scores and never trains (a teacher, a reward model): the same
    engine path as the learners, without optimizer or gradients."""

    num_learners: int = Field(1, ge=1)
    """Data-parallel actors; each scores its share of every batch."""
    cpus_per_learner: float = Field(0.5, gt=0)
    """CPUs Ray reserves for each actor."""
    gpus_per_learner: float = Field(0, ge=0)
    """GPUs Ray reserves for each actor (0 on CPU machines)."""
    zero_stage: Literal[0, 3] = 0
    """0: each actor holds the whole model; 3: its weights are sharded over the actors (DeepSpeed
    ZeRO-3), for a model larger than one device."""
    micro_batch_size: int = Field(8, ge=1)
    """Sequences per forward (without packing)."""
    packing: bool = True
    """Padding-free forwards, bounded by max_tokens_per_micro_batch (as `learner.packing`)."""
    max_tokens_per_micro_batch: int | None = Field(None, ge=1)
    """Token budget of one packed forward; null: micro_batch_size x the longest sequence."""
    placement: Literal["PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    """Ray placement of the actors (as `learner.placement`)."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """`auto`: bf16 on GPU, fp32 on CPU."""

    @property
    def sequence_parallel_size(self) -> int:
        return 1  # scoring runs without sequence parallelism


class RolloutCorrectionConfig(Section):
    """How tokens the engine sampled from a slightly different policy are corrected (rltrain.loss.corrections)."""

    kind: Literal["tis", "mis", "geo_mask"] = "tis"
    """`tis`: truncated importance weights min(r, cap); `mis` (IcePop): tokens whose ratio r =
    exp(learner - engine log-prob) lies outside [low, high] leave the loss and the token totals
    (counted in `rollout/correction_rejected`); `geo_mask`: a sequence whose geometric-mean ratio
    lies outside [low, high] leaves the loss whole."""
    level: Literal["token", "sequence"] = "token"
    """`token`: each token's ratio; `sequence`: the sequence's ratio (the product over its tokens;
    geo_mask: the geometric mean, and geo_mask needs this level)."""
    cap: float = Field(2.0, gt=0)
    """tis: the largest importance weight."""
    low: float = Field(0.5, gt=0)
    """mis, geo_mask: ratios below leave the loss."""
    high: float = Field(2.0, gt=0)
    """mis, geo_mask: ratios above leave the loss."""

    @model_validator(mode="after")
    def _bounds(self) -> RolloutCorrectionConfig:
        if self.low >= self.high:
            raise ValueError(f"low={self.low} must be below high={self.high}")
        if self.kind == "geo_mask" and self.level != "sequence":
            raise ValueError("kind geo_mask is a sequence rule: set level: sequence")
        return self


class LossConfig(Section):
    kind: Literal["ppo", "cispo", "gspo"] = "ppo"
    """Per-token policy loss: PPO/DAPO clipped surrogate, CISPO or GSPO."""
    clip_low: float = Field(0.2, ge=0)
    """Lower clip range (ratio >= 1 - clip_low)."""
    clip_high: float = Field(0.28, ge=0)
    """Upper clip range (ratio <= 1 + clip_high); DAPO's clip-higher uses 0.28."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual-clip bound for negative advantages (e.g. 3.0); null disables."""
    kl_beta: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the reference policy; 0 skips the reference model entirely."""
    kl_estimator: Literal["k1", "k2", "k3", "k3+", "abs"] = "k3"
    """KL estimator: Schulman's k1/k2/k3, `abs` (|log-ratio|), or `k3+` (k3's value with k2's
    gradient, straight-through)."""
    tis_cap: float | None = Field(2.0, gt=0)
    """Cap of truncated importance weights learner/generator; null disables the correction. The
    older spelling of rollout_correction {kind: tis, level: token, cap: x}, used when that is null."""
    rollout_correction: RolloutCorrectionConfig | None = None
    """Correction of the engine's sampling against the learner's old policy: truncated weights,
    masked importance sampling (IcePop) or a geometric sequence mask, per token or per sequence;
    null: tis_cap."""
    masked_mean_denominator: Any = "token"
    """`token`: divide by the count of the whole optimizer step (all micro-batches, all ranks; loss
    tokens for token-mean, sequences for the per-sequence aggregations), exact under any layout;
    null: this micro-batch's own count (the common, layout-dependent behaviour); a positive number:
    a constant in place of the count, per micro-batch (Dr. GRPO)."""
    masked_mean_axis: Literal[1] | None = None
    """1: mean per sequence, then over sequences (original GRPO): the same as
    aggregation=seq-mean-token-mean; null: as `aggregation` says."""
    aggregation: Aggregation | None = None
    """How per-token losses reduce (verl's loss_agg_mode names): `token-mean`, `seq-mean-token-mean`,
    `seq-mean-token-sum`, `seq-mean-token-sum-norm` (token sums over `aggregation_norm`, Dr. GRPO);
    null: token-mean, or seq-mean-token-mean with masked_mean_axis=1. Applies to the policy, value
    and warm-up (SFT) losses alike."""
    aggregation_norm: float | None = Field(None, gt=0)
    """The constant of seq-mean-token-sum-norm; null: rollout.max_new_tokens."""

    @model_validator(mode="after")
    def _denominator(self) -> LossConfig:
        resolved = resolve_denominator(self.masked_mean_denominator, self.masked_mean_axis)
        object.__setattr__(self, "masked_mean_denominator", resolved)
        if self.masked_mean_axis == 1 and self.aggregation not in (None, "seq-mean-token-mean"):
            raise ValueError(
                f"masked_mean_axis: 1 means aggregation seq-mean-token-mean; got "
                f"loss.aggregation={self.aggregation} (set one of the two)"
            )
        if self.aggregation is None:
            aggregation = "seq-mean-token-mean" if self.masked_mean_axis == 1 else "token-mean"
            object.__setattr__(self, "aggregation", aggregation)
        return self


class AlgorithmConfig(Section):
    advantage: Literal["grpo", "dr_grpo", "rloo", "gae", "distill"] = "grpo"
    """Advantage estimator: group-relative (`grpo`, `dr_grpo`, `rloo`: no critic), `gae` (classic
    PPO: per-token advantages from a learned critic, configured in the `critic` section), or
    `distill` (on-policy distillation: each sampled token's advantage is `teacher log-prob -
    student log-prob` under algorithm.teacher, mixed with GRPO's by algorithm.distill_coef)."""
    teacher: str | None = None
    """advantage=distill: the teacher, a local model folder or hub name with the policy's
    tokenizer, scored on its own actors (algorithm.teacher_learners)."""
    teacher_learners: FrozenLearnerConfig = FrozenLearnerConfig()
    """The teacher's actors: count, CPUs/GPUs, micro-batches or token budget, ZeRO stage."""
    distill_coef: float = Field(1.0, ge=0, le=1)
    """advantage=distill: per-token advantage `distill_coef * (teacher - student log-prob) +
    (1 - distill_coef) * GRPO's advantage of the rewards`; 1: distillation alone (the rewards are
    still computed and logged)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """GAE discount per policy token (1: no discount, usual for language models)."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda: 1 is Monte Carlo (unbiased, high variance), 0 is one-step TD."""
    kl_in_reward: float = Field(0.0, ge=0)
    """GAE only: per-token penalty `kl_in_reward * (generator log-prob - reference log-prob)` added
    to the reward (classic RLHF shaping); the reference is the initial policy."""
    group_size: int = Field(4, ge=2)
    """Completions sampled per prompt."""
    prompts_per_step: int = Field(8, ge=1)
    """Prompts per training step (global batch = prompts_per_step * group_size sequences)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more prompts to refill the batch."""
    max_sampling_rounds: int = Field(3, ge=1)
    """With dynamic sampling, generation rounds per step before training on what was found."""
    overlong: Literal["none", "filter", "soft_penalty"] = "none"
    """Truncated completions: keep, exclude from the loss (`filter`), or DAPO's soft length penalty."""
    overlong_buffer: int = Field(16, ge=1)
    """Soft penalty: tokens before max_new_tokens where the penalty ramps from 0 to -overlong_penalty."""
    overlong_penalty: float = Field(1.0, ge=0)
    """Soft penalty at max_new_tokens."""


class SandboxConfig(Section):
    memory_mb: int = Field(512, ge=64)
    """Address-space limit of each process the python tool starts."""
    processes: int = Field(16, ge=1)
    """Processes and threads the code may run at once."""
    file_size_mb: int = Field(16, ge=1)
    """Largest file it may write (its printed output included)."""
    require_isolation: bool = True
    """Refuse to run the python tool where the machine cannot isolate it (no user/network
    namespaces or no Landlock: then no network, no host processes, writes only to its own temporary
    folder); false runs it with the limits alone, still in an empty environment."""


class ToolsConfig(Section):
    enabled: list[Literal["calculator", "python"]] = []
    """Tools the model may call with <tool:NAME>...</tool>; their output is appended and masked out of the loss."""
    max_calls: int = Field(2, ge=0)
    """Tool calls per completion."""
    timeout_s: float = Field(2.0, gt=0)
    """Wall-clock limit of one tool call."""
    max_output_chars: int = Field(200, ge=1)
    """Tool output is cut to this many characters."""
    sandbox: SandboxConfig = SandboxConfig()
    """Containment of the python tool (each call: a fresh process group and temporary folder,
    empty environment, killed as a group on timeout)."""


class EnvConfig(Section):
    name: str | None = None
    """The environment each rollout is an episode of: `builtin:calculator` (the built-in task with
    the calculator as a native tool), `builtin:guess` (a multi-turn number-guessing game), or
    `module:Class` (a subclass of rltrain.envs.Environment); null: one completion per prompt, with
    rollout.tools in the tag format."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments of the environment's constructor."""
    max_turns: int = Field(4, ge=1)
    """Assistant turns per episode (turns that call tools included)."""
    step_timeout_s: float = Field(10.0, gt=0)
    """A reset or step that takes longer is stopped (its episode's process is killed) and ends the
    episode with finish reason `error`; tool calls have rollout.tools.timeout_s."""
    render: Literal["full", "last_turn"] = "full"
    """`full`: what is added after a turn is the chat template's rendering of the whole
    conversation minus the part already there, and a template that changes earlier turns (Qwen3
    drops earlier reasoning) stops the run; `last_turn`: render the added messages after a
    one-message stand-in for the history (works with such templates; the policy then trains on a
    context the template would not build itself)."""


class RolloutConfig(Section):
    backend: Literal["vllm", "hf"] = "vllm"
    """Generator: vLLM engines, or transformers `generate` where vLLM is unavailable."""
    num_engines: int = Field(1, ge=1)
    """Generator actors."""
    cpus_per_engine: float = Field(0.5, gt=0)
    """CPUs Ray reserves for each generator actor."""
    gpus_per_engine: float = Field(0, ge=0)
    """GPUs Ray reserves for each generator actor."""
    max_new_tokens: int = Field(32, ge=1)
    """Completion length limit (tool output included)."""
    max_model_len: int = Field(512, ge=16)
    """vLLM context length."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature (the learner uses it for log-probs too)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling."""
    max_staleness: int = Field(0, ge=0)
    """Generation runs up to this many policy versions ahead of training: the next k steps'
    prompts are generated while the current step trains (off-policy; see loss.rollout_correction).
    Every sampled token carries the version of the weights that sampled it (the training steps
    behind them); a group holding a token more than k versions older than the learners' weights is
    dropped and counted (`rollout/stale_dropped`), never trained on. `async_steps` is the older name."""
    inflight_updates: bool = False
    """New weights reach the engines without waiting for the requests in flight: vLLM takes them
    between two decode steps and keeps its requests (their seeds and KV caches); the transformers
    backend between chunks of `inflight_chunk_tokens`, each request going on from its sampled
    prefix. Each token keeps the log-prob and version it was sampled with (useful with
    max_staleness >= 1; where updates land then depends on timing, so runs are not bit-reproducible)."""
    inflight_chunk_tokens: int = Field(16, ge=1)
    """With inflight_updates and the transformers backend: tokens a request generates between two
    chances to take new weights."""
    kv_cache_gib: float = Field(1.0, gt=0)
    """vLLM CPU KV cache size."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """vLLM GPU memory share."""
    tools: ToolsConfig = ToolsConfig()
    """Tool use during generation."""
    tool_parser: Literal["hermes", "tag"] | None = None
    """How tool calls are written: `hermes` (Qwen2.5/Hermes JSON in <tool_call></tool_call>, results
    as `tool` messages through the chat template) or `tag` (<tool:NAME>ARGUMENT</tool>, results
    inline as <result>...</result>); null: hermes with an environment, tag without. Without an
    environment only `tag` is available."""

    @model_validator(mode="before")
    @classmethod
    def _async_steps_is_max_staleness(cls, raw: Any) -> Any:
        """`rollout.async_steps` is accepted for `rollout.max_staleness`."""
        if isinstance(raw, dict) and "async_steps" in raw:
            raw = dict(raw)
            steps = raw.pop("async_steps")
            if raw.setdefault("max_staleness", steps) != steps:
                raise ValueError(
                    f"async_steps={steps} and max_staleness={raw['max_staleness']} disagree "
                    "(async_steps is the older name of max_staleness; set one)"
                )
        return raw


class DataConfig(Section):
    source: str = BUILTIN_TASK
    """`builtin:arithmetic`, a local .jsonl/.json/.parquet/.arrow file or folder, or a hub dataset name."""
    subset: str | None = None
    """Hub dataset configuration name (e.g. `main` for openai/gsm8k)."""
    split: str = "train"
    """Dataset split."""
    answer_pattern: str | None = None
    """Regex whose first group extracts the reference answer from the answer column
    (e.g. `#### (.+)$` for GSM8K); null keeps the column as it is."""
    prompt_key: str = "prompt"
    """Column with the question."""
    answer_key: str = "answer"
    """Column with the reference answer."""
    system_prompt: str | None = None
    """Optional system message for the chat template."""
    max_prompt_tokens: int = Field(128, ge=1)
    """Prompts longer than this are rejected when loading."""

    @field_validator("answer_pattern")
    @classmethod
    def _regex(cls, value: str | None) -> str | None:
        import re

        if value is not None:
            try:
                if re.compile(value).groups < 1:
                    raise ValueError("needs one (group) around the answer")
            except re.error as e:
                raise ValueError(f"not a valid regex: {e}") from None
        return value


class JudgeConfig(Section):
    """An LLM judge: each completion is put to a model in a prompt, and its greedy verdict is the score."""

    prompt: str = (
        "Question: {question}\nReference answer: {answer}\nStudent answer: {completion}\n"
        "Is the student answer correct? Reply with `Verdict: correct` or `Verdict: incorrect`."
    )
    """The judge's user message; {question}, {answer} (the reference) and {completion} are filled in."""
    pattern: str = r"Verdict:\s*(\w+)"
    """A regular expression over the judge's reply; its first group is the verdict (the last match counts)."""
    values: dict[str, float] = {"correct": 1.0, "incorrect": 0.0}
    """The score of each verdict (case-insensitive); empty: the verdict is a number, the score itself.
    A reply without a verdict, or with one not listed, scores 0 and is counted (`reward/judge_unparsed`)."""
    model: str | None = None
    """The judge model, on engines of its own (rollout's engine settings, never synced); null: the
    generator engines judge with the policy's current weights."""
    max_new_tokens: int = Field(64, ge=1)
    """Tokens of one verdict (greedy)."""
    timeout_s: float = Field(120.0, gt=0)
    """A batch of verdicts that takes longer scores 0 for each and is counted (`reward/judge_timeouts`)."""

    @field_validator("pattern")
    @classmethod
    def _one_group(cls, value: str) -> str:
        import re

        try:
            compiled = re.compile(value)
        except re.error as e:
            raise ValueError(f"not a regular expression ({e})") from None
        if compiled.groups < 1:
            raise ValueError("needs a group, (...), around the verdict")
        return value

    @field_validator("prompt")
    @classmethod
    def _placeholders(cls, value: str) -> str:
        try:
            value.format(question="", answer="", completion="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"takes {{question}}, {{answer}} and {{completion}} only (double other braces): {e!r}"
            ) from None
        return value


class RewardConfig(Section):
    functions: dict[str, float] = Field({"math": 1.0}, min_length=1)
    """Reward functions and their weights: `math` (math-verify), `exact_match`, `format`, `env`
    (the environment's own reward, see env.name), `model` (reward.model's score), `judge`
    (reward.judge's verdict), or a user function `module:function` taking
    (completion, answer) and returning a float. With an environment, the completion is the last
    assistant turn's text."""
    timeout_s: float = Field(5.0, gt=0)
    """A reward call that takes longer scores 0, is counted as a failure, and is stopped (its worker
    process is killed and replaced)."""
    workers: int = Field(2, ge=1)
    """Worker processes that run reward functions."""
    model: str | None = None
    """A reward model: a sequence-classification model folder (or hub name) with one label and the
    policy's tokenizer; it scores each whole sequence (the prompt's chat rendering and the
    completion, as sampled) on its own actors (reward.model_learners), and its score joins
    reward.functions as `model`. A step generated ahead (rollout.max_staleness >= 1) is scored
    while the policy trains on the one before."""
    model_learners: FrozenLearnerConfig = FrozenLearnerConfig()
    """The reward model's actors: count, CPUs/GPUs, micro-batches or token budget, ZeRO stage."""
    judge: JudgeConfig | None = None
    """An LLM judge whose verdict joins reward.functions as `judge`; null: none."""


class SFTWarmupConfig(Section):
    steps: int = Field(0, ge=0)
    """Optimizer steps of supervised warm-up before RL (on the policy learners, token-normalized
    cross-entropy of the completion tokens, tool output masked out); 0 skips it. The warmed-up
    model is kept in the run folder (`sft_model/`), so a resumed or restarted run does not repeat it."""
    source: str = BUILTIN_TASK
    """Examples (also spelled `sft_warmup.data`): `builtin:arithmetic` (questions of the built-in
    task's training prompts, answered directly or through the calculator, see tool_fraction), `env`
    (the environment's `demonstration(row)` conversations on the training rows, in the model's own
    chat format: loss on the assistant turns only), or a local .jsonl file with `prompt` and
    `completion` columns (tool output inside a completion is written `<result>...</result>` and
    masked)."""
    batch_size: int = Field(32, ge=1)
    """Examples per optimizer step."""
    lr: float = Field(3e-3, gt=0)
    """Learning rate of the warm-up (its peak, under a decaying lr_schedule)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Shape of the warm-up's learning rate over its steps (no warm-up of the rate)."""
    tool_fraction: float = Field(0.5, ge=0, le=1)
    """`builtin:arithmetic` only: the share of generated examples that call the calculator."""

    @model_validator(mode="before")
    @classmethod
    def _data_is_source(cls, raw: Any) -> Any:
        """`sft_warmup.data` is accepted for `sft_warmup.source` (and wins over it, as an override)."""
        if isinstance(raw, dict) and "data" in raw:
            raw = {key: value for key, value in raw.items() if key != "data"} | {"source": raw["data"]}
        return raw


class EvalConfig(Section):
    num_prompts: int = Field(64, ge=1)
    """Held-out prompts: never used for training."""
    source: str | None = None
    """Where they come from: a local .jsonl/.json/.parquet/.arrow file with the training data's
    columns; null: generated apart from the training prompts (`builtin:arithmetic`) or the last
    num_prompts rows of the data, which are then left out of training."""


class CriticLearnerConfig(LearnerConfig):
    num_learners: int = Field(1, ge=1)
    """Data-parallel critic learner actors (one DeepSpeed engine each)."""


class CriticConfig(Section):
    model: str | None = None
    """The value model's starting weights: a local model folder or hub name; null: the policy's
    starting weights. A scalar head per token is added (initialized to 0) unless the folder holds
    a critic saved by rltrain."""
    learners: CriticLearnerConfig = CriticLearnerConfig()
    """The critic's own learners: count, CPUs/GPUs, ZeRO stage, micro-batches or token budget,
    optimizer, lr, schedule, clipping (the same keys as `learner`)."""
    value_clip: float | None = Field(0.2, gt=0)
    """Clip range of the value update around the values at rollout time; null: unclipped loss."""
    warmup_steps: int = Field(0, ge=0)
    """Training steps in which only the critic learns (the policy starts moving after them)."""


class RunConfig(Section):
    output_dir: str = "runs/demo"
    """Run folder: resolved config, metrics, TensorBoard logs, checkpoints, plot."""
    steps: int = Field(20, ge=1)
    """Training steps."""
    seed: int = 0
    """Seed for data order, sampling and initialization."""
    save_rollouts_every: int = Field(0, ge=0)
    """Write `rollouts/step_<N>.jsonl` every N steps: one line per sample with its messages, token
    ids, mask, log-probs, rewards per function, finish reason and turns; 0: never."""
    checkpoint_every: int = Field(10, ge=0)
    """Save a resumable checkpoint every N steps (and at the end); 0: only at the end."""
    eval_every: int = Field(0, ge=0)
    """Score the held-out prompts (the `eval` section) every N steps, and at the start and the end
    of the run; 0: never."""
    keep_checkpoints: int | None = Field(None, ge=1)
    """Keep the newest N checkpoints and delete older ones after each save; null keeps all."""
    on_save_error: Literal["stop", "continue"] = "stop"
    """A checkpoint or model export that cannot be written (a full disk, a folder that is not
    writable): `stop` ends the run with one line (exit 1) and the resume command; `continue` says
    so in one line and trains on, trying again at the next save. Either way what the failed save
    wrote is removed and the previous checkpoint stays the latest, loadable."""
    layout_free_checkpoints: bool = True
    """Also write each learner section's whole state without its layout (`layout_free.pt`: every
    parameter's fp32 weights and optimizer moments, the optimizer and schedule steps), so that a
    resume may change learner.num_learners, zero_stage, packing and sequence parallelism. Costs
    three times the model's fp32 size per checkpoint; false: resume needs the layout that saved."""
    max_restarts: int = Field(2, ge=0)
    """When an actor dies or stops answering, tear every actor down, start fresh ones and resume
    from the newest checkpoint, up to this many times per run; past it the run stops with the
    resume command."""
    actor_timeout_s: float = Field(1800.0, gt=0)
    """An actor call of a training step (generate, train, sync, save) that takes longer counts as
    a failure of that actor; the Python stacks of every actor are written to
    `hangs/step_<N>.txt` in the run folder before the restart."""
    check_sync: bool = True
    """After the run's first weight sync, every engine and the learners score the first sequences
    of that step's batch; a gap beyond 10x the engine-learner gap measured before the update (at
    least 1e-4) stops the run with one line naming the engine parameters the sync does not load,
    or saying that none is known to differ."""
    max_mismatch_kl: Annotated[float, Field(gt=0)] | Literal["auto"] | None = "auto"
    """Stop the run (one line, exit 1) when a step's `rollout/mismatch_kl` (the engine's sampling
    log-probs against the learner's on the same tokens) exceeds this: the engine is then evidently
    not running the learner's weights (a weight sync that never arrived, a precision or kernel
    mismatch). In fp32 with no staleness the value is ~1e-12; an engine that kept its weights while
    the demo's learners moved on reached 3e-3 one step later and 1.3e-2 four steps later. Where
    versions mix (in-flight updates) it is measured on the tokens the current weights sampled; with
    `rollout.max_staleness` and no in-flight updates it also holds the policy's change over those
    steps. auto (the default): 1e-2 where it measures the engine alone (no staleness, or in-flight
    updates), off otherwise; null: never stop (the metric is logged anyway)."""
    resume: bool = False
    """Continue from the newest checkpoint in output_dir."""
    stop_after: int | None = Field(None, ge=1)
    """Stop (after checkpointing) once this step is reached, as a preempted job would."""
    wandb_project: str | None = None
    """Also log to Weights & Biases under this project."""
    ray_num_cpus: int | None = Field(None, ge=1)
    """CPUs of the local Ray instance started when no cluster is given (default: all)."""


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
    critic: CriticConfig | None = None
    """A learned value model (PPO with GAE); needs algorithm.advantage=gae."""
    sft_warmup: SFTWarmupConfig = SFTWarmupConfig()
    """Supervised warm start before RL."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation: greedy decoding through the generators, math-verify correctness, tool use."""
    run: RunConfig = RunConfig()

    @model_validator(mode="before")
    @classmethod
    def _eval_every_spelled_in_its_section(cls, raw: Any) -> Any:
        """`eval.every` is accepted for `run.eval_every`."""
        if isinstance(raw, dict) and isinstance(raw.get("eval"), dict) and "every" in raw["eval"]:
            raw = {**raw, "eval": dict(raw["eval"])}
            every = raw["eval"].pop("every")
            run = raw.get("run") or {}
            raw["run"] = {**run, "eval_every": every} if isinstance(run, dict) else run
        return raw

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
                "tokens (data.max_prompt_tokens + rollout.max_new_tokens); raise it or lower those"
            )
        if longest > self.rollout.max_model_len:
            raise ValueError(
                f"data.max_prompt_tokens + rollout.max_new_tokens = {self.data.max_prompt_tokens} + "
                f"{self.rollout.max_new_tokens} = {longest} exceeds rollout.max_model_len={self.rollout.max_model_len}"
            )
        self._check_sequence_parallel()
        self._check_critic()
        self._check_env()
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
            raise ValueError("sft_warmup.source=env: the environment's demonstrations need env.name")
        if "env" in self.reward.functions and self.env.name is None:
            raise ValueError("reward.functions: `env` is the environment's reward; it needs env.name")
        if self.env.name is None and self.rollout.tool_parser == "hermes":
            raise ValueError(
                "rollout.tool_parser=hermes needs an environment (env.name=builtin:calculator gives "
                "the built-in task with native calls); without one, rollout.tools uses the tag format"
            )

    @property
    def tool_parser(self) -> str:
        """The parser in use: ``rollout.tool_parser`` or its default."""
        return self.rollout.tool_parser or ("hermes" if self.env.name else "tag")

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
        return self.data.max_prompt_tokens + self.rollout.max_new_tokens

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
    return validate(raw)


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
    if first["type"] == "extra_forbidden":
        return f"{key}: unknown key (value {first['input']!r}); check the spelling against `rltrain --help-config`"
    if message.startswith(("masked_mean_denominator:", "masked_mean_axis:")):
        return f"{key + '.' if key else ''}{message}"
    if first["type"] == "value_error" and not key:
        return message  # a cross-section check names its keys itself; its input is the whole config
    shown = "" if first["type"] == "missing" else f"got {first['input']!r}; "
    more = f" (+{len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"{key or 'config'}: {shown}{message}{more}"


def dump(config: Config, path: str | os.PathLike) -> None:
    Path(path).write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))


def describe() -> str:
    """Every key with its type, default and docstring, for ``--help-config``."""
    lines = []

    def walk(model: type[BaseModel], prefix: str, defaults: BaseModel | None) -> None:
        for name, field in model.model_fields.items():
            # an optional section (`critic`) is described like a present one
            annotation = next(
                (a for a in get_args(field.annotation) if a is not type(None)), field.annotation
            )
            default = getattr(defaults, name) if defaults is not None else field.default
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                walk(annotation, f"{prefix}{name}.", default if isinstance(default, BaseModel) else None)
                continue
            doc = textwrap.indent((field.description or "").strip(), "    ")
            lines.append(f"{prefix}{name} = {default!r}\n{doc}")

    walk(Config, "", None)
    return "\n".join(lines)
