"""One logging setup for every command (`polar.cli.common.setup_logging`), checked on real subprocesses whose
stderr is a pipe: plain one-line records with a timestamp, no per-request client lines (a node's heartbeats),
uvicorn's records in the same format, and `--log-json` lines that all parse."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from polar.serving import free_port
from tests.conftest import SERVED_MODEL
from tests.node_support import fake_policy
from tests.server_support import AUTH, TOKEN, start_server, wait_until

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "POLAR_TOKEN": TOKEN}
PLAIN = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) +[\w.]+: ")


def stop(proc: subprocess.Popen[str], sig: int = signal.SIGINT) -> str:
    """Send `sig`, wait for the process, return what it wrote."""
    try:
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return out


def test_a_node_at_the_default_level_logs_no_heartbeats(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server.db")
    try:
        with fake_policy() as (url, _):
            argv = [sys.executable, "-m", "polar", "node", "--backend", url, "--model", SERVED_MODEL]
            argv += ["--port", "0", "--control-port", "0", "--store", str(tmp_path / "node.db")]
            argv += ["--server", server.url, "--node-id", "quiet-node", "--heartbeat", "0.05"]
            proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV
            )

            def node() -> dict[str, Any] | None:
                assert proc.poll() is None, proc.communicate()[0]
                nodes = httpx.get(f"{server.url}/nodes", headers=AUTH).json()["nodes"]
                return nodes[0] if nodes else None

            wait_until(node, timeout=60, what="registration")
            registered = time.monotonic()
            # Heartbeats every 0.05 s: a fresh one seen well after registration means dozens were sent.
            wait_until(
                lambda: time.monotonic() - registered > 2 and (n := node()) and n["last_heartbeat_s_ago"] < 1,
                timeout=60,
                what="heartbeats",
            )
            out = stop(proc, signal.SIGTERM)
    finally:
        server.stop()
    assert proc.returncode == 0, out
    assert "heartbeat" not in out and "HTTP Request" not in out, out
    records = [line for line in out.splitlines() if PLAIN.match(line)]
    assert any("polar.node: node quiet-node: model API at" in line for line in records), out
    assert any(line.endswith("polar.node: node stopped") for line in records), out


def test_log_json_lines_all_parse_uvicorn_included(tmp_path: Path) -> None:
    port, control = free_port(), free_port()
    with fake_policy() as (url, _):
        argv = [sys.executable, "-m", "polar", "gateway", "--backend", url, "--model", SERVED_MODEL]
        argv += ["--port", str(port), "--control-port", str(control), "--store", str(tmp_path / "gw.db")]
        argv += ["--log-json", "--log-level", "debug"]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)

        def up() -> bool:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, timeout=60, what="the gateway")
        out = stop(proc)
    assert proc.returncode == 0, out
    records = [orjson.loads(line) for line in out.splitlines() if line.strip()]
    assert records and all(set(r) >= {"time", "level", "logger", "message"} for r in records)
    loggers = {r["logger"] for r in records}
    assert "polar.gateway" in loggers and "uvicorn" in loggers  # uvicorn's own records, as JSON
    assert "uvicorn.error" not in loggers  # was: its life-cycle lines under that name, though nothing failed
    started = [r for r in records if r["message"].startswith("Started server process")]
    assert len(started) == 2 and {r["level"] for r in started} == {"debug"}  # one per listener, at DEBUG


def test_polar_serve_routes_uvicorn_through_the_plain_format(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "polar", "serve", "--port", str(port), "--db", str(tmp_path / "s.db")]
    argv += ["--log-level", "debug"]  # uvicorn's life-cycle lines are DEBUG
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)

    def up() -> bool:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        except httpx.TransportError:
            return False

    wait_until(up, timeout=60, what="polar serve")
    out = stop(proc, signal.SIGTERM)
    lines = [line for line in out.splitlines() if line.strip()]
    assert any("DEBUG   uvicorn: Started server process" in line for line in lines), out
    assert all(PLAIN.match(line) for line in lines), out  # nothing in uvicorn's own "INFO:     " format


def test_uvicorns_life_cycle_lines_are_not_info() -> None:
    """Was: "uvicorn.error: Started server process" at INFO, twice for a gateway (once per listener)."""
    import logging

    from polar.cli.common import setup_logging

    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    setup_logging("info")
    keep = Keep()
    logging.getLogger().addHandler(keep)
    try:
        error = logging.getLogger("uvicorn.error")
        error.info("Started server process [%d]", 1)
        error.error("Exception in ASGI application")
    finally:
        logging.getLogger().removeHandler(keep)
    assert [(r.name, r.levelname, r.getMessage()) for r in seen] == [
        ("uvicorn", "ERROR", "Exception in ASGI application")
    ]
