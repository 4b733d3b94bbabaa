"""Responses `namespace` tools (Codex 0.171.0's `multi_agent_v1` sub-agent tools): each member goes upstream
as one Chat function named `namespace__name`; the policy's call to it comes back as the item OpenAI's
server sends, `function_call` with `namespace` and the member's own `name` (answer, synthesized stream and
live stream alike), which the openai SDK parses; the history Codex sends back renders to the same Chat
call the policy made, so prefix merging holds; malformed groups are a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import orjson
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
from polar.gateway.dialects.responses.tools import flat_name
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
SPAWN_PARAMS = {
    "type": "object",
    "properties": {"message": {"type": "string"}, "fork_context": {"type": "boolean"}},
    "additionalProperties": False,
}
WAIT_PARAMS = {
    "type": "object",
    "properties": {"targets": {"type": "array", "items": {"type": "string"}}},
    "required": ["targets"],
}
# What Codex 0.171.0 sends (descriptions shortened).
MULTI_AGENT = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for spawning and managing sub-agents.",
    "tools": [
        {"type": "function", "name": "spawn_agent", "description": "Spawn a sub-agent.", "strict": False,
         "parameters": SPAWN_PARAMS},
        {"type": "function", "name": "wait_agent", "description": "Wait for agents.", "strict": False,
         "parameters": WAIT_PARAMS},
    ],
}  # fmt: skip
# Codex's own qualified MCP names are `mcp__server__tool`: a namespace ending in `__` gets no second one.
MCP = {
    "type": "namespace",
    "name": "mcp__notes__",
    "description": "The notes MCP server.",
    "tools": [{"type": "custom", "name": "append", "description": "Append raw text."}],
}
SPAWN = "multi_agent_v1__spawn_agent"
SPAWN_ARGS = '{"message": "List the files here."}'
CONTEXT = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]}]


def body(input_items: list[Any], **overrides: Any) -> dict[str, Any]:
    return {
        "model": "policy",
        "instructions": "You are Codex.",
        "input": input_items,
        "tools": [EXEC_COMMAND, MULTI_AGENT, MCP],
        "tool_choice": "auto",
        "stream": True,
        "store": False,
        "include": ["reasoning.encrypted_content"],
        **overrides,
    }


def parsed(**overrides: Any) -> CanonicalRequest:
    return RESP.parse(body(list(CONTEXT), **overrides), CODEC)


CALLS = Completion(
    id="chatcmpl-ns1",
    model="policy",
    content="Delegating.",
    reasoning=None,
    tool_calls=(
        ToolCall("call_a", SPAWN, SPAWN_ARGS),
        ToolCall("call_b", "mcp__notes__append", json.dumps({"input": "a note"})),
        ToolCall("call_c", "exec_command", '{"cmd": "ls"}'),
    ),
    finish_reason="tool_calls",
    prompt_tokens=100,
    completion_tokens=20,
    created=1_760_000_000,
)


def calls_of(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keep = ("type", "namespace", "name", "call_id", "arguments", "input")
    return [{k: o[k] for k in keep if k in o} for o in output if o["type"] != "message"]


EXPECTED_CALLS = [
    {"type": "function_call", "namespace": "multi_agent_v1", "name": "spawn_agent", "call_id": "call_a",
     "arguments": SPAWN_ARGS},
    {"type": "custom_tool_call", "namespace": "mcp__notes__", "name": "append", "call_id": "call_b",
     "input": "a note"},
    {"type": "function_call", "name": "exec_command", "call_id": "call_c", "arguments": '{"cmd": "ls"}'},
]  # fmt: skip


# ---------------------------------------------------------------------------------------------- upstream


def test_members_go_upstream_as_functions_under_flat_names() -> None:
    req = parsed()
    assert [t["function"]["name"] for t in req.tools or []] == [
        "exec_command",
        "multi_agent_v1__spawn_agent",
        "multi_agent_v1__wait_agent",
        "mcp__notes__append",
    ]
    spawn = (req.tools or [])[1]["function"]
    assert spawn == {"name": SPAWN, "description": "Spawn a sub-agent.", "parameters": SPAWN_PARAMS}
    append = (req.tools or [])[3]["function"]  # a custom member: one string argument, as at top level
    assert append["parameters"]["required"] == ["input"]
    assert req.render["namespaced_tools"] == {
        SPAWN: ("multi_agent_v1", "spawn_agent"),
        "multi_agent_v1__wait_agent": ("multi_agent_v1", "wait_agent"),
        "mcp__notes__append": ("mcp__notes__", "append"),
    }
    assert req.render["custom_tools"] == frozenset({"mcp__notes__append"})
    assert req.render["dropped_tools"] == []  # a namespace is no hosted tool
    assert all(len(t["function"]["name"]) <= 64 for t in req.tools or [])
    assert flat_name("a", "b") == "a__b" and flat_name("a__", "b") == "a__b"


def test_tool_choice_names_a_member_by_namespace_and_name() -> None:
    choice = {"type": "function", "namespace": "multi_agent_v1", "name": "wait_agent"}
    assert parsed(tool_choice=choice).tool_choice == {
        "type": "function",
        "function": {"name": "multi_agent_v1__wait_agent"},
    }
    flat = {"type": "function", "name": SPAWN}  # the flat name works too: it is a tool of the request
    assert parsed(tool_choice=flat).tool_choice == {"type": "function", "function": {"name": SPAWN}}


def test_history_calls_render_as_the_policy_made_them() -> None:
    """Codex sends each call back with its namespace (and the output with none); the prompt holds the call
    exactly as the policy sampled it (`Completion.message()`), so the next turn extends the last one."""
    history = [
        *CONTEXT,
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Delegating."}]},
        *EXPECTED_CALLS,
        {"type": "function_call_output", "call_id": "call_a", "output": '{"agent_id":"a1"}'},
        {"type": "custom_tool_call_output", "call_id": "call_b", "output": "ok"},
        {"type": "function_call_output", "call_id": "call_c", "output": "x.txt\n"},
    ]
    req = RESP.parse(body(history), CODEC)
    assert req.messages[2] == CALLS.message()
    assert [m["role"] for m in req.messages[3:]] == ["tool", "tool", "tool"]


# ---------------------------------------------------------------------------------------------- answers


def test_an_answer_calls_members_with_their_namespace() -> None:
    rendered = RESP.render(parsed(), CALLS, CODEC)
    response = Response.model_validate(rendered)  # the SDK's own types accept the items
    assert calls_of(rendered["output"]) == EXPECTED_CALLS
    spawn = response.output[1]
    assert (
        spawn.type == "function_call" and spawn.namespace == "multi_agent_v1" and spawn.name == "spawn_agent"
    )


def check_stream(frames: list[bytes]) -> None:
    """Every item event names the member with its namespace; the SDK's final response equals the answer."""
    events = events_of(frames)
    heads = [{k: v for k, v in c.items() if k not in ("arguments", "input")} for c in EXPECTED_CALLS]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [{k: v for k, v in c.items() if k not in ("arguments", "input")} for c in calls_of(added)] == heads
    assert calls_of([e["item"] for e in events if e["type"] == "response.output_item.done"]) == EXPECTED_CALLS
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [e["name"] for e in done] == ["spawn_agent", "exec_command"]
    client = openai_client(lambda _: sse_response(frames))
    with client.responses.stream(model="policy", input="go") as s:
        final = s.get_final_response()
    assert calls_of([o.model_dump(exclude_none=True) for o in final.output]) == EXPECTED_CALLS


