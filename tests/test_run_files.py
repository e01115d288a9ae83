"""Run-folder bookkeeping without actors: checkpoint pruning and metrics truncation on resume."""

import json

from rltrain.checkpoint import prune
from rltrain.tracking import read_metrics, truncate_metrics


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
    truncate_metrics(path, 0)  # a fresh run in the same folder starts an empty log
    assert path.read_text() == ""
    truncate_metrics(tmp_path / "missing.jsonl", 3)  # nothing to do
