"""Older spellings of config keys. Each setting has one documented spelling; an older one is still
read, moved to its new key before validation, with a one-line note on stderr that names the new
spelling (once per key and process). ``rltrain --help-config`` lists them apart from the keys.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

UNSET = object()  # an older value that sets nothing (its new key keeps its own value)


@dataclass(frozen=True)
class Respelled:
    old: str
    """The older dotted key."""
    new: str
    """The key that replaces it."""
    meaning: str = "the same value"
    """How an old value reads as a new one (for the note and ``--help-config``)."""
    convert: Callable[[Any], Any] = lambda value: value
    """The old value as the new key takes it (UNSET: none); ValueError for a value it cannot take."""
    null_defers: bool = False
    """The new key set to null gives way to the older one: what earlier versions meant by both
    (their resolved config.yaml, which a resume reads, holds both)."""


def _tis_cap(cap: Any) -> Any:
    return None if cap is None else {"kind": "tis", "level": "token", "cap": cap}


def _masked_mean_axis(axis: Any) -> Any:
    if axis is None:
        return UNSET
    if axis != 1:
        raise ValueError(f"only 1 is accepted, got {axis!r}")
    return "seq-mean-token-mean"


RESPELLED = (
    Respelled("loss.tis_cap", "loss.rollout_correction", "x: {kind: tis, level: token, cap: x}; null: null", _tis_cap,
              null_defers=True),  # (rollout_correction: null meant "as tis_cap says")
    Respelled("loss.masked_mean_axis", "loss.aggregation", "1: seq-mean-token-mean; null: unset", _masked_mean_axis),
    Respelled("rollout.async_steps", "rollout.max_staleness"),
    Respelled("eval.every", "run.eval_every"),
    Respelled("sft_warmup.data", "sft_warmup.source"),
)  # fmt: skip

_BY_OLD = {r.old: r for r in RESPELLED}
_noted: set[str] = set()


def respell_key(key: str, value: Any) -> tuple[str, Any]:
    """``key`` and ``value`` as the new spelling writes them (an older key's note shown once);
    the value is UNSET where an older value sets nothing."""
    r = _BY_OLD.get(key)
    if r is None:
        return key, value
    try:
        new_value = r.convert(value)
    except ValueError as e:
        raise ValueError(f"{r.old}: {e} (the older spelling of {r.new}: {r.meaning})") from None
    if new_value is not UNSET:
        _note(
            f"{r.old} is read as {r.new}={_yaml(new_value)}; write {r.new} (the older spelling will go)",
            r.old,
        )
    return r.new, new_value


def respell(raw: Any) -> Any:
    """``raw`` (a config mapping) with every older key moved to its new one. An older key and its
    new one set to different values: ValueError naming both (set one)."""
    if not isinstance(raw, dict):
        return raw
    for r in RESPELLED:
        old_section, old_key = r.old.split(".")
        section = raw.get(old_section)
        if not isinstance(section, dict) or old_key not in section:
            continue
        raw = {**raw, old_section: {k: v for k, v in section.items() if k != old_key}}
        new, value = respell_key(r.old, section[old_key])
        if value is UNSET:
            continue
        new_section, new_key = new.split(".")
        target = raw.get(new_section)
        target = dict(target) if isinstance(target, dict) else {}
        deferred = r.null_defers and target.get(new_key, 0) is None
        if new_key in target and target[new_key] != value and not deferred:
            raise ValueError(
                f"{r.old}={section[old_key]!r} and {r.new}={target[new_key]!r} disagree ({r.old} is the "
                f"older spelling of {r.new}; set one)"
            )
        raw = {**raw, new_section: {**target, new_key: value}}
    return raw


def _note(text: str, key: str) -> None:
    if key not in _noted:
        _noted.add(key)
        print(f"rltrain: note: {text}", file=sys.stderr, flush=True)


def _yaml(value: Any) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def describe_respelled(section: str | None = None) -> str:
    """The older spellings (of the keys under ``section``, a dotted prefix), for ``--help-config``;
    empty where there are none."""

    def under(key: str) -> bool:
        return not section or key == section or key.startswith(section + ".")

    lines = [f"    {r.old} -> {r.new} ({r.meaning})" for r in RESPELLED if under(r.old) or under(r.new)]
    head = "Older spellings (still read, each with a one-line note; write the new key):"
    return "\n".join([head, *lines]) if lines else ""
