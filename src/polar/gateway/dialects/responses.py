"""OpenAI Responses (`POST /v1/responses`): the only dialect Codex speaks (OpenCode and Pi can, too).

Codex sends `store: false` and its whole history every turn, so everything here is rebuilt from the request
alone; nothing depends on server-side state (`previous_response_id` is refused). Input items become Chat
messages: consecutive assistant items (reasoning, message, function_call, custom_tool_call) form ONE
assistant message, as the policy produced them in one completion, so the chat template renders what the
model actually sampled. Reasoning comes back verbatim from the `encrypted_content` we issued.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from polar.gateway.canonical import CanonicalRequest, Completion
from polar.gateway.dialects import responses_schema as s
from polar.gateway.dialects.openai_wire import error_object, upstream_effort, validate
from polar.gateway.dialects.responses_render import render_response
from polar.gateway.dialects.responses_stream import ResponsesEventWriter, synthesize
from polar.gateway.errors import GatewayError, invalid
from polar.gateway.signatures import ReasoningCodec

INCLUDE_ENCRYPTED = "reasoning.encrypted_content"

Part = s.InputText | s.OutputText | s.Refusal | s.InputImage


class ResponsesDialect:
    """The OpenAI Responses dialect (see `Dialect` in `dialects.base`)."""

    name = "responses"

    def parse(
        self,
        body: Any,
        codec: ReasoningCodec,
        *,
        path_model: str | None = None,
        path_stream: bool | None = None,
    ) -> CanonicalRequest:
        req = validate(s.ResponsesRequest, body)
        _refuse_server_state(req)

        tools, custom, dropped, function_names = _tools(req.tools)
        tool_choice = _tool_choice(req.tool_choice, custom | function_names)

        messages: list[dict[str, Any]] = []
        if req.instructions:
            messages.append({"role": "system", "content": req.instructions})
        if isinstance(req.input, str):
            messages.append({"role": "user", "content": req.input})
        else:
            messages.extend(_history(req.input, codec))
        if not messages:
            raise invalid("'input' must contain at least one item.", "input")

        params: dict[str, Any] = {}
        effort = upstream_effort(req.reasoning.effort if req.reasoning else None)
        for key, value in (
            ("temperature", req.temperature),
            ("top_p", req.top_p),
            ("top_k", req.top_k),
            ("max_tokens", req.max_output_tokens),
            ("seed", req.seed),
            ("parallel_tool_calls", req.parallel_tool_calls),
            ("reasoning_effort", effort),
        ):
            if value is not None:
                params[key] = value

        # What the answer echoes back, taken from the body as sent (no copies, no re-validation).
        render: dict[str, Any] = {
            "model": req.model,
            "custom_tools": custom,
            "dropped_tools": dropped,
            "include_encrypted": bool(req.include and INCLUDE_ENCRYPTED in req.include),
            "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "max_output_tokens": req.max_output_tokens,
            "reasoning": body.get("reasoning"),
            "metadata": req.metadata,
            "prompt_cache_key": req.prompt_cache_key,
            "store": req.store if req.store is not None else True,
            "text": req.text,
        }
        return CanonicalRequest(
            model=req.model,
            messages=messages,
            tools=tools or None,
            tool_choice=tool_choice,
            params=params,
            stream=bool(req.stream),
            render=render,
        )

    def render(self, req: CanonicalRequest, comp: Completion, codec: ReasoningCodec) -> dict[str, Any]:
        return render_response(req, comp, codec)

    def stream(self, req: CanonicalRequest, comp: Completion, codec: ReasoningCodec) -> Iterator[bytes]:
        return synthesize(req, comp, codec)

    def error(self, err: GatewayError) -> tuple[int, dict[str, Any]]:
        return err.status, {"error": error_body(err)}

    def stream_error(self, err: GatewayError) -> bytes:
        return ResponsesEventWriter().failed(error_body(err))


def error_body(err: GatewayError) -> dict[str, Any]:
    """OpenAI's error object; a context overflow carries `context_length_exceeded`, which is what Codex
    keys its context-window handling on (codex-rs `is_context_window_error`)."""
    if err.kind == "context_length":
        message = (
            "Your input exceeds the context window of this model. Please adjust your input and try again."
        )
        if err.prompt_tokens is not None and err.max_tokens is not None:
            message = (
                f"Your input exceeds the context window of this model ({err.prompt_tokens} tokens > "
                f"{err.max_tokens} maximum). Please adjust your input and try again."
            )
        return error_object(err, message, param=err.param or "input")
    return error_object(err)


def _refuse_server_state(req: s.ResponsesRequest) -> None:
    if req.previous_response_id is not None:
        raise invalid(
            "'previous_response_id' is not supported: this server keeps no responses; send the full "
            "history in 'input' (store: false).",
            "previous_response_id",
        )
    if req.conversation is not None:
        raise invalid("'conversation' is not supported: send the full history in 'input'.", "conversation")
    if req.prompt is not None:
        raise invalid("'prompt' (stored prompt templates) is not supported.", "prompt")
    if req.background:
        raise invalid("'background' responses are not supported.", "background")


def _tools(
    specs: list[s.FunctionTool | s.CustomTool | s.HostedTool] | None,
) -> tuple[list[dict[str, Any]], frozenset[str], list[str], frozenset[str]]:
    """Chat function tools, the names of custom tools, the names of dropped hosted tools, function names."""
    tools: list[dict[str, Any]] = []
    custom: set[str] = set()
    functions: set[str] = set()
    dropped: list[str] = []
    for t in specs or ():
        if isinstance(t, s.FunctionTool):
            fn: dict[str, Any] = {"name": t.name}
            if t.description is not None:
                fn["description"] = t.description
            fn["parameters"] = (
                t.parameters if t.parameters is not None else {"type": "object", "properties": {}}
            )
            tools.append({"type": "function", "function": fn})
            functions.add(t.name)
        elif isinstance(t, s.CustomTool):
            tools.append(_custom_as_function(t))
            custom.add(t.name)
        else:
            # Hosted tools (web_search, file_search, ...) run on OpenAI's side; the policy cannot call them.
            dropped.append(t.name or t.type)
    return tools, frozenset(custom), dropped, frozenset(functions)


def _custom_as_function(t: s.CustomTool) -> dict[str, Any]:
    """A free-form (custom) tool as a function with one string argument `input`.

    Codex declares `apply_patch` this way, with a Lark grammar; the grammar goes into the argument's
    description so a policy trained through chat templates can see the format it must follow.
    """
    desc = "The raw input for this tool."
    fmt = t.format or {}
    if fmt.get("type") == "grammar" and fmt.get("definition"):
        desc = f"The raw input for this tool. It must match this {fmt.get('syntax', '')} grammar:\n{fmt['definition']}"
    fn: dict[str, Any] = {"name": t.name}
    if t.description is not None:
        fn["description"] = t.description
    fn["parameters"] = {
        "type": "object",
        "properties": {"input": {"type": "string", "description": desc}},
        "required": ["input"],
        "additionalProperties": False,
    }
    return {"type": "function", "function": fn}


def _tool_choice(choice: str | s.ToolChoiceObject | None, callable_names: frozenset[str]) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type in ("function", "custom"):
        if not choice.name:
            raise invalid("Missing required parameter: 'tool_choice.name'.", "tool_choice.name")
        if choice.name not in callable_names:
            raise invalid(
                f"Invalid value for 'tool_choice.name': {choice.name!r} is not one of the request's tools.",
                "tool_choice.name",
            )
        return {"type": "function", "function": {"name": choice.name}}
    raise invalid(f"Unsupported value for 'tool_choice.type': {choice.type!r}.", "tool_choice.type")


def _history(items: list[Any], codec: ReasoningCodec) -> list[dict[str, Any]]:
    """Input items -> Chat messages, merging each run of assistant items into one assistant message."""
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant message being assembled
    turns: list[dict[str, Any]] = []

    def open_turn() -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": None}
        out.append(msg)
        turns.append(msg)
        return msg

    for item in items:
        if isinstance(item, s.ReasoningItem):
            # A reasoning item starts a new completion unless the current one has produced nothing yet.
            if turn is None or turn["content"] is not None or "tool_calls" in turn:
                turn = open_turn()
            text = _reasoning_text(item, codec)
            if text:
                prev = turn.get("reasoning_content")
                turn["reasoning_content"] = f"{prev}\n\n{text}" if prev else text
        elif isinstance(item, s.MessageItem) and item.role == "assistant":
            turn = turn or open_turn()
            text = _assistant_text(item.content)
            turn["content"] = text if turn["content"] is None else turn["content"] + text
        elif isinstance(item, s.FunctionCallItem):
            turn = turn or open_turn()
            turn.setdefault("tool_calls", []).append(_call(item.call_id, item.name, item.arguments))
        elif isinstance(item, s.CustomToolCallItem):
            turn = turn or open_turn()
            # Same text `json.dumps` gives (and Qwen-style models write): `{"input": "..."}`.
            arguments = json.dumps({"input": item.input}, ensure_ascii=False)
            turn.setdefault("tool_calls", []).append(_call(item.call_id, item.name, arguments))
        else:
            turn = None
            out.append(_plain_message(item))

    for msg in turns:
        if msg["content"] is None and "tool_calls" not in msg:
            msg["content"] = ""
    return out


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _reasoning_text(item: s.ReasoningItem, codec: ReasoningCodec) -> str | None:
    """Our own `encrypted_content` restores the exact reasoning; otherwise take what the client kept."""
    if item.encrypted_content:
        text = codec.decode(item.encrypted_content)
        if text is not None:
            return text
    if item.content:
        return "".join(c.text for c in item.content)
    if item.summary:
        return "\n\n".join(p.text for p in item.summary)
    return None


def _text_of(p: s.InputText | s.OutputText | s.Refusal) -> str:
    return p.refusal if isinstance(p, s.Refusal) else p.text


def _assistant_text(content: str | list[Part]) -> str:
    if isinstance(content, str):
        return content
    return "".join(_text_of(p) for p in content if not isinstance(p, s.InputImage))


def _parts(parts: list[Part]) -> str | list[dict[str, Any]]:
    """Responses content parts -> Chat content; a lone text part (what Codex sends) becomes a string."""
    if len(parts) == 1 and not isinstance(parts[0], s.InputImage):
        return _text_of(parts[0])
    out: list[dict[str, Any]] = []
    for p in parts:
        if isinstance(p, s.InputImage):
            image: dict[str, Any] = {"url": p.image_url}
            if p.detail is not None and p.detail != "auto":
                image["detail"] = p.detail
            out.append({"type": "image_url", "image_url": image})
        else:
            out.append({"type": "text", "text": _text_of(p)})
    return out


def _plain_message(item: Any) -> dict[str, Any]:
    if isinstance(item, s.MessageItem):
        # `developer` (Codex's permissions and instructions) is `system` to a chat template.
        role = "system" if item.role in ("system", "developer") else "user"
        content = item.content if isinstance(item.content, str) else _parts(item.content)
        return {"role": role, "content": content}
    # function_call_output / custom_tool_call_output
    output = item.output if isinstance(item.output, str) else _parts(item.output)
    return {"role": "tool", "tool_call_id": item.call_id, "content": output}
