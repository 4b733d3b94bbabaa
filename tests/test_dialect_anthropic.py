"""Anthropic Messages dialect: parsing real-shaped bodies, refusing bad ones by field, and answers the
official `anthropic` SDK accepts (its HTTP layer replaced by a mock transport that calls the dialect)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polar.gateway.canonical import CanonicalRequest, Completion, ToolCall
from polar.gateway.dialects.anthropic.dialect import AnthropicDialect
from polar.gateway.dialects.wire import RAW_ARGUMENTS_KEY, SignatureCache
from polar.gateway.errors import GatewayError
from polar.gateway.signatures import ReasoningCodec
from tests.dialect_support import assert_parsed_or_refused, mutate, refusal

DATA = Path(__file__).parent / "data"
CODEC = ReasoningCodec(b"test-key")
D = AnthropicDialect()


def claude_code_body() -> dict[str, Any]:
    return json.loads((DATA / "claude_code_2_1_request.json").read_text())


def completion(**kw: Any) -> Completion:
    base: dict[str, Any] = dict(
        id="chatcmpl-7f3a",
        model="served",
        content="The command printed hi-from-tool.",
        reasoning=None,
        tool_calls=(),
        finish_reason="stop",
        prompt_tokens=1234,
        completion_tokens=56,
    )
    base.update(kw)
    return Completion(**base)


def sdk_client(comp: Completion, seen: list[CanonicalRequest] | None = None) -> anthropic.Anthropic:
    """An Anthropic SDK client whose transport is the dialect itself answering with `comp`."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        try:
            req = D.parse(orjson.loads(request.content), CODEC)
        except GatewayError as err:
            status, body = D.error(err)
            return httpx2.Response(status, json=body)
        if seen is not None:
            seen.append(req)
        if req.stream:
            frames = b"".join(D.stream(req, comp, CODEC))
            return httpx2.Response(200, content=frames, headers={"content-type": "text/event-stream"})
        return httpx2.Response(200, json=D.render(req, comp, CODEC))

    transport = httpx2.MockTransport(handler)
    return anthropic.Anthropic(
        api_key="sess-1",
        base_url="http://gateway",
        max_retries=0,
        http_client=httpx2.Client(transport=transport),
    )


def dump(blocks: list[Any]) -> list[dict[str, Any]]:
    """Content blocks as plain dicts (the stream helper returns `Parsed*` subclasses of the same blocks)."""
    return [b.model_dump(exclude_none=True) for b in blocks]


def parse_error(body: Any, parse: Callable[..., Any] = D.parse) -> GatewayError:
    return refusal(lambda b: parse(b, CODEC), body)


# ---- parsing -----------------------------------------------------------------------------------------


def test_claude_code_request_normalizes_to_chat() -> None:
    req = D.parse(claude_code_body(), CODEC)
    assert req.model == "claude-sonnet-4-6"
    assert req.stream is True
    system, user, a1, t1, a2, t2, reminder = req.messages
    assert system["role"] == "system"
    assert system["content"].startswith("x-anthropic-billing-header: cc_version=2.1.197.a3f;")
    assert "\nYou are Claude Code, Anthropic's official CLI for Claude.\n" in system["content"]
    assert user == {
        "role": "user",
        "content": [
            {"type": "text", "text": claude_code_body()["messages"][0]["content"][0]["text"]},
            {
                "type": "text",
                "text": "Run `echo hi-from-tool`, then read /work/repo/missing.txt and tell me both results.",
            },
        ],
    }
    # A foreign (real Anthropic) signature is not ours: the visible thinking text is kept.
    assert a1["reasoning_content"] == "The user wants me to run a command first."
    assert a1["content"] == "I'll run the command first."
    assert a1["tool_calls"] == [
        {
            "id": "toolu_01A09q90qw90lq917835lq9",
            "type": "function",
            "function": {
                "name": "Bash",
                "arguments": '{"command":"echo hi-from-tool","description":"Print a test string"}',
            },
        }
    ]
    assert t1 == {"role": "tool", "tool_call_id": "toolu_01A09q90qw90lq917835lq9", "content": "hi-from-tool"}
    assert a2["content"] is None and "reasoning_content" not in a2
    # Claude Code already marks its failures in-band: no second marker.
    assert t2["content"] == "<tool_use_error>File does not exist.</tool_use_error>"
    assert reminder["role"] == "user" and "TodoWrite" in reminder["content"][0]["text"]

    assert req.tools is not None and len(req.tools) == 25
    bash = req.tools[1]["function"]
    assert bash["name"] == "Bash" and bash["parameters"]["required"] == ["command"]
    assert req.params == {"max_tokens": 32000, "chat_template_kwargs": {"enable_thinking": True}}
    assert req.tool_choice is None
    assert req.render == {"thinking": True}


