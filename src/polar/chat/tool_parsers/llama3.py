"""Llama 3.1+ JSON calls: the answer is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`, several joined by `;`)."""

from __future__ import annotations

import json
from typing import Any

from polar.chat.tool_parsers.base import ParsedCall, ToolParse, arguments_json, call_id, failed

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser:
    name = "llama3_json"
    needs_special_tokens = True

    def call_start(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped.startswith(PYTHON_TAG) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return -1

    def pending(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped and PYTHON_TAG.startswith(stripped):
            return len(text)
        return len(text) if not stripped else 0

    def parse(self, text: str, tools: list[dict[str, Any]] | None) -> ToolParse:
        body = text.strip()
        tagged = body.startswith(PYTHON_TAG)
        if tagged:
            body = body[len(PYTHON_TAG) :].strip()
        if not body.startswith("{"):
            return failed(text, "empty <|python_tag|> call") if tagged else ToolParse(content=text or None)
        decoder = json.JSONDecoder()
        calls: list[ParsedCall] = []
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError as exc:
                return failed(text, f"tool call is not JSON: {exc}")
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                if not calls and not tagged and end == len(body):
                    return ToolParse(content=text)  # a plain JSON answer, not a call
                return failed(text, "tool call has no name")
            args = arguments_json(obj.get("parameters", obj.get("arguments", {})))
            if args is None:
                return failed(text, "tool call arguments are not a JSON object")
            calls.append(ParsedCall(name=obj["name"], arguments=args, id=call_id()))
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return ToolParse(content=None, calls=calls)
