"""Save, resume, Hugging Face export.

``<output_dir>/checkpoints/step_<k>/`` holds the DeepSpeed state of every learner (weights,
optimizer, scheduler, RNG) plus the trainer's state (data order, step) and ``hf/``, the policy in
Hugging Face format; with a critic also ``critic/`` (its DeepSpeed state) and ``critic_hf/``.
``checkpoints/latest`` names the newest complete one and is written last, by an atomic rename, so a
run killed mid-save resumes from the previous checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rltrain.learner import LearnerGroup

CRITIC = "critic"  # the critic's DeepSpeed state: step_<k>/critic/


def checkpoint_root(out_dir: Path) -> Path:
    return out_dir / "checkpoints"


def save(
    learners: LearnerGroup,
    out_dir: Path,
    step: int,
    trainer_state: dict[str, Any],
    critic: LearnerGroup | None = None,
) -> Path:
    root, tag = checkpoint_root(out_dir), f"step_{step}"
    learners.save_checkpoint(root, tag, {"step": step, **trainer_state})
    learners.save_hf(root / tag / "hf")
    if critic is not None:
        critic.save_checkpoint(root / tag, CRITIC, {"step": step})
        critic.save_hf(root / tag / "critic_hf")
    tmp = root / "latest.tmp"
    tmp.write_text(tag)
    os.replace(tmp, root / "latest")
    return root / tag


def latest_tag(out_dir: Path) -> str | None:
    marker = checkpoint_root(out_dir) / "latest"
    return marker.read_text().strip() if marker.exists() else None


def load(learners: LearnerGroup, out_dir: Path, critic: LearnerGroup | None = None) -> dict[str, Any]:
    """Restore every learner (and the critic) from the newest checkpoint; returns the trainer state
    saved with it."""
    tag = latest_tag(out_dir)
    if tag is None:
        raise FileNotFoundError(f"run.resume: no checkpoint in {checkpoint_root(out_dir)}")
    if critic is not None:
        critic.load_checkpoint(checkpoint_root(out_dir) / tag, CRITIC)
    return learners.load_checkpoint(checkpoint_root(out_dir), tag)
