"""OpenAI Chat dialect: parsing real-shaped bodies, refusing bad ones by field, and answers the official
`openai` SDK parses (its HTTP transport is replaced by a handler that returns what the dialect rendered)."""

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
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from polar.gateway.canonical import CanonicalRequest, Completion, ToolCall
from polar.gateway.dialects.chat.dialect import ChatDialect
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
CHAT = ChatDialect()

EXEC_TOOL = {
    "type": "function",
    "function": {
        "name": "run_shell_command",
        "description": "Run a shell command.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}


def completion(**kw: Any) -> Completion:
    base: dict[str, Any] = dict(
        id="chatcmpl-abc123",
        model="served-policy",
        content="The command printed hi.",
        reasoning=None,
        tool_calls=(),
        finish_reason="stop",
        prompt_tokens=120,
        completion_tokens=17,
        created=1_760_000_000,
    )
    base.update(kw)
    return Completion(**base)


def qwen_code_body(**overrides: Any) -> dict[str, Any]:
    """The shape Qwen Code sends: system prompt, text-part user messages, tool results as text parts."""
    body: dict[str, Any] = {
        "model": "qwen3-policy",
        "messages": [
            {"role": "system", "content": "You are Qwen Code."},
            {"role": "user", "content": [{"type": "text", "text": "run echo hi"}]},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "I should run it.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "run_shell_command", "arguments": '{"command":"echo hi"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "hi\n"}]},
        ],
        "tools": [EXEC_TOOL],
        "tool_choice": "auto",
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "max_completion_tokens": 512,
        "stop": "<|im_end|>",
        "seed": 7,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "chat_template_kwargs": {"enable_thinking": True},
        "reasoning_effort": "high",
        "parallel_tool_calls": False,
        # Fields the gateway does not use are tolerated, as OpenAI-compatible servers do.
        "user": "u-1",
        "metadata": {"session": "s"},
        "vendor_extra": {"anything": [1, 2]},
    }
    body.update(overrides)
    return body


# ---------------------------------------------------------------------------------------------- parsing


def test_parse_realistic_body() -> None:
    req = CHAT.parse(qwen_code_body(), CODEC)
    assert req.model == "qwen3-policy"
    assert req.stream is True
    assert req.messages == [
        {"role": "system", "content": "You are Qwen Code."},
        {"role": "user", "content": [{"type": "text", "text": "run echo hi"}]},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should run it.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "run_shell_command", "arguments": '{"command":"echo hi"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "hi\n"}]},
    ]
    assert req.tools == [EXEC_TOOL]
    assert req.tool_choice == "auto"
    assert req.params == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "max_tokens": 512,
        "stop": ["<|im_end|>"],
        "seed": 7,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "parallel_tool_calls": False,
        "chat_template_kwargs": {"enable_thinking": True},
        "reasoning_effort": "high",
    }
    assert req.render == {"model": "qwen3-policy", "include_usage": True}


def test_parse_normalizes_roles_reasoning_and_limits() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {
                "role": "user",
                "name": "alice",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {
                        "type": "image_url",
                        "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"},
                    },
                ],
            },
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "A "}, {"type": "text", "text": "dot."}],
            },
            {"role": "assistant", "content": None, "reasoning": "newer vLLM field"},
        ],
        "max_tokens": 64,
        "stop": ["a", "b"],
        "tools": [{"type": "function", "function": {"name": "f", "strict": True}, "cache_control": {}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "reasoning_effort": "minimal",
    }
    req = CHAT.parse(body, CODEC)
    assert req.messages == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {
            "role": "user",
            "name": "alice",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}},
            ],
        },
        {"role": "assistant", "content": "A dot."},
        {"role": "assistant", "content": None, "reasoning_content": "newer vLLM field"},
    ]
    # `minimal` is kept out: vLLM's Chat schema refuses efforts other than low/medium/high.
    assert req.params == {"max_tokens": 64, "stop": ["a", "b"]}
    assert req.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert req.tools == [{"type": "function", "function": {"name": "f"}}]
    assert req.stream is False
    assert req.render == {"model": "m", "include_usage": False}


