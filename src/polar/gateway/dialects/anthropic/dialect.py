r"""Anthropic Messages (`POST /v1/messages`, `POST /v1/messages/count_tokens`), as Claude Code speaks it.

Conversion choices the chat template forces on us (each is deterministic, so the same history always
yields the same upstream prompt):
- `system` blocks are joined with "\n" into one system message. A `role: "system"` message inside
  `messages` (Claude Code 2.1.197 sends one after the first user turn) stays a system message at its
  position, its text blocks joined the same way: Qwen-style templates render it in place.
- A user turn's `tool_result` blocks become `tool` messages, in order, followed by one user message with
  the turn's remaining text and image blocks (images inside tool results join that user message too: Chat
  tool messages carry text only).
- A `tool_reference` inside a tool result (Claude Code's ToolSearch) becomes the text its tool's own
  description promises the model: `<functions>` holding one `<function>{"description", "name",
  "parameters"}</function>` line per referenced tool, taken from the request's `tools` (the name alone when
  the request does not define it).
- A `document` block becomes text: a text or content source verbatim inside `<document title="...">`
  tags; a base64 or URL source (Claude Code's Read sends PDFs as base64) as a tag naming its media type
  and size or URL, saying the content is not shown, so the policy knows it is there and can read the file
  another way. Nothing is silently dropped; no PDF is parsed here.
- `is_error` has no place in the chat template, so a failed tool result reaches the model as text that
  says so: "Error: " + the content, unless the content is already marked `<tool_use_error>` (Claude Code
  2.x wraps its tool failures that way).
- Assistant `thinking` becomes `reasoning_content`: the text our own signature carries when it verifies
  (exact, even when the harness edited the visible text), else the block's text. Several thinking blocks
  in one turn are joined with "\n\n"; a `redacted_thinking` block counts only if its data is ours.
- Assistant `tool_use` becomes `tool_calls` with compact JSON arguments.

Answers: a tool call whose arguments are not a JSON object is rendered with `input` =
{"_polar_raw_arguments": <the model's text>} (see `wire.RAW_ARGUMENTS_KEY`): nothing is invented, Claude
Code's schema check rejects the call so the policy sees its mistake, and the raw text comes back exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

from polar.gateway.canonical import CanonicalRequest, Completion
from polar.gateway.dialects.anthropic import schema as s
from polar.gateway.dialects.anthropic.blocks import document_text, function_line, functions_block
from polar.gateway.dialects.anthropic.stream import AnthropicStreamEncoder, MessageStream
from polar.gateway.dialects.base import SSEOnly, StreamFormat, sse
from polar.gateway.dialects.tool_schema import check_tool_schema
from polar.gateway.dialects.validation import validate
from polar.gateway.dialects.wire import (
    PLAIN_STYLE,
    SignatureCache,
    data_url,
    tool_arguments,
    tool_input,
    tool_input_json,
)
from polar.gateway.errors import GatewayError, invalid
from polar.gateway.signatures import ReasoningCodec
from polar.jsontypes import JSON

_STOP_REASON = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}

_ERROR_TYPE = {
    "invalid_request": "invalid_request_error",
    "context_length": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "request_too_large": "request_too_large",
    "rate_limit": "rate_limit_error",
    "upstream_error": "api_error",
    "timeout": "timeout_error",
    "overloaded": "overloaded_error",
}

_TOOL_ERROR_MARK = "<tool_use_error>"

_decode_signature = SignatureCache(ReasoningCodec.decode)


class AnthropicDialect(SSEOnly):
    """The Anthropic Messages API; see the module docstring for how turns map to Chat messages."""

    name = "anthropic"

    # ---- requests ----------------------------------------------------------------------------------

    def parse(
        self,
        body: JSON,
        codec: ReasoningCodec,
        *,
        path_model: str | None = None,
        path_stream: bool | None = None,
    ) -> CanonicalRequest:
        req = validate(s.MESSAGES_REQUEST, body, PLAIN_STYLE)
        params: dict[str, Any] = {"max_tokens": req["max_tokens"]}
        for key in ("temperature", "top_p", "top_k"):
            value = req.get(key)
            if value is not None:
                params[key] = value
        if stop := req.get("stop_sequences"):
            params["stop"] = stop
        return self._canonical(req, codec, params, stream=bool(req.get("stream")))

    def parse_count_tokens(self, body: JSON, codec: ReasoningCodec) -> CanonicalRequest:
        """`/v1/messages/count_tokens`: the same conversion, without generation settings."""
        return self._canonical(validate(s.COUNT_TOKENS_REQUEST, body, PLAIN_STYLE), codec, {}, stream=False)

    def render_count_tokens(self, n: int) -> dict[str, Any]:
        return {"input_tokens": n}

    def _canonical(
        self, req: s.CountTokensRequest, codec: ReasoningCodec, params: dict[str, Any], *, stream: bool
    ) -> CanonicalRequest:
        render: dict[str, Any] = {}
        messages: list[dict[str, Any]] = []
        tools, dropped = _tools(req.get("tools"))
        defs = {t["function"]["name"]: t["function"] for t in tools}
        system = _system_text(req.get("system"))
        if system is not None:
            messages.append({"role": "system", "content": system})
        for i, msg in enumerate(req["messages"]):
            if msg["role"] == "user":
                _user_turn(msg["content"], i, messages, defs)
            elif msg["role"] == "system":
                messages.append({"role": "system", "content": _system_turn(msg["content"], i)})
            else:
                messages.append(_assistant_turn(msg["content"], i, codec))

        if dropped:
            render["dropped_tools"] = dropped
        tool_choice = None
        choice = req.get("tool_choice")
        if choice is not None:
            tool_choice = _tool_choice(choice, tools, dropped)
            if choice.get("disable_parallel_tool_use"):
                params["parallel_tool_calls"] = False

        thinking = req.get("thinking")
        if thinking is not None:
            enabled = thinking["type"] != "disabled"
            params["chat_template_kwargs"] = {"enable_thinking": enabled}
            render["thinking"] = enabled
            if thinking.get("display") == "omitted":
                render["thinking_omitted"] = True
        return CanonicalRequest(
            model=req["model"],
            messages=messages,
            tools=tools or None,
            tool_choice=tool_choice,
            params=params,
            stream=stream,
            render=render,
        )

    # ---- responses ---------------------------------------------------------------------------------

    def render(self, req: CanonicalRequest, comp: Completion, codec: ReasoningCodec) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        reasoning = _shown_reasoning(req, comp)
        if reasoning is not None:
            text = "" if req.render.get("thinking_omitted") else reasoning
            content.append({"type": "thinking", "thinking": text, "signature": codec.encode(reasoning)})
        if comp.content:
            content.append({"type": "text", "text": comp.content})
        for tc in comp.tool_calls:
            content.append(
                {"type": "tool_use", "id": tc.id, "name": tc.name, "input": tool_input(tc.arguments)}
            )
        return {
            "id": _message_id(comp),
            "type": "message",
            "role": "assistant",
            "model": req.model,
            "content": content,
            "stop_reason": _stop_reason(comp),
            # The backend does not report which of `stop_sequences` matched, so "stop_sequence" is never
            # claimed: a stop there reads as end_turn.
            "stop_sequence": None,
            "usage": {
                "input_tokens": comp.prompt_tokens,
                "output_tokens": comp.completion_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }

    def stream(self, req: CanonicalRequest, comp: Completion, codec: ReasoningCodec) -> Iterator[bytes]:
        w = MessageStream()
        yield w.start(_message_id(comp), req.model, comp.prompt_tokens)
        reasoning = _shown_reasoning(req, comp)
        if reasoning is not None:
            yield w.thinking("" if req.render.get("thinking_omitted") else reasoning)
            yield w.signature(codec.encode(reasoning))
        if comp.content:
            yield w.text(comp.content)
        for tc in comp.tool_calls:
            yield w.tool_use(tc.id, tc.name)
            yield w.tool_input(tool_input_json(tc.arguments))
        yield w.finish(_stop_reason(comp), None, comp.completion_tokens)

    def stream_encoder(
        self, req: CanonicalRequest, codec: ReasoningCodec, fmt: StreamFormat
    ) -> AnthropicStreamEncoder:
        self._sse_only(fmt)
        return AnthropicStreamEncoder(
            req, codec, message_id=_message_id, stop_reason=_stop_reason, error=self.stream_error
        )

    # ---- errors ------------------------------------------------------------------------------------

    def error(self, err: GatewayError) -> tuple[int, dict[str, Any]]:
        message = err.message
        if err.kind == "context_length" and err.prompt_tokens is not None and err.max_tokens is not None:
            # Claude Code matches this exact wording to trigger its compaction / "prompt too long" path.
            message = f"prompt is too long: {err.prompt_tokens} tokens > {err.max_tokens} maximum"
        status = 529 if err.kind == "overloaded" else err.status
        return status, {"type": "error", "error": {"type": _ERROR_TYPE[err.kind], "message": message}}

    def stream_error(self, err: GatewayError) -> bytes:
        return sse(orjson.dumps(self.error(err)[1]), "error")

    def stream_error_status(self, err: GatewayError) -> int:
        return 200


# ---- request conversion helpers ---------------------------------------------------------------------


def _system_text(system: str | list[s.TextBlock] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    return "\n".join(b["text"] for b in system) or None


def _system_turn(content: str | list[s.ContentBlock], i: int) -> str:
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for j, block in enumerate(content):
        if block["type"] != "text":
            path = f"messages[{i}].content[{j}].type"
            raise invalid(f"{path}: a system message carries text blocks only, not {block['type']!r}", path)
        texts.append(block["text"])
    return "\n".join(texts)


def _user_turn(
    content: str | list[s.ContentBlock], i: int, out: list[dict[str, Any]], defs: dict[str, dict[str, Any]]
) -> None:
    if isinstance(content, str):
        out.append({"role": "user", "content": content})
        return
    if not content:
        raise invalid(f"messages[{i}].content must not be empty", f"messages[{i}].content")
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        if block["type"] == "text":
            parts.append({"type": "text", "text": block["text"]})
        elif block["type"] == "image":
            parts.append(_image_part(block))
        elif block["type"] == "document":
            parts.append({"type": "text", "text": document_text(block)})
        elif block["type"] == "tool_result":
            text = _tool_result_text(block, parts, defs)
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        else:
            path = f"messages[{i}].content[{j}].type"
            raise invalid(f"{path}: a user message cannot carry a {block['type']!r} block", path)
    if parts:
        out.append({"role": "user", "content": parts})


def _tool_result_text(
    block: s.ToolResultBlock, images: list[dict[str, Any]], defs: dict[str, dict[str, Any]]
) -> str:
    content = block.get("content", "")
    if isinstance(content, str):
        text = content
    else:
        texts: list[str] = []
        refs: list[str] = []  # a run of tool references, one <functions> block
        for part in content:
            if part["type"] == "tool_reference":
                refs.append(function_line(part["tool_name"], defs))
                continue
            if refs:
                texts.append(functions_block(refs))
                refs = []
            if part["type"] == "text":
                texts.append(part["text"])
            elif part["type"] == "document":
                texts.append(document_text(part))
            else:
                images.append(_image_part(part))
        if refs:
            texts.append(functions_block(refs))
        text = "\n".join(texts)
    if block.get("is_error") and not text.startswith(_TOOL_ERROR_MARK):
        return f"Error: {text}" if text else "Error"
    return text


def _image_part(block: s.ImageBlock) -> dict[str, Any]:
    src = block["source"]
    url = src["url"] if src["type"] == "url" else data_url(src["media_type"], src["data"])
    return {"type": "image_url", "image_url": {"url": url}}


def _assistant_turn(content: str | list[s.ContentBlock], i: int, codec: ReasoningCodec) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        if block["type"] == "text":
            texts.append(block["text"])
        elif block["type"] == "tool_use":
            fn = {"name": block["name"], "arguments": tool_arguments(block["input"])}
            calls.append({"id": block["id"], "type": "function", "function": fn})
        elif block["type"] == "thinking":
            decoded = _decode_signature(codec, block.get("signature"))
            reasoning.append(block["thinking"] if decoded is None else decoded)
        elif block["type"] == "redacted_thinking":
            decoded = _decode_signature(codec, block["data"])
            if decoded is not None:
                reasoning.append(decoded)
        else:
            path = f"messages[{i}].content[{j}].type"
            raise invalid(f"{path}: an assistant message cannot carry a {block['type']!r} block", path)
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": "".join(texts) if texts else (None if calls else ""),
    }
    if reasoning:
        msg["reasoning_content"] = "\n\n".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _tools(tools: list[s.Tool] | None) -> tuple[list[dict[str, Any]], list[str]]:
    if not tools:
        return [], []
    out: list[dict[str, Any]] = []
    dropped: list[str] = []
    for k, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):
            # Anthropic-run tools (web_search_*, code_execution_*, ...) and Anthropic-defined client tools
            # (bash_*, text_editor_*) come without a schema the policy could follow.
            dropped.append(tool["name"])
            continue
        schema = tool.get("input_schema")
        if schema is None:
            raise invalid(f"missing required field tools[{k}].input_schema", f"tools[{k}].input_schema")
        check_tool_schema(schema, f"tools[{k}]", tool["name"], "input_schema")
        fn: dict[str, Any] = {"name": tool["name"]}
        if (description := tool.get("description")) is not None:
            fn["description"] = description
        fn["parameters"] = schema
        out.append({"type": "function", "function": fn})
    return out, dropped


def _tool_choice(choice: s.ToolChoice, tools: list[dict[str, Any]], dropped: list[str]) -> Any:
    kind = choice["type"]
    if kind != "tool":
        return {"auto": "auto", "any": "required", "none": "none"}[kind]
    name = choice.get("name")
    if not name:
        raise invalid(
            "missing required field tool_choice.name (tool_choice.type is 'tool')", "tool_choice.name"
        )
    if name in dropped or not any(t["function"]["name"] == name for t in tools):
        raise invalid(f"tool_choice.name {name!r} is not one of the request's tools", "tool_choice.name")
    return {"type": "function", "function": {"name": name}}


# ---- response helpers -------------------------------------------------------------------------------


def _shown_reasoning(req: CanonicalRequest, comp: Completion) -> str | None:
    """The reasoning to emit as a thinking block: none when thinking was explicitly disabled."""
    if not comp.reasoning or req.render.get("thinking") is False:
        return None
    return comp.reasoning


def _message_id(comp: Completion | str) -> str:
    cid = (comp if isinstance(comp, str) else comp.id).removeprefix("chatcmpl-")
    return cid if cid.startswith("msg_") else f"msg_{cid}"


def _stop_reason(comp: Completion) -> str:
    return _STOP_REASON.get(comp.finish_reason, "end_turn")