def test_string_forms_and_sampling_params() -> None:
    req = D.parse(
        {
            "model": "m",
            "max_tokens": 100,
            "system": "Be brief.",
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
            "temperature": 0.3,
            "top_p": 0.9,
            "top_k": 20,
            "stop_sequences": ["END"],
            "metadata": {"user_id": "u"},
            "service_tier": "auto",
            "some_future_field": {"x": 1},
        },
        CODEC,
    )
    assert req.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    assert req.params == {"max_tokens": 100, "temperature": 0.3, "top_p": 0.9, "top_k": 20, "stop": ["END"]}
    assert req.stream is False and req.tools is None


def test_tool_results_come_first_then_remaining_blocks_with_images() -> None:
    body = {
        "model": "m",
        "max_tokens": 10,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look", "cache_control": {"type": "ephemeral"}},
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [
                            {"type": "text", "text": "line 1"},
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"},
                            },
                            {"type": "text", "text": "line 2"},
                        ],
                    },
                    {
                        "type": "tool_result",
                        "tool_use_id": "t2",
                        "content": "permission denied",
                        "is_error": True,
                    },
                    {"type": "tool_result", "tool_use_id": "t3", "is_error": True},
                    {"type": "image", "source": {"type": "url", "url": "https://example.com/a.jpg"}},
                ],
            }
        ],
    }
    assert D.parse(body, CODEC).messages == [
        {"role": "tool", "tool_call_id": "t1", "content": "line 1\nline 2"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: permission denied"},
        {"role": "tool", "tool_call_id": "t3", "content": "Error"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.jpg"}},
            ],
        },
    ]


def test_reasoning_restored_from_our_signature_over_edited_text() -> None:
    sig = CODEC.encode("exact  reasoning\n with  spacing")
    body = {
        "model": "m",
        "max_tokens": 10,
        "messages": [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "summarized by the harness", "signature": sig},
                    {"type": "redacted_thinking", "data": "opaque-foreign-data"},
                    {"type": "text", "text": "a"},
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "redacted_thinking", "data": CODEC.encode("hidden one")},
                    {"type": "thinking", "thinking": "visible two", "signature": sig[:-2] + "xx"},
                ],
            },
        ],
    }
    msgs = D.parse(body, CODEC).messages
    assert msgs[1] == {
        "role": "assistant",
        "content": "a",
        "reasoning_content": "exact  reasoning\n with  spacing",
    }
    assert msgs[2] == {"role": "assistant", "content": "", "reasoning_content": "hidden one\n\nvisible two"}


@pytest.mark.parametrize(
    ("choice", "expected", "parallel"),
    [
        ({"type": "auto"}, "auto", None),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "none"}, "none", None),
        ({"type": "tool", "name": "Read"}, {"type": "function", "function": {"name": "Read"}}, None),
    ],
)
def test_tool_choice(choice: dict[str, Any], expected: Any, parallel: bool | None) -> None:
    body = claude_code_body()
    body["tool_choice"] = choice
    req = D.parse(body, CODEC)
    assert req.tool_choice == expected
    assert req.params.get("parallel_tool_calls") == parallel


