"""Loading a config: YAML, then dotted ``section.key=value`` overrides (values parsed as YAML),
validated into :class:`~rltrain.config.root.Config`; every problem is one :class:`ConfigError` line
that names the key, the value and what is allowed (the closest known key for an unknown one)."""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from rltrain.config.optimization import ConfigError
from rltrain.config.root import Config
from rltrain.config.spellings import UNSET, respell, respell_key


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """Read YAML, apply ``a.b=value`` overrides (values parsed as YAML), validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError as e:
            raise ConfigError(f"config file {str(path)!r} does not exist") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}".replace("\n", " ")) from e
        if not isinstance(raw, dict):
            raise ConfigError(
                f"config file {str(path)!r} holds a {type(raw).__name__}, expected a mapping of sections "
                "(model:, learner:, loss:, ...)"
            )
    raw = _as_config_error(respell, raw)  # (an override then wins over the file's value in either spelling)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
        try:
            node[leaf] = yaml.safe_load(value) if value else ""
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or type(e).__name__
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({problem})") from None
        _check_mapping_value(item, key, node[leaf])
        new_key, new_value = _as_config_error(respell_key, key, node[leaf])
        if new_key != key:  # an older spelling: moved to its new key
            del node[leaf]
            if new_value is not UNSET:
                section, new_leaf = new_key.split(".")
                raw[section] = {**(raw.get(section) or {}), new_leaf: new_value}
    return validate(raw)


def _as_config_error(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, its ValueError (an older spelling's bad value, or two that disagree) a ConfigError."""
    try:
        return fn(*args)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_mapping_value(item: str, key: str, value: Any) -> None:
    """YAML reads ``{env:1.0}`` (no space after the colon) as the key ``env:1.0`` without a value."""
    if isinstance(value, dict):
        for k, v in value.items():
            if v is None and isinstance(k, str) and ":" in k:
                name, _, number = k.rpartition(":")
                raise ConfigError(
                    f"override {item!r}: YAML reads {{{k}}} as the key {k!r} with no value; put a space "
                    f"after the colon: {key}={{{name}: {number}}}"
                )


def validate(raw: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_one_line(e)) from None


TYPE_TAGS = {"int", "float", "str", "bool", "list", "dict", "none"}  # a union member's place in `loc`


def _key(loc: tuple) -> str:
    """The dotted key of an error's ``loc``, without the union members pydantic adds to it
    (``constrained-float``, ``literal['auto']``)."""
    return ".".join(
        str(p) for p in loc if not isinstance(p, str) or (p.isidentifier() and p not in TYPE_TAGS)
    )


def _one_line(error: ValidationError) -> str:
    errors = error.errors()
    first = errors[0]
    key = _key(first["loc"])
    # the members of one union field fail together: one line with each member's message
    same = [e for e in errors if _key(e["loc"]) == key and e["loc"] != first["loc"]]
    message = "; or ".join(dict.fromkeys(e["msg"].removeprefix("Value error, ") for e in [first, *same]))
    errors = [e for e in errors if e is first or e not in same]
    unknown = [e for e in error.errors() if e["type"] == "extra_forbidden"]
    if unknown:
        return "; ".join(_unknown_key(_key(e["loc"])) for e in unknown) + " (see `rltrain --help-config`)"
    if message.startswith("masked_mean_denominator:"):  # (the message names its key)
        section = key.removesuffix(message.split(":")[0]).removesuffix(".")
        return f"{section + '.' if section else ''}{message}"
    if first["type"] == "value_error" and not key:
        return message  # a cross-section check names its keys itself; its input is the whole config
    if first.get("input", "") is None and first["type"] != "missing":
        message += " (YAML reads null, ~ and a key without a value as None)"
    shown = "" if first["type"] == "missing" else f"got {first['input']!r}; "
    more = f" (+{len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"{key or 'config'}: {shown}{message}{more}"


def _unknown_key(key: str) -> str:
    """``key: unknown key``, with the closest known keys of its section."""
    *parents, leaf = key.split(".")
    model: Any = Config
    for part in parents:
        field = model.model_fields.get(part) if isinstance(model, type) else None
        if field is None:
            break
        model = next((a for a in (field.annotation, *get_args(field.annotation))
                      if isinstance(a, type) and issubclass(a, BaseModel)), None)  # fmt: skip
    known = list(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else []
    close = difflib.get_close_matches(leaf, known, n=2, cutoff=0.6)
    hint = f" (did you mean {' or '.join('.'.join([*parents, c]) for c in close)}?)" if close else ""
    return f"{key}: unknown key{hint}"


def dump(config: Config, path: str | os.PathLike) -> None:
    Path(path).write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
