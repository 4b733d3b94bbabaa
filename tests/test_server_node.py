"""The server's single-use and node-loss rules against a real gateway node, with the network between them
controlled by a loopback relay: a dispatch whose answer is lost (the node got it, or did not), a node that
stops heartbeating but still answers, and a node that vanishes."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import httpx

from polar.rollout.server.store import ServerStore
from tests.node_support import PY, eventually, fake_policy, pids_under, running_node, until, write_caller
from tests.server_support import AUTH, start_server

TERMINAL = ("COMPLETED", "ERROR", "TIMEOUT", "CANCELLED")


class Relay:
    """A loopback TCP relay: `cut()` refuses new connections and drops open ones (a vanished machine);
    `lose_answers` forwards the next N connections' requests but never relays the answer (a lost reply);
    `drop_requests` hangs up on the next N connections before forwarding anything."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.lose_answers = 0
        self.drop_requests = 0
        self.cut_off = False
        self.url = ""
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()

    async def start(self) -> Relay:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    def hang_up(self) -> None:
        """Close open connections (so the next request needs a new one)."""
        for w in list(self._open):
            w.close()

    async def cut(self) -> None:
        self.cut_off = True
        assert self._server is not None
        self._server.close()
        for w in list(self._open):
            w.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut_off:
            writer.close()
            return
        if self.drop_requests:
            self.drop_requests -= 1
            await reader.read(1)
            writer.close()
            return
        lose = self.lose_answers > 0
        if lose:
            self.lose_answers -= 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._open |= {writer, up_writer}
        try:
            if lose:
                forward = asyncio.create_task(_pipe(reader, up_writer))
                await up_reader.read(1)  # the node has answered: the caller never hears it
                writer.close()
                forward.cancel()
                up_writer.close()
            else:
                await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            self._open -= {writer, up_writer}


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, asyncio.CancelledError):
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    dst.close()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _task(task_id: str, command: str, **fields: Any) -> dict[str, Any]:
    return {
        "task_id": task_id,
        "instruction": "do it",
        "timeout_seconds": 60,
        "agent": {"harness": "shell", "settings": {"command": command}},
        # These sessions coordinate with the test through host files (gates, pid files): a trusted program
        # on the host's files, which only `local` gives (a sandbox sees none of the test's tmp_path).
        "runtime": {"backend": "local"},
        **fields,
    }


async def _view(client: httpx.AsyncClient, task_id: str) -> dict[str, Any]:
    view: dict[str, Any] = (await client.get(f"/rollout/task/{task_id}")).json()
    return view


async def _done(client: httpx.AsyncClient, task_id: str) -> dict[str, Any] | None:
    view = await _view(client, task_id)
    return view if all(s["status"] in TERMINAL for s in view["sessions"]) else None


async def _healthy(client: httpx.AsyncClient) -> bool:
    nodes = (await client.get("/nodes")).json()["nodes"]
    return bool(nodes) and bool(nodes[0]["healthy"])


