"""Task-given outbound URLs (`callback_url`, `agent.side_call_backend.url`, a judge's
`evaluator.config.backend.url`) cannot reach internal places.

Through the real rollout server over HTTP: internal and metadata URLs are refused at submit with a 400
naming the field; link-local and metadata stay refused even when the operator allowlists everything; an
allowlisted loopback receiver still gets its callbacks. DNS rebinding (a name that resolves to a public
address at submit and to loopback afterwards) is refused when the connection is made: for callbacks at
delivery, recorded with the reason; for side calls at the node's gateway, an error in the harness's
dialect, recorded as a failure. Resolution is changed through the policy's `lookup` (what a rebinding
attacker's DNS server does); the refusals themselves run the product's code unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from polar.gateway.routing import ROUTE_KEY
from polar.netguard import OutboundPolicy, system_lookup
from polar.serving import ServerThread, serve
from polar.store.sqlite import SQLiteStore
from polar.task import Task
from tests.conftest import SERVED_MODEL, start_gateway
from tests.fakes.fake_vllm import Reply, make_fake_backend
from tests.node_support import PY, eventually, fake_policy, program, running_node, shell_task
from tests.server_support import AUTH, StandInNode, result, start_server, task, wait_until
from tests.side_call_harness import SIDE_CALL_SCRIPT

INTERNAL = [
    "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
    "http://[::1]:22/",
    "http://0x7f000001/",
    "https://metadata.google.internal/computeMetadata/v1/",
]
PUBLIC_IP = "93.184.216.34"  # a global unicast address; nothing is ever sent to it in these tests
HARNESS = "tests.side_call_harness:SideCallShell"
FROZEN_MODEL = "frozen-titler"


class Resolutions:
    """A resolver whose answers for some names the test sets and changes; other names go to the system."""

    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append(host)
        if host in self.answers:
            return self.answers[host]
        return await system_lookup(host, port)


class Receiver:
    """A trainer's callback endpoint that records every POST it gets."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    async def handle(self, request: Request) -> Response:
        self.seen.append(orjson.loads(await request.body()))
        return Response(b"{}", media_type="application/json")


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, ServerThread]]:
    r = Receiver()
    with serve(Starlette(routes=[Route("/cb", r.handle, methods=["POST"])])) as srv:
        yield r, srv


def _route_agent(url: str) -> dict[str, Any]:
    return {
        "harness": HARNESS,
        "settings": {"command": "true"},
        "side_calls": "route",
        "side_call_backend": {"url": url, "kind": "vllm", "model": FROZEN_MODEL},
    }


def _submit(server: ServerThread, body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/rollout/task/submit", json=body, timeout=30, headers=AUTH)


def _bodies(url: str) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("callback_url", task("t", callback_url=url)),
        ("agent.side_call_backend.url", task("t", agent=_route_agent(url))),
        ("evaluator.config.backend.url", task("t", evaluator=_judge(url))),
        ("evaluators.quality.config.backend.url", task("t", evaluators={"quality": _judge(url)})),
    ]


def _judge(url: str) -> dict[str, Any]:
    return {"strategy": "judge", "config": {"rubric": "r", "backend": {"url": url, "model": "judge"}}}


