"""`polar node` as a process: serves the node routes beside the gateway, registers with the server, runs
sessions, and on SIGTERM cancels what runs (killing its processes) before it exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar.rollout.protocol import SessionSpec
from polar.serving import free_port
from tests.conftest import SERVED_MODEL
from tests.node_support import ON_HOST, PY, fake_policy, pids_under, shell_task, write_caller
from tests.server_support import AUTH, TOKEN, start_server, wait_until


def test_polar_node_process(tmp_path: Path) -> None:
    port, control_port = free_port(), free_port()
    server = start_server(tmp_path / "server.db")
    try:
        with fake_policy() as (url, _):
            argv = [sys.executable, "-m", "polar", "node", "--backend", url, "--model", SERVED_MODEL]
            argv += ["--port", str(port), "--control-port", str(control_port)]
            argv += ["--store", str(tmp_path / "node.db"), "--server", server.url]
            argv += ["--runtime-root", str(tmp_path / "rt"), "--node-id", "cli-node", "--heartbeat", "0.1"]
            argv += ["--capacity", "3", "--log-level", "warning"]
            env = {**os.environ, "POLAR_TOKEN": TOKEN}  # the deployment's token, as the server has it
            proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
            )
            try:
                control = f"http://127.0.0.1:{control_port}"
                with httpx.Client(base_url=control, timeout=10, headers=AUTH) as client:

                    def status() -> dict[str, object] | None:
                        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                        try:
                            r = client.get("/node/status")
                        except httpx.ConnectError:
                            return None
                        return dict(r.json())

                    first = wait_until(status, timeout=30, what="the node to serve")
                    assert first["node_id"] == "cli-node" and first["capacity"] == 3
                    nodes = wait_until(
                        lambda: httpx.get(f"{server.url}/nodes", headers=AUTH).json()["nodes"],
                        what="registration",
                    )
                    assert nodes[0]["node_id"] == "cli-node"

                    done = SessionSpec(session_id="cli-sess-1", task=shell_task("true"))
                    assert client.post("/node/sessions", content=done.model_dump_json()).status_code == 202
                    state = completed(client, "cli-sess-1")
                    assert state["result"]["reward"] == 1.0

                    pid_file = tmp_path / "child.pid"
                    hang = shell_task(f"sleep 60 & echo $! > {pid_file}; wait", runtime=ON_HOST)
                    spec = SessionSpec(session_id="cli-sess-2", task=hang)
                    assert client.post("/node/sessions", content=spec.model_dump_json()).status_code == 202
                    wait_until(pid_file.exists, what="the harness to run")
                    assert pids_under(tmp_path / "rt", "sleep", "60")
                os.kill(proc.pid, signal.SIGTERM)
                out, _ = proc.communicate(timeout=30)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    finally:
        server.stop()
    assert proc.returncode == 0, out
    wait_until(lambda: not pids_under(tmp_path / "rt", "sleep", "60"), what="the harness to die")
    assert not list((tmp_path / "rt").iterdir())


def test_bad_options_are_refused(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "polar", "node", "--backend", "ftp://x", "--store", str(tmp_path / "n.db")]
    bad = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "'--backend': 'ftp://x' is not an http(s) URL" in bad.stderr
    argv = [sys.executable, "-m", "polar", "node", "--backend", "http://127.0.0.1:1", "--capacity", "0"]
    bad = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "capacity must be at least 1" in bad.stderr
    argv[-2:] = ["--gateway-workers", "0"]
    bad = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "gateway_workers must be at least 1" in bad.stderr


@pytest.mark.parametrize("workers", [1, 2])
def test_unreachable_backend_without_model_fails_to_start(tmp_path: Path, workers: int) -> None:
    """The same line whether the gateway runs in the node or on workers of its own."""
    argv = [sys.executable, "-m", "polar", "node", "--backend", "http://127.0.0.1:1", "--port", "0"]
    argv += ["--store", str(tmp_path / "n.db"), "--log-level", "error", "--gateway-workers", str(workers)]
    bad = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    # The gateway's own reason, in one line: no traceback, no uvicorn start-up log around it.
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "polar node: could not list the backend's models "
        "(inference server unreachable at http://127.0.0.1:1); pass --model"
    ]


def test_a_node_killed_mid_session_reports_it_after_a_restart_and_never_reruns_it(tmp_path: Path) -> None:
    """SIGKILL while a session's agent runs: nothing reports it. A `polar node` restarted with the same
    store and node id finds it admitted-but-unended in its journal and reports it ERROR ("node restarted
    while the session ran"); the agent is not run again."""
    runs, gate = tmp_path / "runs", tmp_path / "go"
    port, control_port = free_port(), free_port()
    server = start_server(tmp_path / "server.db", audit_interval_s=3600)
    argv = [sys.executable, "-m", "polar", "node", "--model", SERVED_MODEL, "--port", str(port)]
    argv += ["--control-port", str(control_port), "--store", str(tmp_path / "node.db")]
    argv += ["--server", server.url, "--runtime-root", str(tmp_path / "rt"), "--node-id", "phoenix"]
    argv += ["--heartbeat", "0.1", "--log-level", "warning"]
    env = {**os.environ, "POLAR_TOKEN": TOKEN}
    procs: list[subprocess.Popen[str]] = []
    try:
        with fake_policy() as (url, _), httpx.Client(base_url=server.url, timeout=10, headers=AUTH) as http:

            def start() -> None:
                procs.append(subprocess.Popen([*argv, "--backend", url], env=env, text=True))

            def session() -> dict[str, Any]:
                view: dict[str, Any] = http.get("/rollout/task/killed").json()
                return view["sessions"][0]  # type: ignore[no-any-return]

            start()
            wait_until(lambda: http.get("/nodes").json()["nodes"], timeout=30, what="registration")
            command = f'echo "$POLAR_SESSION_ID" >> {runs}; while [ ! -f {gate} ]; do sleep 0.05; done'
            task = {"task_id": "killed", "instruction": "x", "agent": {"harness": "shell", "settings": {"command": command}}, "runtime": ON_HOST}  # fmt: skip
            assert http.post("/rollout/task/submit", json=task).status_code == 201
            wait_until(
                lambda: session()["status"] == "RUNNING" or runs.exists(), timeout=30, what="the agent"
            )
            procs[0].kill()
            procs[0].wait()
            gate.touch()  # were the session run again, it would end at once and append to `runs`
            start()
            done = wait_until(lambda: session()["status"] not in ("DISPATCHED", "RUNNING") and session(),
                              timeout=60, what="the report")  # fmt: skip
            result = http.get("/rollout/task/killed").json()["results"][0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=30)
        server.stop()
    assert done["status"] == "ERROR" and result["reason"].startswith("node restarted while the session ran")
    assert result["node_id"] == "phoenix"
    assert runs.read_text().split() == [done["session_id"]]  # the agent ran once


def test_a_node_on_gateway_workers_serves_and_stops_them_on_sigterm(tmp_path: Path) -> None:
    """`polar node --gateway-workers 2`: a session's calls are served by the workers, and SIGTERM stops the
    node and every gateway process it started."""
    control_port = free_port()
    caller = write_caller(tmp_path)
    with fake_policy() as (url, fake):
        argv = [sys.executable, "-m", "polar", "node", "--backend", url, "--model", SERVED_MODEL]
        argv += ["--port", "0", "--control-port", str(control_port), "--gateway-workers", "2"]
        argv += ["--store", str(tmp_path / "node.db"), "--runtime-root", str(tmp_path / "rt")]
        argv += ["--log-level", "warning"]
        env = {**os.environ, "POLAR_TOKEN": TOKEN}
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            with httpx.Client(
                base_url=f"http://127.0.0.1:{control_port}", timeout=10, headers=AUTH
            ) as client:

                def serving() -> bool:
                    assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                    try:
                        return client.get("/node/status").status_code == 200
                    except httpx.ConnectError:
                        return False

                wait_until(serving, timeout=60, what="the node to serve")
                gateway_pids = pids_of_children(proc.pid)
                assert gateway_pids, "no gateway process under the node"
                task = shell_task(f"{PY} {caller} 2", runtime=ON_HOST)
                spec = SessionSpec(session_id="cli-workers-1", task=task)
                assert client.post("/node/sessions", content=spec.model_dump_json()).status_code == 202
                state = completed(client, "cli-workers-1")
            os.kill(proc.pid, signal.SIGTERM)
            out, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, out
    assert state["result"]["reward"] == 1.0 and len(fake.requests) == 2
    assert not [p for p in gateway_pids if Path(f"/proc/{p}").exists()]


def pids_of_children(pid: int) -> list[int]:
    """`pid`'s descendants (the gateway supervisor and its workers)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(k) for k in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            continue
        out += kids
        todo += kids
    return out


def completed(client: httpx.Client, session_id: str) -> Any:
    """The node's state of the session once it is COMPLETED (the test's bound on waiting is wait_until's)."""
    return wait_until(
        lambda: (s := client.get(f"/node/sessions/{session_id}").json())["status"] == "COMPLETED" and s,
        what="the session",
    )
