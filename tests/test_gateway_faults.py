"""Upstream faults, for every dialect, streaming or not: what the harness sees, what is recorded, what survives.

Each fault is met twice on one session, by raw HTTP (status and the dialect's own envelope, or its in-stream
error event) and by the dialect's official SDK (its exception class, raised on the event for streams). Then:
one failure record per call and no completion, and the gateway still serves the next call on another
session and on the same one (whose seq continues after the failures). Never a 500.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from google import genai
from google.genai import errors as genai_errors
from google.genai import types

from polar.gateway.backends.base import BackendOptions
from polar.store.records import (
    FLAG_NO_LOGPROBS,
    FLAG_NO_PROMPT_IDS,
    FLAG_NO_RESPONSE_IDS,
    FLAG_NOT_TRAINABLE,
    CompletionRecord,
)
from tests.conftest import Gateway, start_gateway
from tests.fakes.fake_vllm import FakeInferenceServer, make_fake_backend
from tests.fakes.server import ServerThread, free_port, serve
from tests.sdk_support import prompt_ids

DIALECTS = ("chat", "responses", "anthropic", "gemini")
GEMINI_MODEL = "gemini-2.5-pro"
CLAUDE_MODEL = "claude-sonnet-4-6"
MAX_LEN = 5  # the fake's context when a test overflows it: every prompt here is longer
SAID = "You said: hello"  # the fake's default answer to "hello"


# ---- the dialects, raw and through their SDKs ---------------------------------------------------------


# Clients are made once and shared: building one loads the CA store (~20 ms), which would dominate a test.
HTTP = httpx.Client(timeout=30)
GENAI_HTTP = httpx.Client(timeout=30)
GENAI_ASYNC_HTTP = httpx.AsyncClient(timeout=30)


@functools.cache
def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unset", max_retries=0)


@functools.cache
def anthropic_client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unset", max_retries=0)


def genai_client(url: str, sid: str) -> genai.Client:
    options = types.HttpOptions(
        base_url=url, api_version="v1beta", httpx_client=GENAI_HTTP, httpx_async_client=GENAI_ASYNC_HTTP
    )
    return genai.Client(api_key=sid, http_options=options)


def new_session(gw: Gateway) -> str:
    return gw.new_session(task_id="faults")


def completions(gw: Gateway, sid: str) -> list[CompletionRecord]:
    return gw.completions(sid)


def failures(gw: Gateway, sid: str) -> list[dict[str, Any]]:
    r = gw.control("GET", f"/sessions/{sid}/failures")
    assert r.status_code == 200, r.text
    return list(r.json()["failures"])


def raw_call(url: str, dialect: str, sid: str, stream: bool, gemini_format: str = "sse") -> httpx.Response:
    headers = {"authorization": f"Bearer {sid}"}
    if dialect == "chat":
        path, body = (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "hello"}]},
        )
    elif dialect == "responses":
        path, body = "/v1/responses", {"model": "m", "input": "hello"}
    elif dialect == "anthropic":
        headers["anthropic-version"] = "2023-06-01"
        path = "/v1/messages"
        body = {"model": CLAUDE_MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "hello"}]}
    else:
        method = "streamGenerateContent" if stream else "generateContent"
        path = f"/v1beta/models/{GEMINI_MODEL}:{method}" + (
            "?alt=sse" if stream and gemini_format == "sse" else ""
        )
        body = {"contents": [{"role": "user", "parts": [{"text": "hello"}]}]}
    if stream and dialect != "gemini":
        body["stream"] = True
    return HTTP.post(url + path, json=body, headers=headers)


def sdk_call(url: str, dialect: str, sid: str, stream: bool) -> str:
    """The answer's text, as the SDK delivers it; raises the SDK's exception on a failure."""
    if dialect in ("chat", "responses"):
        oc = openai_client(url).with_options(api_key=sid)
        if dialect == "chat":
            messages: Any = [{"role": "user", "content": "hello"}]
            if not stream:
                return (
                    oc.chat.completions.create(model="m", messages=messages).choices[0].message.content or ""
                )
            chunks = oc.chat.completions.create(model="m", messages=messages, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        if not stream:
            return oc.responses.create(model="m", input="hello").output_text
        events = list(oc.responses.create(model="m", input="hello", stream=True))
        assert events[-1].type == "response.completed"
        return events[-1].response.output_text
    if dialect == "anthropic":
        ac = anthropic_client(url).with_options(api_key=sid)
        kwargs: Any = {
            "model": CLAUDE_MODEL,
            "max_tokens": 64,
            "messages": [{"role": "user", "content": "hello"}],
        }
        if not stream:
            return "".join(b.text for b in ac.messages.create(**kwargs).content if b.type == "text")
        with ac.messages.stream(**kwargs) as s:
            return "".join(s.text_stream)
    gc = genai_client(url, sid)
    if not stream:
        return gc.models.generate_content(model=GEMINI_MODEL, contents="hello").text or ""
    return "".join(
        c.text or "" for c in gc.models.generate_content_stream(model=GEMINI_MODEL, contents="hello")
    )


def sse_events(raw: bytes) -> list[tuple[str | None, Any]]:
    """(event name, decoded data) of each SSE frame."""
    out: list[tuple[str | None, Any]] = []
    for frame in raw.decode().split("\n\n"):
        if not frame.strip():
            continue
        event, data = None, []
        for line in frame.split("\n"):
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data.append(line.removeprefix("data: "))
        text = "\n".join(data)
        out.append((event, text if text == "[DONE]" else json.loads(text)))
    return out


def stream_error_body(dialect: str, raw: bytes) -> dict[str, Any]:
    """The in-stream error of each dialect's grammar, checked for shape; returns its error envelope."""
    events = sse_events(raw)
    if dialect == "gemini":
        # One `data:` event with the error envelope (sent with the error's status, see `check_raw`).
        assert [e for e, _ in events] == [None]
        return dict(events[0][1])
    if dialect == "chat":
        # A data frame with a top-level `error`, then [DONE]: what the openai SDK raises on.
        assert [e for e, _ in events] == [None, None] and events[1][1] == "[DONE]"
        return dict(events[0][1])
    if dialect == "responses":
        # `error` (the SDK raises on it), then `response.failed` (what Codex acts on).
        assert [e for e, _ in events] == ["error", "response.failed"]
        first, failed = events[0][1], events[1][1]
        assert first["type"] == "error" and first["code"] == first["error"]["code"]
        assert failed["response"]["status"] == "failed"
        assert failed["response"]["error"]["code"] == first["code"]
        assert [d["sequence_number"] for _, d in events] == [0, 1]
        return {"error": first["error"]}
    assert [e for e, _ in events] == ["error"]  # anthropic
    return dict(events[0][1])


