"""The gateway over real HTTP: sessions, keys, capture, durability, limits, probes and the control plane."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from polar.auth import bearer, new_token
from polar.gateway.control import routes as control_routes
from polar.store.sqlite import SQLiteStore
from tests.conftest import SERVED_MODEL, FakeBackend, Gateway, start_gateway
from tests.fakes.server import free_port

TOKEN = new_token()

CHAT_BODY = {"model": "anything", "messages": [{"role": "user", "content": "hello"}]}
ANTHROPIC_BODY = {"model": "claude", "max_tokens": 64, "messages": [{"role": "user", "content": "hello"}]}
RESPONSES_BODY = {"model": "gpt", "input": "hello"}
GEMINI_BODY = {"contents": [{"role": "user", "parts": [{"text": "hello"}]}]}

ROUTES = {
    "chat": ("/v1/chat/completions", CHAT_BODY),
    "responses": ("/v1/responses", RESPONSES_BODY),
    "anthropic": ("/v1/messages", ANTHROPIC_BODY),
    "gemini": ("/v1beta/models/gem:generateContent", GEMINI_BODY),
    # API version v1: the google-genai SDK's default since 3.x (Gemini CLI's SDK still calls v1beta)
    "gemini-v1": ("/v1/models/gem:generateContent", GEMINI_BODY),
}


def error_message(dialect: str, body: dict) -> str:
    """The message of an error envelope, asserting it has the dialect's shape."""
    if dialect == "anthropic":
        assert body["type"] == "error"
        return str(body["error"]["message"])
    if dialect.startswith("gemini"):
        assert isinstance(body["error"]["code"], int) and body["error"]["status"]
        return str(body["error"]["message"])
    assert "type" in body["error"]
    return str(body["error"]["message"])


def post(gw: Gateway, dialect: str, key: str | None, body: object = None, **kw: object) -> httpx.Response:
    path, default = ROUTES[dialect]
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if dialect == "anthropic":
        headers["anthropic-version"] = "2023-06-01"
    return httpx.post(
        gw.url + path, json=default if body is None else body, headers=headers, timeout=30, **kw
    )


def test_sessions_lifecycle(gateway: Gateway) -> None:
    sid = gateway.new_session(task_id="t-1", metadata={"group": "g"})
    r = gateway.control("GET", f"/sessions/{sid}")
    assert r.status_code == 200
    info = r.json()
    assert info["status"] == "open" and info["metadata"] == {"task_id": "t-1", "group": "g"}
    assert gateway.control("POST", "/sessions").status_code == 201  # body is optional
    assert gateway.control("DELETE", f"/sessions/{sid}").json()["status"] == "closed"
    assert gateway.control("GET", f"/sessions/{sid}").json()["status"] == "closed"
    assert gateway.control("GET", "/sessions/nope").status_code == 404
    assert gateway.control("DELETE", "/sessions/nope").status_code == 404


def test_session_ids_are_single_use(gateway: Gateway) -> None:
    r = gateway.control("POST", "/sessions", json={"session_id": "fixed-session-1"})
    assert r.status_code == 201 and r.json()["session_id"] == "fixed-session-1"
    r = gateway.control("POST", "/sessions", json={"session_id": "fixed-session-1"})
    assert r.status_code == 409
    for bad in (["x"], {"session_id": 5}, {"metadata": []}):
        assert gateway.control("POST", "/sessions", json=bad).status_code == 400
    r = gateway.control("POST", "/sessions", content=b"{nope")
    assert r.status_code == 400


@pytest.mark.parametrize("dialect", list(ROUTES))
def test_unknown_missing_and_closed_keys_get_401_in_dialect(gateway: Gateway, dialect: str) -> None:
    for key in (None, "not-a-session"):
        r = post(gateway, dialect, key)
        assert r.status_code == 401
        assert "key" in error_message(dialect, r.json()).lower()
    sid = gateway.new_session()
    gateway.control("DELETE", f"/sessions/{sid}")
    r = post(gateway, dialect, sid)
    assert r.status_code == 401 and "closed" in error_message(dialect, r.json())


@pytest.mark.parametrize("dialect", list(ROUTES))
def test_malformed_json_is_400_in_dialect(gateway: Gateway, dialect: str) -> None:
    sid = gateway.new_session()
    path, _ = ROUTES[dialect]
    for raw in (b"{not json", b"", b"[1, 2]", b'"text"'):
        r = httpx.post(gateway.url + path, content=raw, headers={"authorization": f"Bearer {sid}"})
        assert r.status_code == 400, (raw, r.text)
        assert error_message(dialect, r.json())
    # Failed calls are recorded as failures, never as completions.
    assert gateway.completions(sid) == []
    failures = gateway.control("GET", f"/sessions/{sid}/failures").json()["failures"]
    assert len(failures) == 4 and {f["status"] for f in failures} == {400}