def test_a_synthesized_stream_calls_members_with_their_namespace() -> None:
    check_stream(list(RESP.stream(parsed(), CALLS, CODEC)))


def test_a_live_stream_calls_members_with_their_namespace() -> None:
    """Token by token (`ResponsesStreamEncoder`): a call's name arrives in its first piece, as from vLLM."""
    req = parsed()
    enc = RESP.stream_encoder(req, CODEC, "sse")
    blob = enc.open(StreamHead("chatcmpl-ns1", "policy", 1_760_000_000, 100))
    blob += enc.delta(StreamChunk(content="Delegating."))
    for index, tc in enumerate(CALLS.tool_calls):
        half = len(tc.arguments) // 2
        first = ToolCallDelta(index, tc.id, tc.name, tc.arguments[:half])
        blob += enc.delta(StreamChunk(tool_calls=(first,)))
        blob += enc.delta(StreamChunk(tool_calls=(ToolCallDelta(index, None, None, tc.arguments[half:]),)))
    blob += enc.close(CALLS)
    check_stream(frames_of(blob))


def test_round_trip_through_the_sdk_keeps_the_prompt() -> None:
    """Stream the calls, let the SDK build the response, send its output back as Codex does: the policy's
    next prompt holds its calls exactly as sampled."""
    first = openai_client(lambda _: sse_response(list(RESP.stream(parsed(), CALLS, CODEC))))
    with first.responses.stream(model="policy", input="go") as s:
        output = [
            o.model_dump(exclude_none=True, exclude={"id", "status"}) for o in s.get_final_response().output
        ]
    captured: list[Any] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        captured.append(json.loads(request.content))
        return httpx2.Response(200, content=orjson.dumps(RESP.render(parsed(), CALLS, CODEC)))

    outputs = [{"type": "function_call_output", "call_id": "call_a", "output": "{}"}]
    openai_client(handler).responses.create(
        model="policy",
        input=[*CONTEXT, *output, *outputs],  # type: ignore[list-item]
        tools=[EXEC_COMMAND, MULTI_AGENT, MCP],  # type: ignore[list-item]
        store=False,
    )
    req = RESP.parse(captured[0], CODEC)
    assert req.messages[1] == CALLS.message()


