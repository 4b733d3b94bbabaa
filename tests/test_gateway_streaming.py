"""Real incremental streaming (issue 12, point 2): a streamed harness call is streamed from the backend.

Against the fake vLLM streaming in vLLM 0.32's chunk shape (`tests.fakes.stream`), in every dialect:
- deltas reach the official SDK while the upstream is still sampling: the fake holds after token k until
  released, and the client has already read the text of those k tokens (an event, not a timing);
- the record equals exactly what the fake sent (prompt ids, every sampled id and logprob, finish, usage),
  and it is in the store when the client reads the stream's closing event;
- reasoning and tool-call argument pieces arrive as pieces (whole function calls in Gemini, which has no
  argument deltas);
- a failure mid-stream (connection dropped, an error event, a malformed chunk) ends the harness's stream
  with the dialect's error event and leaves a failure record, no completion;
- token data missing from the stream, or not adding up to the server's usage, is flagged, not repaired.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from google import genai
from google.genai import types

from polar.store.records import FLAG_NO_RESPONSE_IDS, FLAG_NOT_TRAINABLE, FLAG_TOKEN_COUNT_MISMATCH
from tests.conftest import FakeBackend, Gateway
from tests.fakes.fake_vllm import Reply
from tests.sdk_support import Sampler, check_records

pytestmark = pytest.mark.shared_stack

DIALECTS = ["chat", "responses", "anthropic", "gemini"]
MODELS = {
    "chat": "qwen3-coder",
    "responses": "gpt-5-codex",
    "anthropic": "claude-sonnet-4-6",
    "gemini": "gemini-2.5-pro",
}
HTTP = httpx.Client(timeout=30)
ANSWER = "A streamed answer that is long enough to arrive in many token chunks, one byte at a time."
SHELL_ARGS = '{"command": "grep -rn \\"needle\\" src/ tests/ docs/ | head -n 20"}'
THOUGHT = "First I think about which command to run, then I run it."


# ---- clients ------------------------------------------------------------------------------------------


def sdk_text(gw: Gateway, dialect: str, sid: str) -> Iterator[str]:
    """The answer's text pieces as the official SDK hands them over, one by one."""
    model = MODELS[dialect]
    if dialect == "chat":
        oc = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)
        for c in oc.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "go"}], stream=True
        ):
            if c.choices and c.choices[0].delta.content:
                yield c.choices[0].delta.content
    elif dialect == "responses":
        oc = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)
        for e in oc.responses.create(model=model, input="go", stream=True):
            if e.type == "response.output_text.delta":
                yield e.delta
    elif dialect == "anthropic":
        ac = anthropic.Anthropic(base_url=gw.url, api_key=sid, max_retries=0)
        messages: Any = [{"role": "user", "content": "go"}]
        for ev in ac.messages.create(model=model, max_tokens=512, messages=messages, stream=True):
            if ev.type == "content_block_delta" and ev.delta.type == "text_delta":
                yield ev.delta.text
    else:
        gc = genai.Client(api_key=sid, http_options=types.HttpOptions(base_url=gw.url, api_version="v1beta"))
        for ch in gc.models.generate_content_stream(model=model, contents="go"):
            for part in (ch.candidates or [])[0].content.parts or []:  # type: ignore[union-attr]
                if part.text and not part.thought:
                    yield part.text