@pytest.mark.parametrize("url", INTERNAL)
def test_internal_urls_are_refused_at_submit_naming_the_field(tmp_path: Path, url: str) -> None:
    server = start_server(tmp_path / "server.db", outbound=OutboundPolicy())
    try:
        for field, body in _bodies(url):
            r = _submit(server, body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == field
            assert error["message"].startswith(f"{field}: {url!r} is refused: ")
            r = _submit(server, {"tasks": [task("ok"), body]})  # located in a batch too
            assert r.status_code == 400 and r.json()["error"]["param"] == f"tasks[1].{field}"
        assert httpx.get(f"{server.url}/rollout/status", headers=AUTH).json()["tasks"] == {}  # nothing stored
    finally:
        server.stop()


def test_link_local_and_metadata_stay_refused_when_everything_is_allowlisted(tmp_path: Path) -> None:
    names = Resolutions({"innocent.example": ["169.254.169.254"], "v6.example": ["fd00:ec2::254"]})
    policy = OutboundPolicy(allow=("0.0.0.0/0", "::/0"), lookup=names)
    server = start_server(tmp_path / "server.db", outbound=policy)
    try:
        for url in (
            INTERNAL[0],
            INTERNAL[3],
            "http://innocent.example/",
            "http://v6.example/",
            "http://[::ffff:169.254.169.254]/",
        ):
            for field, body in _bodies(url):
                r = _submit(server, body)
                assert r.status_code == 400, (url, r.text)
                assert r.json()["error"]["param"] == field
                assert "never allowed" in r.json()["error"]["message"]
        # What the allowlist does cover is accepted: loopback, written as hex.
        assert _submit(server, task("hex", callback_url=INTERNAL[2])).status_code == 201
    finally:
        server.stop()
    with pytest.raises(ValueError, match="never allowed"):
        OutboundPolicy(allow=("169.254.169.254",))


def test_an_allowlisted_loopback_receiver_gets_its_callbacks(
    tmp_path: Path, receiver: tuple[Receiver, ServerThread]
) -> None:
    endpoint, srv = receiver
    url = f"{srv.url}/cb"
    closed = start_server(tmp_path / "closed.db", outbound=OutboundPolicy())
    try:
        r = _submit(closed, task("t1", callback_url=url))
        assert r.status_code == 400 and r.json()["error"]["param"] == "callback_url"
        assert "127.0.0.1 is a loopback address" in r.json()["error"]["message"]
    finally:
        closed.stop()
    server = start_server(tmp_path / "open.db", outbound=OutboundPolicy(allow=("127.0.0.1",)))
    node = StandInNode()
    try:
        with httpx.Client(timeout=30, headers=AUTH) as http:
            node.register(http, server.url)
            assert _submit(server, task("t1", callback_url=url)).status_code == 201
            (s,) = http.get(f"{server.url}/rollout/task/t1").json()["sessions"]
            node.report(http, server.url, result(s["session_id"], "t1", reward=1.0))

            def delivered() -> Any:
                cbs = http.get(f"{server.url}/rollout/task/t1").json()["callbacks"]
                return len(cbs) == 2 and all(c["state"] == "delivered" for c in cbs)

            wait_until(delivered, what="both callbacks to be delivered")
    finally:
        server.stop()
        node.stop()
    assert sorted(b["event"] for b in endpoint.seen) == ["session_result", "task_done"]


async def _first_event(lines: Any, kind: str) -> dict[str, Any]:
    """The first event of `kind` (the bound only keeps a broken build from hanging the suite)."""
    current = None
    async with asyncio.timeout(30):
        async for line in lines:
            if line.startswith("event: "):
                current = line.removeprefix("event: ")
            elif line.startswith("data: ") and current == kind:
                event: dict[str, Any] = orjson.loads(line.removeprefix("data: "))
                return event
    raise AssertionError("stream ended early")


async def test_a_callback_name_rebound_to_loopback_is_refused_at_delivery(
    tmp_path: Path, receiver: tuple[Receiver, ServerThread]
) -> None:
    endpoint, srv = receiver
    names = Resolutions({"trainer.rebind.test": [PUBLIC_IP]})
    server = start_server(tmp_path / "server.db", outbound=OutboundPolicy(lookup=names))
    url = f"http://trainer.rebind.test:{srv.port}/cb"  # the receiver's port: loopback would reach it
    node = StandInNode()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, headers=AUTH) as http:
            await asyncio.to_thread(node.register, httpx.Client(headers=AUTH), server.url)
            assert (
                await http.post("/rollout/task/submit", json=task("t1", callback_url=url))
            ).status_code == 201
            assert names.asked == ["trainer.rebind.test"]  # checked at submit: public then
            names.answers["trainer.rebind.test"] = ["127.0.0.1"]  # the attacker's DNS changes its answer
            (s,) = (await http.get("/rollout/task/t1")).json()["sessions"]
            async with http.stream("GET", "/events", params={"kinds": "callback_failed"}) as stream:
                body = result(s["session_id"], "t1", reward=1.0)
                with httpx.Client(headers=AUTH) as sync_http:
                    r = await asyncio.to_thread(node.report, sync_http, server.url, body)
                assert r.status_code == 200, r.text
                event = await _first_event(stream.aiter_lines(), "callback_failed")

            async def failed() -> Any:
                cbs = (await http.get("/rollout/task/t1")).json()["callbacks"]
                return cbs if len(cbs) == 2 and all(c["state"] == "failed" for c in cbs) else None

            cbs = await eventually(failed, "both callbacks to be refused")
    finally:
        server.stop()
        node.stop()
    assert endpoint.seen == []  # nothing reached the loopback listener
    assert names.asked.count("trainer.rebind.test") >= 2  # resolved again at delivery
    for cb in cbs:
        assert cb["attempts"] == 1  # a refusal is final: no retries probing the address again
        assert cb["last_error"].startswith("refused by the outbound policy: trainer.rebind.test")
        assert "127.0.0.1 is a loopback address" in cb["last_error"]
    assert event["url"] == url and event["error"].startswith("refused by the outbound policy")


def _side_task(tmp_path: Path, backend_url: str) -> Task:
    script = program("side_calls.py", SIDE_CALL_SCRIPT)
    return shell_task(
        f"{PY} {script} > out.txt",
        agent={
            "harness": HARNESS,
            "side_calls": "route",
            "side_call_backend": {"url": backend_url, "kind": "vllm", "model": FROZEN_MODEL},
        },
    )


