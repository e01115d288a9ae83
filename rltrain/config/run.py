"""The ``run`` section: outputs, checkpoints, restarts, timeouts and the run's own checks."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from rltrain.config.optimization import Section

AUTO_MISMATCH_KL = 1e-2  # run.max_mismatch_kl: auto


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
    startup_timeout_s: float = Field(600.0, gt=0)
    """How long the run waits for Ray to place a group of actors (its bundles of CPUs and GPUs);
    past it the run stops with one line naming what was asked and what the cluster has (resources
    another job holds, or bundles no node can hold though the total would)."""
    actor_timeout_s: float = Field(1800.0, gt=0)
    """An actor call of a training step (generate, train, sync, save) that takes longer counts as
    a failure of that actor; the Python stacks of every actor are written to
    `hangs/step_<N>.txt` in the run folder before the restart."""
    check_collectives: bool = False
    """Learners check before each collective that their group's ranks all issue the same one
    (torch's `TORCH_DISTRIBUTED_DEBUG=DETAIL`): diverging ranks fail at once naming each rank's op,
    and a rank missing from one within half of `run.actor_timeout_s` is named. For tests and hangs."""
    max_user_failure_steps: int | None = Field(1, ge=1)
    """Stop the run (one line naming the function, exit 1) once every call of a reward function,
    or of an environment's reset or step, has failed for this many steps in a row; each kind's
    first traceback is printed once and kept in `errors/` in the run folder either way. null: never
    stop for it (failures score 0 and are counted in `failures/<kind>`)."""
    check_sync: bool = True
    """The engines against the learners, twice. At start-up, before any work (the warm start
    included): every engine holds every tensor the sync sends (parameters and persistent buffers)
    and its log-probs of a few fixed sequences are the learners' on the same weights (within
    `max_first_step_gap` in fp32, `max_mismatch_kl` otherwise); a gap stops the run in one line
    naming it and the engine (exit 2). After the run's first weight sync of an update, every engine
    and the learners score the first sequences of that step's batch; a gap beyond 10x the
    engine-learner gap measured before the update (at least 1e-4) stops the run with one line
    naming the engine parameters the sync does not load, or saying that none is known to differ."""
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
    max_first_step_gap: float | None = Field(1e-3, gt=0)
    """Stop the run (one line, exit 1) when, at its first step, the engine's log-probs of the tokens
    it sampled differ from the learners' by more than this (`rollout/mismatch_max`) where both
    compute in fp32 (CPU engines and learners) on the same weights: the learners then do not run the
    model exactly in their layout. Exact families read under 1e-5 on tiny models and up to 1.4e-4 on
    a 30-layer 135M model; a layout that gets a family wrong reads 7e-3 (Bloom's ALiBi in packed
    rows). Not checked for a mixture of experts (a near-tie routes apart); null: never."""
    resume: bool = False
    """Continue from the newest checkpoint in output_dir."""
    stop_after: int | None = Field(None, ge=1)
    """Stop (after checkpointing) once this step is reached, as a preempted job would."""
    wandb_project: str | None = None
    """Also log every metric to Weights & Biases under this project, as TensorBoard gets them
    (`pip install 'rltrain[wandb]'`; WANDB_MODE=offline writes the run's files under
    output_dir/wandb without an account, for `wandb sync` later)."""
    trackio_project: str | None = None
    """Also log every metric to trackio under this project, as TensorBoard gets them
    (`pip install 'rltrain[trackio]'`; local-first: a SQLite file in $TRACKIO_DIR, by default
    output_dir/trackio; `TRACKIO_DIR=<output_dir>/trackio trackio show` opens its dashboard)."""
    ray_num_cpus: int | None = Field(None, ge=1)
    """CPUs of the local Ray instance started when no cluster is given (default: all)."""