def raw_stream(
    gw: Gateway, dialect: str, sid: str, *, tools: bool = False, fmt: str = "sse"
) -> httpx.Response:
    """A streamed call as raw HTTP (the whole answer read), with thinking on and, if asked, a shell tool."""
    headers = {"authorization": f"Bearer {sid}"}
    schema = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
    model = MODELS[dialect]
    if dialect == "chat":
        path = "/v1/chat/completions"
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": "go"}],
            "stream": True,
        }
        if tools:
            body["tools"] = [{"type": "function", "function": {"name": "shell", "parameters": schema}}]
    elif dialect == "responses":
        path = "/v1/responses"
        body = {"model": model, "input": "go", "stream": True, "include": ["reasoning.encrypted_content"]}
        if tools:
            body["tools"] = [{"type": "function", "name": "shell", "parameters": schema}]
    elif dialect == "anthropic":
        path, headers["anthropic-version"] = "/v1/messages", "2023-06-01"
        body = {
            "model": model,
            "max_tokens": 512,
            "stream": True,
            "thinking": {"type": "enabled", "budget_tokens": 256},
            "messages": [{"role": "user", "content": "go"}],
        }
        if tools:
            body["tools"] = [{"name": "shell", "input_schema": schema}]
    else:
        path = f"/v1beta/models/{model}:streamGenerateContent" + ("?alt=sse" if fmt == "sse" else "")
        body = {
            "contents": [{"role": "user", "parts": [{"text": "go"}]}],
            "generationConfig": {"thinkingConfig": {"includeThoughts": True}},
        }
        if tools:
            body["tools"] = [{"functionDeclarations": [{"name": "shell", "parametersJsonSchema": schema}]}]
    return HTTP.post(gw.url + path, json=body, headers=headers)


def events(raw: bytes) -> list[tuple[str | None, Any]]:
    """(event name, decoded data) of each SSE frame."""
    out: list[tuple[str | None, Any]] = []
    for frame in raw.decode().split("\n\n"):
        if not frame.strip():
            continue
        name, data = None, []
        for line in frame.split("\n"):
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data.append(line.removeprefix("data: "))
        text = "\n".join(data)
        out.append((name, text if text == "[DONE]" else json.loads(text)))
    return out


# ---- incremental delivery -------------------------------------------------------------------------------


@pytest.mark.parametrize("dialect", DIALECTS)
def test_deltas_reach_the_sdk_before_the_upstream_finishes(
    gateway: Gateway, fake_backend: FakeBackend, dialect: str
) -> None:
    sampler = Sampler(fake_backend, Reply(content=ANSWER))
    k = 20
    faults = fake_backend.app.streaming
    faults.hold_after_tokens = k  # the fake stops after k token chunks until released
    sid = gateway.new_session()
    seen = ""
    pieces = sdk_text(gateway, dialect, sid)
    try:
        for piece in pieces:
            seen += piece
            if len(seen) >= k:
                break
        # The client holds the text of the first k tokens (one byte each) while the upstream is held:
        # the answer is not finished anywhere, and nothing is recorded yet.
        assert faults.held.wait(10)
        assert seen == ANSWER[:k] and not faults.released.is_set()
        assert gateway.completions(sid) == []
    finally:
        faults.release()
    seen += "".join(pieces)
    assert seen == ANSWER
    check_records(gateway, sid, sampler, dialect=dialect, model=MODELS[dialect])


def _closing(dialect: str, name: str | None, data: Any) -> bool:
    """Whether an event is the first of the stream's closing events (sent only after the commit)."""
    if dialect == "chat":
        return data != "[DONE]" and bool(data["choices"]) and data["choices"][0]["finish_reason"] is not None
    if dialect == "responses":
        return name == "response.completed"
    if dialect == "anthropic":
        return name == "message_delta"
    return bool(data["candidates"][0].get("finishReason"))


@pytest.mark.parametrize("dialect", DIALECTS)
def test_record_is_stored_before_the_closing_event(
    gateway: Gateway, fake_backend: FakeBackend, dialect: str
) -> None:
    sampler = Sampler(fake_backend, Reply(content=ANSWER, reasoning=THOUGHT))
    sid = gateway.new_session()
    stored_at_close: list[int] = []
    path, body, headers = _request(dialect, sid)
    with HTTP.stream("POST", gateway.url + path, json=body, headers=headers) as r:
        assert r.status_code == 200
        buf = ""
        for text in r.iter_text():
            buf += text
            while "\n\n" in buf:
                frame, buf = buf.split("\n\n", 1)
                ((name, data),) = events(frame.encode() + b"\n\n")
                if _closing(dialect, name, data) and not stored_at_close:
                    # The closing event is only written once the record is committed.
                    stored_at_close.append(len(gateway.stored(sid)))
    assert stored_at_close == [1]
    (rec,) = check_records(gateway, sid, sampler, dialect=dialect, model=MODELS[dialect])
    assert rec.response_message["content"] == ANSWER and rec.response_message["reasoning_content"] == THOUGHT
    assert rec.upstream_request["stream"] is True and rec.upstream_request["stream_options"] == {
        "include_usage": True
    }


