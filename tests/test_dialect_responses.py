"""OpenAI Responses dialect (what Codex speaks): parsing Codex-shaped bodies with full resent history,
refusing bad ones by field, and answers the official `openai` SDK parses (its HTTP transport is replaced by a
handler that returns what the dialect rendered)."""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx2
import openai
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from polar.gateway.canonical import CanonicalRequest, Completion, ToolCall
from polar.gateway.dialects.responses.dialect import ResponsesDialect
from polar.gateway.errors import GatewayError
from polar.gateway.signatures import ReasoningCodec
from tests.dialect_support import (
    assert_parsed_or_refused,
    mutate,
    openai_client,
    openai_refusal,
    sse_response,
)

CODEC = ReasoningCodec(b"test-key")
RESP = ResponsesDialect()
EVENT = TypeAdapter(ResponseStreamEvent)

EXEC_COMMAND = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command in a PTY, returning output.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {
            "cmd": {"type": "string", "description": "Shell command to execute."},
            "workdir": {"type": "string"},
            "yield_time_ms": {"type": "number"},
        },
        "required": ["cmd"],
        "additionalProperties": False,
    },
}
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Use the `apply_patch` tool to edit files.",
    "format": {
        "type": "grammar",
        "syntax": "lark",
        "definition": 'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\n',
    },
}
WEB_SEARCH = {"type": "web_search", "external_web_access": False}

PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hi\n*** End Patch\n"
REASONING_1 = "The user wants hi printed. I will run echo through exec_command first."
REASONING_2 = "It worked. Now create the file with apply_patch."


def completion(**kw: Any) -> Completion:
    base: dict[str, Any] = dict(
        id="chatcmpl-xyz789",
        model="served-policy",
        content="Done: the file hello.txt now contains hi, and the command printed hi.",
        reasoning=None,
        tool_calls=(),
        finish_reason="stop",
        prompt_tokens=9_000,
        completion_tokens=42,
        created=1_760_000_000,
    )
    base.update(kw)
    return Completion(**base)


def codex_body(input_items: list[Any], **overrides: Any) -> dict[str, Any]:
    """A Codex 0.17x request: instructions, developer+user context, its tools, store false, encrypted
    reasoning included, full history in `input`."""
    body: dict[str, Any] = {
        "model": "qwen3-policy",
        "instructions": "You are Codex, a coding agent.",
        "input": input_items,
        "tools": [EXEC_COMMAND, APPLY_PATCH, WEB_SEARCH],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199-session",
        "text": {"verbosity": "medium"},
        "client_metadata": {"x": "ignored"},  # unknown fields are tolerated
    }
    body.update(overrides)
    return body


CONTEXT = [
    {
        "type": "message",
        "role": "developer",
        "content": [{"type": "input_text", "text": "<permissions>danger-full-access</permissions>"}],
    },
    {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "<environment_context/>"}],
    },
    {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "print hi, then add hello.txt"}],
    },
]


def history_items() -> list[Any]:
    """Two earlier turns as Codex resends them (ids stripped, reasoning as we issued it)."""
    return [
        *CONTEXT,
        {
            "type": "reasoning",
            "summary": [{"type": "summary_text", "text": "**Printing hi**"}],
            "encrypted_content": CODEC.encode(REASONING_1),
        },
        {
            "type": "function_call",
            "name": "exec_command",
            "arguments": '{"cmd":"echo hi"}',
            "call_id": "call_1",
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "hi\n"},
        {
            "type": "reasoning",
            "summary": [{"type": "summary_text", "text": REASONING_2}],
            "encrypted_content": CODEC.encode(REASONING_2),
        },
        {
            "type": "custom_tool_call",
            "status": "completed",
            "call_id": "call_2",
            "name": "apply_patch",
            "input": PATCH,
        },
        {"type": "custom_tool_call_output", "call_id": "call_2", "output": "Success. Updated: A hello.txt"},
    ]


# ---------------------------------------------------------------------------------------------- parsing


