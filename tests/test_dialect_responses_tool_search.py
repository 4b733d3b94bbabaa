"""A client-executed Responses `tool_search` (Codex 0.171.0 with deferred MCP tools): the tool goes upstream
as the function `tool_search`; the policy's call comes back as the `tool_search_call` item Codex runs
(answer, synthesized stream and live stream, all parsed by the openai SDK); the history Codex sends back
renders the call as the policy made it and the `tool_search_output` as a tool message listing the loaded
functions, whose later calls answer with their namespace; malformed items are a 400 naming the field.

The items are Codex's own, captured from 0.171.0 run with an MCP server (`tests/mcp_weather.py`),
`features.tool_search` and `features.tool_search_always_defer_mcp_tools` on, and a model its catalog marks
`supports_search_tool` (descriptions shortened)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import Response

from polar.gateway.canonical import (
    CanonicalRequest,
    Completion,
    StreamChunk,
    StreamHead,
    ToolCall,
    ToolCallDelta,
)
from polar.gateway.dialects.responses.dialect import ResponsesDialect
from polar.gateway.signatures import ReasoningCodec
from tests.dialect_support import (
    assert_parsed_or_refused,
    events_of,
    frames_of,
    mutate,
    openai_client,
    openai_refusal,
    sse_response,
)

CODEC = ReasoningCodec(b"test-key")
RESP = ResponsesDialect()

EXEC_COMMAND = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command.",
    "strict": False,
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
}
SEARCH_PARAMS = {
    "type": "object",
    "properties": {
        "limit": {"type": "number", "description": "Maximum number of tools to return. Defaults to 8."},
        "query": {"type": "string", "description": "Search query for deferred tools."},
    },
    "required": ["query"],
    "additionalProperties": False,
}
TOOL_SEARCH = {
    "type": "tool_search",
    "execution": "client",
    "description": "# Tool discovery\n\nSearches over deferred tool metadata with BM25.",
    "parameters": SEARCH_PARAMS,
}
FORECAST = {
    "type": "function",
    "name": "forecast",
    "description": "The weather forecast for a city.",
    "strict": False,
    "defer_loading": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
LOADED = [
    {
        "type": "namespace",
        "name": "mcp__weather",
        "description": "Tools in the mcp__weather namespace.",
        "tools": [FORECAST],
    }
]
CONTEXT = [
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]}
]
SEARCH_CALL = {
    "type": "tool_search_call",
    "id": "tsc_1",
    "call_id": "call_ts1",
    "status": "completed",
    "execution": "client",
    "arguments": {"query": "forecast", "limit": 8},
}
SEARCH_OUTPUT = {
    "type": "tool_search_output",
    "id": "tso_1",
    "call_id": "call_ts1",
    "status": "completed",
    "execution": "client",
    "tools": LOADED,
}
SEARCH_ARGS = '{"query": "forecast", "limit": 8}'  # json.dumps of the object, as Qwen-style models write


def body(input_items: list[Any], **overrides: Any) -> dict[str, Any]:
    return {
        "model": "gpt-5.5",
        "instructions": "You are Codex.",
        "input": input_items,
        "tools": [EXEC_COMMAND, TOOL_SEARCH, {"type": "web_search", "external_web_access": True}],
        "tool_choice": "auto",
        "stream": True,
        "store": False,
        "include": ["reasoning.encrypted_content"],
        **overrides,
    }


def parsed(items: list[Any] | None = None, **overrides: Any) -> CanonicalRequest:
    return RESP.parse(body(list(items or CONTEXT), **overrides), CODEC)


def completion(*calls: ToolCall, content: str = "Searching.") -> Completion:
    return Completion(
        id="chatcmpl-ts1",
        model="gpt-5.5",
        content=content,
        reasoning=None,
        tool_calls=calls,
        finish_reason="tool_calls",
        prompt_tokens=100,
        completion_tokens=20,
        created=1_760_000_000,
    )


SEARCHING = completion(ToolCall("call_ts1", "tool_search", SEARCH_ARGS))
EXPECTED_SEARCH = {
    "type": "tool_search_call",
    "call_id": "call_ts1",
    "execution": "client",
    "arguments": {"query": "forecast", "limit": 8},
}


def calls_of(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keep = ("type", "namespace", "name", "call_id", "arguments", "execution")
    return [{k: o[k] for k in keep if k in o} for o in output if o["type"] != "message"]


# ---------------------------------------------------------------------------------------------- upstream


def test_the_search_tool_goes_upstream_as_a_function() -> None:
    req = parsed()
    assert [t["function"]["name"] for t in req.tools or []] == ["exec_command", "tool_search"]
    assert (req.tools or [])[1]["function"] == {
        "name": "tool_search",
        "description": TOOL_SEARCH["description"],
        "parameters": SEARCH_PARAMS,
    }
    assert req.render["tool_search"] is True
    assert req.render["dropped_tools"] == ["web_search"]


def test_a_server_executed_search_is_dropped_like_a_hosted_tool() -> None:
    req = parsed(tools=[EXEC_COMMAND, {**TOOL_SEARCH, "execution": "server"}])
    assert [t["function"]["name"] for t in req.tools or []] == ["exec_command"]
    assert req.render["tool_search"] is False and req.render["dropped_tools"] == ["tool_search"]


def test_the_search_and_its_result_render_as_a_call_and_a_tool_message() -> None:
    """The call as the policy made it (the gateway's restore puts its exact text back by call id); the
    result lists the loaded function under its flat name, one JSON object per line; the request's `tools`
    stay as they were, so the next prompt extends the last one."""
    req = parsed([*CONTEXT, {"type": "message", "role": "assistant", "content": "Searching."}, SEARCH_CALL,
                  SEARCH_OUTPUT])  # fmt: skip
    assert req.messages[2] == SEARCHING.message()
    tool = req.messages[3]
    assert tool["role"] == "tool" and tool["tool_call_id"] == "call_ts1"
    (line,) = tool["content"].splitlines()
    assert json.loads(line) == {
        "type": "function",
        "function": {
            "name": "mcp__weather__forecast",
            "description": "The weather forecast for a city.",
            "parameters": FORECAST["parameters"],
        },
    }
    assert [t["function"]["name"] for t in req.tools or []] == ["exec_command", "tool_search"]
    assert req.render["namespaced_tools"] == {"mcp__weather__forecast": ("mcp__weather", "forecast")}


def test_a_search_that_found_nothing_says_so() -> None:
    req = parsed([*CONTEXT, SEARCH_CALL, {**SEARCH_OUTPUT, "tools": []}])
    assert req.messages[-1]["content"] == "No tools matched."


# ---------------------------------------------------------------------------------------------- answers


def test_a_call_of_the_search_answers_as_a_tool_search_call() -> None:
    rendered = RESP.render(parsed(), SEARCHING, CODEC)
    response = Response.model_validate(rendered)  # the SDK's own types accept the item
    assert calls_of(rendered["output"]) == [EXPECTED_SEARCH]
    assert response.output[1].type == "tool_search_call"


def test_a_loaded_tool_answers_with_its_namespace() -> None:
    req = parsed([*CONTEXT, SEARCH_CALL, SEARCH_OUTPUT])
    asking = completion(ToolCall("call_f1", "mcp__weather__forecast", '{"city": "Oslo"}'), content="Asking.")
    rendered = RESP.render(req, asking, CODEC)
    assert calls_of(rendered["output"]) == [
        {"type": "function_call", "namespace": "mcp__weather", "name": "forecast", "call_id": "call_f1",
         "arguments": '{"city": "Oslo"}'},
    ]  # fmt: skip


@pytest.mark.parametrize("arguments", ['"forecast"', "{not json", "[1]"])
def test_arguments_that_are_no_object_go_back_as_a_function_call(arguments: str) -> None:
    """Codex answers such a call "unsupported call": the policy sees its mistake, the record keeps it."""
    bad = completion(ToolCall("call_x", "tool_search", arguments))
    assert calls_of(RESP.render(parsed(), bad, CODEC)["output"]) == [
        {"type": "function_call", "name": "tool_search", "call_id": "call_x", "arguments": arguments}
    ]


def test_without_a_search_tool_a_call_named_so_is_a_plain_function_call() -> None:
    req = parsed(tools=[EXEC_COMMAND])
    assert calls_of(RESP.render(req, SEARCHING, CODEC)["output"])[0]["type"] == "function_call"


def check_stream(frames: list[bytes], expected: list[dict[str, Any]]) -> None:
    events = events_of(frames)
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert calls_of(added) == calls_of(done) == expected  # one whole item: no deltas for an object
    client = openai_client(lambda _: sse_response(frames))
    with client.responses.stream(model="gpt-5.5", input="go") as s:
        final = s.get_final_response()
    assert calls_of([o.model_dump(exclude_none=True) for o in final.output]) == expected


def test_a_synthesized_stream_sends_the_search_call_whole() -> None:
    check_stream(list(RESP.stream(parsed(), SEARCHING, CODEC)), [EXPECTED_SEARCH])


@pytest.mark.parametrize(
    ("arguments", "kind"), [(SEARCH_ARGS, "tool_search_call"), ("{nope", "function_call")]
)
def test_a_live_stream_holds_the_search_call_back_until_it_is_complete(arguments: str, kind: str) -> None:
    """Token by token, as from vLLM: the item is known only from the whole arguments."""
    comp = completion(
        ToolCall("call_ts1", "tool_search", arguments), ToolCall("call_c", "exec_command", "{}")
    )
    enc = RESP.stream_encoder(parsed(), CODEC, "sse")
    blob = enc.open(StreamHead("chatcmpl-ts1", "gpt-5.5", 1_760_000_000, 100))
    blob += enc.delta(StreamChunk(content="Searching."))
    for index, tc in enumerate(comp.tool_calls):
        half = len(tc.arguments) // 2
        blob += enc.delta(
            StreamChunk(tool_calls=(ToolCallDelta(index, tc.id, tc.name, tc.arguments[:half]),))
        )
        blob += enc.delta(StreamChunk(tool_calls=(ToolCallDelta(index, None, None, tc.arguments[half:]),)))
    blob += enc.close(comp)
    first = (
        EXPECTED_SEARCH
        if kind == "tool_search_call"
        else {"type": "function_call", "name": "tool_search", "call_id": "call_ts1", "arguments": arguments}
    )
    exec_call = {"type": "function_call", "name": "exec_command", "call_id": "call_c", "arguments": "{}"}
    frames = frames_of(blob)
    events = events_of(frames)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert calls_of(done) == [first, exec_call]
    assert [d["id"] for d in done[1:]] == [
        "tsc_ts1_0" if kind == "tool_search_call" else "fc_ts1_0",
        "fc_ts1_1",
    ]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]
    client = openai_client(lambda _: sse_response(frames))
    with client.responses.stream(model="gpt-5.5", input="go") as s:
        final = s.get_final_response()
    assert calls_of([o.model_dump(exclude_none=True) for o in final.output]) == [first, exec_call]


# ---------------------------------------------------------------------------------------------- refusals

BAD = [
    ("a call without call_id", [{k: v for k, v in SEARCH_CALL.items() if k != "call_id"}], "input[1].call_id"),
    ("arguments as text", [{**SEARCH_CALL, "arguments": SEARCH_ARGS}], "input[1].arguments"),
    ("an output without tools", [SEARCH_CALL, {k: v for k, v in SEARCH_OUTPUT.items() if k != "tools"}],
     "input[2].tools"),
    ("a loaded tool that is no tool", [SEARCH_CALL, {**SEARCH_OUTPUT, "tools": [{"type": "namespace"}]}],
     "input[2].tools[0].name"),
    ("a loaded schema that is not one", [SEARCH_CALL, {**SEARCH_OUTPUT, "tools": [
        {**FORECAST, "parameters": {"type": "objekt"}}]}], "input[2].tools[0].parameters"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "items", "param"), BAD, ids=[c[0] for c in BAD])
def test_a_malformed_search_item_is_a_400_naming_the_field(case: str, items: list[Any], param: str) -> None:
    openai_refusal(RESP, body([*CONTEXT, *items]), CODEC, param)


@pytest.mark.parametrize("first", [True, False])
def test_a_function_named_like_the_search_is_a_400(first: bool) -> None:
    clash = {**EXEC_COMMAND, "name": "tool_search"}
    tools = [clash, TOOL_SEARCH] if first else [TOOL_SEARCH, clash]
    openai_refusal(RESP, body(list(CONTEXT), tools=tools), CODEC, "tools[1].name")


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_mutation_of_a_search_history_is_parsed_or_refused_by_field(data: st.DataObject) -> None:
    history = [*CONTEXT, SEARCH_CALL, SEARCH_OUTPUT]
    assert_parsed_or_refused(RESP, mutate(body(history), data), CODEC, SEARCHING)