def _request(dialect: str, sid: str) -> tuple[str, dict[str, Any], dict[str, str]]:
    headers = {"authorization": f"Bearer {sid}", "anthropic-version": "2023-06-01"}
    model = MODELS[dialect]
    user = [{"role": "user", "content": "go"}]
    if dialect == "chat":
        return "/v1/chat/completions", {"model": model, "messages": user, "stream": True}, headers
    if dialect == "responses":
        return "/v1/responses", {"model": model, "input": "go", "stream": True}, headers
    if dialect == "anthropic":
        return "/v1/messages", {"model": model, "max_tokens": 512, "messages": user, "stream": True}, headers
    body = {"contents": [{"role": "user", "parts": [{"text": "go"}]}]}
    return f"/v1beta/models/{model}:streamGenerateContent?alt=sse", body, headers


# ---- reasoning and tool-call pieces -----------------------------------------------------------------------


def test_chat_streams_reasoning_and_tool_argument_pieces(gateway: Gateway, fake_backend: FakeBackend) -> None:
    sampler = Sampler(fake_backend, Reply(reasoning=THOUGHT, tool_calls=[("shell", SHELL_ARGS)]))
    sid = gateway.new_session()
    evs = events(raw_stream(gateway, "chat", sid, tools=True).content)
    deltas = [d["choices"][0]["delta"] for _, d in evs if d != "[DONE]" and d["choices"]]
    reasoning = [d["reasoning_content"] for d in deltas if d.get("reasoning_content")]
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    assert len(reasoning) > 10 and "".join(reasoning) == THOUGHT
    assert calls[0]["id"] and calls[0]["function"]["name"] == "shell" and all(c["index"] == 0 for c in calls)
    args = [c["function"]["arguments"] for c in calls]
    assert len([a for a in args if a]) > 10 and "".join(args) == SHELL_ARGS
    assert [d["choices"][0]["finish_reason"] for _, d in evs if d != "[DONE]" and d["choices"]][
        -1
    ] == "tool_calls"
    (rec,) = check_records(gateway, sid, sampler, dialect="chat", model=MODELS["chat"])
    assert rec.response_message["tool_calls"][0]["function"]["arguments"] == SHELL_ARGS
    assert rec.response_message["tool_calls"][0]["id"] == calls[0]["id"]


def test_responses_streams_reasoning_and_argument_pieces(gateway: Gateway, fake_backend: FakeBackend) -> None:
    sampler = Sampler(fake_backend, Reply(reasoning=THOUGHT, tool_calls=[("shell", SHELL_ARGS)]))
    sid = gateway.new_session()
    evs = events(raw_stream(gateway, "responses", sid, tools=True).content)
    names = [n for n, _ in evs]
    summary = [d["delta"] for n, d in evs if n == "response.reasoning_summary_text.delta"]
    args = [d["delta"] for n, d in evs if n == "response.function_call_arguments.delta"]
    assert len(summary) > 10 and "".join(summary) == THOUGHT
    assert len(args) > 10 and "".join(args) == SHELL_ARGS
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.completed"
    final = evs[-1][1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "function_call"]
    assert final["output"][1]["arguments"] == SHELL_ARGS and final["output"][0][
        "encrypted_content"
    ].startswith("p1.")
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    check_records(gateway, sid, sampler, dialect="responses", model=MODELS["responses"])


def test_responses_sdk_accumulates_the_streamed_answer(gateway: Gateway, fake_backend: FakeBackend) -> None:
    Sampler(fake_backend, Reply(content=ANSWER, reasoning=THOUGHT))
    oc = openai.OpenAI(base_url=gateway.url + "/v1", api_key=gateway.new_session(), max_retries=0)
    with oc.responses.stream(model=MODELS["responses"], input="go") as s:
        final = s.get_final_response()
    assert final.output_text == ANSWER and final.status == "completed"


