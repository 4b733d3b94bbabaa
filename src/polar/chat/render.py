"""Rendering OpenAI Chat messages with the model's own chat template, the way vLLM prepares them.

What vLLM does before the template sees a message, and we therefore do too: text content parts are joined
with newlines (templates such as Qwen3's call string methods on `content`), a missing content becomes "",
tool-call `arguments` given as JSON text are parsed into objects (templates `tojson` them), and each tool
is dumped with every declared field (`description`/`parameters` as null when absent), which changes the
rendered system prompt. The result is rendered to text and then tokenized without extra special tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from polar.jsontypes import JSON

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (bad content, or the template raised)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _text_of(content: JSON, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                text = part.get("text")
                if not isinstance(text, str):
                    raise ChatTemplateError(f"{where}.content.{j}.text must be a string", f"{where}.content")
                parts.append(text)
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatTemplateError(
                    f"content part type {kind!r} is not supported by this text-only model", f"{where}.content"
                )
        return "\n".join(parts)
    raise ChatTemplateError(
        f"{where}.content must be a string or a list of content parts", f"{where}.content"
    )


def prepare_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        where = f"messages.{i}"
        m = dict(msg)
        m["content"] = _text_of(msg.get("content"), where)
        if "reasoning_content" not in m and isinstance(m.get("reasoning"), str):
            m["reasoning_content"] = m["reasoning"]
        calls = msg.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise ChatTemplateError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
            fixed = []
            for j, call in enumerate(calls):
                if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
                    raise ChatTemplateError(
                        f"{where}.tool_calls.{j} must have a function object", f"{where}.tool_calls"
                    )
                fn = dict(call["function"])
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        parsed = json.loads(args)
                    except ValueError:
                        parsed = None
                    if isinstance(parsed, dict):
                        fn["arguments"] = parsed
                fixed.append({**call, "function": fn})
            m["tool_calls"] = fixed
        out.append(m)
    return out


def prepare_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for tool in tools:
        fn = tool.get("function") or {}
        full_fn = {
            "name": fn.get("name"),
            "description": fn.get("description"),
            "parameters": fn.get("parameters"),
        }
        full_fn.update({k: v for k, v in fn.items() if k not in full_fn})
        full = {"type": tool.get("type", "function"), "function": full_fn}
        full.update({k: v for k, v in tool.items() if k not in full})
        out.append(full)
    return out


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    chat_template: str | None = None,
) -> str:
    """The prompt text the model sees (tokenize it with `add_special_tokens=False`)."""
    from jinja2 import TemplateError

    kwargs = dict(chat_template_kwargs or {})
    for reserved in ("tools", "messages", "conversation", "tokenize"):
        if reserved in kwargs:
            raise ChatTemplateError(f"chat_template_kwargs may not set {reserved!r}", "chat_template_kwargs")
    if chat_template is None and kwargs.get("chat_template") is not None:
        chat_template = kwargs.pop("chat_template")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this model has no chat template; use /v1/completions", "messages")
    prepared, prepared_tools = prepare_messages(messages), prepare_tools(tools)
    try:
        text = tokenizer.apply_chat_template(
            prepared,
            # transformers types this `list[dict | Callable]` (a list of dicts is one; the list is invariant)
            tools=cast("list[dict[Any, Any] | Callable[..., Any]] | None", prepared_tools),
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **kwargs,
        )
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc}", "messages") from exc
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        raise ChatTemplateError(f"cannot render messages with the chat template: {exc}", "messages") from exc
    return str(text)