# ---- what each fault must look like in each dialect --------------------------------------------------


@dataclass(frozen=True)
class Expect:
    kind: str  # the GatewayError kind recorded on the failure
    status: int
    text: str  # a piece of the message the harness must see


# The error label each dialect's clients branch on: OpenAI `code`, Anthropic `error.type`, Gemini `status`.
LABEL: dict[str, dict[str, str]] = {
    "chat": {
        "upstream_error": "server_error",
        "timeout": "timeout",
        "rate_limit": "rate_limit_exceeded",
        "context_length": "context_length_exceeded",
    },
    "anthropic": {
        "upstream_error": "api_error",
        "timeout": "timeout_error",
        "rate_limit": "rate_limit_error",
        "context_length": "invalid_request_error",
    },
    "gemini": {
        "upstream_error": "INTERNAL",
        "timeout": "DEADLINE_EXCEEDED",
        "rate_limit": "RESOURCE_EXHAUSTED",
        "context_length": "INVALID_ARGUMENT",
    },
}
LABEL["responses"] = LABEL["chat"]


def overflow_text(dialect: str, n: int) -> str:
    """The overflow wording each dialect's clients recognise, for a prompt of `n` tokens."""
    return {
        "chat": f"This model's maximum context length is {MAX_LEN} tokens. However, your messages resulted in {n} tokens.",
        "responses": f"Your input exceeds the context window of this model ({n} tokens > {MAX_LEN} maximum).",
        "anthropic": f"prompt is too long: {n} tokens > {MAX_LEN} maximum",
        "gemini": f"The input token count ({n}) exceeds the maximum number of tokens allowed ({MAX_LEN}).",
    }[dialect]


def check_envelope(dialect: str, body: dict[str, Any], expect: Expect) -> None:
    label = LABEL[dialect][expect.kind]
    if dialect in ("chat", "responses"):
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == label, err
        message = err["message"]
    elif dialect == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == label, body
        message = body["error"]["message"]
    else:
        err = body["error"]
        assert err["code"] == expect.status and err["status"] == label, err
        message = err["message"]
    assert expect.text in message, (expect.text, message)