@pytest.mark.parametrize("key_style", ["bearer", "x-api-key", "x-goog-api-key", "query"])
def test_every_key_placement_is_accepted(gateway: Gateway, key_style: str) -> None:
    sid = gateway.new_session()
    headers, params = {}, {}
    if key_style == "bearer":
        headers["authorization"] = f"Bearer {sid}"
    elif key_style == "query":
        params["key"] = sid
    else:
        headers[key_style] = sid
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=CHAT_BODY, headers=headers, params=params)
    assert r.status_code == 200, r.text
    assert len(gateway.completions(sid)) == 1


def test_call_is_captured_exactly_and_committed_before_the_answer(
    gateway: Gateway, fake_backend: FakeBackend
) -> None:
    sid = gateway.new_session()
    r = post(gateway, "chat", sid)
    assert r.status_code == 200
    # Read the SQLite file directly, right after the answer: the record is already there.
    with SQLiteStore(gateway.store_path) as store:
        (rec,) = store.completions(sid)
    upstream = fake_backend.app.requests[-1]
    assert upstream["model"] == SERVED_MODEL and upstream["return_token_ids"] is True
    assert rec.upstream_request == upstream
    assert rec.request == CHAT_BODY and rec.model_requested == "anything" and rec.model_served == SERVED_MODEL
    assert rec.prompt_ids and rec.response_ids and len(rec.response_ids) == len(rec.response_logprobs or [])
    assert rec.trainable and rec.flags == ()
    assert r.json()["model"] == "anything"  # the harness sees the name it asked for
    assert rec.upstream_latency_ms > 0 and rec.gateway_overhead_ms > 0
    assert gateway.completions(sid) == [rec]


def test_record_survives_kill_right_after_response(fake_backend: FakeBackend, tmp_path: Path) -> None:
    """A response the harness saw always has its record, even if the gateway is SIGKILLed at once."""
    port, control_port = free_port(), free_port()
    store = tmp_path / "kill.db"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "polar",
            "gateway",
            "--backend",
            fake_backend.url,
            "--model",
            "m",
            "--port",
            str(port),
            "--control-port",
            str(control_port),
            "--store",
            str(store),
            "--log-level",
            "warning",
        ],
        env={**os.environ, "PYTHONUNBUFFERED": "1", "POLAR_TOKEN": TOKEN},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "gateway did not start"
            time.sleep(0.1)
        sid = httpx.post(f"http://127.0.0.1:{control_port}/sessions", headers=bearer(TOKEN)).json()[
            "session_id"
        ]
        r = httpx.post(
            url + "/v1/chat/completions", json=CHAT_BODY, headers={"authorization": f"Bearer {sid}"}
        )
        assert r.status_code == 200
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    with SQLiteStore(store) as s:
        (rec,) = s.completions(sid)
    assert rec.seq == 0 and rec.trainable
    assert rec.response_message["content"] == r.json()["choices"][0]["message"]["content"]


def test_body_limit_is_413_in_dialect(fake_backend: FakeBackend, tmp_path: Path) -> None:
    gw = start_gateway(fake_backend.url, tmp_path, max_body_bytes=2048)
    try:
        sid = gw.new_session()
        for dialect in ROUTES:
            body = {**ROUTES[dialect][1], "padding": "x" * 5000}
            r = post(gw, dialect, sid, body)
            assert r.status_code == 413, r.text
            assert "limit" in error_message(dialect, r.json())
    finally:
        gw.server.stop()


