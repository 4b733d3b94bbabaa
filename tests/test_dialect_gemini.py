"""Gemini dialect: Gemini CLI-shaped bodies, refusals by field, and answers the official `google-genai` SDK
accepts (its HTTP layer replaced by a mock transport that calls the dialect)."""

from __future__ import annotations

import base64
import copy
import json
import re
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from google import genai
from google.genai import errors as genai_errors
from google.genai import types
from hypothesis import given, settings
from hypothesis import strategies as st

from polar.gateway.canonical import CanonicalRequest, Completion, ToolCall
from polar.gateway.dialects.gemini.dialect import GeminiDialect
from polar.gateway.dialects.gemini.request import decode_signature, encode_signature
from polar.gateway.dialects.gemini.schema import to_json_schema
from polar.gateway.dialects.wire import RAW_ARGUMENTS_KEY
from polar.gateway.errors import GatewayError
from polar.gateway.signatures import ReasoningCodec
from tests.dialect_support import assert_parsed_or_refused, mutate, refusal

DATA = Path(__file__).parent / "data"
CODEC = ReasoningCodec(b"test-key")
D = GeminiDialect()
PATH = re.compile(r"/v1beta/models/(?P<model>[^:/]+):(?P<method>generateContent|streamGenerateContent)$")


def gemini_cli_body() -> dict[str, Any]:
    return json.loads((DATA / "gemini_cli_request.json").read_text())


def completion(**kw: Any) -> Completion:
    base: dict[str, Any] = dict(
        id="chatcmpl-g1",
        model="served",
        content="It printed hi-from-tool.",
        reasoning=None,
        tool_calls=(),
        finish_reason="stop",
        prompt_tokens=800,
        completion_tokens=20,
    )
    base.update(kw)
    return Completion(**base)


def parse(body: Any, model: str | None = "gemini-2.5-pro", stream: bool = False) -> CanonicalRequest:
    return D.parse(body, CODEC, path_model=model, path_stream=stream)


def sdk_client(comp: Completion, seen: list[CanonicalRequest] | None = None) -> genai.Client:
    """A google-genai client whose transport is the dialect itself answering with `comp`."""

    def handler(request: httpx.Request) -> httpx.Response:
        m = PATH.search(request.url.path)
        assert m is not None, request.url
        stream = m["method"] == "streamGenerateContent"
        try:
            req = D.parse(orjson.loads(request.content), CODEC, path_model=m["model"], path_stream=stream)
        except GatewayError as err:
            status, body = D.error(err)
            return httpx.Response(status, json=body)
        if seen is not None:
            seen.append(req)
        if not stream:
            return httpx.Response(200, json=D.render(req, comp, CODEC))
        if request.url.params.get("alt") == "sse":
            frames = b"".join(D.stream(req, comp, CODEC))
            return httpx.Response(200, content=frames, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, content=orjson.dumps(D.stream_json(req, comp, CODEC)))

    # v1beta is the version Gemini CLI calls (this SDK's default is v1).
    options = types.HttpOptions(
        base_url="http://gateway",
        api_version="v1beta",
        httpx_client=httpx.Client(transport=httpx.MockTransport(handler)),
    )
    return genai.Client(api_key="sess-1", http_options=options)


def parse_error(body: Any, model: str | None = "m") -> GatewayError:
    return refusal(lambda b: parse(b, model), body)


TOOLS = types.Tool(
    function_declarations=[
        types.FunctionDeclaration(
            name="run_shell_command",
            description="Run a command",
            parameters_json_schema={"type": "object", "properties": {"command": {"type": "string"}}},
        )
    ]
)


# ---- parsing -----------------------------------------------------------------------------------------