def check_sdk_error(dialect: str, stream: bool, exc: BaseException, expect: Expect) -> None:
    label = LABEL[dialect][expect.kind]
    if dialect in ("chat", "responses"):
        assert isinstance(exc, openai.APIError) and exc.code == label
        if not stream:  # a status error of the class the openai SDK picks from the status
            assert isinstance(exc, openai.APIStatusError) and exc.status_code == expect.status
            assert isinstance(exc, OPENAI_CLASS.get(expect.status, openai.InternalServerError))
    elif dialect == "anthropic":
        assert isinstance(exc, anthropic.APIStatusError) and exc.body["error"]["type"] == label  # type: ignore[index]
        if not stream:
            assert exc.status_code == expect.status
            assert isinstance(exc, ANTHROPIC_CLASS.get(expect.status, anthropic.InternalServerError))
    else:
        assert isinstance(exc, genai_errors.APIError) and exc.code == expect.status
        assert isinstance(exc, genai_errors.ClientError if expect.status < 500 else genai_errors.ServerError)
        # A stream's error arrives with its HTTP status: google-genai names it by the reason phrase and keeps
        # the event's text, which carries the label.
        assert exc.status == label if not stream else f'"status":"{label}"' in str(exc)
    assert expect.text in str(exc), (expect.text, str(exc))


OPENAI_CLASS: dict[int, type[openai.APIStatusError]] = {
    400: openai.BadRequestError,
    429: openai.RateLimitError,
}
ANTHROPIC_CLASS: dict[int, type[anthropic.APIStatusError]] = {
    400: anthropic.BadRequestError,
    429: anthropic.RateLimitError,
}


# ---- fixtures: one fake and one gateway for the module, a fresh session per test --------------------


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeInferenceServer, str]]:
    app = make_fake_backend("vllm")
    with serve(app) as srv:
        yield app, srv.url