async def test_lost_dispatch_answers_never_run_a_session_twice(tmp_path: Path) -> None:
    """First dispatch: the node accepts but the reply is lost; the server sends the same dispatch again
    and the node answers "duplicate" (it has it). Second task: the request and its resend never reach the
    node; the node answers 404 to the probe (fencing that dispatch), and the session is re-dispatched under
    the same id. Each runs exactly once."""
    caller = write_caller(tmp_path)
    server = start_server(tmp_path / "server.db")
    try:
        with fake_policy() as (url, fake):
            relay = Relay(0)
            async with running_node(url, tmp_path, server_url=server.url, heartbeat_s=0.05) as node:
                relay.target_port = _port(node.control_url)
                await relay.start()
                relay.lose_answers = 1
                async with httpx.AsyncClient(base_url=server.url, timeout=30, headers=AUTH) as client:
                    await eventually(lambda: _healthy(client), "a healthy node")
                    # register again with the relay's URL: the server reaches the node only through it
                    reg = {"node_id": node.node_id, "url": relay.url, "capacity": 4}
                    assert (await client.post("/nodes/register", json=reg)).status_code == 200
                    await client.post("/rollout/task/submit", json=_task("lost-reply", f"{PY} {caller}"))
                    view = await eventually(lambda: _done(client, "lost-reply"), "the first task")
                    relay.drop_requests = 2  # the dispatch and its resend
                    relay.hang_up()
                    await client.post("/rollout/task/submit", json=_task("lost-request", f"{PY} {caller}"))
                    view2 = await eventually(lambda: _done(client, "lost-request"), "the second task")
    finally:
        server.stop()
    for v in (view, view2):
        (res,) = v["results"]
        assert res["status"] == "COMPLETED" and res["reward"] == 1.0, res
    assert len(fake.requests) == 2  # one model call per session: neither ran twice
    assert relay.lose_answers == 0 and relay.drop_requests == 0
    store = ServerStore(tmp_path / "server.db")
    # the lost reply was settled by the resend (one dispatch); the lost request was dispatched again, same id
    assert store.session(view["sessions"][0]["session_id"]).attempts == 1  # type: ignore[union-attr]
    assert store.session(view2["sessions"][0]["session_id"]).attempts == 2  # type: ignore[union-attr]
    store.close()


async def test_a_node_that_stops_heartbeating_keeps_its_session_and_the_probe_collects_it(
    tmp_path: Path,
) -> None:
    """Heartbeats (node -> server) are cut, the node itself still answers: it turns unhealthy, the
    server asks about its session instead of re-running it, and picks up the result the node could not
    deliver."""
    gate = tmp_path / "go"
    server = start_server(tmp_path / "server.db", heartbeat_timeout_s=0.3)
    uplink = Relay(_port(server.url))
    await uplink.start()
    try:
        with fake_policy() as (url, _):
            async with (
                running_node(
                    url, tmp_path, server_url=uplink.url, heartbeat_s=0.05, report_attempts=1
                ) as node,
                httpx.AsyncClient(base_url=server.url, timeout=30, headers=AUTH) as client,
            ):
                await eventually(lambda: _healthy(client), "a healthy node")
                command = f"while [ ! -f {gate} ]; do sleep 0.05; done"
                await client.post("/rollout/task/submit", json=_task("quiet", command))
                await until(lambda: node.status().by_stage.get("RUNNING") == 1, "the session to run")
                await uplink.cut()
                await eventually(lambda: _not(_healthy(client)), "the node to turn unhealthy")
                view = await _view(client, "quiet")
                assert view["sessions"][0]["status"] not in TERMINAL  # not re-run, not given up
                gate.touch()
                view = await eventually(lambda: _done(client, "quiet"), "the probe to collect the result")
    finally:
        server.stop()
    (res,) = view["results"]
    assert res["status"] == "COMPLETED" and res["node_id"] == "node-test"
    assert view["sessions"][0]["node_id"] == "node-test"


async def _not(check: Any) -> bool:
    return not await check


async def test_a_vanished_node_ends_its_sessions_as_node_lost(tmp_path: Path) -> None:
    """Both directions cut: after node_lost_after_s of silence its session ends ERROR "node lost" and is
    not re-run elsewhere (the node may well still be running it)."""
    gate = tmp_path / "go"
    server = start_server(tmp_path / "server.db", heartbeat_timeout_s=0.2, node_lost_after_s=0.6)
    uplink = Relay(_port(server.url))
    await uplink.start()
    try:
        with fake_policy() as (url, _):
            async with running_node(
                url, tmp_path, server_url=uplink.url, heartbeat_s=0.05, report_attempts=1, node_id="node-a"
            ) as node:
                down = Relay(_port(node.control_url))
                await down.start()
                async with httpx.AsyncClient(base_url=server.url, timeout=30, headers=AUTH) as client:
                    await eventually(lambda: _healthy(client), "a healthy node")
                    reg = {"node_id": "node-a", "url": down.url, "capacity": 1}
                    await client.post("/nodes/register", json=reg)
                    command = f"while [ ! -f {gate} ]; do sleep 0.05; done"
                    await client.post("/rollout/task/submit", json=_task("vanish", command))
                    await until(lambda: node.status().by_stage.get("RUNNING") == 1, "the session to run")
                    await uplink.cut()
                    await down.cut()
                    view = await eventually(lambda: _done(client, "vanish"), "the node to be declared lost")
                    nodes = (await client.get("/nodes")).json()["nodes"]
                    gate.touch()
    finally:
        server.stop()
    (res,) = view["results"]
    assert res["status"] == "ERROR" and res["reason"].startswith("node lost: node-a")
    assert nodes[0]["lost"] is True and nodes[0]["healthy"] is False