def test_server_tools_are_dropped_and_noted() -> None:
    body = claude_code_body()
    body["tools"].append({"type": "web_search_20250305", "name": "web_search", "max_uses": 5})
    body["tools"].append({"type": "custom", "name": "mine", "input_schema": {"type": "object"}})
    req = D.parse(body, CODEC)
    assert req.tools is not None
    assert [t["function"]["name"] for t in req.tools][-1] == "mine"
    assert "web_search" not in {t["function"]["name"] for t in req.tools}
    assert req.render["dropped_tools"] == ["web_search"]
    body["tool_choice"] = {"type": "tool", "name": "web_search"}
    err = parse_error(body)
    assert err.param == "tool_choice.name" and "web_search" in err.message


@pytest.mark.parametrize(
    ("thinking", "enabled", "render"),
    [
        ({"type": "enabled", "budget_tokens": 2048}, True, {"thinking": True}),
        ({"type": "adaptive"}, True, {"thinking": True}),
        ({"type": "disabled"}, False, {"thinking": False}),
        ({"type": "adaptive", "display": "omitted"}, True, {"thinking": True, "thinking_omitted": True}),
    ],
)
def test_thinking_config(thinking: dict[str, Any], enabled: bool, render: dict[str, Any]) -> None:
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "x"}],
        "thinking": thinking,
    }
    req = D.parse(body, CODEC)
    assert req.params["chat_template_kwargs"] == {"enable_thinking": enabled}
    assert req.render == render


def test_count_tokens_body_has_no_max_tokens() -> None:
    body = claude_code_body()
    del body["max_tokens"]
    req = D.parse_count_tokens(body, CODEC)
    assert req.params == {"chat_template_kwargs": {"enable_thinking": True}}
    assert req.messages == D.parse(claude_code_body(), CODEC).messages
    assert D.render_count_tokens(4321) == {"input_tokens": 4321}
    assert parse_error(body).param == "max_tokens"  # /v1/messages itself still needs it
    assert parse_error({"model": "m"}, D.parse_count_tokens).param == "messages"


def _user(*blocks: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": list(blocks)}]}


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens", "missing"),
        ({"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens", ""),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, "model", "missing"),
        ({"model": "m", "max_tokens": 5, "messages": []}, "messages", ""),
        (
            {"model": "m", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]},
            "messages[0].role",
            "",
        ),
        (
            {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": 7}]},
            "messages[0].content",
            "",
        ),
        (_user({"type": "search_result", "source": "s"}), "messages[0].content[0].type", "'search_result'"),
        (_user({"type": "text"}), "messages[0].content[0].text", "missing"),
        (_user({"type": "text", "text": 5}), "messages[0].content[0].text", "string"),
        (
            _user({"type": "image", "source": {"type": "base64", "media_type": "image/png"}}),
            "messages[0].content[0].source.data",
            "missing",
        ),
        (
            _user({"type": "image", "source": {"type": "file", "file_id": "f"}}),
            "messages[0].content[0].source.type",
            "'file'",
        ),
        (_user({"no_type": 1}), "messages[0].content[0].type", "missing"),
        (
            _user({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "search_result"}]}),
            "messages[0].content[0].content[0].type",
            "'search_result'",
        ),
        (
            _user({"type": "tool_use", "id": "t", "name": "n", "input": {}}),
            "messages[0].content[0].type",
            "user message",
        ),
        (_user(), "messages[0].content", "empty"),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "n", "input": "ls"}],
                    }
                ],
            },
            "messages[0].content[0].input",
            "dictionary",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "image", "source": {"type": "url", "url": "u"}}],
                    }
                ],
            },
            "messages[0].content[0].type",
            "assistant message",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"name": "t"}],
            },
            "tools[0].input_schema",
            "missing",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "tool_choice": {"type": "tool"},
            },
            "tool_choice.name",
            "missing",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "tool_choice": {"type": "sometimes"},
            },
            "tool_choice.type",
            "",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "thinking": {"type": "maybe"},
            },
            "thinking.type",
            "",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "temperature": "hot",
            },
            "temperature",
            "",
        ),
    ],
)
def test_malformed_bodies_name_the_field(body: dict[str, Any], param: str, words: str) -> None:
    err = parse_error(body)
    assert err.param == param
    assert param in err.message and words in err.message