def test_parse_leaves_the_body_untouched() -> None:
    """The proxy records the body as the harness sent it; normalizing must not write into it."""
    body = qwen_code_body()
    body["messages"] += [
        {"role": "developer", "content": "d"},
        {"role": "assistant", "content": [{"type": "text", "text": "t"}], "reasoning": "r"},
        {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]},
    ]
    before = copy.deepcopy(body)
    req = CHAT.parse(body, CODEC)
    assert body == before
    assert req.messages[-3:] == [
        {"role": "system", "content": "d"},
        {"role": "assistant", "content": "t", "reasoning_content": "r"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
    ]


def test_tool_choice_without_tools_is_dropped() -> None:
    """vLLM refuses a `tool_choice` sent without `tools`; `auto`/`none` then mean nothing."""
    for choice in ("auto", "none", None):
        req = CHAT.parse(qwen_code_body(tools=None, tool_choice=choice), CODEC)
        assert req.tools is None and req.tool_choice is None
    req = CHAT.parse(
        qwen_code_body(tool_choice={"type": "function", "function": {"name": "run_shell_command"}}), CODEC
    )
    assert req.tool_choice == {"type": "function", "function": {"name": "run_shell_command"}}


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    req = CHAT.parse(qwen_code_body(max_tokens=10, max_completion_tokens=20), CODEC)
    assert req.params["max_tokens"] == 20


def test_response_format_goes_upstream_and_text_is_left_out() -> None:
    """A JSON response format is the server's to enforce (vLLM's structured outputs): it was dropped here,
    so a judge or harness asking for JSON got free text; `text`, the default, adds nothing."""
    schema = {"type": "object", "properties": {"score": {"type": "integer"}}, "required": ["score"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": True}}
    assert CHAT.parse(qwen_code_body(response_format=fmt), CODEC).params["response_format"] == fmt
    as_object = CHAT.parse(qwen_code_body(response_format={"type": "json_object"}), CODEC)
    assert as_object.params["response_format"] == {"type": "json_object"}
    assert "response_format" not in CHAT.parse(qwen_code_body(response_format={"type": "text"}), CODEC).params


def test_string_content_is_passed_on_without_copy() -> None:
    text = "x" * 1000
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    assert CHAT.parse(body, CODEC).messages[0]["content"] is text


BAD_BODIES: list[tuple[str, Any, str | None]] = [
    ("not an object", [{"role": "user", "content": "hi"}], None),
    ("missing model", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("missing messages", {"model": "m"}, "messages"),
    ("empty messages", {"model": "m", "messages": []}, "messages"),
    ("messages not a list", {"model": "m", "messages": "hi"}, "messages"),
    ("message without role", {"model": "m", "messages": [{"content": "hi"}]}, "messages[0].role"),
    (
        "legacy function role",
        {"model": "m", "messages": [{"role": "function", "content": "x"}]},
        "messages[0].role",
    ),
    (
        "message not an object",
        {"model": "m", "messages": [{"role": "user", "content": "a"}, "hi"]},
        "messages[1]",
    ),
    (
        "tool message without tool_call_id",
        {"model": "m", "messages": [{"role": "tool", "content": "x"}]},
        "messages[0].tool_call_id",
    ),
    (
        "audio content part",
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "hi"}, {"type": "input_audio", "input_audio": {}}],
                }
            ],
        },
        "messages[0].content[1].type",
    ),
    (
        "text part without text",
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages[0].content[0].text",
    ),
    (
        "content is an object",
        {"model": "m", "messages": [{"role": "user", "content": {"text": "hi"}}]},
        "messages[0].content",
    ),
    (
        "tool call arguments as an object",
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}
                    ],
                },
            ],
        },
        "messages[1].tool_calls[0].function.arguments",
    ),
    ("temperature not a number", qwen_code_body(temperature="hot"), "temperature"),
    ("stream as a string is not coerced", qwen_code_body(stream="yes"), "stream"),
    ("max_tokens as a string is not coerced", qwen_code_body(max_tokens="64"), "max_tokens"),
    ("temperature out of range", qwen_code_body(temperature=3), "temperature"),
    ("max_tokens zero", qwen_code_body(max_tokens=0), "max_tokens"),
    ("stop not a string", qwen_code_body(stop=5), "stop"),
    ("n above one", qwen_code_body(n=2), "n"),
    (
        "custom tool type",
        qwen_code_body(tools=[{"type": "custom", "custom": {"name": "x"}}]),
        "tools[0].type",
    ),
    (
        "tool without function name",
        qwen_code_body(tools=[{"type": "function", "function": {}}]),
        "tools[0].function.name",
    ),
    ("unknown tool_choice", qwen_code_body(tool_choice="sometimes"), "tool_choice"),
    ("unknown response_format", qwen_code_body(response_format={"type": "xml"}), "response_format.type"),
    (
        "json_schema without its schema object",
        qwen_code_body(response_format={"type": "json_schema"}),
        "response_format.json_schema",
    ),
    ("legacy functions", qwen_code_body(functions=[{"name": "f"}]), "functions"),
    ("required tool_choice without tools", qwen_code_body(tools=None, tool_choice="required"), "tool_choice"),
    (
        "tool_choice names an unknown tool",
        qwen_code_body(tool_choice={"type": "function", "function": {"name": "nope"}}),
        "tool_choice.function.name",
    ),
]


