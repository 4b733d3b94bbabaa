"""Whatever a client or node sends, the rollout server answers a 4xx naming the problem, never a 500."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar.serving import ServerThread
from tests.json_strategies import json_value
from tests.server_support import start_server

VALID: dict[str, dict[str, Any]] = {
    "/rollout/task/submit": {
        "task_id": "seed",
        "instruction": "x",
        "num_samples": 2,
        "runtime": {"backend": "local", "prepare": [{"type": "exec", "cmd": "true"}]},
        "agent": {"harness": "shell", "settings": {"command": "true"}},
        "evaluator": {"strategy": "session_completed"},
        "early_stop_min_usable": 1,
    },
    "/callbacks/session_result": {"session_id": "polar-x", "task_id": "seed", "status": "COMPLETED"},
    "/nodes/register": {"node_id": "n1", "url": "http://127.0.0.1:9", "capacity": 1},
    "/nodes/n1/heartbeat": {"node_id": "n1", "active": 0, "capacity": 1, "by_stage": {}},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    srv = start_server(tmp_path_factory.mktemp("fuzz") / "server.db")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as c:
        yield c


def _check(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert r.json()["error"]["message"]


def _mutate(base: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    out = dict(base)
    out[key] = value
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(sorted(VALID)), body=json_value)
def test_random_bodies(server: ServerThread, http: httpx.Client, route: str, body: Any) -> None:
    _check(http.post(f"{server.url}{route}", json=body))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(sorted(VALID)), data=st.data())
def test_one_field_replaced(
    server: ServerThread, http: httpx.Client, route: str, data: st.DataObject
) -> None:
    base = VALID[route]
    key = data.draw(st.sampled_from(sorted(base)))
    body = _mutate(base, key, data.draw(json_value))
    if route == "/rollout/task/submit":
        body["task_id"] = data.draw(st.text(min_size=1, max_size=30))  # fresh ids: most are accepted
    _check(http.post(f"{server.url}{route}", json=body))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=64), query=st.text(max_size=20))
def test_raw_bytes_and_queries(server: ServerThread, http: httpx.Client, raw: bytes, query: str) -> None:
    _check(http.post(f"{server.url}/rollout/task/submit", content=raw))
    _check(
        http.get(f"{server.url}/rollout/results", params={"task": query or "x", "after": query, "wait": 0})
    )
    _check(http.get(f"{server.url}/rollout/task/{quote(query, safe='') or 'x'}", params={"results": query}))
