"""Responses input -> Chat: the item history (the tools are `responses_tools`).

Consecutive assistant items (reasoning, message, function_call, custom_tool_call) form ONE assistant
message, as the policy produced them in one completion, so the chat template renders what the model
actually sampled. Reasoning is restored verbatim from the `encrypted_content` we issued. A call to a
namespace member (it carries `namespace`) is named as its tool went upstream (`responses_tools.flat_name`).

A client-executed tool search (Codex 0.171.0 with deferred MCP tools) is a call of the function
`tool_search` whose arguments come back as an object (written as JSON here; the gateway's argument restore
puts the policy's own text back by call id), and its `tool_search_output` is a tool message holding the
loaded definitions, one Chat function per line as Hermes/Qwen templates list `<tools>`. On OpenAI's server
the loaded tools enter the context where the output is, not the request's `tools`; keeping them in the tool
message does the same here, so the next prompt extends the last one (no `tools_changed` split).

An `agent_message` (Codex's `multi_agent_v2`: a task from the parent agent, an answer from a child) is a user
message: its parts' text joined, the payload of an `encrypted_content` part taken as the text it is here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, cast

from polar.gateway.dialects.responses.tools import SEARCH, ConvertedTools, convert_tools, flat_name
from polar.gateway.dialects.wire import SignatureCache
from polar.gateway.signatures import ReasoningCodec
from polar.jsontypes import JSON


def searched_tools(items: list[Any]) -> dict[int, ConvertedTools]:
    """The tools each `tool_search_output` item loaded, by the item's index."""
    return {
        k: convert_tools(item["tools"], f"input[{k}].tools")
        for k, item in enumerate(items)
        if item.get("type") == "tool_search_output"
    }


def loaded_text(loaded: ConvertedTools) -> str:
    """A tool search's result as the policy reads it: the loaded functions, one JSON object per line."""
    if not loaded.tools:
        return "No tools matched."
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in loaded.tools)


def convert_history(
    items: list[Any], codec: ReasoningCodec, loaded: Mapping[int, ConvertedTools]
) -> list[dict[str, Any]]:
    """Input items -> Chat messages, merging each run of assistant items into one assistant message.
    `loaded`: `searched_tools(items)` (the caller needs it too, for the answer's tool maps)."""
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant message being assembled
    turns: list[dict[str, Any]] = []

    def open_turn() -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": None}
        out.append(msg)
        turns.append(msg)
        return msg

    for k, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "reasoning":
            # A reasoning item starts a new completion unless the current one has produced nothing yet.
            if turn is None or turn["content"] is not None or "tool_calls" in turn:
                turn = open_turn()
            text = _reasoning_text(item, codec)
            if text:
                prev = turn.get("reasoning_content")
                turn["reasoning_content"] = f"{prev}\n\n{text}" if prev else text
        elif kind == "message" and item["role"] == "assistant":
            turn = turn or open_turn()
            text = _assistant_text(item["content"])
            turn["content"] = text if turn["content"] is None else turn["content"] + text
        elif kind == "function_call":
            turn = turn or open_turn()
            name = _called(item)
            turn.setdefault("tool_calls", []).append(_call(item["call_id"], name, item["arguments"]))
        elif kind == "custom_tool_call":
            turn = turn or open_turn()
            # Same text `json.dumps` gives (and Qwen-style models write): `{"input": "..."}`.
            arguments = json.dumps({"input": item["input"]}, ensure_ascii=False)
            turn.setdefault("tool_calls", []).append(_call(item["call_id"], _called(item), arguments))
        elif kind == "tool_search_call":
            turn = turn or open_turn()
            arguments = json.dumps(item["arguments"], ensure_ascii=False)
            turn.setdefault("tool_calls", []).append(_call(item["call_id"], SEARCH, arguments))
        elif kind == "tool_search_output":
            turn = None
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": loaded_text(loaded[k])})
        elif kind == "agent_message":
            # Another agent speaking (Codex's multi_agent_v2): to the policy, a user turn. Its header part
            # names sender and task; the payload follows it without a separator, as Codex writes them.
            turn = None
            text = "".join(p.get("text") or p.get("encrypted_content") or "" for p in item["content"])
            out.append({"role": "user", "content": text})
        elif kind == "message":
            turn = None
            # `developer` (Codex's permissions and instructions) is `system` to a chat template.
            role = "system" if item["role"] in ("system", "developer") else "user"
            out.append({"role": role, "content": _content(item["content"])})
        else:  # function_call_output / custom_tool_call_output
            turn = None
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _content(item["output"])})

    for msg in turns:
        if msg["content"] is None and "tool_calls" not in msg:
            msg["content"] = ""
    return out


def _called(item: JSON) -> str:
    """The Chat name of the tool a call item called."""
    namespace = item.get("namespace")
    return flat_name(namespace, item["name"]) if namespace else item["name"]


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# Codex resends every earlier reasoning item on every turn.
_decode = SignatureCache(ReasoningCodec.decode, size=2048)


def _reasoning_text(item: JSON, codec: ReasoningCodec) -> str | None:
    """Our own `encrypted_content` restores the exact reasoning; otherwise take what the client kept."""
    text = _decode(codec, item.get("encrypted_content"))
    if text is not None:
        return text
    content = item.get("content")
    if content:
        return "".join(c["text"] for c in content)
    summary = item.get("summary")
    if summary:
        return "\n\n".join(p["text"] for p in summary)
    return None


def _text_of(part: JSON) -> str:
    return cast(str, part["refusal"] if part["type"] == "refusal" else part["text"])


def _assistant_text(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    return "".join(_text_of(p) for p in content if p["type"] != "input_image")


def _content(content: str | list[Any]) -> str | list[dict[str, Any]]:
    """Responses content -> Chat content; a lone text part (what Codex sends) becomes a string."""
    if isinstance(content, str):
        return content
    if len(content) == 1 and content[0]["type"] != "input_image":
        return _text_of(content[0])
    out: list[dict[str, Any]] = []
    for p in content:
        if p["type"] == "input_image":
            image: dict[str, Any] = {"url": p["image_url"]}
            detail = p.get("detail")
            if detail is not None and detail != "auto":
                image["detail"] = detail
            out.append({"type": "image_url", "image_url": image})
        else:
            out.append({"type": "text", "text": _text_of(p)})
    return out