@pytest.mark.parametrize(("case", "body", "param"), BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
def test_bad_body_is_a_400_naming_the_field(case: str, body: Any, param: str | None) -> None:
    openai_refusal(CHAT, body, CODEC, param)


def test_type_errors_name_every_accepted_type() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": {"text": "hi"}}]}
    with pytest.raises(GatewayError) as info:
        CHAT.parse(body, CODEC)
    assert info.value.message == (
        "Invalid type for 'messages[0].content': expected a string or an array, but got an object instead."
    )


def test_integers_are_fine_where_numbers_are_expected() -> None:
    req = CHAT.parse(qwen_code_body(temperature=1, top_p=1), CODEC)
    assert (req.params["temperature"], req.params["top_p"]) == (1, 1)


def test_unsupported_part_message_names_the_type() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]}
    with pytest.raises(GatewayError) as info:
        CHAT.parse(body, CODEC)
    assert "'file'" in info.value.message
    assert "messages[0].content[0].type" in info.value.message


# ---------------------------------------------------------------------------------------------- render


def canonical(**render: Any) -> CanonicalRequest:
    return CanonicalRequest(
        model="asked-model",
        messages=[{"role": "user", "content": "hi"}],
        render={"model": "asked-model", **render},
    )


TOOL_COMPLETION = completion(
    content="Let me run the command you asked for, then report what it printed back to you.",
    reasoning="The user wants a shell command; use run_shell_command.",
    tool_calls=(
        ToolCall("call_a1", "run_shell_command", '{"command": "echo hi-from-tool"}'),
        ToolCall("call_a2", "run_shell_command", '{"command": "ls -la /tmp"}'),
    ),
    finish_reason="tool_calls",
)


def test_render_is_a_chat_completion_the_sdk_parses() -> None:
    req = canonical()
    body = CHAT.render(req, TOOL_COMPLETION, CODEC)
    ChatCompletion.model_validate(body)  # strict shape check, independent of the SDK's lenient parsing

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, content=orjson.dumps(body), headers={"content-type": "application/json"})

    out = openai_client(handler).chat.completions.create(
        model="asked-model", messages=[{"role": "user", "content": "hi"}]
    )
    assert out.model == "asked-model"
    assert out.id == "chatcmpl-abc123"
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == TOOL_COMPLETION.content
    assert choice.message.model_extra == {"reasoning_content": TOOL_COMPLETION.reasoning}
    calls = choice.message.tool_calls or []
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        (tc.id, tc.name, tc.arguments) for tc in TOOL_COMPLETION.tool_calls
    ]
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (120, 17, 137)