def test_anthropic_streams_thinking_and_input_json_pieces(
    gateway: Gateway, fake_backend: FakeBackend
) -> None:
    sampler = Sampler(fake_backend, Reply(reasoning=THOUGHT, tool_calls=[("shell", SHELL_ARGS)]))
    sid = gateway.new_session()
    evs = events(raw_stream(gateway, "anthropic", sid, tools=True).content)
    deltas = [d["delta"] for n, d in evs if n == "content_block_delta"]
    thinking = [d["thinking"] for d in deltas if d["type"] == "thinking_delta"]
    partial = [d["partial_json"] for d in deltas if d["type"] == "input_json_delta"]
    assert len(thinking) > 10 and "".join(thinking) == THOUGHT
    assert len(partial) > 10 and "".join(partial) == SHELL_ARGS
    assert [d["type"] for d in deltas].count("signature_delta") == 1
    assert [n for n, _ in evs][-2:] == ["message_delta", "message_stop"]
    check_records(gateway, sid, sampler, dialect="anthropic", model=MODELS["anthropic"])
    # The SDK puts the pieces together into the call's input object.
    Sampler(fake_backend, Reply(reasoning=THOUGHT, tool_calls=[("shell", SHELL_ARGS)]))
    ac = anthropic.Anthropic(base_url=gateway.url, api_key=gateway.new_session(), max_retries=0)
    tool = {
        "name": "shell",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
    }
    with ac.messages.stream(
        model=MODELS["anthropic"],
        max_tokens=512,
        messages=[{"role": "user", "content": "go"}],
        tools=[tool],  # type: ignore[list-item]
        thinking={"type": "enabled", "budget_tokens": 256},
    ) as s:
        message = s.get_final_message()
    assert [b.type for b in message.content] == ["thinking", "tool_use"]
    assert message.content[1].input == json.loads(SHELL_ARGS)  # type: ignore[union-attr]
    assert message.content[0].thinking == THOUGHT and message.stop_reason == "tool_use"  # type: ignore[union-attr]


def test_anthropic_holds_back_arguments_that_are_not_an_object(
    gateway: Gateway, fake_backend: FakeBackend
) -> None:
    """Arguments that do not start as a JSON object cannot be an Anthropic `input`: sent whole, wrapped."""
    Sampler(fake_backend, Reply(tool_calls=[("shell", '"just a string"')]))
    evs = events(raw_stream(gateway, "anthropic", gateway.new_session(), tools=True).content)
    partial = [
        d["delta"]["partial_json"]
        for n, d in evs
        if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"
    ]
    assert partial == ['{"_polar_raw_arguments":"\\"just a string\\""}']


@pytest.mark.parametrize("fmt", ["sse", "json-array"])
def test_gemini_streams_thought_pieces_and_whole_function_calls(
    gateway: Gateway, fake_backend: FakeBackend, fmt: str
) -> None:
    sampler = Sampler(fake_backend, Reply(reasoning=THOUGHT, tool_calls=[("shell", SHELL_ARGS)]))
    sid = gateway.new_session()
    r = raw_stream(gateway, "gemini", sid, tools=True, fmt=fmt)
    chunks = [d for _, d in events(r.content)] if fmt == "sse" else r.json()
    parts = [p for c in chunks for p in c["candidates"][0]["content"]["parts"]]
    thoughts = [p["text"] for p in parts if p.get("thought")]
    calls = [p["functionCall"] for p in parts if "functionCall" in p]
    assert len(thoughts) > 10 and "".join(thoughts) == THOUGHT
    assert calls == [{"name": "shell", "args": json.loads(SHELL_ARGS), "id": calls[0]["id"]}]
    assert sum(1 for p in parts if p.get("thoughtSignature")) == 1
    assert chunks[-1]["candidates"][0]["finishReason"] == "STOP" and "usageMetadata" in chunks[-1]
    (rec,) = check_records(gateway, sid, sampler, dialect="gemini", model=MODELS["gemini"])
    assert rec.response_message["tool_calls"][0]["id"] == calls[0]["id"]


# ---- failures mid-stream --------------------------------------------------------------------------------

FAULTS = ["drop_after_tokens", "error_after_tokens", "garbage_after_tokens"]