def test_gemini_cli_request_normalizes_to_chat() -> None:
    req = parse(gemini_cli_body(), "gemini-2.5-pro", stream=True)
    assert req.model == "gemini-2.5-pro" and req.stream is True
    system, ctx, ack, ask, call, result = req.messages
    assert system["role"] == "system" and system["content"].startswith("You are an interactive CLI agent")
    assert ctx["role"] == "user" and ctx["content"][0]["text"].startswith("This is the Gemini CLI.")
    assert ack == {"role": "assistant", "content": "Got it. Thanks for the context!"}
    assert ask["content"] == [
        {"type": "text", "text": "Run `echo hi-from-tool` and tell me what it printed."}
    ]
    call_id = "run_shell_command-1764528000000-4f1e2a9b7c3d5"
    # The real Gemini signature is not ours: no reasoning is invented from it.
    assert call == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {
                    "name": "run_shell_command",
                    "arguments": '{"command":"echo hi-from-tool","description":"Print a test string."}',
                },
            }
        ],
    }
    assert result["role"] == "tool" and result["tool_call_id"] == call_id
    assert result["content"].startswith("Command: echo hi-from-tool\nDirectory: (root)\nOutput: hi-from-tool")
    assert req.tools is not None and len(req.tools) == 11
    assert req.tools[0]["function"]["parameters"]["required"] == ["dir_path"]
    assert req.params == {
        "temperature": 1.0,
        "top_p": 0.95,
        "top_k": 64,
        "chat_template_kwargs": {"enable_thinking": True},
    }
    assert req.render == {"include_thoughts": True, "thinking": True}


def test_openapi_parameters_become_json_schema() -> None:
    schema = {
        "type": "OBJECT",
        "properties": {
            "b": {"type": "STRING", "format": "enum", "enum": ["x", "y"], "nullable": True},
            "a": {
                "type": "ARRAY",
                "items": {"type": "INTEGER", "example": 3},
                "minItems": "1",
                "maxItems": "4",
            },
            "c": {"anyOf": [{"type": "NUMBER"}, {"type": "BOOLEAN"}], "nullable": True},
            "d": {"type": "TYPE_UNSPECIFIED", "description": "anything"},
        },
        "propertyOrdering": ["a", "b"],
        "required": ["a"],
    }
    out = to_json_schema(schema)
    assert out == {
        "type": "object",
        "properties": {
            "a": {
                "type": "array",
                "items": {"type": "integer", "examples": [3]},
                "minItems": 1,
                "maxItems": 4,
            },
            "b": {"type": ["string", "null"], "enum": ["x", "y"]},
            "c": {"anyOf": [{"type": "number"}, {"type": "boolean"}, {"type": "null"}]},
            "d": {"description": "anything"},
        },
        "required": ["a"],
    }
    assert list(out["properties"]) == ["a", "b", "c", "d"]
    body = {
        "contents": [{"role": "user", "parts": [{"text": "x"}]}],
        "tools": [
            {
                "functionDeclarations": [
                    {"name": "f", "parameters": schema},
                    {"name": "g", "description": "no args"},
                ]
            },
            {"googleSearch": {}},
            {"codeExecution": {}},
        ],
    }
    req = parse(body)
    assert req.tools == [
        {"type": "function", "function": {"name": "f", "parameters": out}},
        {"type": "function", "function": {"name": "g", "description": "no args"}},
    ]
    assert req.render["dropped_tools"] == ["googleSearch", "codeExecution"]


def test_calls_without_ids_get_deterministic_ids_and_responses_match_by_name_in_order() -> None:
    body = {
        "contents": [
            {"role": "user", "parts": [{"text": "read two files"}]},
            {
                "role": "model",
                "parts": [
                    {"text": "Reading."},
                    {"functionCall": {"name": "read_file", "args": {"file_path": "a"}}},
                    {"functionCall": {"name": "read_file", "args": {"file_path": "b"}}},
                    {"functionCall": {"name": "glob", "args": {}}},
                ],
            },
            {
                "role": "user",
                "parts": [
                    {"functionResponse": {"name": "glob", "response": {"output": "x.py"}}},
                    {"functionResponse": {"name": "read_file", "response": {"output": "A"}}},
                    {"functionResponse": {"name": "read_file", "response": {"error": "no such file"}}},
                    {"text": "thanks"},
                ],
            },
        ]
    }
    first = parse(body).messages
    assert [c["id"] for c in first[1]["tool_calls"]] == [
        "unnamed_call_1_1",
        "unnamed_call_1_2",
        "unnamed_call_1_3",
    ]
    assert first[2:] == [
        {"role": "tool", "tool_call_id": "unnamed_call_1_3", "content": "x.py"},
        {"role": "tool", "tool_call_id": "unnamed_call_1_1", "content": "A"},
        {"role": "tool", "tool_call_id": "unnamed_call_1_2", "content": "Error: no such file"},
        {"role": "user", "content": [{"type": "text", "text": "thanks"}]},
    ]
    assert parse(copy.deepcopy(body)).messages == first  # same history, same ids


