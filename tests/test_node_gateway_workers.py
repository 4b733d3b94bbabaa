"""A node whose gateway runs on several workers (`polar node --gateway-workers N`, docs/gateway-workers.md):
each session is created on its owner and its runtime is pointed at that worker's own model API, so no call
is passed between workers; the node's control listener reaches the workers (records, pause and resume,
metrics); judges go through them; the workers stop with the node. Real processes: the node starts
`polar gateway --workers 2` as it ships (`polar.cli.node_gateway`)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
from pathlib import Path

import httpx
import pytest

from polar.gateway.forward import owner
from polar.rollout.node import Node
from polar.rollout.node.gateway_link import GatewayStartError
from polar.rollout.protocol import SessionStatus
from polar.serving import BindError
from polar.trajectory import Trajectory
from tests.conftest import SERVED_MODEL
from tests.fakes.fake_vllm import Reply
from tests.node_support import (
    PY,
    TOKEN,
    eventually,
    fake_policy,
    running_node,
    sandboxed_caller_task,
    shell_task,
    spec,
    write_caller,
)

WORKERS = 2


def ids_on_each_worker(n: int = WORKERS) -> list[str]:
    """Session ids whose owners are worker 0, 1, ... (one each), as the node's sessions spread."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < n:
        sid = f"sess-w-{i}"
        found.setdefault(owner(sid, n), sid)
        i += 1
    return [found[k] for k in range(n)]


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    assert m is not None, f"{name} not in the metrics"
    return float(m.group(1))


async def test_each_session_runs_on_its_owner_and_nothing_is_passed_between_workers(tmp_path: Path) -> None:
    """The runtime's gateway URL is its owner's own model API (the session writes it out; the evaluator
    checks it), the calls are recorded and build one trace each, and no worker passed a call on."""
    caller = write_caller(tmp_path)
    sids = ids_on_each_worker()
    with fake_policy() as (url, fake):
        async with running_node(url, tmp_path, gateway_workers=WORKERS) as node:
            assert node.servers.child is not None and len(node.servers.child.worker_urls) == WORKERS
            owners = {sid: node.servers.child.worker_urls[owner(sid, WORKERS)] for sid in sids}
            assert len(set(owners.values())) == WORKERS and node.url not in owners.values()
            for sid in sids:
                task = shell_task(
                    f'echo "$POLAR_GATEWAY_URL" > url.txt && {PY} {caller} 2',
                    evaluator={
                        "strategy": "test_on_output",
                        "config": {"command": "cat url.txt", "expect": owners[sid], "match": "contains"},
                    },
                )
                await node.submit(spec(task, sid))
            results = [await node.wait(sid) for sid in sids]
            async with httpx.AsyncClient(headers={"authorization": f"Bearer {TOKEN}"}) as http:
                scraped = (await http.get(node.control_url + "/metrics")).text
                records = (await http.get(f"{node.control_url}/sessions/{sids[1]}/completions")).json()
    for r in results:
        assert r.status == SessionStatus.COMPLETED, r.reason
        assert r.reward == 1.0  # the runtime was given its owner's URL
        assert len(Trajectory.model_validate(r.trajectory).traces) == 1
    assert len(fake.requests) == 2 * len(sids)
    assert len(records["completions"]) == 2  # through the node's control listener, from the owner
    assert metric(scraped, "polar_gateway_passed_on_total") == 0
    assert metric(scraped, "polar_gateway_records_committed_total") == 2 * len(
        sids
    )  # summed over the workers
    assert 'polar_node_session_ends_total{status="COMPLETED"} 2.0' in scraped  # the node's own, beside them


async def test_pause_and_resume_reach_every_worker(tmp_path: Path) -> None:
    with fake_policy() as (url, _):
        async with (
            running_node(url, tmp_path, gateway_workers=WORKERS) as node,
            httpx.AsyncClient(headers={"authorization": f"Bearer {TOKEN}"}) as http,
        ):
            paused = await http.post(node.control_url + "/admin/pause", json={})
            health = (await http.get(node.control_url + "/health")).json()
            resumed = await http.post(node.control_url + "/admin/resume", json={})
            after = (await http.get(node.control_url + "/health")).json()
            anonymous = await httpx.AsyncClient().post(node.control_url + "/admin/pause", json={})
    assert paused.status_code == 200 and resumed.status_code == 200, (paused.text, resumed.text)
    assert health["paused"] is True and after["paused"] is False, (health, after)
    assert anonymous.status_code == 401  # the node's token check stands before the workers


