"""kill -9 of a `polar gateway` under load loses no acknowledged record.

Every answer a harness received was committed before it was sent (group commit, `polar.store.writer`), so
killing the process in the middle of 16 concurrent streams of calls must leave a record for each 200 a
client saw, in every dialect. Runs the real CLI (two listeners, the control token) against the fake vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from polar.auth import bearer, new_token
from polar.store.sqlite import SQLiteStore
from tests.fakes.server import free_port

CALLS = {
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages": {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    "/v1beta/models/m:generateContent": {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]},
    # Streamed from the backend: acknowledged only by the stream's closing event, sent after the commit.
    "/v1/chat/completions?stream": {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
    },
    "/v1/messages?stream": {
        "model": "m",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
    },
}
# What ends a complete stream: Chat's [DONE] after a finish reason, Anthropic's message_stop.
CLOSING = {
    "/v1/chat/completions?stream": b'"finish_reason":"stop"',
    "/v1/messages?stream": b"event: message_stop",
}


def _wait_up(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, "the gateway did not start"
        time.sleep(0.1)


async def _load(url: str, keys: list[str], acked: dict[str, list[str]], stop: asyncio.Event) -> None:
    async def worker(i: int) -> None:
        key = keys[i % len(keys)]
        path = list(CALLS)[i % len(CALLS)]
        headers = {"authorization": f"Bearer {key}", "x-goog-api-key": key, "anthropic-version": "2023-06-01"}
        async with httpx.AsyncClient(timeout=30) as http:
            while not stop.is_set():
                try:
                    r = await http.post(url + path.split("?")[0], json=CALLS[path], headers=headers)
                except httpx.TransportError:
                    return  # the gateway is gone: this call was never acknowledged
                if r.status_code == 200 and CLOSING.get(path, b"") in r.content:
                    acked[key].append(path)

    await asyncio.gather(*(worker(i) for i in range(16)))


@contextlib.contextmanager
def _gateway(store: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, str, str]]:
    """The fake vLLM and a `polar gateway` recording into `store`: (its process, model API URL, control URL,
    control token); both killed after, if still running."""
    bport, port, cport = free_port(), free_port(), free_port()
    token = new_token()
    env = {**os.environ, "POLAR_TOKEN": token, "PYTHONUNBUFFERED": "1"}
    backend = subprocess.Popen([sys.executable, "-m", "tests.fakes.fake_vllm", "--port", str(bport)], env=env)
    argv = [sys.executable, "-m", "polar", "gateway", "--backend", f"http://127.0.0.1:{bport}"]
    argv += ["--model", "m", "--port", str(port), "--control-port", str(cport), "--store", str(store)]
    gateway = subprocess.Popen([*argv, "--log-level", "warning"], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(f"http://127.0.0.1:{bport}", backend)
        _wait_up(url, gateway)
        yield gateway, url, f"http://127.0.0.1:{cport}", token
    finally:
        for proc in (gateway, backend):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_kill_9_under_load_loses_no_acknowledged_record(tmp_path: Path) -> None:
    store = tmp_path / "gw.db"
    with _gateway(store) as (gateway, url, control, token):
        keys = [
            httpx.post(f"{control}/sessions", headers=bearer(token), json={}).json()["session_id"]
            for _ in range(4)
        ]
        acked: dict[str, list[str]] = {k: [] for k in keys}

        async def scenario() -> None:
            stop = asyncio.Event()
            load = asyncio.create_task(_load(url, keys, acked, stop))
            deadline = time.monotonic() + 180  # a bound so a broken stack fails here instead of hanging
            while sum(len(v) for v in acked.values()) < 200:  # well into the load
                assert time.monotonic() < deadline, f"only {acked} acknowledged calls"
                await asyncio.sleep(0.05)
            gateway.send_signal(signal.SIGKILL)
            await asyncio.wait_for(load, 60)

        asyncio.run(scenario())
        gateway.wait(10)
    with SQLiteStore(store) as s:
        stored = {k: len(s.completions(k)) for k in keys}
    for key in keys:
        assert stored[key] >= len(acked[key]), (key, stored[key], len(acked[key]))
    assert sum(len(v) for v in acked.values()) >= 200


def test_a_reader_in_another_process_does_not_cost_the_gateway_its_records(tmp_path: Path) -> None:
    """Was: every new connection in the gateway first opened and closed the database file itself (to make it
    0600), and closing any descriptor of a file drops all of the process's POSIX locks on it, SQLite's
    included. The next process to open and close the store (sqlite3, the dashboard, `polar traces`) then
    found no other user, deleted the WAL the gateway was still committing into, and calls answered after
    that were gone after a kill -9 (measured: 4 answered, 0 stored)."""
    import sqlite3

    store = tmp_path / "gw.db"
    with _gateway(store) as (gateway, url, control, token):
        key = httpx.post(f"{control}/sessions", headers=bearer(token), json={}).json()["session_id"]
        body = CALLS["/v1/chat/completions"]
        assert httpx.post(f"{url}/v1/chat/completions", json=body, headers=bearer(key)).status_code == 200
        # The gateway opens more connections (control reads), then another process reads and closes.
        assert httpx.get(f"{control}/sessions/{key}/completions", headers=bearer(token)).status_code == 200
        subprocess.run(
            [
                sys.executable,
                "-c",
                f"import sqlite3; sqlite3.connect({str(store)!r}).execute('SELECT 1').fetchall()",
            ],
            check=True,
        )
        with sqlite3.connect(store) as outside:  # and a reader in this (another) process too
            outside.execute("SELECT COUNT(*) FROM completions").fetchall()
        outside.close()
        for _ in range(4):
            assert httpx.post(f"{url}/v1/chat/completions", json=body, headers=bearer(key)).status_code == 200
        assert httpx.get(f"{control}/sessions/{key}/completions", headers=bearer(token)).status_code == 200
        gateway.send_signal(signal.SIGKILL)
        gateway.wait(10)
    with SQLiteStore(store) as s:
        assert len(s.completions(key)) == 5
