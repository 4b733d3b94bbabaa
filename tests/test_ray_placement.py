"""The parts of `--ray` that need no Ray cluster: what each gateway node asks of its Ray node, which Ray
nodes are eligible, the CLI's checks, and the server's `POST /nodes/{id}/lost`, which the driver calls
when Ray reports a node dead (tests/test_ray.py runs the whole on a real Ray cluster)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar.rollout.ray.spec import NodeRequest, node_id_for, trusted_imports
from polar.serving import ServerThread
from polar.task import Task
from tests.server_support import AUTH, StandInNode, start_server, task, wait_until

GIB = 1 << 30


def _task(**runtime: Any) -> Task:
    return Task.model_validate({"task_id": "t", "instruction": "x", "runtime": runtime})


def test_a_node_asks_for_capacity_times_the_largest_runtime_and_one_cpu_at_least() -> None:
    tasks = [_task(), _task(cpus=0.5, memory_mb=512), _task(cpus=2, memory_mb=256)]
    request = NodeRequest.for_tasks(tasks, 4, resource="polar")
    assert (request.cpus, request.memory_mb, request.resource) == (8.0, 2048, "polar")
    assert request.wants() == {"CPU": 8.0, "memory": 2048 * (1 << 20), "polar": 1.0}
    assert request.actor_options() == {"num_cpus": 8.0, "memory": 2048 * (1 << 20), "resources": {"polar": 1}}
    assert NodeRequest.for_tasks([_task()], 4).wants() == {"CPU": 1.0}  # the node itself
    assert NodeRequest.for_tasks([_task()], 4, gateway_workers=3).wants() == {"CPU": 3.0}  # a core a worker
    assert NodeRequest.for_tasks(tasks, 4, gateway_workers=3).cpus == 8.0  # the sessions' share covers them
    assert NodeRequest.for_tasks(tasks, 4, cpus=0, memory_mb=0).wants() == {}  # given: taken as is


def test_only_ray_nodes_that_offer_everything_are_eligible() -> None:
    request = NodeRequest(resource="polar", cpus=4, memory_mb=1024)
    assert request.fits({"CPU": 4.0, "memory": float(GIB), "polar": 1.0})
    assert not request.fits({"CPU": 4.0, "memory": float(GIB)})  # no custom resource
    assert not request.fits({"CPU": 3.0, "memory": float(GIB), "polar": 1.0})
    assert not request.fits({"CPU": 4.0, "memory": float(GIB) - 1, "polar": 1.0})
    with pytest.raises(ValueError, match="resource"):
        NodeRequest(resource=" ")


def test_a_gateway_node_id_is_stable_for_its_ray_node() -> None:
    assert node_id_for("9cc64a5719074e3d68c1fa7cbd640a22aec9f423099cdc0ea59223ed") == "ray-9cc64a571907"


def test_the_run_driver_vouches_only_for_import_paths_its_task_file_names(tmp_path: Path) -> None:
    tasks = [
        Task.model_validate({"task_id": "a", "instruction": "x", "agent": {"harness": "mymod:Agent"}}),
        Task.model_validate({"task_id": "b", "instruction": "x", "agent": {"harness": "shell"}}),
    ]
    assert trusted_imports(tasks, tmp_path) == (("mymod:Agent", tmp_path.resolve()),)


def _polar(*args: str) -> Any:
    import subprocess

    return subprocess.run([sys.executable, "-m", "polar", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("run", "--ray", "examples/tasks.yaml"), "is not a Ray address"),
        (("run", "examples/tasks.yaml", "--ray-cpus", "2"), "--ray-cpus: needs --ray"),
        (("serve", "--backend", "http://127.0.0.1:9"), "--backend: needs --ray"),
        (("serve", "--ray"), "--backend: --ray needs the policy's inference server"),
        (("serve", "--gateway-workers", "2"), "--gateway-workers: needs --ray"),
    ],
    ids=[
        "file-as-address",
        "ray-cpus-alone",
        "serve-backend-alone",
        "serve-ray-without-backend",
        "serve-workers",
    ],
)
def test_ray_usage_errors_say_what_to_change(args: tuple[str, ...], message: str) -> None:
    proc = _polar(*args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert message in " ".join(proc.stderr.split()), proc.stderr


def test_help_shows_ray_examples() -> None:
    for command in ("run", "serve"):
        out = _polar(command, "--help").stdout
        assert "--ray [ADDRESS]" in out and f"polar {command} " in out
        assert any(
            "--ray" in line and line.strip().startswith(f"polar {command}") for line in out.splitlines()
        )


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    srv = start_server(tmp_path / "server.db", node_lost_after_s=600.0)
    try:
        yield srv
    finally:
        srv.stop()


def test_a_node_reported_lost_ends_its_open_sessions_at_once_and_gets_no_more(server: ServerThread) -> None:
    """The server's own loss bound is ten minutes away: the report ends the sessions now, ERROR with the
    reason given, not re-run elsewhere; a second node then gets the new work."""
    with httpx.Client(timeout=30, headers=AUTH) as http:
        a = StandInNode("a").register(http, server.url, capacity=2)
        try:
            http.post(f"{server.url}/rollout/task/submit", json=task("t1", num_samples=2)).raise_for_status()
            wait_until(lambda: len(a.specs) == 2, what="both sessions dispatched to a")
            r = http.post(f"{server.url}/nodes/a/lost", json={"reason": "Ray node 1234 died (killed)"})
            assert r.status_code == 200 and r.json() == {"node_id": "a", "lost": True, "sessions_ended": 2}
            view = http.get(f"{server.url}/rollout/task/t1").json()
            assert view["state"] == "DONE"
            for res in view["results"]:
                assert res["status"] == "ERROR"
                assert (
                    res["reason"]
                    == "node lost: a: Ray node 1234 died (killed); not re-run (it may have run there)"
                )
            b = StandInNode("b").register(http, server.url)
            try:
                http.post(f"{server.url}/rollout/task/submit", json=task("t2")).raise_for_status()
                wait_until(lambda: len(b.specs) == 1, what="the new session on b")
                assert len(a.specs) == 2  # nothing more went to the lost node
                nodes = {n["node_id"]: n for n in http.get(f"{server.url}/nodes").json()["nodes"]}
                assert nodes["a"]["lost"] is True and nodes["b"]["lost"] is False
                # Reporting it again ends nothing more; an unknown node and a bad reason are refused.
                again = http.post(f"{server.url}/nodes/a/lost", json={})
                assert again.json()["sessions_ended"] == 0
                assert http.post(f"{server.url}/nodes/zz/lost", json={}).status_code == 404
                assert http.post(f"{server.url}/nodes/a/lost", json={"reason": 3}).status_code == 400
                assert httpx.post(f"{server.url}/nodes/a/lost", json={}).status_code == 401  # token needed
            finally:
                b.stop()
        finally:
            a.stop()


@pytest.mark.parametrize("command", ["run", "serve"])
def test_a_ray_address_nothing_answers_is_one_line_at_once(tmp_path: Path, command: str) -> None:
    """`ray.init` would retry for minutes; the run folder is not touched."""
    out = tmp_path / "out"
    args = {
        "run": ("run", "examples/tasks.yaml", "--backend", "http://127.0.0.1:9", "--out", str(out)),
        "serve": ("serve", "--port", "0", "--db", str(tmp_path / "server.db"), "--backend", "http://127.0.0.1:9",
                  "--token-file", str(_token(tmp_path))),
    }[command]  # fmt: skip
    proc = _polar(*args, "--ray", "127.0.0.1:1")
    lines = [line for line in proc.stderr.splitlines() if "cannot connect to Ray" in line]
    assert proc.returncode in (1, 2) and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and lines[0].endswith(
        "cannot connect to Ray at 127.0.0.1:1: [Errno 111] Connection refused"
    )
    assert not (out / "results.jsonl").exists()


def _token(tmp_path: Path) -> Path:
    from polar.auth import new_token

    path = tmp_path / "token"
    path.write_text(new_token())
    path.chmod(0o600)
    return path
