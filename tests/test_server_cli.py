"""`polar serve`, `polar submit` and `polar status` as a user runs them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
from click.testing import CliRunner

from polar.cli import main
from polar.serving import ServerThread, free_port
from tests.node_support import eventually, fake_policy, running_node
from tests.server_support import AUTH, TOKEN, start_server

ENV = {"POLAR_TOKEN": TOKEN}  # what an operator sets for `polar submit` / `polar status`

BAD_HARNESS = """\
tasks:
  - task_id: ok
    instruction: fine
  - task_id: broken
    instruction: x
    agent:
      harness: no-such-agent
"""


def test_submit_reports_schema_errors_with_file_and_line(tmp_path: Path) -> None:
    f = tmp_path / "tasks.yaml"
    f.write_text("tasks:\n  - task_id: a\n    instruction: x\n    num_samples: -1\n")
    r = CliRunner().invoke(main, ["submit", str(f), "--server", "http://127.0.0.1:9"])
    assert r.exit_code == 2
    assert f"{f}:4: tasks[0].num_samples" in r.output
    r = CliRunner().invoke(main, ["submit", str(tmp_path / "missing.yaml")])
    assert r.exit_code == 2 and "cannot read" in r.output


def test_submit_to_a_server_that_is_down(tmp_path: Path) -> None:
    f = tmp_path / "tasks.yaml"
    f.write_text("task_id: a\ninstruction: x\n")
    down = f"http://127.0.0.1:{free_port()}"
    r = CliRunner().invoke(main, ["submit", str(f), "--server", down], env=ENV)
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit)  # a message, not a traceback
    assert f"{down}: POST {down}/rollout/task/submit: ConnectError" in r.output


def test_submit_maps_the_servers_refusal_to_the_line(tmp_path: Path) -> None:
    f = tmp_path / "tasks.yaml"
    f.write_text(BAD_HARNESS)
    server = start_server(tmp_path / "server.db")
    try:
        r = CliRunner().invoke(main, ["submit", str(f), "--server", server.url], env=ENV)
        assert r.exit_code == 2
        assert f"{f}:7: HTTP 400: agent.harness: unknown harness 'no-such-agent'" in r.output
        r = CliRunner().invoke(main, ["status", "--server", server.url], env=ENV)
        assert "tasks:    none" in r.output  # nothing of the refused file was stored
    finally:
        server.stop()
    r = CliRunner().invoke(main, ["status", "--server", server.url], env=ENV)
    assert r.exit_code == 2 and server.url in r.output


async def test_submit_wait_and_status_with_a_real_node(tmp_path: Path) -> None:
    f = tmp_path / "tasks.yaml"
    f.write_text(
        "- task_id: echo\n  instruction: hi\n  num_samples: 2\n"
        "  agent: {harness: shell, settings: {command: 'true'}}\n"
    )
    out = tmp_path / "results.jsonl"
    server = start_server(tmp_path / "server.db")
    runner = CliRunner(env=ENV)
    try:
        with fake_policy() as (url, _):
            async with running_node(url, tmp_path, server_url=server.url, heartbeat_s=0.05):
                await eventually(lambda: _node_up(server), "the node")
                args = ["submit", str(f), "--server", server.url, "--wait", "--out", str(out)]
                r = await asyncio.to_thread(runner.invoke, main, args)
                assert r.exit_code == 0, r.output
                # A harness command that cannot start (127) is the node's infrastructure error: exit 3, as
                # `polar run` (was 1, the status of a bug in polar).
                broken = tmp_path / "broken.yaml"
                broken.write_text(
                    "task_id: broken\ninstruction: hi\nagent: {harness: shell, settings: {command: 'exit 127'}}\n"
                )
                failed = await asyncio.to_thread(
                    runner.invoke, main, ["submit", str(broken), "--server", server.url, "--wait"]
                )
                assert failed.exit_code == 3, failed.output
                assert "1 of 1 sessions ended in an infrastructure failure" in failed.output
                status = await asyncio.to_thread(runner.invoke, main, ["status", "--server", server.url])
                one = await asyncio.to_thread(runner.invoke, main, ["status", "echo", "--server", server.url])
                js = await asyncio.to_thread(
                    runner.invoke, main, ["status", "echo", "--json", "--server", server.url]
                )
    finally:
        server.stop()
    assert "submitted echo: 2 session(s)" in r.output
    assert r.output.count("COMPLETED reward=1") == 2
    assert len(out.read_text().splitlines()) == 2
    assert "tasks:    DONE 2" in status.output and "COMPLETED 2" in status.output
    assert "node-test" in status.output
    assert "echo: DONE, COMPLETED 2" in one.output
    assert '"state": "DONE"' in js.output


async def _node_up(server: ServerThread) -> bool:
    async with httpx.AsyncClient(headers=AUTH) as http:
        nodes = (await http.get(f"{server.url}/nodes")).json()["nodes"]
    return bool(nodes) and bool(nodes[0]["healthy"])


def test_polar_serve_runs_and_refuses_bad_options(tmp_path: Path) -> None:
    r = CliRunner().invoke(main, ["serve", "--public-url", "ftp://x"])
    assert r.exit_code == 2 and "--public-url" in r.output
    r = CliRunner().invoke(main, ["serve", "--heartbeat-timeout", "30", "--node-lost-after", "10"])
    assert r.exit_code == 2 and "--node-lost-after" in r.output
    port = free_port()
    db = tmp_path / "srv.db"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "POLAR_TOKEN": TOKEN}
    cmd = [
        sys.executable,
        "-m",
        "polar",
        "serve",
        "--port",
        str(port),
        "--db",
        str(db),
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(headers=AUTH) as http:

            def up() -> bool:
                try:
                    return http.get(f"http://127.0.0.1:{port}/health").status_code == 200
                except httpx.TransportError:
                    assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                    return False

            from tests.server_support import wait_until

            wait_until(up, timeout=30, what="polar serve to answer")
            r2 = http.post(
                f"http://127.0.0.1:{port}/rollout/task/submit", json={"task_id": "x", "instruction": "y"}
            )
            assert r2.status_code == 201
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert db.exists()
