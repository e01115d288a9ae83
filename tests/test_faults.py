"""Faults end to end: a killed learner or generator restarts the run from its newest checkpoint and
it finishes as an uninterrupted run does; past run.max_restarts it stops with one line and the
resume command; a kill during a save leaves the previous checkpoint; a two-node Ray cluster."""

import json
import os
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
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.slow
HOOKS = str(Path(__file__).resolve().parent / "fault_hooks")  # tests/fault_hooks/sitecustomize.py
# 6 steps, a checkpoint every 2: a kill after step 3 is logged resumes from step_2 (or step_4)
FAULT_RUN = ["run.steps=6", "run.checkpoint_every=2"]


def start_trainer(out: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rltrain.train", "--config", "configs/cpu_demo.yaml", *SMALL,
           f"run.output_dir={out}", *overrides]  # fmt: skip
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, **(env or {})})  # fmt: skip


def logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(condition, proc: subprocess.Popen, timeout_s: float = 400) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def kill_actor(out: Path, actor: str) -> int:
    """SIGKILL the process of ``actor`` as named in placement.json; returns its pid."""
    pid = next(p["pid"] for p in json.loads((out / "placement.json").read_text()) if p["actor"] == actor)
    os.kill(pid, signal.SIGKILL)
    return pid


# dynamic sampling refilling the batch, asynchronously (vLLM, two steps generated ahead), packed rows
# and prefix trees: the data order of the restarted and resumed runs must be the uninterrupted run's
# (synchronous dynamic sampling resumes in tests/test_resume.py)
RESTARTED = [*FAULT_RUN, *REFILLING, "rollout.max_staleness=2", "learner.packing=true",
             "learner.prefix_sharing=true", "algorithm.overlong=none"]  # fmt: skip