def test_render_length_finish_and_no_content() -> None:
    body = CHAT.render(canonical(), completion(content=None, finish_reason="length"), CODEC)
    parsed = ChatCompletion.model_validate(body)
    assert parsed.choices[0].finish_reason == "length"
    assert parsed.choices[0].message.content is None
    assert "reasoning_content" not in body["choices"][0]["message"]


def stream_with_sdk(req: CanonicalRequest, comp: Completion) -> list[ChatCompletionChunk]:
    frames = list(CHAT.stream(req, comp, CODEC))
    assert all(f.endswith(b"\n\n") for f in frames)
    assert frames[-1] == b"data: [DONE]\n\n"
    for f in frames[:-1]:  # every chunk is a valid ChatCompletionChunk, strictly validated
        ChatCompletionChunk.model_validate(orjson.loads(f.removeprefix(b"data: ")))
    c = openai_client(lambda _: sse_response(frames))
    return list(
        c.chat.completions.create(
            model="asked-model", messages=[{"role": "user", "content": "x"}], stream=True
        )
    )


def test_stream_chunks_accumulate_to_the_completion() -> None:
    chunks = stream_with_sdk(canonical(include_usage=True), TOOL_COMPLETION)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.model for c in chunks} == {"asked-model"}
    content = reasoning = ""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for tc in delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                if tc.id:
                    slot["id"] = tc.id
                if tc.function and tc.function.name:
                    slot["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
            finish = choice.finish_reason or finish
    assert content == TOOL_COMPLETION.content
    assert reasoning == TOOL_COMPLETION.reasoning
    assert [calls[i] for i in sorted(calls)] == [
        {"id": tc.id, "name": tc.name, "arguments": tc.arguments} for tc in TOOL_COMPLETION.tool_calls
    ]
    assert finish == "tool_calls"
    # The usage chunk comes last, with no choices.
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 137
    # Long text really is cut into several deltas.
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1


def test_stream_without_include_usage_has_no_usage_chunk() -> None:
    chunks = stream_with_sdk(canonical(include_usage=False), completion())
    assert all(c.choices for c in chunks)
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sdk_stream_helper_builds_the_final_completion() -> None:
    frames = list(CHAT.stream(canonical(include_usage=True), TOOL_COMPLETION, CODEC))
    c = openai_client(lambda _: sse_response(frames))
    with c.chat.completions.stream(model="asked-model", messages=[{"role": "user", "content": "x"}]) as s:
        final = s.get_final_completion()
    msg = final.choices[0].message
    assert msg.content == TOOL_COMPLETION.content
    assert [(t.id, t.function.name, t.function.arguments) for t in msg.tool_calls or []] == [
        (tc.id, tc.name, tc.arguments) for tc in TOOL_COMPLETION.tool_calls
    ]
    assert final.choices[0].finish_reason == "tool_calls"


def test_tool_call_round_trip_through_the_sdk() -> None:
    """What the SDK parsed from our answer, sent back as history, parses to the same call and reasoning."""
    first = openai_client(lambda _: sse_response(list(CHAT.stream(canonical(), TOOL_COMPLETION, CODEC))))
    with first.chat.completions.stream(model="asked-model", messages=[{"role": "user", "content": "x"}]) as s:
        message = s.get_final_completion().choices[0].message

    captured: list[Any] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        captured.append(json.loads(request.content))
        return httpx2.Response(200, content=orjson.dumps(CHAT.render(canonical(), completion(), CODEC)))

    history: list[Any] = [
        {"role": "user", "content": "run echo hi-from-tool"},
        message.model_dump(exclude_none=True, exclude={"parsed"}),
        {"role": "tool", "tool_call_id": "call_a1", "content": "hi-from-tool\n"},
        {"role": "tool", "tool_call_id": "call_a2", "content": "total 0\n"},
    ]
    openai_client(handler).chat.completions.create(model="asked-model", messages=history, tools=[EXEC_TOOL])  # type: ignore[list-item]
    req = CHAT.parse(captured[0], CODEC)
    assistant = req.messages[1]
    assert assistant["role"] == "assistant"
    assert assistant["content"] == TOOL_COMPLETION.content
    assert assistant["reasoning_content"] == TOOL_COMPLETION.reasoning
    assert [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in assistant["tool_calls"]
    ] == [(tc.id, tc.name, tc.arguments) for tc in TOOL_COMPLETION.tool_calls]
    assert req.messages[2] == {"role": "tool", "tool_call_id": "call_a1", "content": "hi-from-tool\n"}


# ---------------------------------------------------------------------------------------------- errors


def test_context_length_error_uses_openai_wording() -> None:
    err = GatewayError("context_length", "too long", prompt_tokens=40_000, max_tokens=32_768)
    status, envelope = CHAT.error(err)
    assert status == 400
    assert envelope == {
        "error": {
            "message": "This model's maximum context length is 32768 tokens. However, your messages resulted "
            "in 40000 tokens. Please reduce the length of the messages.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
    c = openai_client(lambda _: httpx2.Response(status, content=orjson.dumps(envelope)))
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert info.value.code == "context_length_exceeded"
    assert "maximum context length is 32768 tokens" in info.value.message


@pytest.mark.parametrize(
    ("kind", "status", "etype", "code", "exc"),
    [
        ("invalid_request", 400, "invalid_request_error", None, openai.BadRequestError),
        ("authentication", 401, "invalid_request_error", "invalid_api_key", openai.AuthenticationError),
        ("permission", 403, "permission_error", "insufficient_permissions", openai.PermissionDeniedError),
        ("not_found", 404, "invalid_request_error", None, openai.NotFoundError),
        ("rate_limit", 429, "requests", "rate_limit_exceeded", openai.RateLimitError),
        ("upstream_error", 502, "server_error", "server_error", openai.InternalServerError),
        ("overloaded", 503, "server_error", None, openai.InternalServerError),
        ("timeout", 504, "server_error", "timeout", openai.InternalServerError),
    ],
)
def test_error_kinds_map_to_openai_envelopes(
    kind: Any, status: int, etype: str, code: str | None, exc: type[Exception]
) -> None:
    err = GatewayError(kind, f"something about {kind}")
    got_status, envelope = CHAT.error(err)
    assert got_status == status
    assert envelope["error"] == {
        "message": f"something about {kind}",
        "type": etype,
        "param": None,
        "code": code,
    }
    c = openai_client(lambda _: httpx2.Response(got_status, content=orjson.dumps(envelope)))
    with pytest.raises(exc) as info:
        c.with_options(max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}]
        )
    assert f"something about {kind}" in str(info.value)


def test_unknown_model_gets_model_not_found() -> None:
    _, envelope = CHAT.error(GatewayError("not_found", "The model `x` does not exist.", param="model"))
    assert envelope["error"]["code"] == "model_not_found"


def test_stream_error_raises_in_the_sdk() -> None:
    ok = list(CHAT.stream(canonical(), completion(), CODEC))[:2]
    err = GatewayError("upstream_error", "upstream inference server went away")
    frames = [*ok, CHAT.stream_error(err)]
    assert frames[-1].endswith(b"data: [DONE]\n\n")
    c = openai_client(lambda _: sse_response(frames))
    got: list[ChatCompletionChunk] = []
    with pytest.raises(openai.APIError) as info:
        for chunk in c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True
        ):
            got.append(chunk)
    assert len(got) == 2
    assert "upstream inference server went away" in info.value.message
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "server_error"


# ---------------------------------------------------------------------------------------------- fuzzing


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_mutation_is_parsed_or_refused_by_field(data: st.DataObject) -> None:
    assert_parsed_or_refused(CHAT, mutate(qwen_code_body(), data), CODEC, TOOL_COMPLETION)