def _error_of(dialect: str, evs: list[tuple[str | None, Any]]) -> str:
    """The message of the stream's closing error event, in the dialect's grammar."""
    if dialect == "chat":
        assert evs[-1][1] == "[DONE]"
        return str(evs[-2][1]["error"]["message"])
    if dialect == "responses":
        assert [n for n, _ in evs[-2:]] == ["error", "response.failed"]
        return str(evs[-1][1]["response"]["error"]["message"])
    if dialect == "anthropic":
        assert evs[-1][0] == "error" and evs[-1][1]["error"]["type"] == "api_error"
        return str(evs[-1][1]["error"]["message"])
    assert evs[-1][1]["error"]["status"] == "INTERNAL"
    return str(evs[-1][1]["error"]["message"])


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("dialect", DIALECTS)
def test_failure_mid_stream_ends_with_the_error_event_and_a_failure_record(
    gateway: Gateway, fake_backend: FakeBackend, dialect: str, fault: str
) -> None:
    Sampler(fake_backend, Reply(content=ANSWER))
    setattr(fake_backend.app.streaming, fault, 10)
    sid = gateway.new_session()
    r = raw_stream(gateway, dialect, sid)
    assert r.status_code == 200
    evs = events(r.content)
    message = _error_of(dialect, evs)
    expected = {
        "drop_after_tokens": "dropped the connection",
        "error_after_tokens": "engine died",
        "garbage_after_tokens": "not JSON",
    }
    assert expected[fault] in message
    assert len(evs) > 10  # the first tokens went out before the failure
    assert gateway.completions(sid) == []
    failures = gateway.control("GET", f"/sessions/{sid}/failures").json()["failures"]
    assert [(f["kind"], expected[fault] in f["message"]) for f in failures] == [("upstream_error", True)]


def test_harness_that_goes_away_leaves_a_failure_record(gateway: Gateway, fake_backend: FakeBackend) -> None:
    Sampler(fake_backend, Reply(content=ANSWER))
    faults = fake_backend.app.streaming
    faults.hold_after_tokens = 5
    sid = gateway.new_session()
    path, body, headers = _request("chat", sid)
    try:
        with HTTP.stream("POST", gateway.url + path, json=body, headers=headers) as r:
            next(r.iter_bytes())
            assert faults.held.wait(10)
        # The upstream stays held until the gateway has seen the hang-up: released at once, the rest of the
        # answer could be written into the closed connection's socket before the server reads its end, and
        # then the stream did end (flaky in CI until this waited).
        for _ in range(500):  # the failure is recorded by a clean-up task once the gateway sees the hang-up
            failures = gateway.control("GET", f"/sessions/{sid}/failures").json()["failures"]
            if failures:
                break
            time.sleep(0.02)
        # ...and the gateway hung up on the upstream in turn: how vLLM learns to stop generating.
        assert faults.aborted.wait(10)
    finally:
        faults.release()
    assert [f["message"] for f in failures] == ["the client closed the stream before it ended"]
    assert gateway.completions(sid) == []


# ---- token data --------------------------------------------------------------------------------------------


def _without_ids(out: dict[str, Any]) -> dict[str, Any]:
    out["choices"][0]["token_ids"] = None  # the stream's token chunks then carry no ids
    return out


def _miscounted(out: dict[str, Any]) -> dict[str, Any]:
    out["usage"]["completion_tokens"] += 1
    return out


@pytest.mark.parametrize(
    ("transform", "flag"), [(_without_ids, FLAG_NO_RESPONSE_IDS), (_miscounted, FLAG_TOKEN_COUNT_MISMATCH)]
)
def test_missing_or_inconsistent_token_data_is_flagged(
    gateway: Gateway, fake_backend: FakeBackend, transform: Any, flag: str
) -> None:
    fake_backend.app.reset([Reply(content=ANSWER)], transform=transform)
    sid = gateway.new_session()
    assert "".join(sdk_text(gateway, "chat", sid)) == ANSWER
    (rec,) = gateway.completions(sid)
    assert flag in rec.flags and FLAG_NOT_TRAINABLE in rec.flags and not rec.trainable
