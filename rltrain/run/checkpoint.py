"""Save, resume, Hugging Face export.

``<output_dir>/checkpoints/step_<k>/`` holds the DeepSpeed state of every learner (weights,
optimizer, scheduler, RNG), ``trainer_state.json`` (the step and the data order, written by the
driver: :meth:`rltrain.run.orchestrator.Orchestrator.state`) and ``hf/``, the policy in Hugging Face
format; with a critic also ``critic/`` (its DeepSpeed state) and ``critic_hf/``.

Saves are atomic: everything is written to ``step_<k>.partial/``, which is renamed to
``step_<k>/`` once complete; then ``checkpoints/latest`` (the newest complete one) is replaced by
an atomic rename, and only then are old checkpoints beyond ``keep`` deleted. A run killed at any
point of a save resumes from the previous checkpoint.

A save that fails (a full disk, a folder that is not writable) raises :class:`SaveFailed` with one
line, after removing what it wrote: ``latest`` still names the previous checkpoint, which stays
loadable. Learner ranks record their write errors instead of raising them, finish DeepSpeed's
collectives, and agree on the outcome, so a failing rank never leaves its peers in a barrier.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rltrain.learner.state import LAYOUT_FREE, layout, saved_layout, write_failure

if TYPE_CHECKING:  # ray and deepspeed stay out of the input checks that use this module
    from rltrain.learner.group import LearnerGroup

CRITIC = "critic"  # the critic's DeepSpeed state: step_<k>/critic/
TRAINER_STATE = "trainer_state.json"  # the step and the data order: step_<k>/trainer_state.json


def layout_problem(folder: Path, lc, section: str) -> str | None:
    """Why the learner section saved in ``folder`` cannot be resumed on ``lc``'s layout, or None."""
    saved = saved_layout(folder)
    if saved is None or saved == layout(lc) or (folder / LAYOUT_FREE).is_file():
        return None
    return (
        f"checkpoint {folder.parent if section == 'critic' else folder} was written by {saved['num_learners']} "
        f"{section} learner(s) with ZeRO-{saved['zero_stage']} and holds no {LAYOUT_FREE} "
        f"(run.layout_free_checkpoints was off); resume with {section_key(section)}.num_learners="
        f"{saved['num_learners']} and {section_key(section)}.zero_stage={saved['zero_stage']}"
    )


def section_key(section: str) -> str:
    return "critic.learners" if section == "critic" else "learner"


def checkpoint_root(out_dir: Path) -> Path:
    return out_dir / "checkpoints"


class SaveFailed(RuntimeError):
    """A checkpoint or export could not be written; the message names it, why, and what is left."""


ADAPTER = "adapter"  # a LoRA run's checkpoint: the adapter as a peft folder, where others have hf/


def save(
    learners: LearnerGroup,
    out_dir: Path,
    step: int,
    trainer_state: dict[str, Any],
    critic: LearnerGroup | None = None,
    keep: int | None = None,
) -> Path:
    """Write checkpoint ``step_<step>`` atomically, point ``latest`` at it, keep the newest ``keep``.
    Raises :class:`SaveFailed` when any part cannot be written, leaving ``latest`` as it was."""
    root, tag = checkpoint_root(out_dir), f"step_{step}"
    partial, final = root / f"{tag}{PARTIAL}", root / tag
    try:
        shutil.rmtree(partial, ignore_errors=True)  # left by a run killed mid-save
        _check(learners.save_checkpoint(root, partial.name, {"step": step}))
        _write(
            partial / TRAINER_STATE, lambda path: path.write_text(json.dumps({"step": step, **trainer_state}))
        )
        if learners.config.model.lora.rank:  # the adapter over the run's base model, not a merged copy
            _check(learners.save_adapter(partial / ADAPTER))
        else:
            _check(learners.save_hf(partial / "hf"))
        if critic is not None:
            _check(critic.save_checkpoint(partial, CRITIC, {"step": step}))
            _check(critic.save_hf(partial / "critic_hf"))
        if final.exists():  # a stale copy (a resumed run saving a step again); `latest` never names it
            shutil.rmtree(final)
        _write(final, lambda path: os.rename(partial, path))
        _write(root / "latest.tmp", lambda path: (path.write_text(tag), os.replace(path, root / "latest")))
    except SaveFailed as e:
        before = latest_tag(out_dir)
        for path in (partial, final):  # the space it took; `latest` names neither
            if before != path.name:
                shutil.rmtree(path, ignore_errors=True)
        left = (
            f"checkpoint {root / before} is still the latest" if before else "no checkpoint was saved before"
        )
        raise SaveFailed(f"checkpoint {tag} was not saved: {e}; {left}") from None
    if keep is not None:
        prune(root, keep)
    return final


