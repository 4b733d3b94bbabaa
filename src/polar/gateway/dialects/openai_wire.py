"""What the two OpenAI dialects (Chat and Responses) share at the wire edge.

Validation errors become a `GatewayError` whose `param` is the offending field path written the way OpenAI
writes it (`messages[2].content[0].type`), error envelopes follow OpenAI's `{"error": {...}}` shape, and a
few small helpers keep the synthetic streams cheap.
"""

from __future__ import annotations

import re
import time
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from polar.gateway.errors import GatewayError, invalid

T = TypeVar("T")


def validate(adapter: TypeAdapter[T], body: Any) -> T:
    """`adapter.validate_python(body)`, with any failure turned into a 400 that names the field.

    Schemas are pydantic-validated `TypedDict`s; pydantic drops keys they do not declare, which is what
    real OpenAI-compatible servers (vLLM, SGLang, OpenAI itself for many fields) do with fields they do
    not know. Harnesses send plenty (`user`, `store`, `metadata`, vendor extras).
    """
    if not isinstance(body, dict):
        raise invalid(f"The request body must be a JSON object, got {_json_type(body)}.", param=None)
    try:
        # Strict, like OpenAI: `"stream": "yes"` or `"max_tokens": "64"` is a type error, not a coercion.
        return adapter.validate_python(body, strict=True)
    except ValidationError as exc:
        raise validation_error(exc, body) from None


# Pydantic puts union member names (`str`, `list[...]`, a discriminator tag such as `user`) into error
# locations; they are not fields. Walking the location against the data keeps only real keys and indices.
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def field_path(loc: tuple[int | str, ...], body: Any) -> tuple[str, Any]:
    """The OpenAI-style path of a pydantic error location, and the value found there (None if absent)."""
    path = ""
    node: Any = body
    last = len(loc) - 1
    for i, part in enumerate(loc):
        if isinstance(part, int) and isinstance(node, list) and 0 <= part < len(node):
            path += f"[{part}]"
            node = node[part]
        elif isinstance(part, str) and isinstance(node, dict) and part in node:
            path += f".{part}" if path else part
            node = node[part]
        elif (
            i == last
            and isinstance(part, str)
            and isinstance(node, dict)
            and _IDENT.match(part)
            and part not in _TYPE_NAMES
        ):
            # A missing field: it is not in the data, but it is the field to name.
            path += f".{part}" if path else part
            node = None
    return path, node


def validation_error(exc: ValidationError, body: Any) -> GatewayError:
    """One clear 400 out of a pydantic error list: the deepest error is the most specific one (a union of
    `str | list[part]` reports a useless `string_type` next to the real problem inside the list)."""
    errors = exc.errors(include_url=False)
    err = max(errors, key=lambda e: len(e["loc"]))
    path, value = field_path(tuple(err["loc"]), body)
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        disc = str(ctx.get("discriminator", "'type'")).strip("'")
        if not _IDENT.match(disc):  # a callable discriminator (`_item_type()`) always reads `type`
            disc = "type"
        if not isinstance(value, dict):
            return invalid(f"Invalid type for '{path}': expected an object, got {_json_type(value)}.", path)
        where = f"{path}.{disc}" if path else disc
        if disc not in value:
            return invalid(f"Missing required parameter: '{where}'.", where)
        if not isinstance(value[disc], str):
            return invalid(
                f"Invalid type for '{where}': expected a string, but got {_json_type(value[disc])} instead.",
                where,
            )
        return invalid(
            f"Unsupported value for '{where}': {value[disc]!r} is not supported here "
            f"(supported: {ctx.get('expected_tags')}).",
            where,
        )
    if kind == "missing":
        return invalid(f"Missing required parameter: '{path}'.", path)
    if kind in _EXPECTED:
        # A type mismatch: name every type the union at this location would have taken, as OpenAI does.
        expected = []
        for e in errors:
            want = _EXPECTED.get(e["type"])
            if want and want not in expected and field_path(tuple(e["loc"]), body)[0] == path:
                expected.append(want)
        return invalid(
            f"Invalid type for '{path}': expected {' or '.join(expected)}, but got {_json_type(value)} instead.",
            path or None,
        )
    return invalid(f"Invalid value for '{path}': {err['msg']}.", path or None)


_EXPECTED = {
    "string_type": "a string",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "a boolean",
    "bool_parsing": "a boolean",
    "none_required": "null",
}


def _json_type(value: Any) -> str:
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


# GatewayError kind -> (OpenAI error `type`, OpenAI error `code`). Types and codes are the ones OpenAI's own
# API returns; clients key on them: Codex maps `context_length_exceeded` to its context-window handling and
# retries `server_error`-like failures, the openai SDK picks its exception class from the HTTP status.
_TYPE_CODE: dict[str, tuple[str, str | None]] = {
    "invalid_request": ("invalid_request_error", None),
    "authentication": ("invalid_request_error", "invalid_api_key"),
    "permission": ("permission_error", "insufficient_permissions"),
    "not_found": ("invalid_request_error", None),
    "request_too_large": ("invalid_request_error", "request_too_large"),
    "context_length": ("invalid_request_error", "context_length_exceeded"),
    "rate_limit": ("requests", "rate_limit_exceeded"),
    "upstream_error": ("server_error", "server_error"),
    # OpenAI answers an overloaded server with code null; Codex retries a null code, while its
    # `server_is_overloaded` handling gives up and asks the user to switch models.
    "overloaded": ("server_error", None),
    "timeout": ("server_error", "timeout"),
}


def error_object(err: GatewayError, message: str | None = None, param: str | None = None) -> dict[str, Any]:
    """The inner OpenAI error object `{message, type, param, code}`."""
    etype, code = _TYPE_CODE.get(err.kind, ("server_error", None))
    if err.kind == "not_found" and err.param == "model":
        code = "model_not_found"
    return {
        "message": message if message is not None else err.message,
        "type": etype,
        "param": param if param is not None else err.param,
        "code": code,
    }


def settle_tool_choice(choice: Any, has_tools: bool) -> Any:
    """The tool choice to forward. vLLM refuses any `tool_choice` sent without `tools` ("When using
    `tool_choice`, `tools` must be set"), which happens when a harness sends `auto` with no tools or when
    every tool was a hosted one we dropped; `auto`/`none` then mean nothing and are dropped, while a choice
    that forces a call cannot be honoured and is refused."""
    if has_tools:
        return choice
    if choice is None or choice in ("auto", "none"):
        return None
    raise invalid(
        "'tool_choice' requires a tool call, but the request has no tools the model can call.", "tool_choice"
    )


# vLLM's Chat schema takes `reasoning_effort` only as low/medium/high and rejects anything else with a 400;
# harnesses also send `minimal`, `none` or `xhigh`. Those stay in the echo but are not forwarded.
_UPSTREAM_EFFORTS = frozenset({"low", "medium", "high"})


def upstream_effort(effort: str | None) -> str | None:
    """The reasoning effort to forward upstream, or None when the inference server would refuse it."""
    return effort if effort in _UPSTREAM_EFFORTS else None


def unix_now() -> int:
    return int(time.time())


def split_text(text: str, parts: int = 4, min_piece: int = 24) -> list[str]:
    """Cut `text` into at most `parts` roughly equal pieces (none shorter than `min_piece` characters).

    A synthetic stream has the whole text at once; a few deltas exercise every client's accumulation path
    without paying one frame per token.
    """
    n = min(parts, max(1, len(text) // min_piece))
    if n <= 1:
        return [text]
    step = -(-len(text) // n)
    return [text[i : i + step] for i in range(0, len(text), step)]