def test_response_shapes_and_images() -> None:
    body = {
        "contents": [
            {"role": "model", "parts": [{"functionCall": {"id": "c1", "name": "look", "args": {"n": 1}}}]},
            {
                "role": "function",
                "parts": [
                    {
                        "functionResponse": {
                            "id": "c1",
                            "name": "look",
                            "response": {"rows": [1, 2], "ok": True},
                            "parts": [{"inlineData": {"mimeType": "image/png", "data": "iVBO"}}],
                        }
                    },
                    {"inlineData": {"mimeType": "image/jpeg", "data": "/9j/"}},
                    {"functionResponse": {"id": "unknown", "name": "other", "response": {}}},
                ],
            },
        ]
    }
    msgs = parse(body).messages
    assert msgs[1:] == [
        {"role": "tool", "tool_call_id": "c1", "content": '{"rows":[1,2],"ok":true}'},
        {"role": "tool", "tool_call_id": "unknown", "content": ""},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
                {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/"}},
            ],
        },
    ]


def test_reasoning_from_thought_parts_and_from_our_signature() -> None:
    sig = encode_signature(CODEC, "the exact reasoning")
    body = {
        "contents": [
            {"role": "user", "parts": [{"text": "q"}]},
            {"role": "model", "parts": [{"text": "visible thought", "thought": True}, {"text": "answer"}]},
            {"role": "user", "parts": [{"text": "q2"}]},
            # A harness that dropped the thought part still carries the signature on the text part.
            {"role": "model", "parts": [{"text": "answer 2", "thoughtSignature": sig}]},
        ]
    }
    msgs = parse(body).messages
    assert msgs[1] == {"role": "assistant", "content": "answer", "reasoning_content": "visible thought"}
    assert msgs[3] == {"role": "assistant", "content": "answer 2", "reasoning_content": "the exact reasoning"}


def test_signature_decoding_accepts_both_alphabets_and_rejects_foreign() -> None:
    text = "ü" * 50 + "?>~" * 40  # makes '+' and '/' likely in the base64
    sig = encode_signature(CODEC, text)
    urlsafe = base64.urlsafe_b64encode(base64.b64decode(sig)).decode().rstrip("=")
    assert decode_signature(CODEC, sig) == text
    assert decode_signature(CODEC, urlsafe) == text
    assert decode_signature(CODEC, CODEC.encode(text)) == text  # a client that echoed the raw token
    assert decode_signature(CODEC, "skip_thought_signature_validator") is None
    assert decode_signature(CODEC, base64.b64encode(b"\x00\xff").decode()) is None
    assert decode_signature(ReasoningCodec(b"other"), sig) is None


@pytest.mark.parametrize(
    ("config", "choice", "tool_names"),
    [
        ({"mode": "AUTO"}, "auto", ["a", "b", "c"]),
        ({"mode": "VALIDATED"}, "auto", ["a", "b", "c"]),
        ({"mode": "NONE"}, "none", ["a", "b", "c"]),
        ({"mode": "ANY"}, "required", ["a", "b", "c"]),
        (
            {"mode": "ANY", "allowedFunctionNames": ["b"]},
            {"type": "function", "function": {"name": "b"}},
            ["a", "b", "c"],
        ),
        ({"mode": "ANY", "allowedFunctionNames": ["c", "a"]}, "required", ["a", "c"]),
        ({}, None, ["a", "b", "c"]),
    ],
)
def test_tool_config(config: dict[str, Any], choice: Any, tool_names: list[str]) -> None:
    body = {
        "contents": [{"parts": [{"text": "x"}]}],
        "tools": [{"functionDeclarations": [{"name": n} for n in "abc"]}],
        "toolConfig": {"functionCallingConfig": config},
    }
    req = parse(body)
    assert req.tool_choice == choice
    assert req.tools is not None and [t["function"]["name"] for t in req.tools] == tool_names


