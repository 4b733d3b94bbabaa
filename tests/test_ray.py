"""Gateway nodes as Ray actors on a real Ray cluster of several Ray nodes on this machine
(`ray.cluster_utils.Cluster`: one GCS, one raylet per Ray node, each with the custom resource `polar`).
Sessions spread over the nodes; a Ray node removed mid-run ends its sessions ERROR with Ray's reason (told
to the server by the driver, long before the server's own loss bound), the rest complete on the others,
and no session runs twice (the shell command's own log and every node's journal say so); a Ray node that
joins gets a gateway node. An actor whose process dies is restarted on its Ray node under the same id; a
drained one ends. `polar run --ray ADDRESS` drives the same cluster from the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sqlite3
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray  # the test extra installs it: without Ray this module fails to collect, loudly

from polar.gateway.config import GatewayConfig
from polar.netguard import OutboundPolicy
from polar.rollout.node import NodeConfig
from polar.rollout.ray import NodeRequest, RayNodeSpec
from tests.conftest import SERVED_MODEL
from tests.node_support import alive, caller_task, fake_policy, pids_under, run_taskfile, write_caller
from tests.server_support import AUTH, TOKEN, start_server, wait_until

pytestmark = pytest.mark.ray

TERMINAL = ("COMPLETED", "ERROR", "TIMEOUT", "CANCELLED")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """Three Ray nodes offering `polar` (CPUs over-declared: sessions are `sleep`s) and a head without."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        for _ in range(3):
            c.add_node(num_cpus=4, resources={"polar": 1})
        ray.init(address=c.address, log_to_driver=False, configure_logging=False)
        c.wait_for_nodes()
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def _spec(backend_url: str, tmp_path: Path, capacity: int, gateway_workers: int = 1) -> RayNodeSpec:
    gateway = GatewayConfig(
        backend_url=backend_url,
        served_model=SERVED_MODEL,
        control_token=TOKEN,
        outbound=OutboundPolicy(allow=("127.0.0.1",)),
    )
    config = NodeConfig(
        gateway=gateway,
        capacity=capacity,
        run_workers=capacity,
        server_url="http://placeholder.invalid",  # replaced below
        heartbeat_s=0.2,
        runtime_root=tmp_path / "runtimes",
        gateway_workers=gateway_workers,
    )
    return RayNodeSpec(config=config, store_dir=tmp_path / "nodes", log_level="warning")


def _task(task_id: str, command: str, num_samples: int) -> dict[str, Any]:
    return {
        "task_id": task_id,
        "instruction": "do it",
        "timeout_seconds": 120,
        "num_samples": num_samples,
        "agent": {"harness": "shell", "settings": {"command": command}},
        "runtime": {"backend": "local"},  # the sessions coordinate through the test's host files
    }


async def _view(client: httpx.AsyncClient, task_id: str) -> dict[str, Any]:
    view: dict[str, Any] = (await client.get(f"/rollout/task/{task_id}")).json()
    return view


