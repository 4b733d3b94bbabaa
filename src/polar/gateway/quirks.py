"""Normalizers for harness habits that would break token prefixes, applied to every request before upstream.

A quirk is a function that returns a new `CanonicalRequest` when it changed something and `None` when it
did not apply, so the proxy can record which quirks touched a call. Quirks never mutate their input: the
request (and its message dicts) may be shared with capture.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from polar.gateway.canonical import CanonicalRequest
from polar.jsontypes import JSON

Quirk = Callable[[CanonicalRequest], CanonicalRequest | None]

# Claude Code (>= 2.1.36) sends `system[0]` = "x-anthropic-billing-header: cc_version=2.1.197.a3f;
# cc_entrypoint=sdk-cli; cch=5e1d0;", whose `cch` changes on every call (anthropics/claude-code#68900).
# Only that line goes, with its line break, wherever it starts a line of the system prompt.
_BILLING_MARK = "x-anthropic-billing-header:"


def _strip_billing(text: str) -> str | None:
    """`text` without its billing lines, or None when it has none. `str.find` rather than a multiline
    regex: system prompts are tens of kilobytes and this runs on every call."""
    start = text.find(_BILLING_MARK)
    if start < 0:
        return None
    pieces: list[str] = []
    kept_from = 0
    while start >= 0:
        if start == 0 or text[start - 1] == "\n":
            end = text.find("\n", start)
            end = len(text) if end < 0 else end + 1
            pieces.append(text[kept_from:start])
            kept_from = end
            start = text.find(_BILLING_MARK, end)
        else:
            start = text.find(_BILLING_MARK, start + 1)
    if not pieces:
        return None
    pieces.append(text[kept_from:])
    return "".join(pieces)


def strip_claude_code_billing_header(req: CanonicalRequest) -> CanonicalRequest | None:
    """Removes Claude Code's per-call billing line from system messages."""
    messages: list[dict[str, Any]] | None = None
    for i, msg in enumerate(req.messages):
        if msg.get("role") != "system":
            continue
        content = msg.get("content")
        new_content: JSON = None
        if isinstance(content, str):
            new_content = _strip_billing(content)
        elif isinstance(content, list):
            new_content = _strip_parts(content)
        if new_content is None:
            continue
        if messages is None:
            messages = list(req.messages)
        messages[i] = {**msg, "content": new_content}
    if messages is None:
        return None
    # A system prompt that was nothing but the billing line would render as an empty system turn.
    messages = [m for m in messages if not (m.get("role") == "system" and m.get("content") in ("", []))]
    return dataclasses.replace(req, messages=messages)


def _strip_parts(parts: list[Any]) -> list[Any] | None:
    changed = False
    out: list[Any] = []
    for part in parts:
        if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            stripped = _strip_billing(part["text"])
            if stripped is not None:
                changed = True
                if stripped:
                    out.append({**part, "text": stripped})
                continue
        out.append(part)
    return out if changed else None


# Order matters only if two quirks touch the same text; names are what the proxy records.
QUIRKS: tuple[tuple[str, Quirk], ...] = (("claude_code_billing_header", strip_claude_code_billing_header),)


def apply_quirks(req: CanonicalRequest) -> tuple[CanonicalRequest, tuple[str, ...]]:
    """Run every registered quirk; return the normalized request and the names of those that applied."""
    applied: list[str] = []
    for name, quirk in QUIRKS:
        out = quirk(req)
        if out is not None:
            req = out
            applied.append(name)
    return req, tuple(applied)
