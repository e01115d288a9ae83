"""Resuming end to end: a run's folder as a stop after step 2's checkpoint leaves it resumes to the
uninterrupted run's weights and metric rows, on its own layout and others (elastic); Ctrl-C during a
step, during a save and twice saves a checkpoint that resumes, every step's row once."""

import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_e2e import (
    HF,
    REFILLING,
    REPO,
    SMALL,
    TESTS_ON_PATH,
    assert_same_rows,
    final_weights,
    logged_rows,
    run_trainer,
)
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

pytestmark = pytest.mark.slow

# "grpo" resumes through vLLM, the other generates with the in-process engine (HF)
RESUME_LAYOUTS = {
    # (the in-process engine: a resumed run's vLLM engine is the PPO config's and LoRA's resume)
    "grpo": [HF],
    # dynamic sampling refilling the batch (with a step generated ahead it resumes in
    # tests/test_faults.py: the killed actors' restarts), on two learners that share every packed
    # row (data-parallel size 1), with a per-sequence mean normalized over the step's sequences
    # (each split sequence counted once)
    "dynamic sampling, sequence parallel": [
        *REFILLING,
        "learner.sequence_parallel_size=2",
        "loss.aggregation=seq-mean-token-mean",
        HF,
    ],
}
# where each resumes: "grpo" (written by 2 learners with ZeRO-2) on 1 learner with ZeRO-3, from the
# layout-free state (elastic); the other on its own layout, from DeepSpeed's state, as the PPO run,
# the Ctrl-C runs below and the restarts in tests/test_faults.py do (DeepSpeed's state on a
# sequence-parallel ZeRO-1 layout also resumes in tests/test_learner.py's checkpoint round trip)
RESUMED_ON = {
    "grpo": ["learner.num_learners=1", "learner.zero_stage=3"],
    "dynamic sampling, sequence parallel": [],
}


@pytest.mark.parametrize("layout", RESUME_LAYOUTS)
def test_resume_gives_the_same_weights_as_an_uninterrupted_run(tmp_path, layout, ray_cluster):
    env = {**TESTS_ON_PATH, **ray_cluster}
    common = ["run.steps=3", *RESUME_LAYOUTS[layout]]
    run_trainer(tmp_path / "straight", *common, "run.checkpoint_every=2", env=env)
    stopped_after_step_2(tmp_path / "straight", tmp_path / "resumed")
    run_trainer(tmp_path / "resumed", *common, "run.resume=true", *RESUMED_ON[layout], env=env)
    straight, resumed = final_weights(tmp_path / "straight"), final_weights(tmp_path / "resumed")
    elastic = bool(RESUMED_ON[layout])
    worst = max((resumed[name] - straight[name]).abs().max().item() for name in straight)
    assert worst < (1e-5 if elastic else 1e-6), worst
    rows = {run: logged_rows(tmp_path / run) for run in ("straight", "resumed")}
    assert [r["step"] for r in rows["resumed"]] == [1, 2, 3]  # step 3's first row replaced, not kept
    # the step after the checkpoint: every row but, on another layout, how each rank cut its share
    assert_same_rows(rows["resumed"][2:], rows["straight"][2:], ("train/micro_batches",) if elastic else ())
    if "dynamic" in layout:  # the batch was refilled (the case a sampler position alone gets wrong)
        assert max(r["rollout/sampling_rounds"] for r in rows["straight"]) > 1


def stopped_after_step_2(run: Path, copy: Path) -> None:
    """``copy``: the folder of ``run`` as a run stopped (killed, preempted) after step 2's
    checkpoint and the later steps' metrics left it: no later checkpoint, no exported model."""
    shutil.copytree(run, copy)
    as_stopped_after_step_2(copy)


def as_stopped_after_step_2(run: Path) -> None:
    """:func:`stopped_after_step_2` in the run's own folder."""
    (run / "checkpoints" / "latest").write_text("step_2")
    later = [p for p in (run / "checkpoints").glob("step_*") if int(p.name.removeprefix("step_")) > 2]
    for part in [*later, run / "final_model", run / "final_critic"]:
        shutil.rmtree(part, ignore_errors=True)


