"""The config sections of generation and data: rollout (tools, sandbox), environment, data,
reward, judge, warm start, evaluation."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rltrain.config.optimization import BUILTIN_TASK, FrozenLearnerConfig, Section


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
    """The environment each rollout is an episode of: a built-in (`builtin:calculator`, the built-in
    task with the calculator as a native tool; `builtin:chain`, arithmetic over turns;
    `builtin:guess`, a number-guessing game; `builtin:shapes`, a picture's colour for a
    vision-language model, its pictures in the environment's turns and a tool's result), `module:Class` or `path/to/file.py:Class` (a subclass
    of rltrain.envs.Environment), `verifiers:<taskset id>` (a verifiers taskset: a module exporting
    a vf.Taskset subclass, its tasks the run's rows, each episode run through the gateway with a
    harness in the generator's process; pip install 'rltrain[verifiers]'); null: one completion
    per prompt, with rollout.tools in the tag format."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments of the environment's constructor (a verifiers taskset's settings)."""
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


class AgentConfig(Section):
    entrypoint: str | None = None
    """A black-box agent each rollout is an episode of: `module:function` or `path/to/file.py:function`
    naming `async def run(row: dict, base_url: str, api_key: str, model: str) -> float`, the user's
    agent (any OpenAI-compatible client) pointed at the gateway beside each generator; it returns
    the episode's reward (`agent` in reward.functions). Its calls are recorded token-in/token-out
    (rltrain.episodes.gateway)."""
    max_calls: int = Field(32, ge=1)
    """Chat completions per episode; later calls are refused (HTTP 429) and counted."""
    timeout_s: float = Field(300.0, gt=0)
    """An agent still running after this long is cancelled: its episode ends with finish reason
    `error` and is counted; the run goes on."""
    concurrency: int = Field(64, ge=1)
    """Episodes in flight per generator (their requests share each engine call)."""
    max_prompt_tokens: int | None = Field(None, ge=1)
    """The most tokens a training sequence's opening prompt may take: the agent's first call, or a
    call that starts a new sequence (its history rewritten); unset: data.max_prompt_tokens. A call
    over it, or one whose new messages no longer fit the episode's budget (rollout.max_new_tokens,
    rollout.max_model_len), is answered as the OpenAI API answers a reply cut by its limit: empty,
    with finish_reason `length` (counted as rollout/gateway_length), never an error the agent must
    catch."""


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
    """Nucleus sampling: the least likely tokens whose probabilities sum to at most 1 - top_p are
    never sampled. The learner's log-probs are those of the same truncated, renormalized
    distribution (as are the engine's), so ratios carry no bias from it."""
    top_k: int = Field(0, ge=0)
    """Sample among the top_k most likely tokens only (0: all); the learner's log-probs follow."""
    min_p: float = Field(0.0, ge=0, lt=1)
    """Drop tokens less likely than min_p x the most likely one (0: off); applied before top_k and
    top_p, as vLLM does; the learner's log-probs follow."""

    max_staleness: int = Field(0, ge=0)
    """Generation runs up to this many policy versions ahead of training: the next k steps'
    prompts are generated while the current step trains (off-policy; see loss.rollout_correction).
    Every sampled token carries the version of the weights that sampled it (the training steps
    behind them); a group holding a token more than k versions older than the learners' weights is
    dropped and counted (`rollout/stale_dropped`), never trained on."""
    inflight_updates: bool = False
    """New weights reach the engines without waiting for the requests in flight: vLLM takes them
    between two decode steps and keeps its requests (their seeds and KV caches); the transformers
    backend (and vLLM serving LoRA adapters, which it binds to a request when it starts) between
    chunks of `inflight_chunk_tokens`, each request going on from its sampled prefix. Each token keeps the log-prob and version it was sampled with (useful with
    max_staleness >= 1; where updates land then depends on timing, so runs are not bit-reproducible)."""
    routing_replay: bool = False
    """A mixture of experts: each engine records the experts its routers chose for every prompt and
    sampled token (per MoE layer, int16), they travel with the rollout, and every learner forward
    (log-probs, reference, update) sends each token to those experts: the router's logits and
    softmax are still computed and trained, only its top-k selection is replaced. Logged:
    `moe/routing_mismatch`, the share of (token, layer) pairs whose experts the learner's own router
    would have chosen otherwise. vLLM's prefix cache is off (every position's routes are recorded
    where it is computed). Single-turn generation and the tool loop; not with env or agent."""
    inflight_chunk_tokens: int = Field(16, ge=1)
    """With inflight_updates, the transformers backend or LoRA adapters: tokens a request generates between two
    chances to take new weights."""
    weight_sync: Literal["collective", "object_store"] = "collective"
    """How new weights reach the engines after an update. `collective`: learner rank 0 and every
    engine join one process group at start-up (NCCL where each holds a GPU of its own, else gloo
    through host memory) and rank 0 broadcasts the weights in buckets, gathered bucket by bucket
    under ZeRO-3. `object_store`: rank 0 puts the whole state dict in Ray's object store and each
    engine fetches it. Where the group cannot be formed the run says so in one line at start-up and
    uses the object store."""
    weight_sync_bucket_mb: float = Field(64.0, gt=0)
    """collective: the bytes gathered, copied and broadcast at once (a tensor larger than this goes
    alone); bounds the memory the sync takes on the learner."""
    weight_sync_shared_memory: bool = True
    """collective over gloo, where learner rank 0 and every engine run on one node: the buckets go
    through two bucket-sized slots of shared memory (/dev/shm) and the group carries only the
    signals that a bucket is written and read; false: every bucket through the group (TCP)."""
    weight_sync_timeout_s: float = Field(300.0, gt=0)
    """collective: forming the group, and one sync's broadcast, fail after this long; a generator
    that is gone or stuck is named and the run restarts from its newest checkpoint."""
    kv_cache_gib: float = Field(1.0, gt=0)
    """vLLM CPU KV cache size."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """vLLM GPU memory share."""
    tools: ToolsConfig = ToolsConfig()
    """Tool use during generation."""
    tool_parser: str | None = None
    """How tool calls are written: `hermes` (Qwen2.5/Hermes JSON in <tool_call></tool_call>, results
    as `tool` messages through the chat template), `tag` (<tool:NAME>ARGUMENT</tool>, results
    inline as <result>...</result>), or the name of one of vLLM's tool parsers (`llama3_json` for
    Llama 3.x, `mistral`, `qwen3_xml`, `deepseek_v3`, ...; results as `tool` messages); null:
    hermes with an environment, tag without. Without an environment only `tag` is available."""


class DifficultySampling(Section):
    """Prompts drawn by their observed difficulty (prime-rl's difficulty pools): each prompt's
    latest group mean reward puts it in the hard, normal or easy pool (unseen prompts are normal),
    and each draw picks a pool by these weights, then that pool's next prompt of the epoch's order.
    A weight of 0 sets its pool aside for the epoch. Where no pool of positive weight holds a prompt
    at all (every prompt easy with easy_weight 0, say), draws take the epoch's next prompt of any
    pool: said once, counted as data/pool_fallback_draws."""

    hard_at: float = 0.25
    """A prompt whose latest group mean reward is at most this is hard."""
    easy_at: float = 1.0
    """A prompt whose latest group mean reward is at least this is easy."""
    hard_weight: float = Field(0.2, ge=0)
    """How often a draw takes a hard prompt, against the other pools' weights."""
    normal_weight: float = Field(1.0, gt=0)
    """The normal pool's weight (unseen prompts are normal: it must be drawn)."""
    easy_weight: float = Field(0.2, ge=0)
    """The easy pool's weight; 0: prompts the policy always solves are not drawn again this epoch."""

    @model_validator(mode="after")
    def _ordered(self) -> DifficultySampling:
        if self.easy_at <= self.hard_at:
            raise ValueError(f"easy_at={self.easy_at} must be above hard_at={self.hard_at}")
        return self


class DataConfig(Section):
    source: str = BUILTIN_TASK
    """A built-in (`builtin:arithmetic`; `builtin:guess` and `builtin:chain`, the rows of those
    environments' episodes), `reasoning_gym:<name>` (one of reasoning-gym's procedural datasets,
    generated with data.size, data.seed and data.task_config; score with the `reasoning_gym`
    reward), a local .jsonl/.json/.parquet/.arrow file or folder, or a hub dataset name."""
    size: int = Field(2000, ge=1)
    """`reasoning_gym:<name>`: the rows generated for training."""
    seed: int = 0
    """`reasoning_gym:<name>`: the dataset's seed (held-out rows come from another, and none of
    them is a training question)."""
    task_config: dict[str, Any] = {}
    """`builtin:arithmetic`: `{digits: [1, 3]}` draws each question's two operands with one of these
    many digits (questions of plainly different difficulty; held-out questions are never training
    questions, so a length whose every question is drawn for training, such as 1, is not held out);
    `reasoning_gym:<name>`: the dataset's own settings (its config's keys, e.g. `{min_terms: 2,
    max_terms: 3}` for chain_sum); `reasoning_gym:composite` lists its datasets here as
    `{datasets: [{name: chain_sum, weight: 2, config: {...}}, {name: gcd}]}`."""
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
    image_column: str | None = None
    """Column with each row's images (a vision-language model): one or a list of file paths
    (relative to the data's folder), data URLs or base64 text, bytes, or a datasets Image column;
    null: text only. Every image is read and checked when the data loads: a missing file, bytes no
    decoder reads or one over data.max_image_pixels stops the run in one line naming the row."""
    max_image_pixels: int = Field(16_777_216, ge=1)
    """An image with more pixels (width x height) than this is refused (docs/vision.md)."""
    difficulty_sampling: DifficultySampling | None = None
    """Draw prompts by their observed difficulty (`{}` for the defaults: hard at or below a group
    mean reward of 0.25, weight 0.2; easy at 1.0, weight 0.2; normal weight 1); null: shuffled
    passes over every prompt. Held in the checkpoint; logged as data/pool_easy, data/pool_hard,
    data/pool_normal (prompts in each pool) and data/pool_fallback_draws (draws no pool of positive
    weight could serve)."""
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
    """Reward functions and their weights, `{name: weight, ...}` (a space after each colon):
    built-ins (`math`: math-verify, `exact_match`, `format`, `digits`, `reasoning_gym`: a
    reasoning_gym:<name> source's own scorer), `env` (the environment's
    own reward, see env.name), `model` (reward.model's score), `judge` (reward.judge's verdict), or
    a user function `module:function` (importable where rltrain runs) or `path/to/file.py:function`.
    A user function takes (completion, answer) and returns a float, or takes TRL's batch form
    (prompts, completions, **kwargs), told apart by a parameter named `completions`, and returns a
    list of floats (the data's other columns come as keyword lists). None (or NaN) is TRL's "does
    not apply to this sample": a sample's reward is the weighted sum of the functions that apply,
    and it fails (reward.on_failure) only where none applies. With an environment, the completion
    is the last assistant turn's text."""
    timeout_s: float = Field(5.0, gt=0)
    """A reward call that takes longer fails (reward.on_failure says what becomes of its sample), is
    counted, and is stopped (its worker process is killed and replaced)."""
    workers: int = Field(2, ge=1)
    """Worker processes that run reward functions."""
    on_failure: Literal["drop", "zero"] = "drop"
    """A sample whose reward could not be computed (a reward function raised, timed out or
    returned no number; no function applied (each returned None or NaN); a reward model or judge
    gave none) or whose episode failed
    outside the policy (its environment, tool host, agent or chat template failed): `drop` keeps it
    out of the loss (no token counted; its group's advantages come from the samples that remain, and
    a group left with fewer than two goes whole); `zero` trains on it with reward 0, as if the policy
    had earned it. Failures the policy causes itself (a malformed tool call, an overlong answer, a
    wrong one) are scored as they are either way."""
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
    chat format: loss on the assistant turns only), a local .jsonl of conversations in OpenAI's
    chat fine-tuning format (`messages`, optional `tools`: rendered as episodes and gateway calls
    are, loss on the assistant turns; an agent's logged conversations, or
    examples/chain_demonstrations.py), or a local .jsonl file with `prompt` and `completion` columns
    (tool output inside a completion is written `<result>...</result>` and masked)."""
    batch_size: int = Field(32, ge=1)
    """Examples per optimizer step."""
    lr: float = Field(3e-3, gt=0)
    """Learning rate of the warm-up (its peak, under a decaying lr_schedule)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Shape of the warm-up's learning rate over its steps (no warm-up of the rate)."""
    tool_fraction: float = Field(0.5, ge=0, le=1)
    """`builtin:arithmetic` only: the share of generated examples that call the calculator."""
    copy_fraction: float = Field(0.0, ge=0, le=1)
    """`builtin:arithmetic` only: the share of generated examples that are given the calculator call's
    opening tag (untrained, as if the prompt) and train the rest of the call and the answer copied
    from its result: practice at copying the question into the call and the result into the answer
    that leaves the first token's choice between calling and answering alone (tool_fraction applies
    to the other examples)."""
    lora: bool = True
    """With model.lora.rank: the warm start trains the adapters (true; RL then starts from their
    merged result with fresh adapters) or every weight (false: the full fine-tuning warm start, as
    when a model is made from scratch, such as the demo's)."""


class EvalConfig(Section):
    num_prompts: int = Field(64, ge=1)
    """Held-out prompts: never used for training."""
    reward_functions: dict[str, float] | None = None
    """What held-out completions are scored by, as reward.functions (weights included): logged per
    function (`eval/reward/<name>`) and weighted (`eval/reward`), and `eval/accuracy` where a
    correctness function (`math`, `exact_match`, `reasoning_gym`) is among them: the share of
    completions it gives full credit (partial credit counts in its eval/reward/<name>). null: the run's own
    reward.functions, those computed by code always, a reward model's and a judge's (they cost a
    model's forward per completion) only with eval.model_rewards."""
    model_rewards: bool = False
    """Score held-out completions by the run's reward model and judge too (with eval.reward_functions
    null); a `rltrain eval` has no reward model or judge actors, and leaves them out."""
    source: str | None = None
    """Where they come from: a local .jsonl/.json/.parquet/.arrow file with the training data's
    columns; null: generated apart from the training prompts (`builtin:arithmetic`) or the last
    num_prompts rows of the data, which are then left out of training."""