def _adapter_problem(folder: Path, config) -> str | None:
    """A checkpoint of LoRA adapters resumes a run with adapters of the same rank, and only such."""
    rank = config.model.lora.rank if config is not None else None
    if not (folder / ADAPTER).is_dir():
        if not (folder / "hf").is_dir():
            return f"checkpoint {folder} is incomplete or damaged (no hf/ or {ADAPTER}/ folder)"
        return (
            f"checkpoint {folder} holds full weights; model.lora.rank={rank} trains adapters"
            if rank
            else None
        )
    try:
        saved = json.loads((folder / ADAPTER / "adapter_config.json").read_text())["r"]
    except (OSError, ValueError, KeyError) as e:
        return f"checkpoint {folder} is incomplete or damaged ({ADAPTER}/adapter_config.json: {type(e).__name__})"
    if rank is not None and saved != rank:
        return f"checkpoint {folder} holds LoRA adapters of rank {saved}; the run has model.lora.rank={rank}"
    return None


def export_hf(learners: LearnerGroup, folder: Path, adapter: Path | None = None) -> None:
    """The policy (or critic) in Hugging Face format (with LoRA merged), and with ``adapter`` the
    LoRA adapter alone as a peft folder there; :class:`SaveFailed` when one cannot be written."""
    for target, save in ((folder, learners.save_hf), (adapter, learners.save_adapter)):
        if target is None:
            continue
        try:
            _check(save(target))
        except SaveFailed as e:
            raise SaveFailed(f"{target} was not written: {e}") from None


def _check(error: str | None) -> None:
    if error is not None:
        raise SaveFailed(error)


def _write(path: Path, write: Callable[[Path], Any]) -> None:
    try:
        write(path)
    except OSError as e:
        raise SaveFailed(write_failure(e, path)) from None


PARTIAL = ".partial"
STEP = re.compile(r"step_(\d+)")


def prune(root: Path, keep: int) -> None:
    """Delete complete checkpoints but the newest ``keep`` (never the one ``latest`` names)."""
    latest = (root / "latest").read_text().strip()
    complete = sorted(
        (int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP.fullmatch(p.name))
    )
    for _, path in complete[:-keep]:
        if path.name != latest:
            shutil.rmtree(path)


def latest_tag(out_dir: Path) -> str | None:
    marker = checkpoint_root(out_dir) / "latest"
    return marker.read_text().strip() if marker.exists() else None


def latest_marker(out_dir: Path) -> tuple[str, int] | None:
    """The ``latest`` pointer and when it was written: tells whether a save happened since."""
    marker = checkpoint_root(out_dir) / "latest"
    return (marker.read_text().strip(), marker.stat().st_mtime_ns) if marker.exists() else None


# what must match between a checkpoint's model and the model a run resumes with
SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def resume_problem(out_dir: Path, model_config: dict[str, Any] | None, config=None) -> str | None:
    """Why ``run.resume`` cannot continue from the newest checkpoint, or None (also when there is no
    checkpoint: the run then starts afresh). ``model_config`` is the run's model ``config.json``;
    ``config`` (the run's :class:`~rltrain.config.Config`) adds the learner layouts' check."""
    tag = latest_tag(out_dir)
    if tag is None:
        return None
    folder = checkpoint_root(out_dir) / tag
    if not folder.is_dir():
        return (
            f"{checkpoint_root(out_dir) / 'latest'} names {tag!r}, which is not in {checkpoint_root(out_dir)}"
        )
    try:
        json.loads((folder / TRAINER_STATE).read_text())
    except (OSError, ValueError) as e:
        return f"checkpoint {folder} is incomplete or damaged ({TRAINER_STATE}: {type(e).__name__})"
    problem = _adapter_problem(folder, config)
    if problem is not None:
        return problem
    try:
        saved = json.loads((folder / "hf" / "config.json").read_text()) if (folder / "hf").is_dir() else {}
    except (OSError, ValueError) as e:
        return f"checkpoint {folder} is incomplete or damaged (hf/config.json: {type(e).__name__})"
    for key in SHAPE_KEYS if model_config is not None else ():
        if key in saved and key in model_config and saved[key] != model_config[key]:
            return (f"checkpoint {folder} holds another model ({key} {saved[key]!r}; the run's model has "
                    f"{model_config[key]!r})")  # fmt: skip
    if config is not None:
        sections = [(folder, config.learner, "policy")]
        if config.critic is not None and (folder / CRITIC).is_dir():
            sections.append((folder / CRITIC, config.critic.learners, "critic"))
        for where, lc, section in sections:
            problem = layout_problem(where, lc, section)
            if problem:
                return problem
    return None


def load(learners: LearnerGroup, out_dir: Path, critic: LearnerGroup | None = None) -> dict[str, Any]:
    """Restore every learner (and the critic) from the newest checkpoint; returns the trainer state
    saved with it."""
    tag = latest_tag(out_dir)
    if tag is None:
        raise FileNotFoundError(f"run.resume: no checkpoint in {checkpoint_root(out_dir)}")
    if critic is not None:
        critic.load_checkpoint(checkpoint_root(out_dir) / tag, CRITIC)
    learners.load_checkpoint(checkpoint_root(out_dir), tag)
    return json.loads((checkpoint_root(out_dir) / tag / TRAINER_STATE).read_text())