def test_non_object_body_is_refused() -> None:
    assert "JSON object" in parse_error([1, 2]).message
    assert parse_error(None).param is None


def test_error_reaches_sdk_as_bad_request() -> None:
    client = sdk_client(completion())
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model="m",
            max_tokens=5,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "search_result",
                            "source": "https://example.com",
                            "title": "t",
                            "content": [{"type": "text", "text": "x"}],
                        }
                    ],
                }
            ],  # type: ignore[list-item]
        )
    assert info.value.status_code == 400
    assert "messages[0].content[0].type" in info.value.message


# ---- rendering, checked by the SDK -------------------------------------------------------------------


def test_sdk_parses_message_with_thinking_text_and_tool_use() -> None:
    comp = completion(
        content="Running it.",
        reasoning="I should run\nthe command.",
        tool_calls=(ToolCall("call_9", "Bash", '{"command": "echo hi-from-tool", "timeout": 5}'),),
        finish_reason="tool_calls",
    )
    msg = sdk_client(comp).messages.create(
        model="claude-x", max_tokens=50, messages=[{"role": "user", "content": "go"}]
    )
    assert msg.id == "msg_7f3a" and msg.model == "claude-x" and msg.role == "assistant"
    thinking, text, tool = msg.content
    assert thinking.type == "thinking" and thinking.thinking == "I should run\nthe command."
    assert CODEC.decode(thinking.signature) == "I should run\nthe command."
    assert text.type == "text" and text.text == "Running it."
    assert tool.type == "tool_use" and tool.id == "call_9" and tool.name == "Bash"
    assert tool.input == {"command": "echo hi-from-tool", "timeout": 5}
    assert msg.stop_reason == "tool_use" and msg.stop_sequence is None
    assert msg.usage.input_tokens == 1234 and msg.usage.output_tokens == 56
    assert msg.usage.cache_read_input_tokens == 0 and msg.usage.cache_creation_input_tokens == 0


@pytest.mark.parametrize(
    ("finish", "stop_reason"),
    [
        ("stop", "end_turn"),
        ("length", "max_tokens"),
        ("tool_calls", "tool_use"),
        ("content_filter", "refusal"),
    ],
)
def test_stop_reasons(finish: Any, stop_reason: str) -> None:
    msg = sdk_client(completion(finish_reason=finish)).messages.create(
        model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}]
    )
    assert msg.stop_reason == stop_reason


def test_thinking_disabled_or_omitted() -> None:
    comp = completion(reasoning="secret plan")
    client = sdk_client(comp)
    base: dict[str, Any] = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    off = client.messages.create(**base, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]
    omitted = client.messages.create(**base, thinking={"type": "adaptive", "display": "omitted"})
    block = omitted.content[0]
    assert block.type == "thinking" and block.thinking == ""
    assert CODEC.decode(block.signature) == "secret plan"
    default = client.messages.create(**base)
    assert default.content[0].type == "thinking"


def test_empty_completion_renders_no_blocks() -> None:
    msg = sdk_client(completion(content="", finish_reason="length")).messages.create(
        model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}]
    )
    assert msg.content == [] and msg.stop_reason == "max_tokens"


