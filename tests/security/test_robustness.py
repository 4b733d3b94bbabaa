"""The robustness findings of issue #10 (point 7), each reproduced as it was measured on main.

The agent under training is untrusted: whatever it (or its harness) sends must get a clear 4xx in the
caller's dialect naming what is wrong, never a 500 or a hang, and nothing acknowledged may be lost. Every
server here is real, on loopback; malformed HTTP goes through a plain socket.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from click.testing import CliRunner
from google import genai
from google.genai import errors as genai_errors
from google.genai import types as genai_types
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from polar.cli import main
from polar.gateway.answers import check_nesting
from polar.gateway.dialects.anthropic.dialect import AnthropicDialect
from polar.gateway.dialects.gemini.dialect import GeminiDialect
from polar.gateway.dialects.responses.dialect import ResponsesDialect
from polar.gateway.errors import GatewayError
from polar.gateway.recorder import request_summary
from polar.gateway.signatures import ReasoningCodec
from polar.http_server import http_protocol
from polar.limits import MAX_JSON_DEPTH
from polar.serving import EmbeddedServer, ServerThread
from polar.store.records import CompletionRecord, FailureRecord
from polar.store.sqlite import SQLiteStore
from tests.conftest import FakeBackend, Gateway, start_gateway
from tests.json_strategies import json_value
from tests.node_support import control_client, fake_policy, running_node, shell_task, spec
from tests.server_support import AUTH, TOKEN, start_server, task

DATA = Path(__file__).resolve().parent.parent / "data"
USER = [{"role": "user", "content": "hi"}]
GEMINI_TOOL_TURNS = [
    {"role": "user", "parts": [{"text": "hi"}]},
    {"role": "model", "parts": [{"functionCall": {"name": "f", "args": {}}}]},
]


def deep_json(depth: int) -> str:
    """`{"a":{"a":...1...}}`, `depth` objects deep, written by hand: json/orjson/httpx cannot encode it."""
    return '{"a":' * depth + "1" + "}" * depth


def body_with(template: dict[str, Any], marker: str, deep: str) -> bytes:
    """`template` serialized with the string `marker` replaced by the raw JSON `deep`."""
    return orjson.dumps(template).replace(orjson.dumps(marker), deep.encode())


def gemini_body(response: Any) -> dict[str, Any]:
    turn = {"role": "user", "parts": [{"functionResponse": {"name": "f", "response": response}}]}
    return {"contents": [*GEMINI_TOOL_TURNS, turn]}


def failures(gw: Gateway, sid: str) -> list[FailureRecord]:
    with SQLiteStore(gw.store_path) as store:
        return store.failures(sid)


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def raw_request(url: str, request: bytes) -> bytes:
    """Send raw bytes and read until the server closes (the timeout only bounds a hung test)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        return read_until_closed(sock)


