"""Mistral calls after the `[TOOL_CALLS]` control token, in both generations of the format:
`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (tokenizers up to v7) and
`[TOOL_CALLS]name[ARGS]{...}` repeated (v11 and later)."""

from __future__ import annotations

import json
from typing import Any

from polar.chat.tool_parsers.base import (
    ParsedCall,
    ToolParse,
    arguments_json,
    failed,
    leading_content,
    marker_pending,
    mistral_call_id,
)

MARK = "[TOOL_CALLS]"
ARGS = "[ARGS]"


class MistralParser:
    name = "mistral"
    needs_special_tokens = True

    def call_start(self, text: str) -> int:
        return text.find(MARK)

    def pending(self, text: str) -> int:
        return marker_pending(text, (MARK,))

    def parse(self, text: str, tools: list[dict[str, Any]] | None) -> ToolParse:
        start = text.find(MARK)
        if start < 0:
            return ToolParse(content=text or None)
        body = text[start + len(MARK) :].strip()
        calls: list[ParsedCall] = []
        if body.startswith("["):
            try:
                items = json.loads(body)
            except ValueError as exc:
                return failed(text, f"tool calls are not JSON: {exc}")
            if not isinstance(items, list) or not items:
                return failed(text, "tool calls are not a list")
            for obj in items:
                if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                    return failed(text, "tool call has no name")
                args = arguments_json(obj.get("arguments", {}))
                if args is None:
                    return failed(text, "tool call arguments are not a JSON object")
                calls.append(ParsedCall(obj["name"], args, mistral_call_id()))
        else:
            for chunk in text[start:].split(MARK)[1:]:
                name, sep, raw = chunk.partition(ARGS)
                if not sep or not name.strip():
                    return failed(text, "tool call without [ARGS]")
                args = arguments_json(raw.strip())
                if args is None:
                    return failed(text, "tool call arguments are not a JSON object")
                calls.append(ParsedCall(name.strip(), args, mistral_call_id()))
        return ToolParse(content=leading_content(text, start), calls=calls)
