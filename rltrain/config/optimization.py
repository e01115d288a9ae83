"""The config sections of the model and its training: model, learners, loss, algorithm, critic;
the constants and checks they share (:class:`Section`, :class:`ConfigError`)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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
TINY_MOE_MODEL = "builtin:tiny-moe"  # the same, its MLPs a mixture of experts
# the built-in models, each built locally on the built-in tokenizer: name -> the family it is made of
BUILTIN_MODELS = {TINY_MODEL: "qwen2", TINY_MOE_MODEL: "qwen3_moe", "builtin:tiny-gpt-oss": "gpt_oss",
                  "builtin:tiny-gemma3": "gemma3_text", "builtin:tiny-qwen3.5": "qwen3_5_text",
                  "builtin:tiny-vl": "qwen2_5_vl"}  # fmt: skip
BUILTIN_TASK = "builtin:arithmetic"
SFT_FROM_ENV = "env"  # sft_warmup.source: the environment's demonstrations
VERIFIERS = "verifiers:"  # env.name: a verifiers taskset (rltrain.episodes.verifiers_env)


class ConfigError(ValueError):
    """A one-line, user-facing config problem."""


def first_line(error: Exception) -> str:
    """An exception as one line, as the one-line errors show it: its type and its message's first line."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


class Section(BaseModel):
    # no NaN or infinity anywhere: a learning rate, weight or limit that is not finite cannot train
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True, allow_inf_nan=False
    )