def test_generation_config() -> None:
    body = {
        "contents": [{"parts": [{"text": "x"}]}],
        "generationConfig": {
            "maxOutputTokens": 256,
            "stopSequences": ["STOP"],
            "seed": 7,
            "candidateCount": 1,
            "presencePenalty": 0.5,
            "frequencyPenalty": 0.25,
            "responseMimeType": "application/json",
            "responseSchema": {"type": "OBJECT", "properties": {"next": {"type": "STRING"}}},
            "thinkingConfig": {"thinkingBudget": 0},
        },
        "safetySettings": [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}],
        "cachedContent": "cachedContents/abc",
    }
    req = parse(body)
    assert req.params == {
        "max_tokens": 256,
        "seed": 7,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "stop": ["STOP"],
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "response",
                "schema": {"type": "object", "properties": {"next": {"type": "string"}}},
            },
        },
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert req.render == {"thinking": False}
    body["generationConfig"] = {
        "responseMimeType": "application/json",
        "thinkingConfig": {"thinkingLevel": "HIGH"},
    }
    req = parse(body)
    assert req.params == {
        "response_format": {"type": "json_object"},
        "chat_template_kwargs": {"enable_thinking": True},
    }
    body["generationConfig"] = {
        "response_mime_type": "text/plain",
        "max_output_tokens": 9,
    }  # snake_case works too
    assert parse(body).params == {"max_tokens": 9}


def _contents(*parts: Any, role: str = "user") -> dict[str, Any]:
    return {"contents": [{"role": role, "parts": list(parts)}]}


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({}, "contents", "missing"),
        ({"contents": []}, "contents", ""),
        ({"contents": [{"role": "assistant", "parts": [{"text": "x"}]}]}, "contents[0].role", ""),
        ({"contents": [{"role": "user", "parts": "hello"}]}, "contents[0].parts", ""),
        (_contents({"text": 5}), "contents[0].parts[0].text", "string"),
        (
            _contents({"functionResponse": {"response": {}}}),
            "contents[0].parts[0].functionResponse.name",
            "missing",
        ),
        (
            _contents({"functionCall": {"name": "f", "args": [1]}}, role="model"),
            "contents[0].parts[0].functionCall.args",
            "",
        ),
        (
            _contents({"inlineData": {"mimeType": "image/png"}}),
            "contents[0].parts[0].inlineData.data",
            "missing",
        ),
        (
            _contents({"fileData": {"fileUri": "gs://b/o", "mimeType": "application/pdf"}}),
            "contents[0].parts[0].fileData",
            "unsupported",
        ),
        (
            _contents({"executableCode": {"code": "1"}}, role="model"),
            "contents[0].parts[0].executableCode",
            "unsupported",
        ),
        (_contents({"functionCall": {"name": "f"}}), "contents[0].parts[0].functionCall", "model turn"),
        (
            _contents({"functionResponse": {"name": "f"}}, role="model"),
            "contents[0].parts[0].functionResponse",
            "model turn",
        ),
        (
            {**_contents({"text": "x"}), "generationConfig": {"candidateCount": 2}},
            "generationConfig.candidateCount",
            "1",
        ),
        ({**_contents({"text": "x"}), "generationConfig": {"topK": 0}}, "generationConfig.topK", ""),
        (
            {**_contents({"text": "x"}), "generationConfig": {"responseMimeType": "text/x.enum"}},
            "generationConfig.responseMimeType",
            "text/x.enum",
        ),
        (
            {**_contents({"text": "x"}), "tools": [{"functionDeclarations": [{"description": "no name"}]}]},
            "tools[0].functionDeclarations[0].name",
            "missing",
        ),
        (
            {**_contents({"text": "x"}), "toolConfig": {"functionCallingConfig": {"mode": "SOMETIMES"}}},
            "toolConfig.functionCallingConfig.mode",
            "",
        ),
        (
            {
                **_contents({"text": "x"}),
                "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["nope"]}},
            },
            "toolConfig.functionCallingConfig.allowedFunctionNames[0]",
            "nope",
        ),
    ],
)
def test_malformed_bodies_name_the_field(body: dict[str, Any], param: str, words: str) -> None:
    err = parse_error(body)
    assert err.param == param
    assert param in err.message and words in err.message


