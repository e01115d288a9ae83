"""Run-folder bookkeeping without actors: checkpoint pruning, a failed save, metrics truncation on
resume."""

import json
import os

import pytest

from rltrain.learner import state
from rltrain.run import checkpoint
from rltrain.run.checkpoint import prune
from rltrain.run.tracking import Tracker, read_metrics, truncate_metrics


def test_prune_keeps_the_newest_and_never_the_latest_pointer(tmp_path):
    for step in (1, 2, 10, 3):
        (tmp_path / f"step_{step}").mkdir()
    (tmp_path / "step_11.partial").mkdir()  # a save under way is not a checkpoint
    (tmp_path / "latest").write_text("step_2")  # e.g. a resumed run pointing back at an older one
    prune(tmp_path, keep=2)
    # newest two by step number (3, 10; not by name, where "step_10" < "step_2"), plus the one latest names
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step_10",
        "step_11.partial",
        "step_2",
        "step_3",
    ]


def test_resume_truncates_metrics_to_the_checkpoint_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward/mean": s / 10}) + "\n" for s in [1, 2, 3, 4, 5]))
    truncate_metrics(path, 3)  # resumed from step 3: steps 4 and 5 will be logged again
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert len(path.read_text().splitlines()) == 3
    truncate_metrics(tmp_path / "missing.jsonl", 3)  # nothing to do


def test_a_fresh_run_in_a_used_folder_drops_the_earlier_runs_rows_step_0_included(tmp_path):
    from rltrain.config import Config
    from rltrain.run.tracking import Tracker

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in [0, 1, 2]))  # 0: the evaluation
    Tracker(tmp_path, Config(), start_step=0).close()  # the fresh run logs its own step 0
    assert path.read_text() == ""
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in [0, 1, 2]))
    Tracker(tmp_path, Config(), start_step=1).close()  # resumed after step 1
    assert [r["step"] for r in read_metrics(path)] == [0, 1]


class Writer:
    """Stands in for a learner group's file writing (the learner side is tested on real actors in
    test_learner): writes a file per call, or returns the error a rank reported."""

    def __init__(self, fail_on: str | None = None):
        from rltrain.config import Config

        self.fail_on, self.config = fail_on, Config()

    def save_checkpoint(self, root, tag, client_state):
        (root / tag).mkdir(parents=True, exist_ok=True)
        (root / tag / "model.pt").write_text("weights")
        return "writing model.pt failed (No space left on device)" if self.fail_on == "checkpoint" else None

    def save_hf(self, folder):
        folder.mkdir(parents=True)
        return "writing hf failed (Read-only file system)" if self.fail_on == "hf" else None


@pytest.mark.parametrize("fail_on", ["checkpoint", "hf"])
def test_a_failed_save_removes_what_it_wrote_and_leaves_the_latest_pointer(tmp_path, fail_on):
    checkpoint.save(Writer(), tmp_path, 1, {"data": {}})
    with pytest.raises(checkpoint.SaveFailed) as failed:
        checkpoint.save(Writer(fail_on), tmp_path, 2, {"data": {}}, keep=1)
    root = tmp_path / "checkpoints"
    message = str(failed.value)
    assert message.startswith("checkpoint step_2 was not saved: writing ") and "\n" not in message
    assert message.endswith(f"checkpoint {root / 'step_1'} is still the latest")
    assert (root / "latest").read_text() == "step_1"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_1"]  # no step_2.partial; step_1 kept
    with pytest.raises(checkpoint.SaveFailed, match="no checkpoint was saved before"):
        checkpoint.save(Writer(fail_on), tmp_path / "fresh", 1, {"data": {}})


def test_a_write_error_names_the_path_the_reason_and_the_free_space(tmp_path):
    # torch's zip writer reports a full disk as "unexpected pos"; an OSError carries its reason
    text = state.write_failure(OSError(30, "Read-only file system"), tmp_path / "a" / "b.pt")
    assert text.startswith(f"writing {tmp_path / 'a' / 'b.pt'} failed (Read-only file system; ")
    assert text.endswith(" MiB free there)")


def test_recorded_write_errors_keep_a_rank_going_and_restore_the_engine():
    class Engine:  # DeepSpeed's checkpoint engine's two writing methods
        def __init__(self):
            self.written = []

        def makedirs(self, path, exist_ok=False):
            self.written.append(path)

        def save(self, state_dict, path):
            if path.endswith("optim.pt"):
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
            self.written.append(path)

    engine = Engine()
    with state.recorded_write_errors(engine) as errors:
        engine.makedirs("/no/such/dir", exist_ok=True)
        engine.save({}, "/no/such/dir/optim.pt")  # recorded, not raised
        engine.save({}, "/no/such/dir/model.pt")  # after a failure nothing more is written
    assert engine.written == ["/no/such/dir"]
    assert len(errors) == 1 and errors[0].startswith("writing /no/such/dir/optim.pt failed (")
    assert "save" not in vars(engine) and "makedirs" not in vars(engine)  # the class's methods again
    with pytest.raises(RuntimeError):
        engine.save({}, "/x/optim.pt")


