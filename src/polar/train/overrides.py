"""Dotted field paths over a pydantic config model: listing them, suggesting the one a mistyped path meant,
and command-line overrides (`--set loss.eps_high=0.3`) applied to the raw mapping before validation.

Generic over the root model (`polar.train.config` binds it to `TrainConfig` and to the TRL/verl names it
knows), so the config module keeps only its models and loading.
"""

from __future__ import annotations

import copy
import difflib
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel


class ConfigError(ValueError):
    """A training config that cannot be used, with `path:line: field: reason` in its message."""


class OverrideError(ConfigError):
    """A `--set` (or `--out`/`--steps`) that is malformed, names no field, or gives a bad value: a usage
    error of the command line, reported with the override as the user wrote it."""


# A name from another framework (TRL, verl) -> the field path that means the same, or None.
Aliases = Callable[[str], str | None]


def model_of(annotation: object) -> type[BaseModel] | None:
    """The pydantic model a field holds (`X` or `X | None`), or None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, types.UnionType):
        args = get_args(annotation)
        models = [m for a in args if (m := model_of(a)) is not None]
        if len(models) == 1 and len(args) == 2 and type(None) in args:
            return models[0]
    return None


def field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted field path of `model`: sections and their fields, in order."""
    out: list[str] = []
    for name, info in model.model_fields.items():
        out.append(prefix + name)
        sub = model_of(info.annotation)
        if sub is not None:
            out += field_paths(sub, f"{prefix}{name}.")
    return out


def suggest(path: Sequence[Any], model: type[BaseModel], aliases: Aliases | None = None) -> str | None:
    """The field path of `model` an unknown `path` most likely meant: what `aliases` maps it to (a TRL or
    verl key: `learning_rate` -> `optimizer.lr`), the same name in another section (`lr` ->
    `optimizer.lr`), else the closest spelling (`loss.eps_hi` -> `loss.eps_high`); None when nothing is
    close or the path runs through a list."""
    if not path or any(isinstance(p, int) for p in path):
        return None
    candidates = field_paths(model)
    key, last = ".".join(map(str, path)), str(path[-1])
    for typed in (key, last):  # a TRL or verl name typed by habit, alone or under polar's section
        if aliases is not None and (known := aliases(typed)) is not None:
            return known
    leaves: dict[str, str] = {}
    for c in candidates:
        leaves.setdefault(c.rsplit(".", 1)[-1], c)
    if last in leaves and leaves[last] != key:
        return leaves[last]
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if close:
        return close[0]
    close = difflib.get_close_matches(last, list(leaves), n=1, cutoff=0.7)
    return leaves[close[0]] if close else None


@dataclass(frozen=True, slots=True)
class Override:
    """One command-line change: the field at `path` set to `value`. `label` is the override as typed
    (`--set loss.eps_high=0.3`, `--steps 5`), so an error quotes what the user wrote."""

    label: str
    path: tuple[str, ...]
    value: Any


def check_path(label: str, path: tuple[str, ...], model: type[BaseModel], aliases: Aliases | None) -> None:
    """Raise `OverrideError` unless `path` names a field of `model` (through sections only)."""
    current: type[BaseModel] | None = model
    for i, name in enumerate(path):
        info = current.model_fields.get(name) if current is not None else None
        if info is None:
            hint = suggest(path, model, aliases)
            maybe = f" (did you mean {hint}?)" if hint else ""
            raise OverrideError(f"{label}: no config field {'.'.join(path)}{maybe}")
        current = model_of(info.annotation)
        if current is None and i < len(path) - 1:
            here = ".".join(path[: i + 1])
            raise OverrideError(
                f"{label}: {here} is a single value, not a section: set it whole ({here}=...)"
            )


def parse_override(text: str, model: type[BaseModel], aliases: Aliases | None = None) -> Override:
    """`KEY=VALUE` from `--set`: KEY a dotted field path (`optimizer.lr`), VALUE parsed as YAML, so `2e-6`,
    `true`, `null`, `[0.9, 0.95]`, `{eps_high: 0.3}` and `other.yaml` mean what they would in the file.
    A path that names no field of `model` raises `OverrideError` at once, with the closest field name."""
    label = f"--set {text}"
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise OverrideError(f"{label}: expected KEY=VALUE with a dotted KEY, e.g. --set loss.eps_high=0.3")
    path = tuple(key.split("."))
    if not all(path):
        raise OverrideError(f"{label}: {key!r} has an empty name between dots")
    check_path(label, path, model, aliases)
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise OverrideError(f"{label}: not a YAML value: {getattr(exc, 'problem', exc)}") from None
    return Override(label, path, value)


def _merged(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def apply_overrides(data: dict[str, Any], overrides: Sequence[Override]) -> dict[str, Any]:
    """A copy of the config mapping with each override applied in order (a later one wins); a mapping
    given for a section is merged into it, so `--set loss={eps_high: 0.3}` keeps the file's other keys."""
    out = copy.deepcopy(data)
    for o in overrides:
        node = out
        for name in o.path[:-1]:
            if not isinstance(node.get(name), dict):
                node[name] = {}
            node = node[name]
        leaf, value = o.path[-1], copy.deepcopy(o.value)
        node[leaf] = (
            _merged(node[leaf], value)
            if isinstance(value, dict) and isinstance(node.get(leaf), dict)
            else value
        )
    return out


def culprit(loc: Sequence[Any], overrides: Sequence[Override]) -> Override | None:
    """The last override that set the value at `loc` (or a value inside it, or the section holding it)."""
    for o in reversed(overrides):
        n = min(len(o.path), len(loc))
        if n and tuple(loc[:n]) == o.path[:n]:
            return o
    return None