def test_model_must_come_from_the_path() -> None:
    err = parse_error(_contents({"text": "x"}), model=None)
    assert err.param == "model" and "path" in err.message


def test_error_reaches_sdk_as_client_error() -> None:
    client = sdk_client(completion())
    with pytest.raises(genai_errors.ClientError) as info:
        client.models.generate_content(
            model="gemini-2.5-pro",
            contents=[types.Content(role="user", parts=[types.Part(text="hi")])],
            config=types.GenerateContentConfig(candidate_count=3),
        )
    assert info.value.code == 400 and info.value.status == "INVALID_ARGUMENT"
    assert "generationConfig.candidateCount" in (info.value.message or "")


# ---- rendering, checked by the SDK -------------------------------------------------------------------


def test_sdk_parses_response_with_thought_text_and_function_calls() -> None:
    comp = completion(
        content="Running it.",
        reasoning="I should run the command.",
        tool_calls=(ToolCall("call_7", "run_shell_command", '{"command": "echo hi"}'),),
        finish_reason="tool_calls",
    )
    config = types.GenerateContentConfig(
        tools=[TOOLS], thinking_config=types.ThinkingConfig(include_thoughts=True, thinking_budget=1024)
    )
    resp = sdk_client(comp).models.generate_content(model="gemini-2.5-pro", contents="go", config=config)
    assert resp.model_version == "gemini-2.5-pro" and resp.response_id == "chatcmpl-g1"
    cand = resp.candidates[0]
    assert cand.finish_reason == types.FinishReason.STOP and cand.index == 0
    thought, text, call = cand.content.parts
    assert thought.thought is True and thought.text == "I should run the command."
    assert text.text == "Running it." and text.thought is None
    assert CODEC.decode(text.thought_signature.decode()) == "I should run the command."
    assert call.function_call.id == "call_7" and call.function_call.name == "run_shell_command"
    assert call.function_call.args == {"command": "echo hi"}
    assert resp.text == "Running it."
    assert [fc.name for fc in resp.function_calls] == ["run_shell_command"]
    usage = resp.usage_metadata
    assert (usage.prompt_token_count, usage.candidates_token_count, usage.total_token_count) == (800, 20, 820)


def test_without_include_thoughts_the_signature_still_carries_reasoning() -> None:
    comp = completion(
        content=None, reasoning="hidden", tool_calls=(ToolCall("c", "f", "{}"),), finish_reason="tool_calls"
    )
    resp = sdk_client(comp).models.generate_content(model="m", contents="go")
    (part,) = resp.candidates[0].content.parts
    assert part.function_call.name == "f" and part.thought is None
    assert decode_signature(CODEC, base64.b64encode(part.thought_signature).decode()) == "hidden"
    # Only reasoning: the signature rides on an empty text part.
    resp = sdk_client(completion(content="", reasoning="only")).models.generate_content(
        model="m", contents="go"
    )
    (part,) = resp.candidates[0].content.parts
    assert part.text == "" and CODEC.decode(part.thought_signature.decode()) == "only"
    # Thinking switched off: nothing about reasoning is emitted.
    off = types.GenerateContentConfig(thinking_config=types.ThinkingConfig(thinking_budget=0))
    resp = sdk_client(completion(reasoning="x")).models.generate_content(model="m", contents="go", config=off)
    (part,) = resp.candidates[0].content.parts
    assert part.text == "It printed hi-from-tool." and part.thought_signature is None