def test_parse_codex_body_with_history() -> None:
    req = RESP.parse(codex_body(history_items()), CODEC)
    assert req.model == "qwen3-policy"
    assert req.stream is True
    assert req.messages == [
        {"role": "system", "content": "You are Codex, a coding agent."},
        {"role": "system", "content": "<permissions>danger-full-access</permissions>"},
        {"role": "user", "content": "<environment_context/>"},
        {"role": "user", "content": "print hi, then add hello.txt"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": REASONING_1,  # restored verbatim, not the summary
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "exec_command", "arguments": '{"cmd":"echo hi"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "hi\n"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": REASONING_2,
            "tool_calls": [
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "apply_patch", "arguments": json.dumps({"input": PATCH})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_2", "content": "Success. Updated: A hello.txt"},
    ]
    exec_tool, patch_tool = req.tools or []
    assert exec_tool == {
        "type": "function",
        "function": {
            "name": "exec_command",
            "description": EXEC_COMMAND["description"],
            "parameters": EXEC_COMMAND["parameters"],
        },
    }
    assert patch_tool["function"]["name"] == "apply_patch"
    params = patch_tool["function"]["parameters"]
    assert params["required"] == ["input"] and params["properties"]["input"]["type"] == "string"
    assert "lark grammar" in params["properties"]["input"]["description"]
    assert req.tool_choice == "auto"
    assert req.params == {"parallel_tool_calls": False, "reasoning_effort": "medium"}
    r = req.render
    assert r["model"] == "qwen3-policy"
    assert r["custom_tools"] == frozenset({"apply_patch"})
    assert r["dropped_tools"] == ["web_search"]
    assert r["include_encrypted"] is True
    assert r["store"] is False
    assert r["prompt_cache_key"] == "0199-session"


def test_parse_leaves_the_body_untouched() -> None:
    body = codex_body(history_items())
    before = copy.deepcopy(body)
    RESP.parse(body, CODEC)
    assert body == before


def test_consecutive_assistant_items_form_one_message() -> None:
    items = [
        {"role": "user", "content": "go"},  # an "easy" message: no `type`
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Running both."}],
        },
        {"type": "function_call", "call_id": "a", "name": "exec_command", "arguments": '{"cmd":"ls"}'},
        {"type": "function_call", "call_id": "b", "name": "exec_command", "arguments": '{"cmd":"pwd"}'},
        {"type": "function_call_output", "call_id": "a", "output": [{"type": "input_text", "text": "x.py"}]},
        {"type": "function_call_output", "call_id": "b", "output": "/repo"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
        {"type": "message", "role": "user", "content": "thanks"},
    ]
    req = RESP.parse({"model": "m", "input": items}, CODEC)
    assert req.messages == [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "Running both.",
            "reasoning_content": "think",
            "tool_calls": [
                {
                    "id": "a",
                    "type": "function",
                    "function": {"name": "exec_command", "arguments": '{"cmd":"ls"}'},
                },
                {
                    "id": "b",
                    "type": "function",
                    "function": {"name": "exec_command", "arguments": '{"cmd":"pwd"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "x.py"},
        {"role": "tool", "tool_call_id": "b", "content": "/repo"},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "thanks"},
    ]
    assert req.tools is None
    assert req.stream is False


def test_a_new_reasoning_item_starts_a_new_assistant_turn() -> None:
    items = [
        {"role": "user", "content": "go"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "one"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "first"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "two"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "second"}]},
    ]
    msgs = RESP.parse({"model": "m", "input": items}, CODEC).messages
    assert msgs[1:] == [
        {"role": "assistant", "content": "first", "reasoning_content": "one"},
        {"role": "assistant", "content": "second", "reasoning_content": "two"},
    ]


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        # A token we did not issue (another server's, or tampered with) is ignored: the summary is used.
        (
            {
                "type": "reasoning",
                "summary": [{"type": "summary_text", "text": "a"}, {"type": "summary_text", "text": "b"}],
                "encrypted_content": "gAAAAAB-openai-token",
            },
            "a\n\nb",
        ),
        (
            {
                "type": "reasoning",
                "summary": [],
                "encrypted_content": CODEC.encode("exact").replace("p1.", "p1.X"),
                "content": [{"type": "reasoning_text", "text": "raw reasoning"}],
            },
            "raw reasoning",
        ),
        ({"type": "reasoning", "summary": [], "encrypted_content": CODEC.encode("exact")}, "exact"),
        ({"type": "reasoning", "summary": []}, None),
    ],
)
def test_reasoning_restoration_order(item: dict[str, Any], expected: str | None) -> None:
    items = [{"role": "user", "content": "q"}, item, {"type": "message", "role": "assistant", "content": "a"}]
    assistant = RESP.parse({"model": "m", "input": items}, CODEC).messages[1]
    assert assistant.get("reasoning_content") == expected
    assert assistant["content"] == "a"