def test_the_ppo_config_waits_for_its_critic_exports_both_models_and_resumes_as_an_uninterrupted_run(
    tmp_path, ray_cluster
):
    # configs/cpu_ppo.yaml (vLLM; a critic with its own learner, checkpointed and restored beside the
    # policy) with a short warm start and 4 steps, its value loss and policy loss in Dr. GRPO's
    # per-sequence sum over a constant (that it learns the task is measured by
    # benchmarks/bench_demo.py; that the critic learns values by tests/test_critic.py)
    ppo = ["sft_warmup.steps=100", "run.steps=4", "run.eval_every=0", "run.ray_num_cpus=2",
           "loss.aggregation=seq-mean-token-sum-norm", "loss.aggregation_norm=16"]  # fmt: skip

    def run_ppo(out: Path, *overrides: str) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [sys.executable, "-m", "rltrain.train", "--config", "configs/cpu_ppo.yaml", f"run.output_dir={out}",
             *ppo, *overrides],
            cwd=REPO, capture_output=True, text=True, timeout=900, env={**os.environ, **ray_cluster},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    out = tmp_path / "run"
    run_ppo(out, "run.checkpoint_every=2")
    rows = logged_rows(out)
    assert "train/pg_loss" not in rows[2] and "train/pg_loss" in rows[3]  # the policy waits 3 steps
    assert all(math.isfinite(r["critic/value_loss"]) and r["critic/tokens"] > 0 for r in rows)
    # what benchmarks/critic_variance.py reads: the critic at the question, and every step's rollouts
    assert all("critic/question_explained_variance" in r for r in rows)
    assert sorted(p.name for p in (out / "rollouts").iterdir()) == [f"step_{s}.jsonl" for s in range(1, 5)]
    models = (("final_model", AutoModelForCausalLM), ("final_critic", AutoModelForTokenClassification))
    want = {folder: auto.from_pretrained(out / folder).state_dict() for folder, auto in models}

    # the same folder as a stop after step 2's checkpoint leaves it, resumed: the same policy, critic
    # and rows (the resumed step 3 still waits for the critic), and the warmed-up model reused
    as_stopped_after_step_2(out)
    done = run_ppo(out, "run.resume=true")
    assert "sft warm-up" not in done.stdout + done.stderr
    for folder, auto in models:
        got = auto.from_pretrained(out / folder).state_dict()
        for name in want[folder]:
            torch.testing.assert_close(got[name], want[folder][name], rtol=0, atol=1e-6)
    resumed = logged_rows(out)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert_same_rows(resumed[2:], rows[2:])


# when the Ctrl-C comes: during a step (after the first row: step 2 generating or training), while
# a checkpoint is written (every step saves one), and twice (the second while the save runs). A
# save to interrupt holds until the test has pressed (tests/fault_hooks: RLTRAIN_TEST_HOLD_SAVE),
# so "while a checkpoint is written" is an event, not a race with how long a save takes
CTRL_C = {
    "during a step": ("run.checkpoint_every=0", lambda out, hold: len(logged_rows(out)) >= 1, 1),
    "while a checkpoint is written": (
        "run.checkpoint_every=1",
        lambda out, hold: any(hold.glob("saving_*")),
        1,
    ),
    "twice": ("run.checkpoint_every=0", lambda out, hold: len(logged_rows(out)) >= 2, 2),
}
HOOKS = str(Path(__file__).resolve().parent / "fault_hooks")


@pytest.mark.parametrize("when", CTRL_C)
def test_ctrl_c_saves_a_checkpoint_and_stops_whenever_it_comes(when, tmp_path, ray_cluster):
    out, hold = tmp_path / "run", tmp_path / "hold"
    hold.mkdir()
    every, ready, presses = CTRL_C[when]
    cmd = [sys.executable, "-m", "rltrain.train", "--config", "configs/cpu_demo.yaml", *SMALL, HF,
           "run.steps=200", every, f"run.output_dir={out}"]  # fmt: skip
    holding = {"RLTRAIN_TEST_HOLD_SAVE": str(hold), "PYTHONPATH": HOOKS} if when != "during a step" else {}
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **ray_cluster, **holding})  # fmt: skip
    deadline = time.monotonic() + 300
    while not ((out / "metrics.jsonl").exists() and ready(out, hold)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    if presses == 2:  # the second press once the checkpoint the first asked for is being written
        while not any(hold.glob("saving_*")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
    (hold / "release").write_text("")  # the held save completes
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 130, output[-3000:]
    tag = (out / "checkpoints" / "latest").read_text()
    saved_step = int(tag.removeprefix("step_"))
    assert saved_step >= 1 and output.rstrip().endswith(
        f"rltrain: interrupted; the newest checkpoint is {tag}; resume with: python -m rltrain.train "
        f"--config {out / 'config.yaml'} run.resume=true"
    ), output[-2000:]
    assert "Traceback" not in output
    AutoModelForCausalLM.from_pretrained(out / "checkpoints" / tag / "hf")  # complete, loadable
    if when != "during a step":
        return
    run_trainer(
        out, HF, f"run.steps={saved_step + 1}", "run.checkpoint_every=0", "run.resume=true", env=ray_cluster
    )
    # every step's row exactly once: a Ctrl-C after a step's update was issued lets that step log
    # its row before the checkpoint that holds it (it was missing after the resume)
    assert [row["step"] for row in logged_rows(out)] == list(range(1, saved_step + 2))
