"""Tool-call parsers by name, and detection from a chat template."""

from __future__ import annotations

from polar.chat.tool_parsers.base import ParsedCall, ToolParse, ToolParser, chat_calls
from polar.chat.tool_parsers.hermes import HermesParser
from polar.chat.tool_parsers.llama3 import Llama3JsonParser
from polar.chat.tool_parsers.mistral import MistralParser
from polar.chat.tool_parsers.qwen3_coder import Qwen3CoderParser

PARSERS: dict[str, type] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "qwen3": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
    "qwen3_xml": Qwen3CoderParser,
    "llama3_json": Llama3JsonParser,
    "llama3": Llama3JsonParser,
    "mistral": MistralParser,
}


def get_parser(name: str) -> ToolParser:
    try:
        parser: ToolParser = PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {sorted(PARSERS)}") from None
    return parser


def detect_parser(chat_template: str | None) -> ToolParser | None:
    """Pick the parser whose call syntax the template teaches the model; None when it has no tools."""
    t = chat_template or ""
    if "<function=" in t and "<parameter=" in t:
        return Qwen3CoderParser()
    if "<tool_call>" in t:
        return HermesParser()
    if "[TOOL_CALLS]" in t:
        return MistralParser()
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and "tools" in t):
        return Llama3JsonParser()
    return None


__all__ = ["PARSERS", "ParsedCall", "ToolParse", "ToolParser", "chat_calls", "detect_parser", "get_parser"]