def responses(raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Every HTTP/1.1 response in `raw` (status, headers, body); bodies are framed by Content-Length."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        size = int(headers["content-length"])
        out.append((status, headers, rest[:size]))
        raw = rest[size:]
    return out


# -- 1. deep nesting: refused at parse, before any generation, and the failure is stored ---------------------
@pytest.mark.parametrize("depth", [255, 300, 1023])
def test_deep_metadata_is_a_400_before_generation_and_its_failure_is_stored(
    gateway: Gateway, fake_backend: FakeBackend, depth: int
) -> None:
    """Was: parsed, generated, then 503 "retry" (orjson cannot store past 254 levels), failure lost too."""
    sid = gateway.new_session()
    before = fake_backend.app.calls
    raw = body_with({"model": "m", "messages": USER, "metadata": "DEEP"}, "DEEP", deep_json(depth))
    r = httpx.post(
        f"{gateway.url}/v1/chat/completions", content=raw, headers={"authorization": f"Bearer {sid}"}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert f"deeper than {MAX_JSON_DEPTH} levels" in error["message"]
    assert error["type"] == "invalid_request_error" and error["param"].startswith("metadata.a")
    assert fake_backend.app.calls == before  # refused before any generation
    (failure,) = failures(gateway, sid)
    assert failure.status == 400 and failure.kind == "invalid_request"
    # The body itself cannot be stored; a summary of it is, so the failure is not lost.
    assert failure.request is not None
    summary = failure.request["polar_unstored_body"]
    assert summary["keys"] == ["model", "messages", "metadata"] and "128" in summary["reason"]


def test_a_260_deep_gemini_function_response_is_a_400_on_a_kept_connection(gateway: Gateway) -> None:
    """Was: a 500 that closed the keep-alive connection."""
    sid = gateway.new_session()
    host, port = gateway.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    headers = {"x-goog-api-key": sid, "content-type": "application/json"}
    deep = body_with(gemini_body("DEEP"), "DEEP", deep_json(260))
    conn.request("POST", "/v1beta/models/gemini-2.5-pro:generateContent", deep, headers)
    r = conn.getresponse()
    error = json.loads(r.read())["error"]
    assert r.status == 400 and error["status"] == "INVALID_ARGUMENT"
    assert "contents[2].parts[0].functionResponse.response" in error["message"]
    assert not r.will_close
    sock = conn.sock
    conn.request(
        "POST", "/v1beta/models/gemini-2.5-pro:generateContent", orjson.dumps(gemini_body({})), headers
    )
    r = conn.getresponse()
    assert r.status == 200, r.read()
    assert conn.sock is sock  # the same connection served the next call
    conn.close()


def test_rollout_submit_refuses_deep_metadata_and_settings_naming_the_field(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server.db")
    try:
        for field, template in (
            ("metadata", task("deep-meta", metadata="DEEP")),
            ("agent.settings", task("deep-settings", agent={"harness": "shell", "settings": "DEEP"})),
        ):
            raw = body_with(template, "DEEP", deep_json(300))
            r = httpx.post(f"{server.url}/rollout/task/submit", content=raw, headers=AUTH)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"].startswith(field) and f"deeper than {MAX_JSON_DEPTH}" in error["message"]
        assert (
            httpx.get(f"{server.url}/rollout/task/deep-meta", headers=AUTH).status_code == 404
        )  # not stored
    finally:
        server.stop()


async def test_the_node_refuses_a_deep_session_spec_naming_the_field(tmp_path: Path) -> None:
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node, control_client(node) as client:
            body = spec(shell_task("true", metadata={"k": "DEEP"}), "sess-deep").model_dump(mode="json")
            r = await client.post("/node/sessions", content=body_with(body, "DEEP", deep_json(300)))
            assert r.status_code == 422, r.text
            error = r.json()["error"]
            assert error["field"].startswith("task.metadata.k") and str(MAX_JSON_DEPTH) in error["message"]
            assert node.state("sess-deep") is None


@st.composite
def nested_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A request-like object with one chain of objects and arrays up to 300 deep somewhere in it, often
    right around the limit."""
    value = draw(json_value)
    depth = draw(st.integers(MAX_JSON_DEPTH - 8, MAX_JSON_DEPTH + 4) | st.integers(0, 300))
    for bit in draw(st.binary(min_size=depth, max_size=depth)):
        value = [value] if bit & 1 else {("a", "properties", "items")[bit % 3]: value}
    body: dict[str, Any] = draw(st.dictionaries(st.text(max_size=8), json_value, max_size=4))
    body[draw(st.sampled_from(["metadata", "tools", "messages"]))] = value
    return body


@given(body=nested_bodies())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_every_accepted_body_is_stored_and_read_back(body: dict[str, Any]) -> None:
    """Whatever the nesting check accepts can be stored as a record (request, upstream body and tools each
    wrap it further) and served back; a refused body still leaves a stored failure with its summary."""
    try:
        check_nesting(body)
        accepted = True
    except GatewayError:
        accepted = False
    event("accepted" if accepted else "refused")
    with tempfile.TemporaryDirectory() as tmp, SQLiteStore(Path(tmp) / "s.db") as store:
        if accepted:
            record = CompletionRecord(
                session_id="s",
                seq=0,
                completion_id="c",
                dialect="chat",
                created_at=1.0,
                request=body,
                upstream_request={"messages": USER, "metadata": body},
                prompt_ids=[1, 2],
                response_ids=[3],
                response_logprobs=[-0.5],
                finish_reason="stop",
                response_message={"role": "assistant", "content": "x"},
                tools=[{"type": "function", "function": {"name": "f", "parameters": body}}],
                usage={"prompt_tokens": 2, "completion_tokens": 1},
                model_requested="m",
                model_served="m",
            )
            store.write(lambda w: w.add_completion(record))
            (back,) = store.completions("s")
            assert back == record
            orjson.dumps({"completions": [back.to_json()]})  # what the control plane serves
            request: dict[str, Any] = body
        else:
            request = request_summary(body, "too deep")
        failure = FailureRecord("s", 1, "chat", 1.0, 400, "invalid_request", "m", request)
        store.write(lambda w: w.add_failure(failure))
        assert store.failures("s") == [failure]


# -- 2. never a 500 ------------------------------------------------------------------------------------------
DEEP_EVERYWHERE: list[tuple[str, dict[str, Any], dict[str, str]]] = [
    ("/v1/chat/completions", {"model": "m", "messages": USER, "metadata": "DEEP"}, {}),
    ("/v1/responses", {"model": "m", "input": "hi", "metadata": "DEEP"}, {}),
    ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": USER, "metadata": "DEEP"}, {}),
    ("/v1/messages/count_tokens", {"model": "m", "messages": USER, "metadata": "DEEP"}, {}),
    ("/v1beta/models/g:generateContent", gemini_body("DEEP"), {}),
    ("/v1beta/models/g:streamGenerateContent?alt=sse", gemini_body("DEEP"), {}),
    ("/v1beta/models/g:streamGenerateContent", gemini_body("DEEP"), {}),
    ("/v1beta/models/g:countTokens", gemini_body("DEEP"), {}),
    (
        "/v1/messages",
        {"model": "m", "max_tokens": 8, "messages": USER, "tools": [{"name": "t", "input_schema": "DEEP"}]},
        {},
    ),
]


@pytest.mark.parametrize("depth", [260, 1024])
def test_deep_bodies_get_a_4xx_on_every_route(gateway: Gateway, depth: int) -> None:
    sid = gateway.new_session()
    headers = {"authorization": f"Bearer {sid}", "x-api-key": sid, "x-goog-api-key": sid}
    with httpx.Client(timeout=30) as client:
        for path, template, _ in DEEP_EVERYWHERE:
            raw = body_with(template, "DEEP", deep_json(depth))
            r = client.post(gateway.url + path, content=raw, headers=headers)
            assert r.status_code == 400, (path, r.status_code, r.text)
            assert "error" in r.json() and str(MAX_JSON_DEPTH) in r.text, (path, r.text)


# -- 3. a body that never arrives: a 408, not a hang ---------------------------------------------------------
@pytest.fixture
def slow_gateway(fake_backend: FakeBackend, tmp_path: Path) -> Iterator[Gateway]:
    gw = start_gateway(fake_backend.url, tmp_path, body_timeout_s=0.5)
    try:
        yield gw
    finally:
        gw.server.stop()


def short_body(path: str, headers: str = "") -> bytes:
    """A request whose Content-Length (100) promises more than the two bytes it sends."""
    return f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n{headers}\r\n{{}}".encode()


def test_a_content_length_larger_than_the_body_gets_a_408(slow_gateway: Gateway, tmp_path: Path) -> None:
    """Was: the request waited forever (no body read timeout)."""
    sid = slow_gateway.new_session()
    for path, auth, envelope in (
        ("/v1/chat/completions", f"authorization: Bearer {sid}\r\n", "error"),
        ("/v1/messages", f"x-api-key: {sid}\r\n", "type"),
    ):
        ((status, headers, body),) = responses(raw_request(slow_gateway.url, short_body(path, auth)))
        assert status == 408 and headers["connection"] == "close"
        error = orjson.loads(body)
        assert envelope in error and "did not arrive within 0.5 s" in error["error"]["message"]
        assert "2 bytes received of the 100 declared" in error["error"]["message"]
    assert [f.status for f in failures(slow_gateway, sid)] == [408, 408]
    server = start_server(tmp_path / "server.db", body_timeout_s=0.5)
    try:
        token = f"authorization: Bearer {TOKEN}\r\n"
        ((status, headers, body),) = responses(
            raw_request(server.url, short_body("/rollout/task/submit", token))
        )
        assert status == 408 and headers["connection"] == "close"
        assert "did not arrive" in orjson.loads(body)["error"]["message"]
    finally:
        server.stop()


# -- 4. malformed HTTP: a JSON error body, not uvicorn's plain text -----------------------------------------
def check_all_json(raw: bytes) -> None:
    answers = responses(raw)
    assert answers and answers[-1][0] == 400
    for _, headers, body in answers:
        assert headers["content-type"] == "application/json", (headers, body)
        assert "message" in orjson.loads(body)["error"]


def malformed(sid: str) -> list[bytes]:
    payload = orjson.dumps({"model": "m", "messages": USER})
    return [
        # Content-Length smaller than the body: the rest is read as a next request, which is no HTTP.
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n"
        + f"authorization: Bearer {sid}\r\n\r\n".encode()
        + payload,
        b"NOT HTTP AT ALL\r\n\r\n",
        b"GET / HTTP/1.1\r\nhost: x\r\nbad header line\r\n\r\n",
    ]


def test_malformed_http_gets_a_json_error(gateway: Gateway, tmp_path: Path) -> None:
    """Was: uvicorn's text/plain "Invalid HTTP request received." from every polar server."""
    for request in malformed(gateway.new_session()):
        check_all_json(raw_request(gateway.url, request))
    server = start_server(tmp_path / "server.db")
    try:
        for request in malformed("none"):
            check_all_json(raw_request(server.url, request))
    finally:
        server.stop()


async def test_the_node_server_answers_malformed_http_with_json() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

    server = EmbeddedServer(app, "127.0.0.1", 0)
    await server.start()
    try:
        for request in malformed("none"):
            check_all_json(await asyncio.to_thread(raw_request, server.url, request))
    finally:
        await server.stop()


def test_the_cli_servers_use_the_json_error_protocol(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    started: list[Any] = []
    monkeypatch.setattr("polar.cli.serve.serve_until_stopped", lambda servers, **kw: started.extend(servers))
    assert CliRunner().invoke(main, ["serve", "--db", str(tmp_path / "s.db")]).exit_code == 0
    assert [s.config["http"] for s in started] == [http_protocol()]
    assert started[0].config["timeout_graceful_shutdown"] == 3  # an open /events stream ends with it
    # `polar serve`, `gateway`, `node`, `serve-model` and in-process servers run EmbeddedServers.
    assert EmbeddedServer(None, "127.0.0.1", 0).config["http"] is http_protocol()
    assert all(s.config["http"] is http_protocol() for s in ServerThread(None, also=[None]).servers)


# -- 5. tool schemas are checked as JSON Schema at the edge --------------------------------------------------
BAD_SCHEMA = {"type": "object", "properties": {"path": {"type": "strng"}}}
GOOD_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}}
BAD_TOOLS: list[tuple[str, dict[str, Any], str]] = [
    (
        "/v1/chat/completions",
        {
            "model": "m",
            "messages": USER,
            "tools": [
                {"type": "function", "function": {"name": "ok", "parameters": GOOD_SCHEMA}},
                {"type": "function", "function": {"name": "Bash", "parameters": BAD_SCHEMA}},
            ],
        },
        "tools[1].function.parameters",
    ),
    (
        "/v1/responses",
        {
            "model": "m",
            "input": "hi",
            "tools": [
                {"type": "function", "name": "ok", "parameters": GOOD_SCHEMA},
                {"type": "function", "name": "Bash", "parameters": BAD_SCHEMA},
            ],
        },
        "tools[1].parameters",
    ),
    (
        "/v1/messages",
        {
            "model": "m",
            "max_tokens": 8,
            "messages": USER,
            "tools": [
                {"name": "ok", "input_schema": GOOD_SCHEMA},
                {"name": "Bash", "input_schema": {**GOOD_SCHEMA, "required": "path"}},
            ],
        },
        "tools[1].input_schema",
    ),
    (
        "/v1beta/models/g:generateContent",
        {
            "contents": [{"role": "user", "parts": [{"text": "hi"}]}],
            "tools": [
                {"functionDeclarations": [{"name": "ok", "parametersJsonSchema": GOOD_SCHEMA}]},
                {
                    "functionDeclarations": [
                        {"name": "ok2", "parameters": {"type": "OBJECT"}},
                        {"name": "Bash", "parametersJsonSchema": BAD_SCHEMA},
                    ]
                },
            ],
        },
        "tools[1].functionDeclarations[1].parametersJsonSchema",
    ),
    (
        "/v1beta/models/g:generateContent",
        {
            "contents": [{"role": "user", "parts": [{"text": "hi"}]}],
            "tools": [
                {"functionDeclarations": [{"name": "Bash", "parameters": {"type": "OBJECT", "minItems": -1}}]}
            ],
        },
        "tools[0].functionDeclarations[0].parameters",
    ),
]


def test_invalid_tool_schemas_are_400s_naming_the_tool(gateway: Gateway, fake_backend: FakeBackend) -> None:
    """Was: forwarded to the inference server, which failed on it: a 502 blaming the backend."""
    sid = gateway.new_session()
    headers = {"authorization": f"Bearer {sid}", "x-api-key": sid, "x-goog-api-key": sid}
    before = fake_backend.app.calls
    with httpx.Client(timeout=30) as client:
        for path, body, field in BAD_TOOLS:
            r = client.post(gateway.url + path, json=body, headers=headers)
            assert r.status_code == 400, (path, r.text)
            error = r.json()["error"]
            tool, rel = field.split(".", 1) if "functionDeclarations" not in field else field.rsplit(".", 1)
            assert f"{tool}.{rel} (tool 'Bash') is not a valid JSON Schema" in error["message"], error
            assert error.get("param", field) == field
        assert fake_backend.app.calls == before
        valid = {**BAD_TOOLS[0][1], "tools": BAD_TOOLS[0][1]["tools"][:1]}
        assert client.post(gateway.url + BAD_TOOLS[0][0], json=valid, headers=headers).status_code == 200


def real_requests() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in sorted(DATA.glob("*.json")):
        data = json.loads(path.read_text())
        if "_about" in data:  # a file holding several requests by name
            yield from ((f"{path.name}:{k}", v) for k, v in data.items() if isinstance(v, dict))
        else:
            yield path.name, data


def test_the_real_captured_requests_keep_their_tools() -> None:
    codec = ReasoningCodec(b"k" * 32)
    seen = 0
    for name, body in real_requests():
        if name.startswith("claude"):
            req = AnthropicDialect().parse(body, codec)
        elif name.startswith("codex"):
            req = ResponsesDialect().parse(body, codec)
        else:
            req = GeminiDialect().parse(body, codec, path_model="gemini-2.5-pro", path_stream=False)
        seen += len(req.tools or ())
    assert seen > 100


# -- 6. Gemini alt=sse errors: an SSE event the SDK raises on -----------------------------------------------
def test_gemini_sse_errors_are_sse_events_the_sdk_raises(gateway: Gateway, fake_backend: FakeBackend) -> None:
    """Was: a 200 with a bare JSON line, not an SSE event."""
    sid = gateway.new_session()
    fake_backend.app.set(status=500)
    body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
    r = httpx.post(
        f"{gateway.url}/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse",
        json=body,
        headers={"x-goog-api-key": sid},
    )
    assert r.status_code == 502 and r.headers["content-type"].startswith("text/event-stream")
    assert r.content.startswith(b"data: ") and r.content.endswith(b"\n\n")
    event = orjson.loads(r.content.removeprefix(b"data: "))
    assert event["error"]["code"] == 502 and event["error"]["status"] == "INTERNAL"
    client = genai.Client(
        api_key=sid, http_options=genai_types.HttpOptions(base_url=gateway.url, api_version="v1beta")
    )
    with pytest.raises(genai_errors.ServerError) as raised:
        for _ in client.models.generate_content_stream(model="gemini-2.5-pro", contents="hi"):
            pass
    assert raised.value.code == 502 and "inference server failed" in str(raised.value)
