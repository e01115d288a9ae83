"""``--help-config``: every key with its value and the documentation under its field."""

from __future__ import annotations

import textwrap
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel

from rltrain.config.optimization import ConfigError
from rltrain.config.root import Config


def describe(
    config: Config | None = None, section: str | None = None, builtins: dict[str, list[str]] | None = None
) -> str:
    """Every key (under ``section``, a dotted prefix) with its type's allowed values, its value
    (``config``'s: the values a run would use; the defaults otherwise) and its docstring, for
    ``--help-config``. ``builtins``: the built-in names the code offers for a key, listed with it."""
    lines = []

    def walk(model: type[BaseModel], prefix: str, values: BaseModel | None) -> None:
        for name, field in model.model_fields.items():
            # an optional section (`critic`) is described like a present one
            annotation = next(
                (a for a in get_args(field.annotation) if a is not type(None)), field.annotation
            )
            value = getattr(values, name) if values is not None else field.default
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                walk(annotation, f"{prefix}{name}.", value if isinstance(value, BaseModel) else None)
                continue
            key = f"{prefix}{name}"
            if section and not (key == section or key.startswith(section + ".")):
                continue
            doc = (field.description or "").strip()
            choices = _choices(field.annotation)
            if choices:
                alone = get_origin(field.annotation) is Literal or all(
                    get_origin(a) is Literal or a is type(None) for a in get_args(field.annotation)
                )
                doc += f"\n{'One of' if alone else 'Besides a value of its type'}: {', '.join(choices)}."
            if builtins and key in builtins:
                doc += f"\nBuilt-ins: {', '.join(builtins[key])}."
            lines.append(f"{key} = {value!r}\n{textwrap.indent(doc, '    ')}")

    walk(Config, "", config)
    if section and not lines:
        sections = ", ".join(Config.model_fields)
        raise ConfigError(f"--help-config {section}: no such key or section (sections: {sections})")
    return "\n".join(lines)


def _choices(annotation: Any) -> list[str]:
    """The values a ``Literal`` (alone or in a union) allows, as YAML writes them."""
    if get_origin(annotation) is Literal:
        return [
            yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()
            for v in get_args(annotation)
        ]
    if get_origin(annotation) in (Union, UnionType):
        found = [c for a in get_args(annotation) for c in _choices(a)]
        if found and type(None) in get_args(annotation):
            found.append("null")
        return found
    return []