@pytest.mark.parametrize(
    ("finish", "reason"),
    [("stop", "STOP"), ("tool_calls", "STOP"), ("length", "MAX_TOKENS"), ("content_filter", "SAFETY")],
)
def test_finish_reasons(finish: Any, reason: str) -> None:
    resp = sdk_client(completion(finish_reason=finish)).models.generate_content(model="m", contents="x")
    assert resp.candidates[0].finish_reason == reason


def test_arguments_that_are_not_an_object_are_wrapped() -> None:
    comp = completion(content=None, tool_calls=(ToolCall("c", "f", "not json"),), finish_reason="tool_calls")
    resp = sdk_client(comp).models.generate_content(model="m", contents="x")
    assert resp.function_calls[0].args == {RAW_ARGUMENTS_KEY: "not json"}
    seen: list[CanonicalRequest] = []
    history = [types.Content(role="user", parts=[types.Part(text="x")]), resp.candidates[0].content]
    sdk_client(completion(), seen).models.generate_content(model="m", contents=history)
    assert seen[0].messages[1]["tool_calls"][0]["function"]["arguments"] == "not json"


def test_sdk_stream_chunks() -> None:
    comp = completion(
        content="Two calls.",
        reasoning="Plan it.",
        tool_calls=(
            ToolCall("a", "read_file", '{"file_path": "x"}'),
            ToolCall("b", "glob", '{"pattern": "*"}'),
        ),
        finish_reason="tool_calls",
    )
    config = types.GenerateContentConfig(thinking_config=types.ThinkingConfig(include_thoughts=True))
    chunks = list(
        sdk_client(comp).models.generate_content_stream(model="gemini-x", contents="go", config=config)
    )
    assert len(chunks) == 3
    parts = [p for c in chunks for p in c.candidates[0].content.parts]
    assert parts[0].thought is True and parts[0].text == "Plan it."
    assert "".join(p.text or "" for p in parts if not p.thought) == "Two calls."
    assert [
        (p.function_call.id, p.function_call.name, p.function_call.args) for p in parts if p.function_call
    ] == [
        ("a", "read_file", {"file_path": "x"}),
        ("b", "glob", {"pattern": "*"}),
    ]
    assert [c.candidates[0].finish_reason for c in chunks] == [None, None, types.FinishReason.STOP]
    assert chunks[-1].usage_metadata.total_token_count == 820
    assert all(c.usage_metadata is None for c in chunks[:-1])


def test_stream_json_array_chunks_validate() -> None:
    comp = completion(reasoning="r", tool_calls=(ToolCall("a", "f", "{}"),), finish_reason="tool_calls")
    req = parse(_contents({"text": "x"}), stream=True)
    chunks = D.stream_json(req, comp, CODEC)
    raw = orjson.loads(orjson.dumps(chunks))
    parsed = [types.GenerateContentResponse.model_validate(c) for c in raw]
    assert [p.text for p in parsed[:1]] == ["It printed hi-from-tool."]
    assert parsed[-1].candidates[0].finish_reason == types.FinishReason.STOP
    # The non-streaming body is the same parts in one candidate.
    whole = types.GenerateContentResponse.model_validate(D.render(req, comp, CODEC))
    assert whole.candidates[0].content.parts == [p for c in parsed for p in c.candidates[0].content.parts]
    # The SSE form carries the same chunks, one `data:` frame each.
    frames = b"".join(D.stream(req, comp, CODEC)).split(b"\n\n")
    assert [orjson.loads(f.removeprefix(b"data: ")) for f in frames if f] == raw


