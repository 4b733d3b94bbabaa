"""What the two OpenAI dialects (Chat and Responses) share at the wire edge.

Validation errors are worded the way OpenAI words them (`OPENAI_STYLE`, for `validation.validate`), error
envelopes follow OpenAI's `{"error": {...}}` shape, and a few small helpers keep the synthetic streams
cheap.
"""

from __future__ import annotations

import time
from typing import Any

from polar.gateway.dialects.validation import Style
from polar.gateway.errors import GatewayError, invalid
from polar.jsontypes import JSON

# OpenAI's own wording (`Missing required parameter: 'model'.`), and its strictness: `"stream": "yes"` or
# `"max_tokens": "64"` is a type error, not a coercion. A type error names every JSON type the field takes.
OPENAI_STYLE = Style(
    strict=True,
    types={
        "string_type": "a string",
        "list_type": "an array",
        "dict_type": "an object",
        "model_type": "an object",
        "model_attributes_type": "an object",
        "int_type": "an integer",
        "int_parsing": "an integer",
        "float_type": "a number",
        "float_parsing": "a number",
        "bool_type": "a boolean",
        "bool_parsing": "a boolean",
        "none_required": "null",
    },
    not_object="The request body must be a JSON object, got {got}.",
    missing="Missing required parameter: '{path}'.",
    wrong_type="Invalid type for '{path}': expected {expected}, but got {got} instead.",
    unsupported="Unsupported value for '{path}': {tag!r} is not supported here (supported: {supported}).",
    invalid="Invalid value for '{path}': {detail}.",
)


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


def settle_tool_choice(choice: JSON, has_tools: bool) -> JSON:
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
