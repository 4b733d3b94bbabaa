"""Qwen3-Coder calls: XML inside `<tool_call>`, one `<parameter=…>` block per argument.

    <tool_call>
    <function=run_shell>
    <parameter=command>
    ls -la
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text; they become JSON values by the declared JSON-schema type of that parameter
in the request's tools (string stays text, integer/number/boolean/object/array are parsed). A value that
does not fit its declared type is kept as text, as vLLM does: it is what the model wrote.
"""

from __future__ import annotations

import json
import re
from typing import Any

from polar.chat.tool_parsers.base import (
    ParsedCall,
    ToolCallTagParser,
    ToolParse,
    call_id,
    failed,
    leading_content,
)
from polar.jsontypes import JSON

OPEN = "<tool_call>"
_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class Qwen3CoderParser(ToolCallTagParser):
    name = "qwen3_coder"

    def parse(self, text: str, tools: list[dict[str, Any]] | None) -> ToolParse:
        start = text.find(OPEN)
        if start < 0:
            return ToolParse(content=text or None)
        calls: list[ParsedCall] = []
        pos = start
        while pos < len(text) and text[pos:].strip():
            m = _CALL.match(text, pos + (len(text[pos:]) - len(text[pos:].lstrip())))
            if m is None:
                return failed(text, "malformed <tool_call> block")
            name = m.group(1).strip()
            body = m.group(2)
            schema = _param_types(tools, name)
            args: dict[str, Any] = {}
            rest = _PARAM.sub("", body)
            if rest.strip():
                return failed(text, f"unexpected text in <function={name}>")
            for pm in _PARAM.finditer(body):
                key = pm.group(1).strip()
                args[key] = _convert(_trim(pm.group(2)), schema.get(key))
            calls.append(ParsedCall(name=name, arguments=json.dumps(args, ensure_ascii=False), id=call_id()))
            pos = m.end()
        return ToolParse(content=leading_content(text, start), calls=calls)


def _trim(value: str) -> str:
    # The template writes "\n" after the opening tag and before the closing one.
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _param_types(tools: list[dict[str, Any]] | None, name: str) -> dict[str, Any]:
    for tool in tools or []:
        fn = tool.get("function") or {}
        if fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return {k: (v or {}).get("type") for k, v in props.items() if isinstance(v, dict)}
    return {}


def _convert(value: str, kind: JSON) -> JSON:
    if isinstance(kind, list):  # ["string", "null"] and the like
        kind = next((k for k in kind if k != "null"), None)
    if value.strip().lower() == "null" and kind != "string":
        return None
    if kind == "string":
        return value
    try:
        if kind == "integer":
            return int(value.strip())
        if kind == "number":
            num = float(value.strip())
            return int(num) if num.is_integer() and "." not in value and "e" not in value.lower() else num
        if kind == "boolean":
            lowered = value.strip().lower()
            if lowered in ("true", "false"):
                return lowered == "true"
            return value
        return json.loads(value)
    except ValueError:
        return value