async def test_cancelling_a_task_kills_its_sessions_on_the_node(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    command = f"sleep 60 & mktemp {pids}/agent.XXXXXX >/dev/null; wait"  # ($$ is 2 in every PID namespace)
    server = start_server(tmp_path / "server.db")
    try:
        with fake_policy() as (url, _):
            async with (
                running_node(url, tmp_path, server_url=server.url, heartbeat_s=0.05, capacity=4) as node,
                httpx.AsyncClient(base_url=server.url, timeout=30, headers=AUTH) as client,
            ):
                await eventually(lambda: _healthy(client), "a healthy node")
                await client.post("/rollout/task/submit", json=_task("long", command, num_samples=2))
                await until(lambda: len(list(pids.iterdir())) == 2, "both agents to start")
                r = await client.delete("/rollout/task/long")
                assert r.json() == {"task_id": "long", "cancelled": True, "state": "CANCELLED"}
                await until(lambda: node.status().active == 0, "the node to free both sessions")
                view = await _view(client, "long")
    finally:
        server.stop()
    assert [s["status"] for s in view["sessions"]] == ["CANCELLED", "CANCELLED"]
    assert all(s["node_id"] == "node-test" for s in view["sessions"])
    await until(lambda: not pids_under(tmp_path / "runtimes", "sleep", "60"), "both agents to die")


async def test_two_nodes_share_by_load_and_priority_decides_the_queue(tmp_path: Path) -> None:
    """Four blocking sessions over nodes of capacity 2 and 3 land two and two (least-loaded fraction);
    then, with both full, a high-priority task submitted after a low one takes the one slot that frees."""
    gate, gate2 = tmp_path / "go", tmp_path / "go2"
    block = f"while [ ! -f {gate} ]; do sleep 0.05; done"
    block2 = f"while [ ! -f {gate2} ]; do sleep 0.05; done"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    server = start_server(tmp_path / "server.db")
    try:
        with fake_policy() as (url, _):
            async with (
                running_node(
                    url, tmp_path / "a", server_url=server.url, heartbeat_s=0.05, capacity=2, node_id="a"
                ),
                running_node(
                    url, tmp_path / "b", server_url=server.url, heartbeat_s=0.05, capacity=3, node_id="b"
                ),
                httpx.AsyncClient(base_url=server.url, timeout=30, headers=AUTH) as client,
            ):

                async def both() -> bool:
                    nodes = (await client.get("/nodes")).json()["nodes"]
                    return len(nodes) == 2 and all(n["healthy"] for n in nodes)

                await eventually(both, "two healthy nodes")
                await client.post("/rollout/task/submit", json=_task("wide", block, num_samples=4))

                async def placed() -> dict[str, Any] | None:
                    view = await _view(client, "wide")
                    return view if all(s["status"] not in ("REGISTERED",) for s in view["sessions"]) else None

                wide = await eventually(placed, "all four placed")
                await client.post("/rollout/task/submit", json=_task("fill", block2))  # b's last slot
                await eventually(lambda: _placed_one(client, "fill"), "the filler placed")
                await client.post("/rollout/task/submit", json=_task("low", "true"))
                await client.post("/rollout/task/submit", json=_task("high", "true", priority=5))
                gate2.touch()  # exactly one slot frees: the high-priority task gets it, low waits for it
                await eventually(lambda: _done(client, "low"), "low")
                await eventually(lambda: _done(client, "high"), "high")
                order = (
                    await client.get("/rollout/results", params=[("task", "low"), ("task", "high")])
                ).json()
    finally:
        server.stop()
    by_node: dict[str, int] = {}
    for s in wide["sessions"]:
        by_node[s["node_id"]] = by_node.get(s["node_id"], 0) + 1
    assert by_node == {"a": 2, "b": 2}
    assert [r["task_id"] for r in order["results"]] == ["high", "low"]


async def _placed_one(client: httpx.AsyncClient, task_id: str) -> bool:
    return (await _view(client, task_id))["sessions"][0]["status"] != "REGISTERED"


class HoldDispatches:
    """Wraps a node's control app: while `holding`, each `POST /node/sessions` is read whole and then held
    inside the node (its request still in flight there) until `release()`; what the node answers the
    released ones is recorded. The caller has long given up on them by then."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.holding = True
        self.held = 0
        self.answers: list[int] = []
        self._go = asyncio.Event()

    def release(self) -> None:
        self.holding = False
        self._go.set()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if not (
            self.holding
            and scope["type"] == "http"
            and (scope["method"], scope["path"]) == ("POST", "/node/sessions")
        ):
            await self.app(scope, receive, send)
            return
        messages = []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        self.held += 1
        await self._go.wait()
        replay = iter(messages)

        async def again() -> Any:
            return next(replay, {"type": "http.disconnect"})

        async def record(message: Any) -> None:
            if message["type"] == "http.response.start":
                self.answers.append(message["status"])
            with contextlib.suppress(Exception):  # the server hung up long ago
                await send(message)

        await self.app(scope, again, record)


async def test_a_dispatch_still_in_flight_when_the_probe_finds_nothing_never_runs(tmp_path: Path) -> None:
    """The lost-reply race, reproduced: node a receives the dispatch (and its resend) but answers neither
    before the server gives up; the server's probe finds nothing on a and requeues the session, which runs
    on node b. Then a's held requests go on: a fenced that dispatch when it answered the probe, so it refuses
    both (409) instead of running the session a second time."""
    runs = tmp_path / "runs"
    command = f'echo "$POLAR_SESSION_ID" >> {runs}'
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    # a short dispatch timeout (the held requests), and a long cooldown: the requeued session goes to b
    server = start_server(tmp_path / "server.db", node_timeout_s=0.5, refuse_cooldown_s=600.0)
    holds: list[HoldDispatches] = []

    def hold(app: Any) -> HoldDispatches:
        holds.append(HoldDispatches(app))
        return holds[0]

    try:
        with fake_policy() as (url, _):
            common: dict[str, Any] = {"server_url": server.url, "heartbeat_s": 0.05}
            async with (
                running_node(url, tmp_path / "a", node_id="a", wrap_control=hold, **common) as a,
                running_node(url, tmp_path / "b", node_id="b", **common),
                httpx.AsyncClient(base_url=server.url, timeout=30, headers=AUTH) as client,
            ):

                async def both() -> bool:
                    nodes = (await client.get("/nodes")).json()["nodes"]
                    return len(nodes) == 2 and all(n["healthy"] for n in nodes)

                await eventually(both, "two healthy nodes")
                await client.post("/rollout/task/submit", json=_task("race", command))
                view = await eventually(lambda: _done(client, "race"), "the session to run on b")
                assert holds[0].held == 2  # the dispatch and its resend, both still inside node a
                holds[0].release()
                await until(lambda: len(holds[0].answers) == 2, "node a to answer the held requests")
                (sid,) = [s["session_id"] for s in view["sessions"]]
                on_a = a.state(sid)
                assert a.journal is not None
                fence = a.journal.get(sid)
    finally:
        for h in holds:
            h.release()
        server.stop()
    (res,) = view["results"]
    assert res["status"] == "COMPLETED" and res["node_id"] == "b"
    assert holds[0].answers == [409, 409]
    assert runs.read_text().split() == [sid]  # ran once, on b
    assert on_a is None and fence is not None and fence.state.value == "fenced"