def test_deepspeeds_copy_of_its_recovery_scripts_is_a_recorded_write_too(tmp_path):
    from deepspeed.runtime.engine import DeepSpeedEngine

    class CheckpointEngine:
        def makedirs(self, path, exist_ok=False):
            pass

        def save(self, state_dict, path):
            pass

    class Engine:  # DeepSpeed's own copy (rank 0, after the ZeRO state): a full disk refuses it too
        _copy_recovery_script = DeepSpeedEngine._copy_recovery_script
        _change_recovery_script_permissions = DeepSpeedEngine._change_recovery_script_permissions

        def __init__(self):
            self.checkpoint_engine = CheckpointEngine()

    engine, gone = Engine(), tmp_path / "gone"  # copying into a folder that is not there fails
    with state.recorded_deepspeed_write_errors(engine) as errors:
        engine.checkpoint_engine.save({}, str(gone / "optim.pt"))
        engine._copy_recovery_script(str(gone))  # recorded, not raised
    assert len(errors) == 1 and errors[0].startswith(f"writing {gone} failed (No such file or directory; ")
    assert "_copy_recovery_script" not in vars(engine) and "save" not in vars(engine.checkpoint_engine)


def test_ctrl_c_is_recorded_where_its_exception_could_be_lost_and_waits_for_a_save():
    # (one during a save is recorded only too: test_e2e sends one while a checkpoint is written)
    import os
    import signal

    from rltrain.run.loop import CtrlC

    ctrl_c = CtrlC()
    try:
        with pytest.raises(KeyboardInterrupt):  # the first one raises where the loop is
            os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):  # and is recorded: a swallowed exception is raised again
            ctrl_c.check()
        os.kill(os.getpid(), signal.SIGINT)  # a second one: the interrupted step's save is under way
        assert ctrl_c.count == 2
        with pytest.raises(KeyboardInterrupt), ctrl_c.deferred():  # a third stops at once
            os.kill(os.getpid(), signal.SIGINT)
        ctrl_c.restore()  # after a Ctrl-C it stays to the process's end: a late one waits too
        assert signal.getsignal(signal.SIGINT) == ctrl_c._on_sigint
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    quiet = CtrlC()  # a run that ends without one hands the handler back
    quiet.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_runs_own_object_store_holds_twice_the_weights_it_syncs(tmp_path):
    from rltrain.run.launch import MIN_OBJECT_STORE, object_store_bytes

    assert object_store_bytes(None) == MIN_OBJECT_STORE  # the built-in model: 512 MiB is plenty
    (tmp_path / "model.safetensors").write_bytes(b"")
    os.truncate(tmp_path / "model.safetensors", 538 * 2**20)  # SmolLM2-135M in fp32 (sparse file)
    # 2 x 538 MiB + 256 MiB of room (it was 512 MiB, smaller than the weights one sync puts there)
    assert object_store_bytes(str(tmp_path)) == (2 * 538 + 256) * 2**20


def test_wandb_offline_writes_the_runs_file_with_every_metric_tensorboard_gets(tmp_path, monkeypatch):
    from rltrain.config import load_config

    monkeypatch.setenv("WANDB_MODE", "offline")  # no account, no network: the run's files only
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = load_config(None, ["run.wandb_project=rltrain-tests", "run.steps=2"])
    with Tracker(tmp_path, config, start_step=0) as tracker:
        tracker.log(1, {"reward/mean": 0.625, "loss/policy": 0.125})
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    # the records hold each key and its value as JSON text (wandb's own reader is in its Go core)
    data = runs[0].read_bytes()
    assert b"reward/mean" in data and b"0.625" in data and b"loss/policy" in data and b"0.125" in data


def test_trackio_writes_the_runs_database_with_every_metric_tensorboard_gets(tmp_path, monkeypatch):
    import sqlite3

    from rltrain.config import load_config

    monkeypatch.delenv("TRACKIO_DIR", raising=False)  # the run's folder, then
    config = load_config(None, ["run.trackio_project=rltrain-tests", "run.steps=2"])
    with Tracker(tmp_path, config, start_step=0) as tracker:
        tracker.log(1, {"reward/mean": 0.625, "loss/policy": 0.125})
        tracker.log(2, {"reward/mean": 0.75})
    db = sqlite3.connect(tmp_path / "trackio" / "rltrain-tests.db")
    rows = db.execute("select step, metrics from metrics order by step").fetchall()
    assert [(step, json.loads(values)) for step, values in rows] == [
        (1, {"reward/mean": 0.625, "loss/policy": 0.125}),
        (2, {"reward/mean": 0.75}),
    ]