def test_killed_actors_restart_the_run_and_a_run_killed_whole_resumes_both_ending_as_an_uninterrupted_one(
    tmp_path, ray_cluster
):
    # one run, two faults: policy learner 1 dies once 3 steps are logged (the run restarts its actors
    # from step_2, in its own process); once the restart has checkpointed step 4, the whole run is
    # killed (SIGKILL to its process group) and resumed with run.resume=true. The rollouts of steps 5
    # and 6 were generated ahead under older weights and come back from the checkpoint: the resumed
    # run measures the engine-learner gap on the tokens its own weights sampled alone
    # (rollout/mismatch_measured; none at all: its first-step check waits for a step that has some),
    # and it ends with the uninterrupted run's weights and rows
    env = {**TESTS_ON_PATH, **ray_cluster}
    straight_run = tmp_path / "straight"
    run_trainer(straight_run, *RESTARTED, env=env)
    out = tmp_path / "run"
    proc = start_trainer(out, *RESTARTED, env=env)
    wait_for(lambda: len(logged_steps(out)) >= 3, proc)
    learner = kill_actor(out, "policy learner 1")
    wait_for(lambda: pid_of(out, "policy learner 1") not in (None, learner), proc)
    wait_for(lambda: (out / "checkpoints" / "latest").exists()
             and (out / "checkpoints" / "latest").read_text() == "step_4", proc)  # fmt: skip
    os.killpg(proc.pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    said = [line for line in err.splitlines() if line.startswith("rltrain: policy learner 1 died")]
    assert len(said) == 1 and f"pid {learner}" in said[0] and "(restart 1 of 2)" in said[0], err[-3000:]
    resumed = run_trainer(out, *RESTARTED, "run.resume=true", env=env)
    assert "Traceback" not in resumed.stderr
    straight, restarted = final_weights(straight_run), final_weights(out)
    for name in straight:  # the tolerance of the resume test
        torch.testing.assert_close(restarted[name], straight[name], rtol=0, atol=1e-6)
    assert logged_steps(out) == [1, 2, 3, 4, 5, 6]  # the re-run steps replaced their first rows
    rows, straight_rows = logged_rows(out), logged_rows(straight_run)
    assert_same_rows(rows, straight_rows)
    assert min(r["rollout/mismatch_measured"] for r in rows[4:]) < 1  # resumed on older weights' rollouts
    assert max(r["rollout/sampling_rounds"] for r in straight_rows) > 1  # refills happened
    assert max(r["perf/prefix_shared_fraction"] for r in straight_rows) > 0  # trees were built


def placement(out: Path) -> list[dict] | None:
    """placement.json's entries, or None until it is written whole."""
    try:
        return json.loads((out / "placement.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def pid_of(out: Path, actor: str) -> int | None:
    return next((p["pid"] for p in placement(out) or [] if p["actor"] == actor), None)


def created_placement_groups(ray) -> int:
    from ray.util import placement_group_table

    return sum(pg["state"] == "CREATED" for pg in placement_group_table().values())


def test_a_generator_killed_in_the_first_evaluation_restarts_one_set_of_actors_and_past_max_restarts_the_run_stops_with_one_line_and_the_resume_command(
    tmp_path, ray_local, ray_cluster
):
    out = tmp_path / "run"
    # a held-out set (64 prompts) evaluated at step 0 and at the end (run.eval_every past the steps)
    evaluated = ["run.eval_every=100", "eval.num_prompts=64"]
    proc = start_trainer(out, *FAULT_RUN, *evaluated, "run.max_restarts=1", HF, env=ray_cluster)
    # 1. placement.json is written as the run's actors start; nothing uses a generator before the
    # step-0 evaluation (no weights to send in a fresh run), so its first call finds the engine dead
    wait_for(lambda: placement(out) is not None, proc)
    one_set = created_placement_groups(ray_local)  # the run's own (each test's runs have ended)
    first = kill_actor(out, "generator 0")
    wait_for(lambda: len(logged_steps(out)) >= 4, proc)  # the step-0 row and steps 1-3 of the restart
    assert (
        placement(out) != []
        and next(p for p in placement(out) if p["actor"] == "generator 0")["pid"] != first
    )
    # the failed start left nothing behind: the restart holds no more placement groups than the start
    # did (a leaked set would double them; an earlier run's may still be going as Ray removes them)
    assert created_placement_groups(ray_local) <= one_set
    # 2. past run.max_restarts the run stops with one line and the command that resumes it
    pid = kill_actor(out, "policy learner 0")
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 1
    assert "rltrain: generator 0 died" in err and f"pid {first}" in err, err[-3000:]
    assert "restarting every actor from the first step (no checkpoint yet) (restart 1 of 1)" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("rltrain: policy learner 0 died (") and f"pid {pid}" in last, err[-3000:]
    assert "stopping after 1 restart(s) (run.max_restarts=1)" in last
    tag = (out / "checkpoints" / "latest").read_text()
    assert f"last checkpoint: {out / 'checkpoints' / tag}" in last
    command = last.split("resume with: ")[1]
    assert command == f"python -m rltrain.train --config {out / 'config.yaml'} run.resume=true"
    assert "Traceback" not in err
    # the printed command (with this interpreter) finishes the run
    done = subprocess.run([sys.executable, *command.split()[1:]], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, **ray_cluster})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # every step's row once: the step-0 evaluation's too (logged by the restart alone)
    assert logged_steps(out) == [0, 1, 2, 3, 4, 5, 6]


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path, ray_cluster):
    out, hold = tmp_path / "run", tmp_path / "hold"
    hold.mkdir()
    (hold / "from").write_text("3")  # step_3's save holds, written but for its model and the rename
    # a Ray instance of its own: it dies with the driver's process group, mid-save (the held save:
    # tests/fault_hooks, an event rather than a race with how long a save takes)
    proc = start_trainer(out, "run.steps=4", "run.checkpoint_every=1", "run.keep_checkpoints=2", HF,
                         env={"RLTRAIN_TEST_HOLD_SAVE": str(hold), "PYTHONPATH": HOOKS})  # fmt: skip
    root = out / "checkpoints"
    wait_for(lambda: (hold / "saving_3").exists(), proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and its local Ray instance, mid-save
    proc.wait()
    step = 3
    assert (root / "latest").read_text() == f"step_{step - 1}"
    assert sorted(p.name for p in root.glob("step_*")) == [
        f"step_{step - 2}",
        f"step_{step - 1}",
        f"step_{step}.partial",
    ]
    AutoModelForCausalLM.from_pretrained(root / f"step_{step - 1}" / "hf")
    assert step in logged_steps(out)  # logged before its save began: resuming must drop it
    run_trainer(out, f"run.steps={step + 1}", "run.checkpoint_every=1", "run.keep_checkpoints=2", HF,
                "run.resume=true", env=ray_cluster)  # fmt: skip
    assert logged_steps(out) == list(range(1, step + 2))  # no step twice
    assert sorted(p.name for p in root.glob("step_*")) == [f"step_{step}", f"step_{step + 1}"]


def test_a_hung_learner_on_a_two_node_cluster_leaves_every_actors_stacks_and_the_run_finishes_after_the_restart(
    tmp_path, monkeypatch
):
    # a ray.cluster_utils.Cluster of two nodes (2 CPUs each), the learners STRICT_SPREAD: one on each.
    # Policy learner 1 sleeps at the start of its third update (after 2 optimizer steps), once: its
    # actors see RLTRAIN_TEST_HANG and import the test's fault hook (tests/fault_hooks/sitecustomize.py)
    # at their start-up from PYTHONPATH, which the cluster's nodes take from this process
    from ray.cluster_utils import Cluster

    hang = tmp_path / "hang"
    hang.write_text("1 2 600")
    monkeypatch.setenv("RLTRAIN_TEST_HANG", str(hang))
    monkeypatch.setenv("PYTHONPATH", HOOKS)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        out = tmp_path / "run"
        done = run_trainer(out, "run.steps=4", "run.checkpoint_every=1", "run.actor_timeout_s=30", HF,
                           "learner.placement=STRICT_SPREAD", env={"RAY_ADDRESS": cluster.address})  # fmt: skip
        places = {p["actor"]: p["node_id"] for p in json.loads((out / "placement.json").read_text())}
        nodes = {node.node_id for node in cluster.list_all_nodes()}
        assert places["policy learner 0"] != places["policy learner 1"]
        assert {places["policy learner 0"], places["policy learner 1"]} == nodes
    finally:
        cluster.shutdown()
    stacks = out / "hangs" / "step_3.txt"
    assert (
        "policy learner 1" in done.stderr and "did not answer within run.actor_timeout_s=30s" in done.stderr
    )
    assert f"every actor's stacks: {stacks}; restarting every actor from checkpoint step_2" in done.stderr
    report = stacks.read_text()
    section = report.split("=== policy learner 1 ")[1].split("===")[0]
    assert "planted_sleep" in section, report[-3000:]  # the sleeping function, in the sleeping actor
    assert "=== generator 0 " in report and "=== policy learner 0 " in report
    assert logged_steps(out) == [1, 2, 3, 4] and (out / "final_model").exists()
    assert not hang.exists()


def test_saves_that_fail_keep_the_previous_checkpoint_and_stop_or_go_on_as_configured(tmp_path, ray_cluster):
    out = tmp_path / "run"
    root = out / "checkpoints"
    root.mkdir(parents=True)
    # a checkpoint of this run takes ~3.4 MB: 5 MB holds step_1, not step_2 beside it (a full disk)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(root)], capture_output=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mount.stderr.decode().strip()}")
    try:
        done = run_trainer(out, "run.steps=3", "run.checkpoint_every=1", "run.keep_checkpoints=1",
                           "run.on_save_error=continue", HF, env=ray_cluster)  # fmt: skip
        said = [line for line in done.stderr.splitlines() if "was not saved" in line]
        assert [line.split(":")[0] for line in said] == ["rltrain", "rltrain"], done.stderr[-3000:]
        for step, line in zip((2, 3), said):
            assert line.startswith(f"rltrain: step {step}: checkpoint step_{step} was not saved: writing ")
            assert "No space left on device" in line, line
            assert line.endswith(f"checkpoint {root / 'step_1'} is still the latest; going on "
                                 "(run.on_save_error=continue)")  # fmt: skip
        assert logged_steps(out) == [1, 2, 3] and (out / "final_model").exists()  # trained to the end
        assert (root / "latest").read_text() == "step_1"
        assert sorted(p.name for p in root.glob("step_*")) == ["step_1"]  # nothing partial left

        # the previous checkpoint resumes; with run.on_save_error=stop a failed save ends the run
        stopped = subprocess.run(
            [sys.executable, "-m", "rltrain.train", "--config", str(out / "config.yaml"), "run.resume=true",
             "run.on_save_error=stop"],
            cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, **ray_cluster},
        )  # fmt: skip
        assert stopped.returncode == 1, stopped.stderr[-3000:]
        assert "Traceback" not in stopped.stderr
        last = stopped.stderr.strip().splitlines()[-1]
        assert last.startswith("rltrain: step 2: checkpoint step_2 was not saved: writing "), last
        assert last.endswith(f"stopping (run.on_save_error=stop); resume with: python -m rltrain.train "
                             f"--config {out / 'config.yaml'} run.resume=true")  # fmt: skip
        assert logged_steps(out) == [1, 2]  # resumed after step 1, stopped at step 2's save
        assert (root / "latest").read_text() == "step_1"
        AutoModelForCausalLM.from_pretrained(root / "step_1" / "hf")
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)
