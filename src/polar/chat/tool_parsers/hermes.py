"""Hermes / Qwen2.5 / Qwen3 calls: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, repeated."""

from __future__ import annotations

import json
import re
from typing import Any

from polar.chat.tool_parsers.base import (
    ParsedCall,
    ToolCallTagParser,
    ToolParse,
    arguments_json,
    call_id,
    failed,
    leading_content,
)

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class HermesParser(ToolCallTagParser):
    name = "hermes"

    def parse(self, text: str, tools: list[dict[str, Any]] | None) -> ToolParse:
        start = text.find(OPEN)
        if start < 0:
            return ToolParse(content=text or None)
        calls: list[ParsedCall] = []
        pos = start
        while True:
            nxt = text.find(OPEN, pos)
            if nxt < 0:
                break
            if text[pos:nxt].strip():
                return failed(text, "text between tool calls")
            m = _BLOCK.match(text, nxt)
            if m is None:
                return failed(text, "unclosed <tool_call>")
            call = _decode(m.group(1))
            if isinstance(call, str):
                return failed(text, call)
            calls.append(call)
            pos = m.end()
        if text[pos:].strip():
            return failed(text, "text after the last tool call")
        return ToolParse(content=leading_content(text, start), calls=calls)


def _decode(body: str) -> ParsedCall | str:
    try:
        obj = json.loads(body)
    except ValueError as exc:
        return f"tool call is not JSON: {exc}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return "tool call has no name"
    args = arguments_json(obj.get("arguments", {}))
    if args is None:
        return "tool call arguments are not a JSON object"
    return ParsedCall(name=obj["name"], arguments=args, id=call_id())
