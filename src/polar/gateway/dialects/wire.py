"""Helpers the Anthropic and Gemini dialects share at the wire edge.

Pydantic does the validation; this module turns its errors into one 400 that names the offending field the
way the caller wrote it (`messages[2].content[0].source.type`), and holds the small conversions both
dialects need (tool arguments text <-> JSON object, data URLs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import orjson
from pydantic import TypeAdapter, ValidationError

from polar.gateway.errors import GatewayError
from polar.gateway.signatures import ReasoningCodec

# A tool call whose arguments are not a JSON object cannot be an Anthropic `input` or a Gemini `args` (both
# must be objects). We never invent arguments: the raw text travels under this one key, the harness's own
# schema validation rejects it (so the policy is told its call was malformed), and when the harness sends
# the call back in its history the raw text is restored exactly.
RAW_ARGUMENTS_KEY = "_polar_raw_arguments"

T = TypeVar("T")


def validation_error(exc: ValidationError, body: Any) -> GatewayError:
    """The one `invalid_request` error for a failed validation, naming the deepest offending field."""
    errors = exc.errors(include_url=False, include_input=False)
    # Unions report one error per branch; the deepest location is the branch the caller meant.
    err = max(errors, key=lambda e: len(e["loc"]))
    path = field_path(body, err["loc"])
    kind = err["type"]
    if kind == "missing":
        message = f"missing required field {path}"
    elif kind == "union_tag_invalid":
        ctx = err.get("ctx") or {}
        path = f"{path}.type" if path else "type"
        message = f"unsupported {path} {ctx.get('tag')!r}; supported: {ctx.get('expected_tags')}"
    elif kind == "union_tag_not_found":
        path = f"{path}.type" if path else "type"
        message = f"missing required field {path}"
    else:
        message = f"invalid {path or 'body'}: {err['msg']}"
    return GatewayError("invalid_request", message, param=path or None)


def field_path(body: Any, loc: tuple[int | str, ...]) -> str:
    """Render a pydantic location as a path into the caller's JSON.

    Pydantic locations also hold union branch labels (`str`, `list[...]`) and discriminator tags (`text`
    right after a list index); we walk the input alongside and keep only the steps that exist in it, plus a
    final missing key.
    """
    out: list[str] = []
    node = body
    after_index = False
    last = len(loc) - 1
    for i, step in enumerate(loc):
        if isinstance(step, int):
            if isinstance(node, list) and 0 <= step < len(node):
                out.append(f"[{step}]")
                node = node[step]
                after_index = True
            continue
        if isinstance(node, dict):
            if after_index and node.get("type") == step and i != last:
                after_index = False  # discriminator tag of the item we just entered
                continue
            if step in node:
                out.append(f".{step}" if out else step)
                node = node[step]
            elif i == last:
                out.append(f".{step}" if out else step)
        after_index = False
    return "".join(out)


def validate(schema: TypeAdapter[T], body: Any) -> T:
    """Validate `body` against a wire schema (unknown keys are dropped), raising the 400 on failure."""
    if not isinstance(body, dict):
        raise GatewayError("invalid_request", "the request body must be a JSON object")
    try:
        return schema.validate_python(body)
    except ValidationError as exc:
        raise validation_error(exc, body) from None


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
    """Remembers what signatures decode to (their reasoning, or None for a foreign one).

    Harnesses send the whole history back on every call, so each signature is verified again and again
    (HMAC + zlib, about 5 us each; a long Claude Code session carries hundreds). Entries are keyed by the
    codec object too, so a token is only ever trusted under the key that verified it. Oldest entries go
    first once `size` is reached.
    """

    def __init__(self, decode: Callable[[ReasoningCodec, str], str | None], size: int = 4096) -> None:
        self._decode = decode
        self._size = size
        self._entries: dict[tuple[ReasoningCodec, str], str | None] = {}

    def __call__(self, codec: ReasoningCodec, token: str | None) -> str | None:
        if not token:
            return None
        key = (codec, token)
        try:
            return self._entries[key]
        except KeyError:
            pass
        text = self._decode(codec, token)
        if len(self._entries) >= self._size:
            del self._entries[next(iter(self._entries))]
        self._entries[key] = text
        return text
