"""Helpers for the rollout server tests: a real server on loopback with fast clocks, and task builders."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from polar.netguard import OutboundPolicy
from polar.rollout.server import ServerConfig, create_app
from polar.rollout.server.callbacks import RetryPolicy
from polar.serving import ServerThread

FAST = {
    "tick_s": 0.05,
    "probe_interval_s": 0.05,
    "refuse_cooldown_s": 0.05,
    "node_timeout_s": 2.0,
    "callbacks": RetryPolicy(attempts=4, backoff_s=0.02, backoff_max_s=0.1, timeout_s=2.0),
    # Test receivers (callback endpoints, frozen models) listen on loopback, which an operator must allow.
    "outbound": OutboundPolicy(allow=("127.0.0.1",)),
}


def start_server(db_path: Path, port: int | None = None, **overrides: Any) -> ServerThread:
    config = ServerConfig(db_path=db_path, **{**FAST, **overrides})
    return ServerThread(create_app(config), port=port).start()


def task(task_id: str = "t1", **fields: Any) -> dict[str, Any]:
    return {"task_id": task_id, "instruction": "fix the failing test", **fields}


def wait_until(check: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll until `check()` is truthy (no timing assertion: the timeout only bounds a hung test)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def result(session_id: str, task_id: str, status: str = "COMPLETED", **fields: Any) -> dict[str, Any]:
    return {"session_id": session_id, "task_id": task_id, "status": status, **fields}


def post_result(client: httpx.Client, url: str, body: dict[str, Any]) -> httpx.Response:
    return client.post(f"{url}/callbacks/session_result", json=body)
