"""Anthropic content blocks the policy cannot take as they are, turned into text it can read.

The policy sees text (and images); these blocks would otherwise be refused (a 400 ends a Claude Code run)
or dropped (the policy would act on a result it never saw). Each conversion is deterministic, so a history
re-sent every turn renders to the same prompt tokens. Which block becomes what is in anthropic.py's docstring.
"""

from __future__ import annotations

from typing import Any

import orjson

from polar.gateway.dialects.anthropic import schema as s


def document_text(block: s.DocumentBlock) -> str:
    """Text and content sources verbatim inside `<document>` tags; a base64 or URL source (Claude Code
    2.1.197's Read sends a PDF as base64) as a tag naming it, saying its content is not shown, so the
    policy knows the document is there and can read the file another way. No PDF is parsed here."""
    src = block["source"]
    title = block.get("title")
    attrs = f" title={attr(title)}" if title else ""
    if src["type"] == "text":
        body = src["data"]
    elif src["type"] == "content":
        content = src["content"]
        body = content if isinstance(content, str) else "\n".join(b["text"] for b in content)
    elif src["type"] == "url":
        return f"<document{attrs} url={attr(src['url'])}>(not fetched: content not shown)</document>"
    else:
        data = src["data"]
        size = len(data) * 3 // 4 - (len(data) - len(data.rstrip("=")))  # decoded size, without decoding
        kind = f' media_type={attr(src["media_type"])} bytes="{size}"'
        return f"<document{attrs}{kind}>(binary content not shown)</document>"
    return f"<document{attrs}>\n{body}\n</document>"


def attr(value: str) -> str:
    return orjson.dumps(value).decode()  # a JSON string: quoted, with quotes and newlines escaped


def function_line(name: str, defs: dict[str, dict[str, Any]]) -> str:
    """A `tool_reference` as the line Claude Code 2.1.197's ToolSearch description promises the model:
    `<function>{"description", "name", "parameters"}</function>` from the request's tools, or the name."""
    fn = defs.get(name)
    shown = (
        {"name": name} if fn is None else {k: fn[k] for k in ("description", "name", "parameters") if k in fn}
    )
    return f"<function>{orjson.dumps(shown).decode()}</function>"


def functions_block(lines: list[str]) -> str:
    return "<functions>\n" + "\n".join(lines) + "\n</functions>"