def test_arguments_that_are_not_an_object_are_wrapped_not_invented() -> None:
    comp = completion(
        content=None,
        tool_calls=(ToolCall("c1", "Bash", '{"command": "ls"'), ToolCall("c2", "Read", '["a"]')),
        finish_reason="tool_calls",
    )
    client = sdk_client(comp)
    msg = client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert [b.input for b in msg.content if b.type == "tool_use"] == [
        {RAW_ARGUMENTS_KEY: '{"command": "ls"'},
        {RAW_ARGUMENTS_KEY: '["a"]'},
    ]
    with client.messages.stream(
        model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}]
    ) as stream:
        streamed = stream.get_final_message()
    assert dump(streamed.content) == dump(msg.content)
    # Sent back in history, the raw text is restored exactly.
    history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": msg.content}]
    seen: list[CanonicalRequest] = []
    sdk_client(completion(), seen).messages.create(model="m", max_tokens=5, messages=history)  # type: ignore[arg-type]
    calls = seen[0].messages[1]["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == ['{"command": "ls"', '["a"]']


def test_sdk_stream_accumulates_to_the_same_message() -> None:
    comp = completion(
        content="Let me check.",
        reasoning='Think about ünïcode and "quotes"\nand lines.',
        tool_calls=(
            ToolCall("call_a", "Read", '{"file_path": "/tmp/x"}'),
            ToolCall("call_b", "Grep", '{"pattern": "def \\\\w+", "-n": true}'),
        ),
        finish_reason="tool_calls",
    )
    client = sdk_client(comp)
    kwargs: dict[str, Any] = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    whole = client.messages.create(**kwargs)
    events: list[str] = []
    with client.messages.stream(**kwargs) as stream:
        for event in stream:
            events.append(event.type)
        final = stream.get_final_message()
    assert dump(final.content) == dump(whole.content)
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == 56
    assert final.usage.input_tokens == 1234
    assert final.content[3].input == {"pattern": "def \\w+", "-n": True}
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert events.count("content_block_start") == 4 and events.count("content_block_stop") == 4
    assert "signature" in events and "thinking" in events and "input_json" in events


def test_raw_stream_grammar() -> None:
    comp = completion(reasoning="r", tool_calls=(ToolCall("c", "n", "{}"),), finish_reason="tool_calls")
    req = D.parse(claude_code_body(), CODEC)
    raw = b"".join(D.stream(req, comp, CODEC)).decode()
    frames = [f for f in raw.split("\n\n") if f]
    names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    for frame in frames:
        event, data = frame.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert payload["type"] == event.removeprefix("event: ")
    start = json.loads(frames[0].split("\n")[1][6:])
    assert (
        start["message"]["model"] == "claude-sonnet-4-6" and start["message"]["usage"]["input_tokens"] == 1234
    )


def test_round_trip_through_the_sdk_restores_call_and_reasoning() -> None:
    reasoning = "Plan:\n  1. list files  \n  2. read them\n"
    comp = completion(
        content=None,
        reasoning=reasoning,
        tool_calls=(ToolCall("call_rt", "Bash", '{"command": "ls -la", "description": "List"}'),),
        finish_reason="tool_calls",
    )
    first = sdk_client(comp).messages.create(
        model="m", max_tokens=5, messages=[{"role": "user", "content": "go"}]
    )
    assistant = first.to_param()
    # A harness may shorten the visible thinking; the signature still carries the original.
    assistant_content = [b.model_dump(exclude_none=True) for b in first.content]
    assistant_content[0]["thinking"] = "Plan: list, read"
    history: list[Any] = [
        {"role": "user", "content": "go"},
        {"role": assistant["role"], "content": assistant_content},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "call_rt",
                    "content": "a b c",
                    "cache_control": {"type": "ephemeral"},
                }
            ],
        },
    ]
    seen: list[CanonicalRequest] = []
    sdk_client(completion(), seen).messages.create(model="m", max_tokens=5, messages=history)
    msg = seen[0].messages[1]
    assert msg["reasoning_content"] == reasoning
    (call,) = msg["tool_calls"]
    assert call["id"] == "call_rt" and call["function"]["name"] == "Bash"
    assert json.loads(call["function"]["arguments"]) == {"command": "ls -la", "description": "List"}
    assert call["function"]["arguments"] == '{"command":"ls -la","description":"List"}'
    assert seen[0].messages[2] == {"role": "tool", "tool_call_id": "call_rt", "content": "a b c"}


