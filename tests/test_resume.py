"""Resuming end to end: a run's folder as a stop after step 2's checkpoint leaves it resumes to the
uninterrupted run's weights and metric rows, on its own layout and others (elastic); Ctrl-C during a
step, during a save and twice saves a checkpoint that resumes, every step's row once."""

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

# "grpo" resumes through vLLM, the others generate with the in-process engine (HF)
RESUME_LAYOUTS = {
    "grpo": [],
    # (with a step generated ahead it resumes in tests/test_faults.py: the killed actors' restarts)
    "dynamic sampling": [*REFILLING, HF],
    # the two learners share every packed row (data-parallel size 1), with a per-sequence mean
    # normalized over the step's sequences (each split sequence counted once)
    "sequence parallel": ["learner.sequence_parallel_size=2", "loss.aggregation=seq-mean-token-mean", HF],
    # a critic with its own learner, checkpointed and restored beside the policy; its value loss and
    # the policy loss in Dr. GRPO's per-sequence sum over a constant
    "ppo with a critic": [
        HF,
        "algorithm.advantage=gae",
        "critic.learners.lr=1e-3",
        "loss.aggregation=seq-mean-token-sum-norm",
        "loss.aggregation_norm=16",
    ],
}


@pytest.mark.parametrize("layout", RESUME_LAYOUTS)
def test_resume_gives_the_same_weights_as_an_uninterrupted_run(tmp_path, layout, ray_cluster):
    env = {**TESTS_ON_PATH, **ray_cluster}
    common = ["run.steps=3", *RESUME_LAYOUTS[layout]]
    run_trainer(tmp_path / "straight", *common, "run.checkpoint_every=2", env=env)
    # the same checkpoint resumed here and, for "grpo" (written by 2 learners with ZeRO-2), on other
    # layouts (elastic)
    for other in ["resumed", *(ELASTIC if layout == "grpo" else [])]:
        stopped_after_step_2(tmp_path / "straight", tmp_path / other)
    run_trainer(tmp_path / "resumed", *common, "run.resume=true", env=env)
    straight, resumed = final_weights(tmp_path / "straight"), final_weights(tmp_path / "resumed")
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=0, atol=1e-6)
    if "critic" in layout:
        critic = {run: AutoModelForTokenClassification.from_pretrained(tmp_path / run / "final_critic").state_dict()
                  for run in ("straight", "resumed")}  # fmt: skip
        for name in critic["straight"]:
            torch.testing.assert_close(critic["resumed"][name], critic["straight"][name], rtol=0, atol=1e-6)
    rows = {run: logged_rows(tmp_path / run) for run in ("straight", "resumed")}
    assert [r["step"] for r in rows["resumed"]] == [1, 2, 3]  # step 3's first row replaced, not kept
    assert_same_rows(rows["resumed"][2:], rows["straight"][2:])  # the step after the checkpoint
    if "dynamic" in layout:  # the batch was refilled (the case a sampler position alone gets wrong)
        assert max(r["rollout/sampling_rounds"] for r in rows["straight"]) > 1
    for other, overrides in (ELASTIC if layout == "grpo" else {}).items():
        run_trainer(tmp_path / other, *common, "run.resume=true", *overrides, env=env)
        elastic = final_weights(tmp_path / other)
        worst = max((elastic[name] - straight[name]).abs().max().item() for name in straight)
        assert worst < 1e-5, (other, worst)
        # every row but how each rank cut its share
        assert_same_rows(logged_rows(tmp_path / other)[2:], rows["straight"][2:], ("train/micro_batches",))


def stopped_after_step_2(run: Path, copy: Path) -> None:
    """``copy``: the folder of ``run`` as a run stopped (killed, preempted) after step 2's
    checkpoint and step 3's metrics left it: no step 3 checkpoint, no exported model."""
    shutil.copytree(run, copy)
    (copy / "checkpoints" / "latest").write_text("step_2")
    for part in ("checkpoints/step_3", "final_model", "final_critic"):
        shutil.rmtree(copy / part, ignore_errors=True)


# a layout a checkpoint of 2 learners with ZeRO-2 resumes on, from its layout-free state (1 learner,
# ZeRO-3); DeepSpeed's own state on a sequence-parallel layout (ZeRO-1, sp=2) resumes in
# tests/test_learner.py's checkpoint round trip
ELASTIC = {"1 learner zero-3": ["learner.num_learners=1", "learner.zero_stage=3"]}


# when the Ctrl-C comes: during a step (after the first row: step 2 generating or training), while
# a checkpoint is written (every step saves one), and twice (the second while the save runs)
CTRL_C = {
    "during a step": ("run.checkpoint_every=0", lambda out: len(logged_rows(out)) >= 1, 1),
    "while a checkpoint is written": (
        "run.checkpoint_every=1",
        lambda out: any(p.name.endswith(".partial") for p in (out / "checkpoints").glob("step_*")),
        1,
    ),
    "twice": ("run.checkpoint_every=0", lambda out: len(logged_rows(out)) >= 2, 2),
}


@pytest.mark.parametrize("when", CTRL_C)
def test_ctrl_c_saves_a_checkpoint_and_stops_whenever_it_comes(when, tmp_path, ray_cluster):
    out = tmp_path / "run"
    every, ready, presses = CTRL_C[when]
    cmd = [sys.executable, "-m", "rltrain.train", "--config", "configs/cpu_demo.yaml", *SMALL, HF,
           "run.steps=200", every, f"run.output_dir={out}"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **ray_cluster})  # fmt: skip
    deadline = time.monotonic() + 300
    while not ((out / "metrics.jsonl").exists() and ready(out)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    for _ in range(presses):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
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
