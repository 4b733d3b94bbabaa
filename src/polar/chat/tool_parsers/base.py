"""What every tool-call parser returns, and the shared rules.

A parser turns the model's answer text into structured calls. When the text clearly starts a tool call
that does not parse (bad JSON, an unclosed tag, a missing name) the result carries `error` and the whole
text stays content: we never repair a call, the gateway records the flag and the sample is trained as a
failure.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from polar.jsontypes import JSON


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object
    id: str


@dataclass(frozen=True, slots=True)
class ToolParse:
    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)
    error: str | None = None


class ToolParser(Protocol):
    name: str
    # Special tokens that mark calls (Mistral's [TOOL_CALLS]) must survive detokenization.
    needs_special_tokens: bool

    def parse(self, text: str, tools: list[dict[str, Any]] | None) -> ToolParse: ...

    def call_start(self, text: str) -> int:
        """Index where a tool call begins in `text`, or -1 (streaming stops emitting content there)."""
        ...

    def pending(self, text: str) -> int:
        """Length of a suffix of `text` that may be the start of a call marker (held back while streaming)."""
        ...


def chat_calls(calls: Sequence[ParsedCall]) -> list[dict[str, Any]]:
    """Parsed calls as an OpenAI Chat message's `tool_calls`."""
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


def call_id() -> str:
    return f"chatcmpl-tool-{secrets.token_hex(16)}"


def mistral_call_id() -> str:
    # Mistral's templates reject tool call ids that are not exactly 9 alphanumeric characters.
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


def arguments_json(value: JSON) -> str | None:
    """Arguments as JSON object text, or None when they are not an object (or JSON text of one)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def failed(text: str, why: str) -> ToolParse:
    return ToolParse(content=text or None, calls=[], error=why)


def marker_pending(text: str, markers: tuple[str, ...]) -> int:
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:n]):
                best = max(best, n)
                break
    return best


def leading_content(text: str, start: int) -> str | None:
    head = text[:start]
    return head if head.strip() else None


class ToolCallTagParser:
    """Formats whose calls open with `<tool_call>` (Hermes/Qwen JSON and Qwen3-Coder XML): a call starts at
    the tag, and a streamed text that ends in a prefix of it may still become one."""

    open_tag = "<tool_call>"
    needs_special_tokens = False

    def call_start(self, text: str) -> int:
        return text.find(self.open_tag)

    def pending(self, text: str) -> int:
        return marker_pending(text, (self.open_tag,))