# ---------------------------------------------------------------------------------------------- refusals

SPAWN_TOOL = MULTI_AGENT["tools"][0]  # type: ignore[index]
BAD = [
    ("no name", [{"type": "namespace", "tools": [SPAWN_TOOL]}], "tools[0].name"),
    ("empty name", [{"type": "namespace", "name": "", "tools": [SPAWN_TOOL]}], "tools[0].name"),
    ("no tools", [{"type": "namespace", "name": "ns"}], "tools[0].tools"),
    ("tools not a list", [{"type": "namespace", "name": "ns", "tools": SPAWN_TOOL}], "tools[0].tools"),
    (
        "a hosted member",
        [{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}],
        "tools[0].tools[0].type",
    ),
    (
        "a nested namespace",
        [{"type": "namespace", "name": "ns", "tools": [{**MULTI_AGENT}]}],
        "tools[0].tools[0].type",
    ),
    (
        "a member without a name",
        [{"type": "namespace", "name": "ns", "tools": [{"type": "function", "parameters": SPAWN_PARAMS}]}],
        "tools[0].tools[0].name",
    ),
    (
        "a member whose schema is not one",
        [{"type": "namespace", "name": "ns", "tools": [{**SPAWN_TOOL, "parameters": {"type": "objekt"}}]}],
        "tools[0].tools[0].parameters",
    ),
    (
        "a member named like a top-level tool",
        [{**EXEC_COMMAND, "name": "ns__exec"}, {"type": "namespace", "name": "ns", "tools": [
            {**EXEC_COMMAND, "name": "exec"}]}],
        "tools[1].tools[0].name",
    ),
    (
        "a top-level tool named like a member",
        [{"type": "namespace", "name": "ns", "tools": [{**EXEC_COMMAND, "name": "exec"}]},
         {**EXEC_COMMAND, "name": "ns__exec"}],
        "tools[1].name",
    ),
    (
        "two members of one flat name",
        [{"type": "namespace", "name": "a__b", "tools": [{**EXEC_COMMAND, "name": "c"}]},
         {"type": "namespace", "name": "a", "tools": [{**EXEC_COMMAND, "name": "b__c"}]}],
        "tools[1].tools[0].name",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("case", "tools", "param"), BAD, ids=[c[0] for c in BAD])
def test_a_malformed_namespace_is_a_400_naming_the_field(case: str, tools: list[Any], param: str) -> None:
    openai_refusal(RESP, body(list(CONTEXT), tools=tools), CODEC, param)


def test_a_history_namespace_that_is_no_string_is_a_400() -> None:
    item = {"type": "function_call", "call_id": "c", "name": "spawn_agent", "arguments": "{}", "namespace": 3}
    openai_refusal(RESP, body([*CONTEXT, item]), CODEC, "input[1].namespace")


def test_two_top_level_tools_of_one_name_pass_as_before() -> None:
    req = parsed(tools=[EXEC_COMMAND, EXEC_COMMAND])
    assert [t["function"]["name"] for t in req.tools or []] == ["exec_command", "exec_command"]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_mutation_of_a_namespaced_body_is_parsed_or_refused_by_field(data: st.DataObject) -> None:
    history = [
        *CONTEXT,
        *EXPECTED_CALLS,
        {"type": "function_call_output", "call_id": "call_a", "output": "{}"},
    ]
    assert_parsed_or_refused(RESP, mutate(body(history), data), CODEC, CALLS)


# ------------------------------------------------------------------------------------- multi_agent_v2

NEW_TASK = {
    "type": "agent_message",
    "author": "/root",
    "recipient": "/root/helper",
    "content": [
        {
            "type": "input_text",
            "text": "Message Type: NEW_TASK\nTask name: /root/helper\nSender: /root\nPayload:\n",
        },
        {"type": "encrypted_content", "encrypted_content": "List the files here."},
    ],
}


def test_an_agent_message_is_a_user_turn_of_its_text() -> None:
    """Codex 0.171.0's `multi_agent_v2` hands a spawned agent its task (and a parent its child's answer) as
    an `agent_message`; the `encrypted_content` part holds the policy's own argument text, verbatim."""
    req = RESP.parse(body([*CONTEXT, NEW_TASK]), CODEC)
    assert req.messages[-1] == {
        "role": "user",
        "content": "Message Type: NEW_TASK\nTask name: /root/helper\nSender: /root\nPayload:\nList the files here.",
    }


@pytest.mark.parametrize(
    ("part", "param"),
    [
        ({"type": "output_text", "text": "x"}, "input[1].content[0].type"),
        ({"type": "encrypted_content"}, "input[1].content[0].encrypted_content"),
    ],
)
def test_a_malformed_agent_message_is_a_400(part: dict[str, Any], param: str) -> None:
    openai_refusal(RESP, body([*CONTEXT, {**NEW_TASK, "content": [part]}]), CODEC, param)
