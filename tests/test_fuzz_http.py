"""Property tests through the HTTP surface: whatever a client sends, no dialect answers 500 or crashes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import Gateway, start_gateway
from tests.fakes.server import serve
from tests.json_strategies import json_value

VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": "m",
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "out"},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "max_tokens": 16,
        "stream": False,
    },
    "/v1/responses": {
        "model": "m",
        "instructions": "be brief",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "stream": False,
    },
    "/v1/messages": {
        "model": "m",
        "max_tokens": 16,
        "system": [{"type": "text", "text": "sys"}],
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]},
        ],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    },
    "/v1beta/models/m:generateContent": {
        "contents": [
            {"role": "user", "parts": [{"text": "hi"}]},
            {"role": "model", "parts": [{"functionCall": {"name": "f", "args": {}}}]},
            {"role": "user", "parts": [{"functionResponse": {"name": "f", "response": {"r": 1}}}]},
        ],
        "tools": [{"functionDeclarations": [{"name": "f", "parameters": {"type": "OBJECT"}}]}],
        "generationConfig": {"maxOutputTokens": 16},
    },
}
PATHS = [*VALID, "/v1/messages/count_tokens", "/v1beta/models/m:streamGenerateContent"]


@pytest.fixture(scope="module")
def fuzz_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, str]]:
    from tests.fakes.fake_vllm import make_fake_backend

    tmp: Path = tmp_path_factory.mktemp("fuzz")
    with serve(make_fake_backend("vllm")) as backend:
        gw = start_gateway(backend.url, tmp)
        try:
            yield gw, gw.new_session()
        finally:
            gw.server.stop()


def mutate(body: dict[str, Any], data: st.DataObject) -> Any:
    """A valid body with one part replaced, deleted, or nested somewhere it does not belong."""
    body = dict(body)
    action = data.draw(st.sampled_from(["replace", "delete", "deep", "whole"]))
    key = data.draw(st.sampled_from(sorted(body)))
    if action == "replace":
        body[key] = data.draw(json_value)
    elif action == "delete":
        del body[key]
    elif action == "deep" and isinstance(body[key], list) and body[key]:
        items = list(body[key])
        i = data.draw(st.integers(0, len(items) - 1))
        item = items[i]
        if isinstance(item, dict) and item:
            item = dict(item)
            item[data.draw(st.sampled_from(sorted(item)))] = data.draw(json_value)
        else:
            item = data.draw(json_value)
        items[i] = item
        body[key] = items
    else:
        return data.draw(json_value)
    return body


def check(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        body = response.json()
        assert "error" in body, body


@given(data=st.data())
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_mutated_bodies_never_500(fuzz_gateway: tuple[Gateway, str], data: st.DataObject) -> None:
    gw, sid = fuzz_gateway
    path = data.draw(st.sampled_from(list(VALID)))
    body = mutate(VALID[path], data)
    stream = data.draw(st.booleans())
    if isinstance(body, dict) and stream and "v1beta" not in path:
        body["stream"] = True
    r = httpx.post(gw.url + path, json=body, headers={"authorization": f"Bearer {sid}"}, timeout=30)
    check(r)


@given(path=st.sampled_from(PATHS), raw=st.binary(max_size=200) | json_value.map(lambda v: repr(v).encode()))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_garbage_bytes_never_500(fuzz_gateway: tuple[Gateway, str], path: str, raw: bytes) -> None:
    gw, sid = fuzz_gateway
    r = httpx.post(gw.url + path, content=raw, headers={"authorization": f"Bearer {sid}"}, timeout=30)
    check(r)
    assert 400 <= r.status_code < 500


def test_valid_bodies_succeed(fuzz_gateway: tuple[Gateway, str]) -> None:
    """The seeds of the fuzzers are themselves accepted (so the fuzzers start from valid ground)."""
    gw, sid = fuzz_gateway
    for path, body in VALID.items():
        r = httpx.post(gw.url + path, json=body, headers={"authorization": f"Bearer {sid}"}, timeout=30)
        assert r.status_code == 200, (path, r.text)