class LoraConfig(Section):
    rank: int = Field(0, ge=0)
    """LoRA rank on the policy's learners (0: off, every weight is trained). With a rank, only the
    adapters get gradients and optimizer state, the reference is the same model with its adapters
    off, and engines take each policy version as an adapter (never merged into their base)."""
    alpha: float = Field(16.0, gt=0)
    """LoRA scale numerator: an adapter adds alpha / rank x B @ A to its weight."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training (engines sample without it)."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
    )
    """The modules that get adapters (by name): the attention and MLP projections."""


class ModelConfig(Section):
    name_or_path: str = TINY_MODEL
    """A local model directory, a Hugging Face hub name, a local llama.cpp `.gguf` file (dequantized
    to a Hugging Face folder once, in ~/.cache/rltrain/gguf), `builtin:tiny` (a ~100k-parameter
    Qwen2 model and byte-level tokenizer built locally, no download), `builtin:tiny-moe` (a tiny
    Qwen3-MoE on the same tokenizer: 8 experts, top-2), `builtin:tiny-gpt-oss` (gpt-oss: a sliding
    window of 8 tokens, attention sinks, 4 experts), `builtin:tiny-gemma3` (Gemma 3: sliding and
    full layers, a window of 8, the logit soft-cap), `builtin:tiny-qwen3.5` (Qwen3.5's hybrid: a
    Gated DeltaNet layer beside a full-attention one; generated with rollout.backend=hf) or
    `builtin:tiny-vl` (Qwen2.5-VL: a vision tower of one block, its processor; data.image_column)."""
    trust_remote_code: bool = False
    """Passed to transformers when loading the model and tokenizer."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    lora: LoraConfig = LoraConfig()
    """LoRA adapters instead of full fine-tuning (rank 0: off)."""
    freeze_vision: bool = True
    """A vision-language model's vision tower (and its merger into the language model) keeps its
    weights: no gradients, no optimizer state, and weight syncs leave it out (the engines hold it
    from the start). False trains it with the rest."""

    @field_validator("name_or_path")
    @classmethod
    def _local_path_exists(cls, value: str) -> str:
        looks_local = value.startswith(("/", "./", "../", "~")) or os.sep * 2 in value
        if value.lower().endswith(".gguf"):
            if not Path(value).expanduser().is_file():
                raise ValueError(f"{value!r} is not a file (a .gguf checkpoint must be a local file)")
        elif looks_local and not Path(value).expanduser().is_dir():
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
    prefix_sharing: Literal["auto"] | bool = "auto"
    """Compute a group's shared prompt once: each micro-batch runs as one prefix-tree row (the
    shared prefix once, then each member's completion, positions continuing from the prompt's
    end), in every forward that reads it. `auto`: where it saves at least 10% of the micro-batch's
    tokens against one packed row, with the run's first shared micro-batch checked once against
    the unshared forward (a difference beyond rounding turns it off, in one logged line);
    true/false force it on or off. Not with sequence parallelism."""
    num_mini_batches: int = Field(1, ge=1)
    """Optimizer steps per training step: the global batch is cut into this many accumulation groups."""
    skip_zero_gradient: bool = True
    """Sequences whose gradient is exactly zero are counted, not run: every loss token's advantage 0
    (a group whose rewards are all equal, a reward at its group's mean) and nothing else in the loss
    that moves weights at zero advantage (no KL to a reference, load-balancing loss, critic's or
    teacher's per-token advantages, rejecting rollout correction; the step's denominator over the
    whole step: token mode). Their loss tokens and sequences still count in every denominator of
    the step, so the update is the one without the skip; `perf/skipped_sequences` logs the share.
    The policy learners only."""
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
    prefix_sharing: Literal["auto"] | bool = "auto"
    """Compute a group's shared prompt once (a prefix-tree forward), as `learner.prefix_sharing`:
    `auto` where it saves at least 10% of the micro-batch's tokens; true/false force it."""
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
    kind: Literal["ppo", "cispo", "gspo", "dppo"] = "ppo"
    """Per-token policy loss: PPO/DAPO clipped surrogate, CISPO, GSPO, or DPPO (a divergence mask
    in place of the ratio clip: loss.dppo_*; the clip keys do not apply)."""
    dppo_divergence: Literal["tv", "kl"] = "tv"
    """DPPO's divergence estimate per token: `tv` (Binary-TV, |p - p_anchor|) or `kl` (Binary-KL,
    KL(Bern(p_anchor) || Bern(p)))."""
    dppo_delta_low: float | None = Field(None, gt=0)
    """DPPO: a token with a negative advantage leaves the gradient once the policy moved it down by
    more than this; null: 0.15 for tv, 0.05 for kl (the paper's; prime-rl, SkyRL and verl's
    generic config use 0.2)."""
    dppo_delta_high: float | None = Field(None, gt=0)
    """DPPO: the same bound for tokens with a positive advantage moved up; null: as dppo_delta_low."""
    dppo_anchor: Literal["rollout", "old"] = "rollout"
    """DPPO's anchor policy: `rollout`, the engine's sampling log-probs (the paper's, Stable-RL,
    prime-rl, SkyRL; the ratio is then the whole importance weight, and loss.rollout_correction's
    weights are not applied again, its rejections are), or `old`, the learner's recomputed old
    policy (verl; loss.rollout_correction then corrects for the engine, as verl's
    rollout_is_weights)."""
    dppo_ratio_cap: float | None = Field(None, gt=0)
    """DPPO: a ratio above this weighs its token's gradient by the cap (truncated importance
    sampling; verl's clip_ratio_c, 3 by default there); null: no cap (prime-rl, SkyRL)."""
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
    rollout_correction: RolloutCorrectionConfig | None = RolloutCorrectionConfig()
    """Correction of the engine's sampling against the learner's old policy: truncated weights
    (the default: token-level, capped at 2), masked importance sampling (IcePop) or a geometric
    sequence mask, per token or per sequence; null: none."""
    masked_mean_denominator: Denominator = "token"
    """`token`: divide by the count of the whole optimizer step (all micro-batches, all ranks; loss
    tokens for token-mean, sequences for the per-sequence aggregations), exact under any layout;
    null: this micro-batch's own count (the common, layout-dependent behaviour); a positive number:
    a constant in place of the count, per micro-batch (Dr. GRPO)."""
    aggregation: Aggregation = "token-mean"
    """How per-token losses reduce (verl's loss_agg_mode names): `token-mean`, `seq-mean-token-mean`
    (each sequence's mean, then over sequences: original GRPO), `seq-mean-token-sum`,
    `seq-mean-token-sum-norm` (token sums over `aggregation_norm`, Dr. GRPO). Applies to the
    policy, value and warm-up (SFT) losses alike."""
    aggregation_norm: float | None = Field(None, gt=0)
    """The constant of seq-mean-token-sum-norm; null: rollout.max_new_tokens."""
    moe_aux_coef: float | None = Field(None, ge=0)
    """Weight of a mixture of experts' load-balancing loss (Switch Transformer's, as transformers
    computes it, from what each router returns: docs/moe.md); null: the model config's
    `router_aux_loss_coef` where its transformers code adds the loss, 0 for a family that balances
    otherwise (DeepSeek-V3's score-correction bias); 0: off. A dense model, or one whose routers no
    kind of output rltrain reads, refuses a positive value at start-up in one line."""
    moe_aux_scope: Literal["step", "micro_batch"] = "step"
    """`step`: the loss of each optimizer step is transformers' `load_balancing_loss_func` over all
    of the step's tokens (every micro-batch on every rank), whatever the layout (the assignment
    counts come from a no-grad forward before the step, summed in the token totals' collective);
    `micro_batch`: transformers' own per-forward loss, averaged like a per-micro-batch mean (the
    layout-dependent control)."""

    @field_validator("masked_mean_denominator", mode="before")
    @classmethod
    def _denominator_value(cls, value: object) -> Denominator:
        """ "token", a positive number (a numeric string too, as YAML or an override may give it), or
        null; anything else is one line naming the key and the accepted forms."""
        return resolve_denominator(value)


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