def test_control_plane_is_a_separate_listener_behind_the_token(
    fake_backend: FakeBackend, tmp_path: Path
) -> None:
    gw = start_gateway(fake_backend.url, tmp_path, control_token="sekrit-sekrit-sekrit")
    try:
        control = f"{gw.control_url}/sessions"
        assert httpx.post(control).status_code == 401
        r = httpx.post(control, headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401 and "wrong control token" in r.json()["error"]["message"]
        sid = gw.new_session()  # uses the token
        assert httpx.get(f"{control}/{sid}/completions").status_code == 401
        r = httpx.get(f"{control}/{sid}/completions", headers={"authorization": f"Bearer {sid}"})
        assert r.status_code == 401  # a harness's key does not open the control plane
        assert post(gw, "chat", sid).status_code == 200  # the model API works with the session key
        # Every route of the control app (new ones included, read from the app itself): the token or 401 on
        # the control listener, and absent from the model API whatever the credentials.
        every = [
            (method, route.path.replace("{session_id}", sid) + query)
            for route in control_routes
            if route.path != "/health"
            for method in sorted(route.methods or ()) if method != "HEAD"
            for query in ("", "?policy_version=7")
        ]  # fmt: skip
        assert {"/admin/backends", "/backends", "/metrics", "/admin/resume?policy_version=7"} <= {
            p for _, p in every
        }
        for method, path in every:
            for headers in ({}, bearer("wrong"), bearer(sid)):
                r = httpx.request(method, f"{gw.control_url}{path}", headers=headers, json={})
                assert r.status_code == 401, (method, path, headers, r.status_code)
            for headers in ({}, bearer("sekrit-sekrit-sekrit"), bearer(sid)):
                r = httpx.request(method, f"{gw.url}{path}", headers=headers, json={})
                assert r.status_code in (404, 405), (method, path, r.status_code)
        assert gw.control("GET", "/health").status_code == 200
        assert gw.control("GET", f"/sessions/{sid}").json()["status"] == "open"  # nothing was changed
        assert gw.control("GET", "/health").json()["paused"] is False
    finally:
        gw.server.stop()


def test_probes(gateway: Gateway) -> None:
    assert httpx.head(gateway.url + "/").status_code == 200
    assert httpx.get(gateway.url + "/health").json() == {"status": "ok", "model": SERVED_MODEL}
    assert gateway.control("GET", "/health").json()["paused"] is False
    models = httpx.get(gateway.url + "/v1/models").json()
    assert models["data"][0]["id"] == SERVED_MODEL
    assert httpx.get(gateway.url + "/v1/models/x").json()["id"] == "x"
    gm = httpx.get(gateway.url + "/v1beta/models").json()
    assert gm["models"][0]["name"] == f"models/{SERVED_MODEL}"
    assert httpx.get(gateway.url + "/v1beta/models/gem").json()["name"] == "models/gem"


@pytest.mark.parametrize(
    ("how", "headers", "params"),
    [
        ("x-goog-api-key", {"x-goog-api-key": "k"}, {}),
        ("x-goog-api-client", {"x-goog-api-client": "google-genai-sdk/3.6.1 gl-python/3.11"}, {}),
        ("?key=", {}, {"key": "k"}),
    ],
    ids=["api-key-header", "client-header", "query-key"],
)
def test_gemini_model_listing_at_v1(gateway: Gateway, how: str, headers: dict, params: dict) -> None:
    """`/v1/models` is both OpenAI's listing and Gemini's (API version v1): a Gemini client gets Gemini's."""
    gm = httpx.get(gateway.url + "/v1/models", headers=headers, params=params).json()
    assert gm["models"][0]["name"] == f"models/{SERVED_MODEL}", how
    assert (
        httpx.get(gateway.url + "/v1/models/gem", headers=headers, params=params).json()["name"]
        == "models/gem"
    )
    # OpenAI and Anthropic clients, which send none of those, still get theirs
    for plain in ({}, {"authorization": "Bearer k"}, {"x-api-key": "k", "anthropic-version": "2023-06-01"}):
        assert httpx.get(gateway.url + "/v1/models", headers=plain).json()["data"][0]["id"] == SERVED_MODEL
        assert (
            httpx.get(gateway.url + "/v1/models/Qwen/Qwen3-8B", headers=plain).json()["id"] == "Qwen/Qwen3-8B"
        )


def test_unknown_routes_and_methods_answer_in_dialect(gateway: Gateway) -> None:
    r = httpx.post(gateway.url + "/v1/nothing", json={})
    assert r.status_code == 404 and error_message("chat", r.json())
    r = httpx.post(gateway.url + "/v1/messages/nothing", json={}, headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 404 and error_message("anthropic", r.json())
    for version in ("v1beta", "v1"):
        r = httpx.post(f"{gateway.url}/{version}/models/gem:explode", json={})
        assert r.status_code == 404 and error_message("gemini", r.json())
        r = httpx.post(f"{gateway.url}/{version}/models/gem:countTokens", content=b"{", params={"key": "x"})
        assert r.status_code == 401 and error_message("gemini", r.json())
    r = httpx.get(gateway.url + "/v1/chat/completions")
    assert r.status_code == 405 and error_message("chat", r.json())


def test_pause_drains_and_resume_admits(gateway: Gateway, fake_backend: FakeBackend) -> None:
    sid = gateway.new_session()

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            fake_backend.app.delay_s = 0.5
            slow = asyncio.create_task(
                client.post(
                    gateway.url + "/v1/chat/completions",
                    json=CHAT_BODY,
                    headers={"authorization": f"Bearer {sid}"},
                )
            )
            await asyncio.sleep(0.2)
            control = httpx.AsyncClient(base_url=gateway.control_url, headers=bearer(gateway.control_token))
            paused = (await control.post("/admin/pause", params={"timeout": 10})).json()
            assert paused == {"paused": True, "drained": True, "in_flight": 0}
            # The generation in flight finished upstream before the drain returned; its answer follows.
            assert (await asyncio.wait_for(slow, 5)).status_code == 200
            fake_backend.app.delay_s = 0.0
            blocked = asyncio.create_task(
                client.post(
                    gateway.url + "/v1/chat/completions",
                    json=CHAT_BODY,
                    headers={"authorization": f"Bearer {sid}"},
                )
            )
            await asyncio.sleep(0.3)
            assert not blocked.done()
            assert (await control.get("/health")).json()["paused"] is True
            await control.post("/admin/resume")
            assert (await blocked).status_code == 200
            await control.aclose()

    asyncio.run(scenario())
    assert len(gateway.completions(sid)) == 2
    r = gateway.control("POST", "/admin/pause", params={"timeout": "soon"})
    assert r.status_code == 400