def test_round_trip_through_the_sdk_restores_call_and_reasoning() -> None:
    reasoning = "Step 1: look.\n  Step 2: act.  "
    comp = completion(
        content=None,
        reasoning=reasoning,
        tool_calls=(ToolCall("call_rt", "run_shell_command", '{"command": "ls -la", "dir_path": "."}'),),
        finish_reason="tool_calls",
    )
    config = types.GenerateContentConfig(
        tools=[TOOLS], thinking_config=types.ThinkingConfig(include_thoughts=True)
    )
    first = sdk_client(comp).models.generate_content(model="m", contents="go", config=config)
    model_turn = first.candidates[0].content
    # Gemini CLI drops thought parts from its history; the signature on the call part is enough.
    kept = types.Content(role="model", parts=[p for p in model_turn.parts if not p.thought])
    reply = types.Part.from_function_response(name="run_shell_command", response={"output": "a b"})
    reply.function_response.id = "call_rt"
    history = [
        types.Content(role="user", parts=[types.Part(text="go")]),
        kept,
        types.Content(role="user", parts=[reply]),
    ]
    seen: list[CanonicalRequest] = []
    sdk_client(completion(), seen).models.generate_content(model="m", contents=history, config=config)
    msg = seen[0].messages[1]
    assert msg["reasoning_content"] == reasoning
    (call,) = msg["tool_calls"]
    assert call["id"] == "call_rt" and call["function"]["name"] == "run_shell_command"
    assert call["function"]["arguments"] == '{"command":"ls -la","dir_path":"."}'
    assert seen[0].messages[2] == {"role": "tool", "tool_call_id": "call_rt", "content": "a b"}


# ---- errors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "status", "name", "exc"),
    [
        ("invalid_request", 400, "INVALID_ARGUMENT", genai_errors.ClientError),
        ("authentication", 401, "UNAUTHENTICATED", genai_errors.ClientError),
        ("permission", 403, "PERMISSION_DENIED", genai_errors.ClientError),
        ("not_found", 404, "NOT_FOUND", genai_errors.ClientError),
        ("request_too_large", 413, "INVALID_ARGUMENT", genai_errors.ClientError),
        ("rate_limit", 429, "RESOURCE_EXHAUSTED", genai_errors.ClientError),
        ("upstream_error", 502, "INTERNAL", genai_errors.ServerError),
        ("overloaded", 503, "UNAVAILABLE", genai_errors.ServerError),
        ("timeout", 504, "DEADLINE_EXCEEDED", genai_errors.ServerError),
    ],
)
def test_error_envelopes(kind: Any, status: int, name: str, exc: type[Exception]) -> None:
    got_status, body = D.error(GatewayError(kind, f"about {kind}"))
    assert got_status == status
    assert body == {"error": {"code": status, "message": f"about {kind}", "status": name}}

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(got_status, json=body)

    options = types.HttpOptions(
        base_url="http://gw", httpx_client=httpx.Client(transport=httpx.MockTransport(handler))
    )
    client = genai.Client(api_key="k", http_options=options)
    with pytest.raises(exc) as info:
        client.models.generate_content(model="m", contents="x")
    assert isinstance(info.value, genai_errors.APIError)
    assert info.value.code == status and info.value.status == name and info.value.message == f"about {kind}"


def test_context_length_wording() -> None:
    status, body = D.error(
        GatewayError("context_length", "too long", prompt_tokens=1048577, max_tokens=1048576)
    )
    assert status == 400
    assert body["error"] == {
        "code": 400,
        "message": "The input token count (1048577) exceeds the maximum number of tokens allowed (1048576).",
        "status": "INVALID_ARGUMENT",
    }


def test_stream_error_frame() -> None:
    """One SSE event, sent with the error's own status: @google/genai (JS 1.52.0, Pi 0.73.1) reads a `data:`
    error event on a 200 as an empty answer, but raises on any non-2xx status before reading the stream."""
    err = GatewayError("overloaded", "paused")
    frame = D.stream_error(err)
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert orjson.loads(frame[6:]) == {"error": {"code": 503, "message": "paused", "status": "UNAVAILABLE"}}
    assert D.stream_error_status(err) == 503


def test_parse_does_not_mutate_the_body() -> None:
    body = gemini_cli_body()
    before = copy.deepcopy(body)
    parse(body)
    assert body == before


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_any_mutation_is_parsed_or_refused_by_field(data: st.DataObject) -> None:
    body = mutate(gemini_cli_body(), data)
    assert_parsed_or_refused(D, body, CODEC, completion(), path_model="gemini-2.5-pro", path_stream=False)
