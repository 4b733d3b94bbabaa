"""Helpers the Anthropic and Gemini dialects share at the wire edge.

How both word a validation error (`PLAIN_STYLE`, for `validation.validate`), the small conversions both
dialects need (tool arguments text <-> JSON object, data URLs), and the reasoning-token cache that the
Responses dialect uses too.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

import orjson

from polar.gateway.dialects.validation import Style
from polar.gateway.signatures import ReasoningCodec

# A tool call whose arguments are not a JSON object cannot be an Anthropic `input` or a Gemini `args` (both
# must be objects). We never invent arguments: the raw text travels under this one key, the harness's own
# schema validation rejects it (so the policy is told its call was malformed), and when the harness sends
# the call back in its history the raw text is restored exactly.
RAW_ARGUMENTS_KEY = "_polar_raw_arguments"

# Pydantic's own phrasing ("Input should be a valid dictionary"). Lax: a number written as a string is
# taken, as protobuf's JSON mapping (which Gemini's API follows) accepts either form for numeric fields.
PLAIN_STYLE = Style(
    strict=False,
    types={
        "string_type": "a valid string",
        "list_type": "a valid list",
        "dict_type": "a valid dictionary",
        "model_type": "a valid dictionary",
        "model_attributes_type": "a valid dictionary",
        "int_type": "a valid integer",
        "int_parsing": "a valid integer",
        "float_type": "a valid number",
        "float_parsing": "a valid number",
        "bool_type": "a valid boolean",
        "bool_parsing": "a valid boolean",
        "none_required": "None",
    },
    not_object="the request body must be a JSON object, got {got}",
    missing="missing required field {path}",
    wrong_type="invalid {path}: Input should be {expected}, got {got}",
    unsupported="unsupported {path} {tag!r}; supported: {supported}",
    invalid="invalid {path}: {detail}",
)


def tool_input(arguments: str) -> dict[str, Any]:
    """The JSON object of a tool call's arguments, or the raw text wrapped under `RAW_ARGUMENTS_KEY`."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {RAW_ARGUMENTS_KEY: arguments}
    if isinstance(value, dict):
        return value
    return {RAW_ARGUMENTS_KEY: arguments}


def tool_input_json(arguments: str) -> str:
    """The JSON text of `tool_input(arguments)`: the model's own text when it is an object (streamed as it
    was sampled, no re-serialization), else the wrapped form."""
    value = tool_input(arguments)
    if len(value) == 1 and value.get(RAW_ARGUMENTS_KEY) is arguments:
        return orjson.dumps(value).decode()
    return arguments


def tool_arguments(value: dict[str, Any]) -> str:
    """Compact JSON text of tool input sent back in history; restores raw text we wrapped ourselves."""
    if len(value) == 1:
        raw = value.get(RAW_ARGUMENTS_KEY)
        if isinstance(raw, str):
            return raw
    return orjson.dumps(value).decode()


def data_url(mime_type: str, data: str) -> str:
    """An OpenAI `image_url` data URL; the base64 payload is passed through untouched."""
    return f"data:{mime_type};base64,{data}"


class SignatureCache:
    """Remembers what reasoning tokens decode to (their reasoning, or None for a foreign one).

    Harnesses send the whole history back on every call, so each token is verified again and again (HMAC +
    zlib, about 5 us each; a long Claude Code session carries hundreds, a Codex history re-sends every
    reasoning item): without a cache a session's decoding work grows with the square of its length.
    Entries are keyed by the codec object too, so a token is only ever trusted under the key that verified
    it. The least recently used entry goes once `size` is reached.
    """

    def __init__(self, decode: Callable[[ReasoningCodec, str], str | None], size: int = 4096) -> None:
        self._lookup = lru_cache(maxsize=size)(decode)

    def __call__(self, codec: ReasoningCodec, token: str | None) -> str | None:
        return self._lookup(codec, token) if token else None