def test_string_input_instructions_and_sampling() -> None:
    req = RESP.parse(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": "hello",
            "max_output_tokens": 256,
            "temperature": 0.6,
            "top_p": 0.95,
            "top_k": 20,
            "tool_choice": {"type": "function", "name": "exec_command"},
            "tools": [EXEC_COMMAND],
            "reasoning": {"effort": "xhigh"},
            "metadata": {"k": "v"},
        },
        CODEC,
    )
    assert req.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    # `xhigh` is not forwarded: vLLM's schema refuses efforts other than low/medium/high.
    assert req.params == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 256}
    assert req.tool_choice == {"type": "function", "function": {"name": "exec_command"}}
    assert req.render["include_encrypted"] is False
    assert req.render["metadata"] == {"k": "v"}


def test_text_format_goes_upstream_as_response_format() -> None:
    """Codex's `--output-schema` asks for structured output in `text.format`; the upstream server reads the
    chat `response_format`, with the schema's fields one level down. Plain text is left out."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "name": "codex_output_schema", "schema": schema, "strict": True}
    body = {"model": "m", "input": "x", "text": {"format": fmt, "verbosity": "medium"}}
    req = RESP.parse(body, CODEC)
    assert req.params["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "codex_output_schema", "schema": schema, "strict": True},
    }
    assert req.render["text"] == body["text"]  # echoed as sent
    as_object = RESP.parse({**body, "text": {"format": {"type": "json_object"}}}, CODEC)
    assert as_object.params["response_format"] == {"type": "json_object"}
    for plain in ({"format": {"type": "text"}}, {"verbosity": "low"}, None):
        assert "response_format" not in RESP.parse({**body, "text": plain}, CODEC).params


def test_only_hosted_tools_leave_no_tools_and_no_tool_choice() -> None:
    req = RESP.parse({"model": "m", "input": "x", "tools": [WEB_SEARCH], "tool_choice": "auto"}, CODEC)
    assert req.tools is None and req.tool_choice is None
    assert req.render["dropped_tools"] == ["web_search"]


def test_content_parts_and_images() -> None:
    items = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "what is in"},
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "high"},
            ],
        },
        {
            "type": "function_call_output",
            "call_id": "c",
            "output": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
    ]
    msgs = RESP.parse({"model": "m", "input": items}, CODEC).messages
    assert msgs == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is in"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "high"}},
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "c",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        },
    ]


BAD_BODIES: list[tuple[str, Any, str | None]] = [
    ("not an object", "hello", None),
    ("missing model", {"input": "hi"}, "model"),
    ("missing input", {"model": "m"}, "input"),
    ("input is a number", {"model": "m", "input": 5}, "input"),
    ("empty input", {"model": "m", "input": []}, "input"),
    (
        "item_reference",
        {"model": "m", "input": [*CONTEXT, {"type": "item_reference", "id": "msg_1"}]},
        "input[3].type",
    ),
    (
        "web_search_call item",
        {"model": "m", "input": [{"type": "web_search_call", "id": "ws"}]},
        "input[0].type",
    ),
    ("item not an object", {"model": "m", "input": ["hi"]}, "input[0]"),
    (
        "function_call without call_id",
        {"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
        "input[0].call_id",
    ),
    (
        "function_call_output without output",
        {"model": "m", "input": [{"type": "function_call_output", "call_id": "c"}]},
        "input[0].output",
    ),
    ("tool role message", {"model": "m", "input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    (
        "input_file part",
        {
            "model": "m",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_file"}]}
            ],
        },
        "input[0].content[1].type",
    ),
    (
        "image by file id",
        {
            "model": "m",
            "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}],
        },
        "input[0].content[0].image_url",
    ),
    (
        "function tool without name",
        {"model": "m", "input": "x", "tools": [{"type": "function"}]},
        "tools[0].name",
    ),
    (
        "max_output_tokens not an int",
        {"model": "m", "input": "x", "max_output_tokens": "lots"},
        "max_output_tokens",
    ),
    (
        "previous_response_id",
        {"model": "m", "input": "x", "previous_response_id": "resp_1"},
        "previous_response_id",
    ),
    ("conversation", {"model": "m", "input": "x", "conversation": "conv_1"}, "conversation"),
    ("background", {"model": "m", "input": "x", "background": True}, "background"),
    (
        "hosted tool_choice",
        {"model": "m", "input": "x", "tool_choice": {"type": "web_search"}},
        "tool_choice.type",
    ),
    (
        "tool_choice names an unknown tool",
        {"model": "m", "input": "x", "tool_choice": {"type": "function", "name": "nope"}},
        "tool_choice.name",
    ),
    (
        "required tool_choice with only hosted tools",
        {"model": "m", "input": "x", "tools": [WEB_SEARCH], "tool_choice": "required"},
        "tool_choice",
    ),
    (
        "unknown text.format",
        {"model": "m", "input": "x", "text": {"format": {"type": "xml"}}},
        "text.format.type",
    ),
    (
        "json_schema text.format without its schema",
        {"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "o"}}},
        "text.format.schema",
    ),
    ("stream as a string is not coerced", {"model": "m", "input": "x", "stream": "true"}, "stream"),
    ("include not a list", {"model": "m", "input": "x", "include": "reasoning.encrypted_content"}, "include"),
]


@pytest.mark.parametrize(("case", "body", "param"), BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
def test_bad_body_is_a_400_naming_the_field(case: str, body: Any, param: str | None) -> None:
    openai_refusal(RESP, body, CODEC, param)


def test_unsupported_item_message_names_the_type() -> None:
    with pytest.raises(GatewayError) as info:
        RESP.parse({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}, CODEC)
    assert "'item_reference'" in info.value.message
    assert "input[0].type" in info.value.message


# ---------------------------------------------------------------------------------------------- render


def parsed_request(**overrides: Any) -> CanonicalRequest:
    return RESP.parse(codex_body(list(CONTEXT), **overrides), CODEC)


TOOL_COMPLETION = completion(
    content=None,
    reasoning="I need to look at the directory first, then write the file with apply_patch.",
    tool_calls=(
        ToolCall("call_x1", "exec_command", '{"cmd": "ls -la", "workdir": "/repo"}'),
        ToolCall("call_x2", "apply_patch", json.dumps({"input": PATCH})),
    ),
    finish_reason="tool_calls",
)


def test_render_is_a_response_the_sdk_parses() -> None:
    req = parsed_request()
    body = RESP.render(req, TOOL_COMPLETION, CODEC)
    Response.model_validate(body)  # strict shape check, independent of the SDK's lenient parsing

    c = openai_client(lambda _: httpx2.Response(200, content=orjson.dumps(body)))
    out = c.responses.create(model="qwen3-policy", input="x")
    assert out.id == "resp_xyz789"
    assert out.model == "qwen3-policy"
    assert out.status == "completed"
    assert [o.type for o in out.output] == ["reasoning", "function_call", "custom_tool_call"]
    reasoning, call, custom = out.output
    assert reasoning.type == "reasoning"
    assert reasoning.summary[0].text == TOOL_COMPLETION.reasoning
    assert CODEC.decode(reasoning.encrypted_content) == TOOL_COMPLETION.reasoning
    assert call.type == "function_call"
    assert (call.call_id, call.name, call.arguments) == (
        "call_x1",
        "exec_command",
        TOOL_COMPLETION.tool_calls[0].arguments,
    )
    assert custom.type == "custom_tool_call"
    assert (custom.call_id, custom.name, custom.input) == ("call_x2", "apply_patch", PATCH)
    assert out.usage is not None
    assert (out.usage.input_tokens, out.usage.output_tokens, out.usage.total_tokens) == (9_000, 42, 9_042)
    assert out.tools and [t.type for t in out.tools] == ["function", "custom", "web_search"]


def test_render_text_answer_and_no_encrypted_content_unless_included() -> None:
    req = parsed_request(include=[])
    comp = completion(reasoning="short thought")
    body = RESP.render(req, comp, CODEC)
    out = Response.model_validate(body)
    assert out.output_text == comp.content
    reasoning = out.output[0]
    assert reasoning.type == "reasoning" and reasoning.encrypted_content is None
    assert out.output[1].type == "message" and out.output[1].status == "completed"


def test_render_length_is_incomplete() -> None:
    body = RESP.render(parsed_request(), completion(finish_reason="length"), CODEC)
    out = Response.model_validate(body)
    assert out.status == "incomplete"
    assert out.incomplete_details is not None and out.incomplete_details.reason == "max_output_tokens"
    assert out.output[0].type == "message" and out.output[0].status == "incomplete"


def test_custom_tool_input_that_is_not_json_is_kept_raw() -> None:
    comp = completion(
        content=None, tool_calls=(ToolCall("c", "apply_patch", PATCH),), finish_reason="tool_calls"
    )
    out = Response.model_validate(RESP.render(parsed_request(), comp, CODEC))
    assert out.output[0].type == "custom_tool_call" and out.output[0].input == PATCH


def split_events(blob: bytes) -> list[dict[str, Any]]:
    events = []
    for frame in blob.split(b"\n\n"):
        if frame:
            event_line, data_line = frame.split(b"\n")
            data = orjson.loads(data_line.removeprefix(b"data: "))
            assert event_line == b"event: " + data["type"].encode()
            events.append(data)
    return events


def raw_events(frames: list[bytes]) -> list[dict[str, Any]]:
    """Decode our SSE frames by hand and check each is a valid, strictly-typed Responses stream event."""
    events = []
    for frame in frames:
        assert frame.endswith(b"\n\n")
        event_line, data_line = frame.rstrip(b"\n").split(b"\n")
        data = orjson.loads(data_line.removeprefix(b"data: "))
        assert event_line == b"event: " + data["type"].encode()
        EVENT.validate_python(data)
        events.append(data)
    return events


def test_stream_grammar() -> None:
    req = parsed_request()
    frames = list(
        RESP.stream(req, completion(reasoning="A long enough line of reasoning to be cut in pieces."), CODEC)
    )
    events = raw_events(frames)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    reasoning_end = types.index("response.output_item.done")
    assert types[2:reasoning_end] == [
        "response.output_item.added",
        "response.reasoning_summary_part.added",
        *["response.reasoning_summary_text.delta"] * (reasoning_end - 6),
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
    ]
    assert reasoning_end - 6 >= 2
    message = types[reasoning_end + 1 : -1]
    assert message[:2] == ["response.output_item.added", "response.content_part.added"]
    assert message[-3:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert set(message[2:-3]) == {"response.output_text.delta"}
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []


def test_stream_through_the_sdk_matches_render() -> None:
    req = parsed_request()
    frames = list(RESP.stream(req, TOOL_COMPLETION, CODEC))
    c = openai_client(lambda _: sse_response(frames))
    events = list(c.responses.create(model="qwen3-policy", input="x", stream=True))
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types
    assert "response.function_call_arguments.done" in types
    assert "response.custom_tool_call_input.delta" in types
    assert "response.custom_tool_call_input.done" in types
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    patch = "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta")
    assert args == TOOL_COMPLETION.tool_calls[0].arguments
    assert patch == PATCH

    with c.responses.stream(model="qwen3-policy", input="x") as s:
        final = s.get_final_response()
    rendered = Response.model_validate(RESP.render(req, TOOL_COMPLETION, CODEC))
    assert [o.model_dump(exclude_none=True) for o in final.output] == [
        o.model_dump(exclude_none=True) for o in rendered.output
    ]
    assert final.usage == rendered.usage


def test_stream_of_a_truncated_answer_ends_incomplete() -> None:
    frames = list(RESP.stream(parsed_request(), completion(finish_reason="length"), CODEC))
    events = raw_events(frames)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    c = openai_client(lambda _: sse_response(frames))
    last = list(c.responses.create(model="m", input="x", stream=True))[-1]
    assert last.type == "response.incomplete"


def test_round_trip_through_the_sdk_restores_calls_and_reasoning() -> None:
    """Stream an answer, let the SDK build the final response, send its output back as Codex does (plus the
    tool outputs), and parse: the same calls, the reasoning verbatim from encrypted_content."""
    first = openai_client(lambda _: sse_response(list(RESP.stream(parsed_request(), TOOL_COMPLETION, CODEC))))
    with first.responses.stream(model="qwen3-policy", input=CONTEXT) as s:  # type: ignore[arg-type]
        output = s.get_final_response().output

    captured: list[Any] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        captured.append(json.loads(request.content))
        return httpx2.Response(200, content=orjson.dumps(RESP.render(parsed_request(), completion(), CODEC)))

    resent: list[Any] = [
        *CONTEXT,
        # Codex drops ids and keeps only summary + encrypted_content; make the summary useless on purpose.
        *[
            {**o.model_dump(exclude_none=True, exclude={"id"}), "summary": []}
            if o.type == "reasoning"
            else o.model_dump(exclude_none=True, exclude={"id"})
            for o in output
        ],
        {"type": "function_call_output", "call_id": "call_x1", "output": "hello.txt\n"},
        {"type": "custom_tool_call_output", "call_id": "call_x2", "output": "Success."},
    ]
    openai_client(handler).responses.create(
        model="qwen3-policy",
        input=resent,
        tools=[EXEC_COMMAND, APPLY_PATCH],  # type: ignore[list-item]
        store=False,
        include=["reasoning.encrypted_content"],
    )
    req = RESP.parse(captured[0], CODEC)
    assistant = req.messages[3]
    assert assistant == {
        "role": "assistant",
        "content": None,
        "reasoning_content": TOOL_COMPLETION.reasoning,
        "tool_calls": [
            {
                "id": "call_x1",
                "type": "function",
                "function": {"name": "exec_command", "arguments": TOOL_COMPLETION.tool_calls[0].arguments},
            },
            {
                "id": "call_x2",
                "type": "function",
                "function": {"name": "apply_patch", "arguments": json.dumps({"input": PATCH})},
            },
        ],
    }
    assert req.messages[4:] == [
        {"role": "tool", "tool_call_id": "call_x1", "content": "hello.txt\n"},
        {"role": "tool", "tool_call_id": "call_x2", "content": "Success."},
    ]


# ---------------------------------------------------------------------------------------------- errors


def test_context_length_error() -> None:
    err = GatewayError("context_length", "too long", prompt_tokens=140_000, max_tokens=131_072)
    status, envelope = RESP.error(err)
    assert status == 400
    e = envelope["error"]
    assert (e["type"], e["code"], e["param"]) == ("invalid_request_error", "context_length_exceeded", "input")
    assert e["message"].startswith("Your input exceeds the context window of this model")
    assert "140000" in e["message"] and "131072" in e["message"]
    c = openai_client(lambda _: httpx2.Response(status, content=orjson.dumps(envelope)))
    with pytest.raises(openai.BadRequestError) as info:
        c.responses.create(model="m", input="x")
    assert info.value.code == "context_length_exceeded"


def test_stream_error_for_codex_and_the_sdk() -> None:
    err = GatewayError("context_length", "too long", prompt_tokens=140_000, max_tokens=131_072)
    frames = RESP.stream_error(err)
    events = split_events(frames)
    assert [e["type"] for e in events] == ["error", "response.failed"]
    EVENT.validate_python(events[0])
    # `context_length_exceeded` is what OpenAI sends and Codex reads, though the SDK's type for
    # `ResponseError.code` does not list it; apart from that code the event has the SDK's exact shape.
    failed = {
        **events[1],
        "response": {**events[1]["response"], "error": {"code": "server_error", "message": ""}},
    }
    EVENT.validate_python(failed)
    # What Codex reads: response.failed -> response.error.code.
    assert events[1]["response"]["status"] == "failed"
    assert events[1]["response"]["error"]["code"] == "context_length_exceeded"
    # The nested error object makes the SDK raise, for raw streams and for the stream helper.
    c = openai_client(lambda _: sse_response([frames]))
    with pytest.raises(openai.APIError) as info:
        list(c.responses.create(model="m", input="x", stream=True))
    assert "context window" in info.value.message
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.APIError), c.responses.stream(model="m", input="x") as s:
        s.get_final_response()


def test_stream_error_code_for_upstream_failures() -> None:
    frames = RESP.stream_error(GatewayError("overloaded", "paused for a weight update"))
    events = split_events(frames)
    for e in events:
        EVENT.validate_python(e)
    # OpenAI answers overload with a null code; response.failed needs one, and Codex retries server_error.
    assert events[0]["error"]["code"] is None
    assert events[1]["response"]["error"] == {"code": "server_error", "message": "paused for a weight update"}


# ---------------------------------------------------------------------------------------------- fuzzing


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_mutation_is_parsed_or_refused_by_field(data: st.DataObject) -> None:
    assert_parsed_or_refused(RESP, mutate(codex_body(history_items()), data), CODEC, TOOL_COMPLETION)
