"""The one validation edge every dialect shares.

Pydantic does the checking; this module turns its error list into a single 400 `GatewayError` that names
the offending field the way the caller wrote it (`messages[2].content[0].type`), in the words of the
caller's API family (a `Style`). The analysis is the same for all four dialects: only the wording, and
whether strings may be coerced into numbers, differ.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from polar.gateway.errors import GatewayError, invalid
from polar.jsontypes import JSON

T = TypeVar("T")

# Pydantic error types that mean "wrong JSON type here", the keys of every `Style.types`.
TYPE_ERRORS = frozenset(
    {
        "string_type",
        "list_type",
        "dict_type",
        "model_type",
        "model_attributes_type",
        "int_type",
        "int_parsing",
        "float_type",
        "float_parsing",
        "bool_type",
        "bool_parsing",
        "none_required",
    }
)


@dataclass(frozen=True, slots=True)
class Style:
    """How one API family validates a body and words a refusal.

    Templates are `str.format` strings over `path` (the caller's field path), `got` (the JSON type the
    caller sent), `expected` (every type the field accepts, joined with "or"), `tag`/`supported` (a
    discriminator value and the accepted ones) and `detail` (pydantic's own words).
    """

    strict: bool  # refuse `"64"` for an integer instead of coercing it
    types: Mapping[str, str]  # pydantic type-error kind -> the name of the type it wanted
    not_object: str
    missing: str
    wrong_type: str
    unsupported: str
    invalid: str

    def __post_init__(self) -> None:
        if set(self.types) != TYPE_ERRORS:
            raise ValueError(f"a Style names exactly these type errors: {sorted(TYPE_ERRORS)}")


def validate(adapter: TypeAdapter[T], body: JSON, style: Style) -> T:
    """`adapter.validate_python(body)`, with any failure turned into a 400 that names the field.

    Schemas drop keys they do not declare, which is what real servers do with fields they do not know;
    harnesses send plenty (`user`, `store`, `metadata`, vendor extras).
    """
    if not isinstance(body, dict):
        raise invalid(style.not_object.format(got=json_type(body)))
    try:
        return adapter.validate_python(body, strict=style.strict)
    except ValidationError as exc:
        raise validation_error(exc, body, style) from None


def validation_error(exc: ValidationError, body: JSON, style: Style) -> GatewayError:
    """One clear 400 out of a pydantic error list.

    The deepest error is the most specific one: a union reports one error per branch (`str | list[part]`
    gives a useless `string_type` next to the real problem inside the list).
    """
    errors = exc.errors(include_url=False, include_input=False)
    err = max(errors, key=lambda e: len(e["loc"]))
    path, value = field_path(tuple(err["loc"]), body)
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        return _tag_error(style, path, value, ctx)
    if kind == "missing":
        return invalid(style.missing.format(path=path), path or None)
    if kind in style.types:
        # A type mismatch: name every type the union at this location would have taken.
        expected: list[str] = []
        for e in errors:
            want = style.types.get(e["type"])
            if want and want not in expected and field_path(tuple(e["loc"]), body)[0] == path:
                expected.append(want)
        message = style.wrong_type.format(path=path, expected=" or ".join(expected), got=json_type(value))
        return invalid(message, path or None)
    return invalid(style.invalid.format(path=path or "body", detail=err["msg"]), path or None)


def _tag_error(style: Style, path: str, value: JSON, ctx: dict[str, Any]) -> GatewayError:
    """A discriminated union that could not pick a member: name the tag field, not the whole object."""
    disc = str(ctx.get("discriminator", "'type'")).strip("'")
    if not _IDENT.match(disc):  # a callable discriminator (`_item_type()`) always reads `type`
        disc = "type"
    if not isinstance(value, dict):
        message = style.wrong_type.format(path=path, expected=style.types["dict_type"], got=json_type(value))
        return invalid(message, path or None)
    where = f"{path}.{disc}" if path else disc
    if disc not in value:
        return invalid(style.missing.format(path=where), where)
    tag = value[disc]
    if not isinstance(tag, str):
        message = style.wrong_type.format(path=where, expected=style.types["string_type"], got=json_type(tag))
        return invalid(message, where)
    message = style.unsupported.format(path=where, tag=tag, supported=ctx.get("expected_tags"))
    return invalid(message, where)


# Pydantic puts union member names (`str`, `list[...]`) and discriminator tags (`text`, `user`) into error
# locations; they are not fields. Walking the location against the data keeps only real keys and indices.
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def field_path(loc: tuple[int | str, ...], body: JSON) -> tuple[str, JSON]:
    """The caller's path to a pydantic error location, and the value found there (None if absent).

    A missing field is not in the data but is the field to name, so a final key-like step is kept.
    """
    path = ""
    node: JSON = body
    last = len(loc) - 1
    for i, step in enumerate(loc):
        if isinstance(step, int):
            if isinstance(node, list) and 0 <= step < len(node):
                path += f"[{step}]"
                node = node[step]
        elif isinstance(node, dict):
            if step in node and not (i < last and _is_tag(node, step, loc[i + 1])):
                path += f".{step}" if path else step
                node = node[step]
            elif i == last and _is_field_name(step):
                path += f".{step}" if path else step
                node = None
    return path, node


def _is_tag(node: dict[str, Any], step: str, following: int | str) -> bool:
    """Whether `step`, also a key of `node`, is the discriminator tag of the union member `node` is.

    `{"type": "text", "text": "hi", "cache_control": 5}` fails at `(..., "text", "cache_control")`, where
    `text` is the tag; `{"type": "function", "function": {}}` fails at `(..., "function", "name")`, where
    `function` is a field. What follows the step tells them apart.
    """
    if node.get("type") != step or isinstance(following, int):
        return False
    child = node[step]
    if isinstance(child, dict):
        return following not in child and following in node
    return following in node or _is_field_name(following)


def _is_field_name(step: str) -> bool:
    return bool(_IDENT.match(step)) and step not in _TYPE_NAMES


def json_type(value: JSON) -> str:
    """What a JSON value is, in words (`an array`)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
