"""A `Completion` as a Responses `Response` object and its output items.

Output order follows OpenAI's: reasoning, message, then one item per tool call. Reasoning is always sent as
one summary part holding the full text (Codex shows it, and resends it when it has nothing better), and,
when the client includes `reasoning.encrypted_content`, also as our codec token, which restores it verbatim
on the next turn. Tool calls to Responses custom tools become `custom_tool_call` items carrying `input`; a
call to a namespace member (`responses_tools`) carries its `namespace` and its name within it. A call of a
client-executed `tool_search` becomes a `tool_search_call` item whose `arguments` is the parsed object, as
Codex 0.171.0 reads it; arguments that are not a JSON object go back as a plain `function_call`, which Codex
answers as an unsupported call (the policy sees its mistake, and the record keeps what it wrote).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from polar.gateway.canonical import CanonicalRequest, Completion
from polar.gateway.dialects.openai_wire import error_object, unix_now
from polar.gateway.dialects.responses.tools import SEARCH
from polar.gateway.errors import GatewayError
from polar.gateway.signatures import ReasoningCodec

ItemKind = Literal["reasoning", "message", "function_call", "custom_tool_call", "tool_search_call"]

_INCOMPLETE_REASON = {"length": "max_output_tokens", "content_filter": "content_filter"}


@dataclass(frozen=True, slots=True)
class OutputItem:
    """One finished output item, plus the text a stream delivers in deltas for it (reasoning summary,
    message text, function arguments or custom tool input)."""

    kind: ItemKind
    item: dict[str, Any]
    text: str


def base_id(comp: Completion) -> str:
    """Ids of the response and its items derive from the completion id, so records and answers link up."""
    return strip_id(comp.id)


def strip_id(cid: str) -> str:
    """A completion id without the server's prefix."""
    for prefix in ("chatcmpl-", "resp_", "cmpl-"):
        if cid.startswith(prefix):
            return cid[len(prefix) :]
    return cid


def custom_input(arguments: str) -> str:
    """The free-form input of a custom tool call the policy wrote as `{"input": "..."}`.

    Anything else (not JSON, other keys) is passed through as the raw argument text rather than lost.
    """
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments
    if isinstance(value, dict):
        got = value.get("input")
        if isinstance(got, str):
            return got
        if len(value) == 1:
            (only,) = value.values()
            if isinstance(only, str):
                return only
    return arguments


def search_arguments(req: CanonicalRequest, name: str, arguments: str) -> dict[str, Any] | None:
    """The arguments of a call the client runs as its tool search, or None when it is not one."""
    if name != SEARCH or not req.render.get("tool_search"):
        return None
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def search_item(item_id: str, call_id: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "tool_search_call",
        "status": "completed",
        "call_id": call_id,
        "execution": "client",
        "arguments": arguments,
    }


def call_item(req: CanonicalRequest, kind: str, item_id: str, call_id: str, name: str) -> dict[str, Any]:
    """The head of a call item (no `arguments`/`input` yet) to the tool the policy called by its Chat name:
    a namespace member's item names the namespace and the member, as OpenAI's server does."""
    item: dict[str, Any] = {"id": item_id, "type": kind, "status": "completed", "call_id": call_id}
    member = (req.render.get("namespaced_tools") or {}).get(name)
    if member is None:
        item["name"] = name
    else:
        item["namespace"], item["name"] = member
    return item


def output_items(req: CanonicalRequest, comp: Completion, codec: ReasoningCodec) -> list[OutputItem]:
    base = base_id(comp)
    truncated = comp.finish_reason in _INCOMPLETE_REASON
    items: list[OutputItem] = []
    if comp.reasoning:
        reasoning: dict[str, Any] = {
            "id": f"rs_{base}",
            "type": "reasoning",
            "summary": [{"type": "summary_text", "text": comp.reasoning}],
        }
        if req.render.get("include_encrypted"):
            reasoning["encrypted_content"] = codec.encode(comp.reasoning)
        items.append(OutputItem("reasoning", reasoning, comp.reasoning))
    if comp.content or not comp.tool_calls:
        text = comp.content or ""
        message = {
            "id": f"msg_{base}",
            "type": "message",
            "status": "incomplete" if truncated else "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
        }
        items.append(OutputItem("message", message, text))
    custom: frozenset[str] = req.render.get("custom_tools") or frozenset()
    for i, tc in enumerate(comp.tool_calls):
        searched = search_arguments(req, tc.name, tc.arguments)
        if searched is not None:
            items.append(OutputItem("tool_search_call", search_item(f"tsc_{base}_{i}", tc.id, searched), ""))
        elif tc.name in custom:
            value = custom_input(tc.arguments)
            call = call_item(req, "custom_tool_call", f"ctc_{base}_{i}", tc.id, tc.name)
            call["input"] = value
            items.append(OutputItem("custom_tool_call", call, value))
        else:
            call = call_item(req, "function_call", f"fc_{base}_{i}", tc.id, tc.name)
            call["arguments"] = tc.arguments
            items.append(OutputItem("function_call", call, tc.arguments))
    return items


def usage(comp: Completion) -> dict[str, Any]:
    return {
        "input_tokens": comp.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": comp.completion_tokens,
        # The backend does not split reasoning from answer tokens; 0 means "not counted", not "none".
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": comp.prompt_tokens + comp.completion_tokens,
    }


def response_object(
    req: CanonicalRequest,
    resp_id: str,
    created: int,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    incomplete_reason: str | None = None,
) -> dict[str, Any]:
    """The Response envelope. `instructions` is not echoed: Codex resends ~20 KB of them every turn and no
    client reads them back; `tools` is echoed as the request's own list (required by the schema)."""
    r = req.render
    resp: dict[str, Any] = {
        "id": resp_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "instructions": None,
        "max_output_tokens": r.get("max_output_tokens"),
        "model": r.get("model", req.model),
        "output": output,
        "parallel_tool_calls": r.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "prompt_cache_key": r.get("prompt_cache_key"),
        "reasoning": r.get("reasoning") or {"effort": None, "summary": None},
        "store": r.get("store", True),
        "temperature": r.get("temperature"),
        "text": r.get("text") or {"format": {"type": "text"}},
        "tool_choice": r.get("tool_choice", "auto"),
        "tools": r.get("tools", []),
        "top_p": r.get("top_p"),
        "truncation": "disabled",
        "usage": usage,
        "metadata": r.get("metadata") or {},
    }
    if status in ("completed", "incomplete"):
        resp["completed_at"] = unix_now()
    return resp


def final_status(comp: Completion) -> tuple[str, str | None]:
    """`completed`, or `incomplete` with OpenAI's reason when the policy hit its token limit."""
    reason = _INCOMPLETE_REASON.get(comp.finish_reason)
    return ("incomplete", reason) if reason else ("completed", None)


def render_response(req: CanonicalRequest, comp: Completion, codec: ReasoningCodec) -> dict[str, Any]:
    status, reason = final_status(comp)
    return response_object(
        req,
        f"resp_{base_id(comp)}",
        comp.created or unix_now(),
        status=status,
        output=[o.item for o in output_items(req, comp, codec)],
        usage=usage(comp),
        incomplete_reason=reason,
    )


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