# ---- errors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "status", "etype", "exc"),
    [
        ("invalid_request", 400, "invalid_request_error", anthropic.BadRequestError),
        ("authentication", 401, "authentication_error", anthropic.AuthenticationError),
        ("permission", 403, "permission_error", anthropic.PermissionDeniedError),
        ("not_found", 404, "not_found_error", anthropic.NotFoundError),
        ("request_too_large", 413, "request_too_large", anthropic.APIStatusError),
        ("rate_limit", 429, "rate_limit_error", anthropic.RateLimitError),
        ("upstream_error", 502, "api_error", anthropic.InternalServerError),
        ("overloaded", 529, "overloaded_error", anthropic.InternalServerError),
        ("timeout", 504, "timeout_error", anthropic.InternalServerError),
    ],
)
def test_error_envelopes(kind: Any, status: int, etype: str, exc: type[Exception]) -> None:
    err = GatewayError(kind, f"something about {kind}")
    got_status, body = D.error(err)
    assert got_status == status
    assert body == {"type": "error", "error": {"type": etype, "message": f"something about {kind}"}}

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(got_status, json=body)

    client = anthropic.Anthropic(
        api_key="k",
        base_url="http://gw",
        max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
    )
    with pytest.raises(exc) as info:
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert isinstance(info.value, anthropic.APIStatusError) and info.value.status_code == status
    assert info.value.body == body


def test_context_length_uses_claude_code_wording() -> None:
    err = GatewayError("context_length", "too long", prompt_tokens=210000, max_tokens=200000)
    status, body = D.error(err)
    assert status == 400
    assert body["error"] == {
        "type": "invalid_request_error",
        "message": "prompt is too long: 210000 tokens > 200000 maximum",
    }
    # Without numbers the backend's own message is kept.
    assert D.error(GatewayError("context_length", "too long"))[1]["error"]["message"] == "too long"


def test_stream_error_event_is_raised_by_the_sdk() -> None:
    err = GatewayError("overloaded", "draining for a weight update")
    frame = D.stream_error(err)
    assert frame.startswith(b"event: error\ndata: ") and frame.endswith(b"\n\n")

    def handler(request: httpx2.Request) -> httpx2.Response:
        req = D.parse(orjson.loads(request.content), CODEC)
        head = next(iter(D.stream(req, completion(), CODEC)))  # message_start + ping, then the failure
        return httpx2.Response(200, content=head + frame, headers={"content-type": "text/event-stream"})

    client = anthropic.Anthropic(
        api_key="k",
        base_url="http://gw",
        max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
    )
    with (
        pytest.raises(anthropic.APIStatusError) as info,
        client.messages.stream(
            model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}]
        ) as stream,
    ):
        stream.get_final_message()
    assert "draining for a weight update" in str(info.value)


def test_parse_does_not_mutate_the_body() -> None:
    body = claude_code_body()
    before = copy.deepcopy(body)
    D.parse(body, CODEC)
    assert body == before


def test_signature_cache_is_bounded_and_keyed_by_codec() -> None:
    calls: list[str] = []

    def decode(codec: ReasoningCodec, token: str) -> str | None:
        calls.append(token)
        return codec.decode(token)

    cache = SignatureCache(decode, size=2)
    good = CODEC.encode("ours")
    assert cache(CODEC, good) == "ours" and cache(CODEC, good) == "ours"
    assert calls == [good]  # the second lookup did not verify again
    assert cache(ReasoningCodec(b"another key"), good) is None  # never trusted under another key
    assert cache(CODEC, None) is None and cache(CODEC, "") is None
    cache(CODEC, "foreign-1")
    cache(CODEC, good)  # evicted by now: verified again
    assert calls == [good, good, "foreign-1", good]


def test_signature_cache_keeps_what_the_history_keeps_resending() -> None:
    calls: list[str] = []

    def decode(codec: ReasoningCodec, token: str) -> str | None:
        calls.append(token)
        return None

    cache = SignatureCache(decode, size=2)
    cache(CODEC, "old")
    cache(CODEC, "newer")
    cache(CODEC, "old")  # resent: now the most recently used
    cache(CODEC, "newest")  # evicts `newer`, not `old`
    cache(CODEC, "old")
    assert calls == ["old", "newer", "newest"]


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_any_mutation_is_parsed_or_refused_by_field(data: st.DataObject) -> None:
    assert_parsed_or_refused(D, mutate(claude_code_body(), data), CODEC, completion())
