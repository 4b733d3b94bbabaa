"""Markdown tables from pydantic models: each field's type, default, constraints and description.

The models are the single source: the validator enforces the constraints rendered here, and the
description is the `Field(description=...)` text. Nested models get a table of their own (a `Section`),
with dotted field paths so a reader can write them as they are (`loss.eps_high`, `--set loss.eps_high=...`).
"""

from __future__ import annotations

import enum
import re
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined


@dataclass(frozen=True, slots=True)
class Section:
    """One table: the fields of `model`, named with `prefix` (`loss.`, `runtime.prepare[].`)."""

    title: str
    prefix: str
    model: type[BaseModel]


def anchor(title: str) -> str:
    """The anchor GitHub gives a heading (lowercase; punctuation dropped; spaces to hyphens)."""
    text = re.sub(r"[^\w\- ]", "", title.lower())
    return text.replace(" ", "-")


def cell(text: str) -> str:
    """Text safe inside a table cell: pipes escaped (GitHub renders `\\|` as `|`, in code spans too)."""
    return text.replace("|", "\\|").replace("\n", " ")


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _models_in(annotation: object) -> list[type[BaseModel]]:
    """The models a field holds, directly, optionally, in a list, as a map's values, or in a (discriminated)
    union."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = get_origin(annotation)
    if origin is Annotated:
        return _models_in(get_args(annotation)[0])
    if origin is dict:
        return _models_in(get_args(annotation)[1])
    if origin in (Union, types.UnionType, list):
        return [m for a in get_args(annotation) for m in _models_in(a)]
    return []


def _literal_tag(model: type[BaseModel]) -> str | None:
    """A union member's discriminator value (`type: upload`), for its section title."""
    info = model.model_fields.get("type")
    if info is not None and get_origin(info.annotation) is Literal:
        return str(get_args(info.annotation)[0])
    return None


def sections(root: type[BaseModel], title: str, prefix: str = "") -> list[Section]:
    """`root`'s table, then one per nested model in field order (depth first)."""
    out = [Section(title, prefix, root)]
    for name, info in root.model_fields.items():
        for sub in _models_in(info.annotation):
            origin = get_origin(info.annotation)
            path = f"{prefix}{name}{'[]' if origin is list else '.<name>' if origin is dict else ''}"
            tag = _literal_tag(sub)
            out += sections(sub, f"`{path}`" + (f" ({tag})" if tag else ""), f"{path}.")
    return out


def _number(value: float | int) -> str:
    return re.sub(r"e([+-])0*(\d)", r"e\1\2", repr(value))


def value_text(value: object) -> str:
    """A value as it would be written in YAML (`null`, `true`, `1e-6`, `[0.9, 0.999]`)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return value_text(value.value)
    if isinstance(value, int | float):
        return _number(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {value_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def type_text(annotation: object, link: Callable[[type[BaseModel]], str] | None = None) -> str:
    """A field's type for readers: `float | null`, `grpo | rloo | dr_grpo`, `list[int]`, a model's link."""
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return link(annotation) if link else "object"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(str(m.value) for m in annotation)
    if isinstance(annotation, type):
        return {"str": "str", "int": "int", "float": "float", "bool": "bool"}.get(
            annotation.__name__, annotation.__name__
        )
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " | ".join(value_text(a) for a in args)
    if origin is Annotated:
        bounds = [m for m in args[1:] if isinstance(m, FieldInfo)]
        limits = [c for b in bounds for c in b.metadata]
        if args[0] is int and {type(c) for c in limits} == {at.Ge, at.Le}:
            low = next(c.ge for c in limits if isinstance(c, at.Ge))
            high = next(c.le for c in limits if isinstance(c, at.Le))
            if (low, high) == (0, 1):
                return "0/1"
        return type_text(args[0], link)
    if origin in (Union, types.UnionType):
        models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) > 1 and link is not None:
            return "one of " + ", ".join(link(m) for m in models)
        return " | ".join(type_text(a, link) for a in args)
    if origin is list:
        return f"list[{type_text(args[0], link)}]"
    if origin is tuple:
        return "[" + ", ".join(type_text(a, link) for a in args) + "]"
    if origin is dict:
        return f"map[{type_text(args[0], link)}, {type_text(args[1], link)}]"
    return str(annotation)


_BOUNDS: tuple[tuple[type, str, str], ...] = (
    (at.Gt, "gt", "> {}"),
    (at.Ge, "ge", ">= {}"),
    (at.Lt, "lt", "< {}"),
    (at.Le, "le", "<= {}"),
    (at.MinLen, "min_length", "length >= {}"),
    (at.MaxLen, "max_length", "length <= {}"),
)


def constraints_text(info: FieldInfo) -> str:
    """The field's bounds as the validator enforces them (`>= 1`, `< 1`, `length <= 200`)."""
    out: list[str] = []
    for item in info.metadata:
        for kind, attr, fmt in _BOUNDS:
            if isinstance(item, kind):
                out.append(fmt.format(value_text(getattr(item, attr))))
    return ", ".join(out)


def default_text(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
        return "see below" if isinstance(value, BaseModel) else value_text(value)
    if info.default is PydanticUndefined:
        return "required"
    return value_text(info.default)


def rows(section: Section, link: Callable[[type[BaseModel]], str]) -> Iterator[list[str]]:
    for name, info in section.model.model_fields.items():
        default = default_text(info)
        yield [
            f"`{section.prefix}{name}`",
            type_text(info.annotation, link),
            default if default in ("required", "see below") else f"`{default}`",
            constraints_text(info),
            info.description or "",
        ]


def render(parts: Sequence[Section], level: str = "###") -> str:
    """Every section as a heading, its model's docstring and its table; nested models link to theirs."""
    anchors = {s.model: anchor(s.title) for s in parts}
    titles = {s.model: s.title for s in parts}

    def link(model: type[BaseModel]) -> str:
        return (
            f"[{titles[model].replace('`', '')}](#{anchors[model]})" if model in anchors else model.__name__
        )

    out: list[str] = []
    for s in parts:
        out.append(f"{level} {s.title}")
        doc = s.model.__doc__
        if doc and not doc.startswith(f"{s.model.__name__}("):
            out.append(" ".join(doc.split()))
        out.append(table(["field", "type", "default", "constraints", "meaning"], list(rows(s, link))))
    return "\n\n".join(out)