@pytest.fixture(scope="module")
def gw(fake: tuple[FakeInferenceServer, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gateway = start_gateway(fake[1], tmp_path_factory.mktemp("faults"))
    try:
        yield gateway
    finally:
        gateway.server.stop()


@pytest.fixture(scope="module")
def slow_gw(
    fake: tuple[FakeInferenceServer, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    """A gateway that gives the backend half a second per call."""
    options = BackendOptions(retries=0, timeout_s=0.5)
    gateway = start_gateway(fake[1], tmp_path_factory.mktemp("slow"), backend=options)
    try:
        yield gateway
    finally:
        gateway.server.stop()


@pytest.fixture
def backend(fake: tuple[FakeInferenceServer, str]) -> FakeInferenceServer:
    fake[0].reset()
    return fake[0]


def sdk_failure(url: str, dialect: str, sid: str, stream: bool) -> BaseException:
    with pytest.raises(Exception) as info:
        sdk_call(url, dialect, sid, stream)
    return info.value


def check_raw(r: httpx.Response, dialect: str, stream: bool, expect: Expect) -> None:
    if stream:
        # The harness asked for a stream: an event stream carrying the dialect's error event, with status 200
        # (Gemini: the error's own, which @google/genai, JS, raises on; it ignores a `data:` error on a 200).
        status = expect.status if dialect == "gemini" else 200
        assert r.status_code == status and r.headers["content-type"].startswith("text/event-stream")
        check_envelope(dialect, stream_error_body(dialect, r.content), expect)
    else:
        assert r.status_code == expect.status, r.text
        assert r.headers["content-type"].startswith("application/json")
        check_envelope(dialect, r.json(), expect)


def meet_fault(
    gw: Gateway,
    backend: FakeInferenceServer | None,
    dialect: str,
    stream: bool,
    expect: Expect,
    *,
    concurrently: bool = False,
) -> str:
    """One raw and one SDK call on a new session, both failing as `expect`; returns the session id.

    `concurrently` sends both at once (a slow backend then costs its timeout once, not twice)."""
    sid = new_session(gw)
    if concurrently:
        with ThreadPoolExecutor(1) as pool:
            raw = pool.submit(raw_call, gw.url, dialect, sid, stream)
            exc = sdk_failure(gw.url, dialect, sid, stream)
            check_raw(raw.result(), dialect, stream, expect)
        check_sdk_error(dialect, stream, exc, expect)
    else:
        r = raw_call(gw.url, dialect, sid, stream)
        check_raw(r, dialect, stream, worded(expect, dialect, backend))
        exc = sdk_failure(gw.url, dialect, sid, stream)
        check_sdk_error(dialect, stream, exc, worded(expect, dialect, backend))

    failed = failures(gw, sid)
    assert sorted(f["seq"] for f in failed) == [0, 1]
    assert {(f["dialect"], f["status"], f["kind"]) for f in failed} == {(dialect, expect.status, expect.kind)}
    assert completions(gw, sid) == []
    return sid


def worded(expect: Expect, dialect: str, backend: FakeInferenceServer | None) -> Expect:
    """For an overflow, the exact wording for the prompt the server just refused; else `expect`."""
    if expect.kind != "context_length":
        return expect
    assert backend is not None
    n = len(prompt_ids(backend.requests[-1]))
    return Expect(expect.kind, expect.status, overflow_text(dialect, n))


def still_serves(gw: Gateway, dialect: str, stream: bool, failed_sid: str) -> None:
    """A healthy call on another session, then on the failed one: both answer and are recorded."""
    other = new_session(gw)
    assert sdk_call(gw.url, dialect, other, stream) == SAID
    assert sdk_call(gw.url, dialect, failed_sid, stream) == SAID
    (rec,) = completions(gw, other)
    assert rec.seq == 0 and rec.trainable and failures(gw, other) == []
    (rec,) = completions(gw, failed_sid)
    assert rec.seq == 2 and rec.trainable and len(failures(gw, failed_sid)) == 2


STREAM = pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
DIALECT = pytest.mark.parametrize("dialect", DIALECTS)

# fault name -> (settings of the fake, what the harness must see)
FAULTS: dict[str, tuple[dict[str, Any], Expect]] = {
    "garbage": ({"garbage": True}, Expect("upstream_error", 502, "not JSON")),
    "http500": ({"status": 500}, Expect("upstream_error", 502, "HTTP 500")),
    "http503": ({"status": 503}, Expect("upstream_error", 502, "HTTP 503")),
    "http429": ({"status": 429}, Expect("rate_limit", 429, "too many requests")),
    "overflow": ({"max_model_len": MAX_LEN}, Expect("context_length", 400, "")),
}


# ---- the faults --------------------------------------------------------------------------------------


@DIALECT
@STREAM
@pytest.mark.parametrize("fault", list(FAULTS))
def test_backend_fault(
    gw: Gateway, backend: FakeInferenceServer, dialect: str, stream: bool, fault: str
) -> None:
    settings, expect = FAULTS[fault]
    backend.set(**settings)
    sid = meet_fault(gw, backend, dialect, stream, expect)
    assert backend.calls == 2  # no retry of a 4xx/5xx by the gateway (retries=0) nor by the SDKs
    backend.reset()
    still_serves(gw, dialect, stream, sid)


@DIALECT
@STREAM
def test_backend_down_then_back(
    backend: FakeInferenceServer, tmp_path: Path, dialect: str, stream: bool
) -> None:
    port = free_port()  # nothing listens here: every connection is refused
    gw = start_gateway(f"http://127.0.0.1:{port}", tmp_path)
    try:
        sid = meet_fault(gw, None, dialect, stream, Expect("upstream_error", 502, "unreachable"))
        srv = ServerThread(backend, port=port).start()  # the inference server comes (back) up
        try:
            still_serves(gw, dialect, stream, sid)
        finally:
            srv.stop()
    finally:
        gw.server.stop()


@DIALECT
@STREAM
def test_backend_slow(slow_gw: Gateway, backend: FakeInferenceServer, dialect: str, stream: bool) -> None:
    backend.set(delay_s=0.8)
    expect = Expect("timeout", 504, "did not answer within 0.5 s")
    sid = meet_fault(slow_gw, backend, dialect, stream, expect, concurrently=True)
    backend.set(delay_s=0.0)
    still_serves(slow_gw, dialect, stream, sid)


@DIALECT
@STREAM
def test_backend_without_token_ids_answers_but_is_not_trainable(
    gw: Gateway, backend: FakeInferenceServer, dialect: str, stream: bool
) -> None:
    backend.set(no_token_ids=True)
    sid = new_session(gw)
    r = raw_call(gw.url, dialect, sid, stream)
    assert r.status_code == 200
    if stream:
        assert r.headers["content-type"].startswith("text/event-stream") and r.text.count("data:") > 3
    assert sdk_call(gw.url, dialect, sid, stream) == SAID
    recs = completions(gw, sid)
    assert [rec.seq for rec in recs] == [0, 1] and failures(gw, sid) == []
    for rec in recs:
        assert rec.dialect == dialect and not rec.trainable
        assert rec.prompt_ids is None and rec.response_ids is None and rec.response_logprobs is None
        assert rec.flags == (FLAG_NO_PROMPT_IDS, FLAG_NO_RESPONSE_IDS, FLAG_NO_LOGPROBS, FLAG_NOT_TRAINABLE)
        assert rec.response_message["content"] == SAID
        assert rec.usage["prompt_tokens"] > 0  # usage still comes from the server's own count


def test_gemini_json_array_stream_failure_is_json(gw: Gateway, backend: FakeInferenceServer) -> None:
    """`:streamGenerateContent` without `alt=sse` answers one JSON array; its failure must be JSON too."""
    backend.set(status=503)
    sid = new_session(gw)
    r = raw_call(gw.url, "gemini", sid, stream=True, gemini_format="json-array")
    assert r.headers["content-type"].startswith("application/json"), r.headers["content-type"]
    body = r.json()
    envelope = body[0] if isinstance(body, list) else body
    check_envelope("gemini", envelope, Expect("upstream_error", 502, "HTTP 503"))
    assert r.status_code == 502