async def test_a_judge_session_goes_through_the_workers(tmp_path: Path) -> None:
    """Evaluator models (`Node.models()`) open their session on its owner, are called there, and are
    refused once closed."""
    import openai

    with fake_policy([Reply("judged")]) as (url, _):
        async with running_node(url, tmp_path, gateway_workers=WORKERS) as node:
            models = node.models()
            backend = {"url": url, "kind": "vllm", "model": SERVED_MODEL}
            session = await models.open_session("judge", backend, "sess-judged", {})
            client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.session_id, max_retries=0)
            ask = [{"role": "user", "content": "grade it"}]
            answer = await client.chat.completions.create(model="m", messages=ask)  # type: ignore[arg-type]
            await models.close_session(session.session_id)
            with pytest.raises(openai.AuthenticationError):
                await client.chat.completions.create(model="m", messages=ask)  # type: ignore[arg-type]
            assert node.servers.child is not None
            expected = node.servers.child.worker_urls[owner(session.session_id, WORKERS)]
    assert answer.choices[0].message.content == "judged"
    assert session.base_url == f"{expected}/v1"


@pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap not installed (scripts/test installs it)"
)
async def test_a_sandboxed_session_reaches_its_owner_only(tmp_path: Path) -> None:
    """In a bubblewrap sandbox (network=gateway) the forwarder inside leads to the session's owner: the
    calls are answered and none was passed between workers."""
    sid = ids_on_each_worker()[1]
    task = sandboxed_caller_task(tmp_path)
    with fake_policy([Reply("one"), Reply("sandboxed")]) as (url, fake):
        async with running_node(url, tmp_path, upload_roots=(tmp_path,), gateway_workers=WORKERS) as node:
            await node.submit(spec(task, sid))
            result = await node.wait(sid)
            async with httpx.AsyncClient(headers={"authorization": f"Bearer {TOKEN}"}) as http:
                scraped = (await http.get(node.control_url + "/metrics")).text
    assert result.status == SessionStatus.COMPLETED, result.reason
    assert result.reward == 1.0 and len(fake.requests) == 2
    assert metric(scraped, "polar_gateway_passed_on_total") == 0


async def test_the_workers_stop_with_the_node(tmp_path: Path) -> None:
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path, gateway_workers=WORKERS) as node:
            child = node.servers.child
            assert child is not None and child.proc is not None
            pid = child.proc.pid
            workers = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
            assert len(workers) == WORKERS
    assert child.proc.poll() is not None
    assert not [p for p in (pid, *workers) if os.path.exists(f"/proc/{p}") and _alive(p)]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def test_a_port_in_use_is_one_line(tmp_path: Path) -> None:
    """The workers cannot bind the node's model API port: the node does not start, and says why."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with fake_policy() as (url, _), pytest.raises(GatewayStartError, match=f"{port}"):
            async with running_node(url, tmp_path, gateway_workers=WORKERS, port=port):
                pass
    finally:
        taken.close()


async def test_the_node_stops_when_its_gateway_is_killed(tmp_path: Path) -> None:
    """kill -9 of the workers' supervisor (its workers get SIGTERM from the kernel): with no gateway the
    node cannot serve its sessions, so it stops rather than admit sessions nothing can serve."""
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path, gateway_workers=WORKERS) as node:
            assert node.servers.child is not None and node.servers.child.proc is not None
            serving = asyncio.create_task(node.serve_forever())
            os.kill(node.servers.child.proc.pid, signal.SIGKILL)
            await asyncio.wait_for(serving, 60)
            assert node.draining


async def test_a_node_that_cannot_serve_its_control_port_stops_its_workers(tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    started: list[Node] = []
    try:
        with fake_policy() as (url, _), pytest.raises(BindError):
            async with running_node(
                url, tmp_path, gateway_workers=WORKERS, control_port=taken.getsockname()[1], seen=started
            ):
                pass
    finally:
        taken.close()
    (node,) = started
    assert node.servers.child is not None and node.servers.child.proc is not None
    assert node.servers.child.proc.poll() is not None  # the workers' supervisor was stopped


async def test_a_worker_killed_is_started_again_and_serves_its_sessions(tmp_path: Path) -> None:
    """kill -9 of one worker: its supervisor starts it again on the same sockets (as for `polar gateway
    --workers`), and a session it owns then runs through it."""
    caller = write_caller(tmp_path)
    sid = ids_on_each_worker()[1]
    with fake_policy() as (url, fake):
        async with running_node(url, tmp_path, gateway_workers=WORKERS) as node:
            assert node.servers.child is not None and node.servers.child.proc is not None
            supervisor = node.servers.child.proc.pid
            before = _children(supervisor)
            assert len(before) == WORKERS
            os.kill(before[1], signal.SIGKILL)

            async def restarted() -> bool:
                now = _children(supervisor)
                return len(now) == WORKERS and before[1] not in now

            await eventually(restarted, "the worker to be started again")
            owner_url = node.servers.child.worker_urls[owner(sid, WORKERS)]
            async with httpx.AsyncClient(timeout=30) as http:  # its sockets were kept: it serves on them
                assert (await http.get(owner_url + "/health")).status_code == 200
            await node.submit(spec(shell_task(f"{PY} {caller} 2"), sid))
            result = await node.wait(sid)
    assert result.status == SessionStatus.COMPLETED, result.reason
    assert len(fake.requests) == 2


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