async def test_a_side_call_backend_rebound_to_loopback_is_refused_at_connect(tmp_path: Path) -> None:
    """Submitted to the real server (public at submit), run on a real node whose gateway then resolves the
    name to the loopback frozen model: the side call is refused, the session ends as an infrastructure
    error, and the frozen model gets nothing."""
    frozen = make_fake_backend("vllm", [Reply("Frozen title")], model=FROZEN_MODEL)
    names = Resolutions({"frozen.rebind.test": [PUBLIC_IP]})
    policy = OutboundPolicy(lookup=names)
    server = start_server(tmp_path / "server.db", outbound=policy)
    try:
        with serve(frozen) as frozen_srv, fake_policy([Reply("Done.")]) as (url, main_policy):
            side_task = _side_task(tmp_path, f"http://frozen.rebind.test:{frozen_srv.port}")
            async with (
                httpx.AsyncClient(base_url=server.url, timeout=30, headers=AUTH) as http,
                running_node(url, tmp_path, server_url=server.url, heartbeat_s=0.05, outbound=policy),
            ):
                body = side_task.model_dump(mode="json")
                r = await http.post("/rollout/task/submit", json=body)
                assert r.status_code == 201, r.text
                names.answers["frozen.rebind.test"] = ["127.0.0.1"]

                async def done() -> Any:
                    view = (await http.get("/rollout/task/t1")).json()
                    return view if view["state"] == "DONE" else None

                view = await eventually(done, "the session to end")
    finally:
        server.stop()
    assert frozen.requests == [] and main_policy.requests == []
    (res,) = view["results"]
    assert res["status"] == "ERROR", res
    with SQLiteStore(tmp_path / "node.db") as store:
        (failure,) = store.failures(res["session_id"])
    assert failure.kind == "upstream_error"
    assert "is not allowed: frozen.rebind.test resolves to a refused address" in failure.message
    assert "127.0.0.1 is a loopback address" in failure.message


def test_a_refused_side_call_is_an_error_in_the_callers_dialect(tmp_path: Path) -> None:
    """At the gateway: a route to a name now resolving to loopback, and one to a loopback IP literal
    (which aiohttp never resolves), are answered at once in the caller's dialect and recorded."""
    frozen = make_fake_backend("vllm", [Reply("never")], model=FROZEN_MODEL)
    with serve(frozen) as frozen_srv, fake_policy([Reply("never")]) as (url, main_policy):
        names = Resolutions({"frozen.rebind.test": ["127.0.0.1"]})
        gw = start_gateway(url, tmp_path, outbound=OutboundPolicy(lookup=names))
        try:
            routes = {
                "frozen.rebind.test": f"http://frozen.rebind.test:{frozen_srv.port}",
                "127.0.0.1 is a loopback": frozen_srv.url,
            }
            for why, backend_url in routes.items():
                route = {
                    "harness": HARNESS,
                    "settings": {"command": "true"},
                    "backend": {"url": backend_url, "kind": "vllm", "model": FROZEN_MODEL},
                }
                sid = gw.new_session(metadata={ROUTE_KEY: route})
                chat = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=sid, max_retries=0)
                with pytest.raises(openai.APIStatusError) as err:
                    chat.chat.completions.create(
                        model=SERVED_MODEL, messages=[{"role": "user", "content": "title?"}]
                    )
                assert err.value.status_code == 502 and why in str(err.value)
                assert "is not allowed" in str(err.value)
                messages = anthropic.Anthropic(base_url=gw.url, api_key=sid, max_retries=0)
                with pytest.raises(anthropic.APIStatusError) as aerr:
                    messages.messages.create(
                        model=SERVED_MODEL, max_tokens=16, messages=[{"role": "user", "content": "title?"}]
                    )
                assert aerr.value.status_code == 502 and why in str(aerr.value)
                with SQLiteStore(gw.store_path) as store:
                    failures = store.failures(sid)
                assert [f.kind for f in failures] == ["upstream_error", "upstream_error"]
                assert all("is not allowed" in f.message for f in failures)
        finally:
            gw.server.stop()
    assert frozen.requests == [] and main_policy.requests == []


def test_the_cli_refuses_allowlist_entries_that_can_never_be_allowed(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from polar.cli.node import node
    from polar.cli.serve import serve as serve_cmd

    runner = CliRunner()
    for cmd, args in (
        (serve_cmd, ["--db", str(tmp_path / "s.db")]),
        (node, ["--backend", "http://127.0.0.1:9", "--store", str(tmp_path / "n.db")]),
    ):
        for entry, why in (
            ("169.254.169.254", "never allowed"),
            ("metadata.google.internal", "never allowed"),
        ):
            r = runner.invoke(cmd, [*args, "--allow-callback", "10.0.0.0/8", "--allow-callback", entry])
            assert r.exit_code == 2, r.output
            assert "--allow-callback" in r.output and why in r.output