async def _wait(check: Any, what: str, timeout_s: float = 60.0) -> Any:
    """Poll `check()` until truthy (a bound on a hung test, not a timing assertion)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while True:
        value = await check()
        if value:
            return value
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


def _journal(store: Path) -> dict[str, str]:
    with sqlite3.connect(store) as db:
        return dict(db.execute("SELECT session_id, state FROM node_outcomes").fetchall())


def _with_server(spec: RayNodeSpec, server_url: str) -> RayNodeSpec:
    import dataclasses

    return dataclasses.replace(spec, config=dataclasses.replace(spec.config, server_url=server_url))


async def test_a_gateway_actor_killed_by_its_process_restarts_on_its_ray_node_and_runs_nothing_twice(
    cluster: Any, tmp_path: Path
) -> None:
    """SIGKILL of an actor's worker process: Ray restarts the actor on the same Ray node, the driver starts
    its node again under the same id and store, and the journal ends the session that was running there
    ERROR "node restarted" (never run again); the other nodes' sessions are untouched. The nodes serve
    their gateways on two worker processes each: the killed actor's go with it, the restarted one has its
    own."""
    import os

    from polar.rollout.ray.cluster import RayNodes

    gate = tmp_path / "go"
    ran = tmp_path / "ran"
    block = f'echo "$POLAR_SESSION_ID" >> {ran}; while [ ! -f {gate} ]; do sleep 0.1; done'
    server = start_server(tmp_path / "server.db", heartbeat_timeout_s=30.0, node_lost_after_s=600.0)
    nodes: RayNodes | None = None
    try:
        with fake_policy() as (url, _):
            spec = _with_server(_spec(url, tmp_path, capacity=2, gateway_workers=2), server.url)
            nodes = RayNodes(spec, NodeRequest(resource="polar", cpus=1), server.url, TOKEN, poll_s=0.2)
            started = await nodes.start(wait_for_one=True)
            assert len(started) == 3
            async with httpx.AsyncClient(base_url=server.url, timeout=30, headers=AUTH) as client:
                await client.post("/rollout/task/submit", json=_task("restart", block, 3))

                async def three_running() -> dict[str, Any] | None:
                    view = await _view(client, "restart")
                    running = [s for s in view["sessions"] if s["status"] == "RUNNING"]
                    return view if len(running) == 3 else None

                first = await _wait(three_running, "one session running on each node")
                victim = next(iter(nodes.placed.values()))
                (on_victim,) = [s["session_id"] for s in first["sessions"] if s["node_id"] == victim.node_id]
                old_pid = (await victim.handle.status.remote())["pid"]
                store = tmp_path / "nodes" / victim.node_id / "gateway.db"
                workers = _store_holders(tmp_path / "nodes")[store] - {old_pid}
                assert len(workers) >= 2  # its gateway's processes, beside the actor's
                os.kill(old_pid, signal.SIGKILL)

                async def victim_ended() -> bool:
                    view = await _view(client, "restart")
                    return any(
                        s["session_id"] == on_victim and s["status"] in TERMINAL for s in view["sessions"]
                    )

                await _wait(victim_ended, "the restarted node to report the session it lost")

                async def workers_gone() -> bool:
                    return not any(alive(pid) for pid in workers)

                await _wait(workers_gone, "the killed actor's gateway workers to exit")
                restarted = _store_holders(tmp_path / "nodes")[store]
                gate.touch()

                async def done() -> dict[str, Any] | None:
                    view = await _view(client, "restart")
                    return view if view["state"] == "DONE" else None

                final = await _wait(done, "every session to finish")
                listed = {n["node_id"]: n for n in (await client.get("/nodes")).json()["nodes"]}
                new_status = await victim.handle.status.remote()
                kept = (victim.gone, victim.started, victim.failed)  # the driver kept it through the restart
                # A drain through the server: the node leaves, its actor ends, nothing replaces it.
                r = await client.post(f"/nodes/{victim.node_id}/drain", json={})
                assert r.status_code == 202, r.text

                async def left() -> bool:
                    nodes_now = (await client.get("/nodes")).json()["nodes"]
                    return victim.node_id not in {n["node_id"] for n in nodes_now} and victim.gone

                await _wait(left, "the drained node to leave")
                with pytest.raises(ray.exceptions.RayActorError):
                    await victim.handle.status.remote()
                await asyncio.sleep(1.0)  # five of the driver's polls: it does not place a new one there
                assert [p.node_id for p in nodes.placed.values() if p.ray_node == victim.ray_node] == [
                    victim.node_id
                ]
    finally:
        if nodes is not None:
            await nodes.stop("test finished")
        server.stop()
    results = {r["session_id"]: r for r in final["results"]}
    assert results[on_victim]["status"] == "ERROR"
    assert (
        "node restarted" in results[on_victim]["reason"] and "not run again" in results[on_victim]["reason"]
    )
    assert results[on_victim]["node_id"] == victim.node_id
    assert [r["status"] for sid, r in results.items() if sid != on_victim] == ["COMPLETED", "COMPLETED"]
    assert new_status["started"] and new_status["pid"] != old_pid  # the same actor, a new process
    assert len(restarted - {new_status["pid"]}) >= 2 and not restarted & workers  # workers of its own
    assert listed[victim.node_id]["healthy"] and not listed[victim.node_id]["lost"]
    assert kept == (False, True, None)
    runs = Counter(ran.read_text().split())
    assert set(runs) == set(results) and set(runs.values()) == {1}


def test_polar_run_on_a_ray_cluster_spreads_the_task_file_over_the_ray_nodes(
    cluster: Any, tmp_path: Path
) -> None:
    """`polar run --ray ADDRESS --ray-resource polar --gateway-workers 2`: the CLI's own driver connects to
    the running cluster, places a gateway node on each Ray node offering `polar`, each serving its gateway
    on two worker processes beside its actor, and writes every result; every call is recorded in its node's
    store, and no worker outlives the run."""
    import json
    import subprocess
    import sys
    import time

    taskfile = run_taskfile(tmp_path, caller_task("spread", f"{sys.executable} call.py 2", num_samples=3))
    out = tmp_path / "out"
    most = 0
    with fake_policy() as (url, backend):
        proc = subprocess.Popen(
            [sys.executable, "-m", "polar", "run", str(taskfile), "--backend", url, "--model", SERVED_MODEL,
             "--out", str(out), "--capacity", "1", "--ray", cluster.address, "--ray-resource", "polar",
             "--gateway-workers", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        end = time.monotonic() + 300  # a bound on a hung run, not a timing assertion
        while proc.poll() is None and time.monotonic() < end:
            # Who holds a node's store open: its actor (the journal), and with workers their processes.
            most = max([most, *map(len, _store_holders(out / "nodes").values())])
            time.sleep(0.1)
        stdout, stderr = proc.communicate(timeout=max(1.0, end - time.monotonic()))
        calls = len(backend.requests)
    assert proc.returncode == 0, stdout + stderr
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["status"] for r in results] == ["COMPLETED"] * 3
    assert all(r["trajectory"]["metadata"]["calls"] == 2 for r in results)
    live = sum(1 for n in ray.nodes() if n["Alive"] and "polar" in n["Resources"])
    assert len({r["node_id"] for r in results}) == live == 3  # capacity 1 each: one session per Ray node
    assert all(r["node_id"].startswith("ray-") for r in results)
    stores = sorted((out / "nodes").glob("ray-*/gateway.db"))
    assert len(stores) == 3
    assert _recorded(stores) == calls == 6  # every call its node's workers answered, recorded once
    assert most >= 3  # the actor and two workers (one process holds it without workers)
    assert not _store_holders(out / "nodes")  # the workers stopped with their nodes
    assert "gateway nodes on Ray: ray-" in stdout


def test_sigterm_stops_a_polar_run_on_ray_as_ctrl_c_does(cluster: Any, tmp_path: Path) -> None:
    """`ray.init` makes SIGTERM `sys.exit(15)` in its driver; `polar run --ray` keeps its own handler: the
    sessions are cancelled on their Ray nodes, the summary says where each node's records are, exit 143."""
    import subprocess
    import sys
    import tempfile

    taskfile = tmp_path / "tasks.yaml"
    taskfile.write_text(
        "tasks:\n  - task_id: slow\n    instruction: wait\n    num_samples: 2\n"
        "    runtime: {backend: local}\n    agent: {harness: shell, settings: {command: 'sleep 613'}}\n"
    )
    out = tmp_path / "out"
    with fake_policy() as (url, _):
        proc = subprocess.Popen(
            [sys.executable, "-m", "polar", "run", str(taskfile), "--backend", url, "--model", SERVED_MODEL,
             "--out", str(out), "--capacity", "1", "--ray", cluster.address, "--ray-resource", "polar"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:

            def sleeping() -> list[int] | None:
                assert proc.poll() is None, proc.communicate()
                found = pids_under(Path(tempfile.gettempdir()), "sleep", "613")
                return found if len(found) == 2 else None

            sleepers = wait_until(sleeping, timeout=120, what="both sessions' agents")
            proc.send_signal(signal.SIGTERM)
            printed, errors = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 143, printed + errors
    assert "Traceback" not in errors and "SIGTERM received" not in errors
    assert "interrupted: cancelled the running sessions; nothing finished was lost" in printed
    assert f"records in {out / 'nodes'}/*/gateway.db" in printed
    wait_until(lambda: not any(alive(pid) for pid in sleepers), timeout=30, what="the agents to stop")


def test_polar_serve_on_a_ray_cluster_runs_submitted_tasks_on_its_gateway_workers(
    cluster: Any, tmp_path: Path
) -> None:
    """`polar serve --ray ADDRESS --gateway-workers 2`: the server places a gateway node on each Ray node
    offering `polar`, each serving its gateway on two processes beside its actor; a submitted task's
    sessions complete through them with every call recorded, and SIGTERM stops the server with its nodes
    and their workers (`ray.init` had made SIGTERM exit the driver with status 15 and a stack dump)."""
    import os
    import subprocess
    import sys

    from polar.serving import free_port

    caller = write_caller(tmp_path)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    most = 0
    with fake_policy() as (url, backend):
        proc = subprocess.Popen(
            [sys.executable, "-m", "polar", "serve", "--port", str(port), "--db", str(tmp_path / "server.db"),
             "--ray", cluster.address, "--ray-resource", "polar", "--capacity", "1", "--gateway-workers", "2",
             "--backend", url, "--model", SERVED_MODEL],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "POLAR_TOKEN": TOKEN},
        )  # fmt: skip
        try:

            def nodes() -> bool:
                assert proc.poll() is None, proc.communicate()[0]
                try:
                    listed = httpx.get(f"{base}/nodes", headers=AUTH).json()["nodes"]
                except (httpx.TransportError, ValueError):
                    return False
                return sum(1 for n in listed if n["healthy"]) == 3

            wait_until(nodes, timeout=120, what="a gateway node on each Ray node")
            task = _task("served", f"{sys.executable} {caller} 2", 3) | {
                "evaluator": {"strategy": "session_completed"}
            }
            assert httpx.post(f"{base}/rollout/task/submit", json=task, headers=AUTH).status_code == 201

            def done() -> Any:
                nonlocal most
                most = max([most, *map(len, _store_holders(tmp_path / "nodes").values())])
                view = httpx.get(f"{base}/rollout/task/served", headers=AUTH).json()
                return view if view["state"] == "DONE" else None

            view = wait_until(done, timeout=120, what="the task's sessions")
        finally:
            proc.send_signal(signal.SIGTERM)
            output = proc.communicate(timeout=120)[0]
        calls = len(backend.requests)
    assert proc.returncode == 0 and "SIGTERM received" not in output, output  # not Ray's exit (status 15)
    results = view["results"]
    assert [r["status"] for r in results] == ["COMPLETED"] * 3, results
    assert all(r["trajectory"]["metadata"]["calls"] == 2 for r in results)
    assert len({r["node_id"] for r in results}) == 3  # capacity 1 each: one session per Ray node
    assert _recorded((tmp_path / "nodes").glob("ray-*/gateway.db")) == calls == 6
    assert most >= 3  # the actor and two workers hold a node's store
    assert not _store_holders(tmp_path / "nodes")  # stopped with the server


def _recorded(stores: Iterable[Path]) -> int:
    """The calls recorded in these gateway stores."""
    count = 0
    for store in stores:
        with contextlib.closing(sqlite3.connect(store)) as db:  # (a connection's `with` does not close it)
            count += db.execute("SELECT count(*) FROM completions").fetchone()[0]
    return count


def _store_holders(root: Path) -> dict[Path, set[int]]:
    """The processes holding each `gateway.db` under `root` open, from /proc."""
    import os

    held: dict[Path, set[int]] = {}
    for fds in Path("/proc").glob("[0-9]*/fd"):
        try:
            names = list(fds.iterdir())
        except OSError:  # gone, or not ours to read
            continue
        for fd in names:
            try:
                target = Path(os.readlink(fd))
            except OSError:  # closed meanwhile
                continue
            if target.name == "gateway.db" and root in target.parents:
                held.setdefault(target, set()).add(int(fds.parent.name))
    return held


async def test_sessions_spread_over_ray_nodes_and_a_lost_node_runs_nothing_twice(
    cluster: Any, tmp_path: Path
) -> None:
    from polar.rollout.ray.cluster import RayNodes

    gate = tmp_path / "go"
    ran = tmp_path / "ran"  # one line per run of an agent, appended by the agent itself
    block = f'echo "$POLAR_SESSION_ID" >> {ran}; while [ ! -f {gate} ]; do sleep 0.1; done'
    # The server's own loss bound is far away: what ends the lost node's sessions is Ray's report.
    server = start_server(tmp_path / "server.db", heartbeat_timeout_s=30.0, node_lost_after_s=600.0)
    nodes: RayNodes | None = None
    try:
        with fake_policy() as (url, _):
            spec = _with_server(_spec(url, tmp_path, capacity=2, gateway_workers=2), server.url)
            nodes = RayNodes(spec, NodeRequest(resource="polar", cpus=1), server.url, TOKEN, poll_s=0.2)
            started = await nodes.start(wait_for_one=True)
            async with httpx.AsyncClient(base_url=server.url, timeout=30, headers=AUTH) as client:

                async def registered() -> list[dict[str, Any]] | None:
                    listed = (await client.get("/nodes")).json()["nodes"]
                    healthy = [n for n in listed if n["healthy"]]
                    return listed if len(healthy) == 3 else None

                listed = await _wait(registered, "three healthy gateway nodes")
                await client.post("/rollout/task/submit", json=_task("wide", block, 10))

                async def six_running() -> dict[str, Any] | None:
                    view = await _view(client, "wide")
                    running = [s for s in view["sessions"] if s["status"] == "RUNNING"]
                    return view if len(running) == 6 else None

                first = await _wait(six_running, "two sessions running on each node")
                by_node = Counter(s["node_id"] for s in first["sessions"] if s["status"] == "RUNNING")
                victim = next(p for p in nodes.placed.values() if p.node_id == sorted(by_node)[0])
                on_victim = {s["session_id"] for s in first["sessions"] if s["node_id"] == victim.node_id}
                raylet = next(n for n in cluster.worker_nodes if n.node_id == victim.ray_node)
                cluster.remove_node(raylet)

                async def victim_ended() -> bool:
                    view = await _view(client, "wide")
                    return all(
                        s["status"] in TERMINAL for s in view["sessions"] if s["session_id"] in on_victim
                    )

                await _wait(victim_ended, "the lost node's sessions to end")
                gate.touch()

                async def done() -> dict[str, Any] | None:
                    view = await _view(client, "wide")
                    return view if view["state"] == "DONE" else None

                final = await _wait(done, "every session to finish")
                after = (await client.get("/nodes")).json()["nodes"]
                # A Ray node joining gets a gateway node of its own, without restarting anything.
                joined = cluster.add_node(num_cpus=4, resources={"polar": 1})

                async def replaced() -> list[dict[str, Any]] | None:
                    listed_now = (await client.get("/nodes")).json()["nodes"]
                    fresh = [n for n in listed_now if n["node_id"] == f"ray-{joined.node_id[:12]}"]
                    return fresh if fresh and fresh[0]["healthy"] else None

                await _wait(replaced, "a gateway node on the Ray node that joined")
    finally:
        if nodes is not None:
            await nodes.stop("test finished")
        server.stop()
    assert sorted(started) == sorted(n["node_id"] for n in listed)
    assert sorted(by_node.values()) == [2, 2, 2]  # least-loaded placement over the three Ray nodes
    results = {r["session_id"]: r for r in final["results"]}
    assert len(results) == 10  # every session has its one result
    lost = {sid for sid, r in results.items() if r["status"] == "ERROR"}
    assert lost == on_victim
    for sid in lost:
        reason = results[sid]["reason"]
        assert reason.startswith(f"node lost: {victim.node_id}: Ray node "), reason
        assert "not re-run" in reason
    completed = [r for r in results.values() if r["status"] == "COMPLETED"]
    assert len(completed) == 8
    assert {r["node_id"] for r in completed} == set(by_node) - {victim.node_id}
    assert [n["lost"] for n in after if n["node_id"] == victim.node_id] == [True]
    # Nothing ran twice: each session's agent started once, and no two nodes' journals hold one id.
    runs = Counter(ran.read_text().split())
    assert set(runs) == set(results) and set(runs.values()) == {1}
    journals = {p.parent.name: _journal(p) for p in (tmp_path / "nodes").glob("*/gateway.db")}
    assert (
        len(journals) == 4 and journals[f"ray-{joined.node_id[:12]}"] == {}
    )  # three, and the one that joined
    seen = Counter(sid for j in journals.values() for sid in j)
    assert set(seen) == set(results) and set(seen.values()) == {1}
