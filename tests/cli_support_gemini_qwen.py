"""Running the `gemini_cli` and `qwen_code` presets on a real node, and the checks their tests share.

`run_cli` submits one task whose agent is the preset to a node (the gateway, a `local` or `bwrap` runtime
with only the gateway reachable) in front of the scripted fake vLLM, with an evaluator that reads the file
the CLI's own tool wrote (`expect`; None: just that the CLI exited 0). With `watch=True` the runtime reaches the gateway through `RouteRecorder`, a
loopback pass-through that notes each request line, so a test can see the route the CLI used (Gemini's
stream is chosen by the path, not the body). `check_capture` asserts what issue 6 asks of every CLI.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from polar.harness import HarnessContext
from polar.harness.registry import get_harness
from polar.rollout.protocol import SessionResult, SessionStatus
from polar.runtime import LocalRuntime, RuntimeSpec, make_runtime
from polar.store.records import CompletionRecord
from polar.store.sqlite import SQLiteStore
from polar.trajectory import audit, build
from tests.conftest import SERVED_MODEL, start_gateway
from tests.fakes.fake_vllm import FakeInferenceServer, Reply, Script
from tests.fakes.server import serve
from tests.node_support import fake_policy, running_node, shell_task, spec

SIDE_ANSWER = "A short side answer."
_HOP = {b"host", b"content-length", b"transfer-encoding", b"connection"}


def tool_script(tool: str, arguments: str, answer: str) -> Script:
    """The policy: call `tool` with `arguments` (compact JSON) once, then answer; a call without tools (a
    side call) gets a short text. A CLI that does not offer `tool` gets a text naming what it offered, so the
    file is never written and the test fails on the evaluation."""

    def script(body: dict[str, Any]) -> Reply:
        names = sorted(t["function"]["name"] for t in body.get("tools") or [])
        if not names:
            return Reply(content=SIDE_ANSWER)
        if tool not in names:
            return Reply(content=f"no {tool} among {names}")
        if not any(m.get("role") == "tool" for m in body["messages"]):
            return Reply(content="Creating hello.txt.", tool_calls=[(tool, arguments)])
        return Reply(content=answer)

    return script


class RouteRecorder:
    """An ASGI pass-through to `target` that records (method, path, query) of every request."""

    def __init__(self) -> None:
        self.target = ""
        self.seen: list[tuple[str, str, str]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (msg := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body, more = b"", True
        while more:
            msg = await receive()
            body, more = body + msg.get("body", b""), msg.get("more_body", False)
        query = scope["query_string"].decode()
        self.seen.append((scope["method"], scope["path"], query))
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP]
        url = self.target + scope["path"] + (f"?{query}" if query else "")
        async with httpx.AsyncClient(timeout=60) as client:
            r = await client.request(scope["method"], url, content=body, headers=headers)
        out = [(k.encode(), v.encode()) for k, v in r.headers.items() if k.encode() not in _HOP]
        await send({"type": "http.response.start", "status": r.status_code, "headers": out})
        await send({"type": "http.response.body", "body": r.content})


@dataclass(frozen=True)
class CliRun:
    result: SessionResult
    records: list[CompletionRecord]  # as the gateway stored them (the node adds tags only on its copy)
    fake: FakeInferenceServer
    artifacts: Path  # the session's kept artifacts folder
    routes: list[tuple[str, str, str]]  # requests seen on the way to the gateway (watch=True only)


@contextlib.contextmanager
def _recorder(watch: bool) -> Iterator[tuple[RouteRecorder, str] | None]:
    if not watch:
        yield None
        return
    recorder = RouteRecorder()
    with serve(recorder) as srv:
        yield recorder, srv.url


async def run_cli(
    tmp_path: Path,
    harness: str,
    script: Script,
    *,
    expect: str | None,
    settings: dict[str, Any] | None = None,
    backend: str = "local",
    watch: bool = False,
    session_id: str = "sess-cli",
) -> CliRun:
    task = shell_task(
        "unused",
        instruction="Create the file hello.txt.",
        timeout_seconds=240,
        agent={"harness": harness, "settings": settings or {}},
        runtime={"backend": backend, "network": "gateway"},
        evaluator=(
            {"strategy": "session_completed"}
            if expect is None
            else {
                "strategy": "test_on_output",
                "config": {"command": "cat hello.txt", "expect": expect, "match": "exact"},
            }
        ),
    )
    with fake_policy(script) as (url, fake), _recorder(watch) as watching:
        overrides: dict[str, Any] = {"keep": "artifacts"}
        if watching is not None:
            # The runtime is handed the recorder's URL; the recorder forwards to the node once it is up.
            overrides["runtime_gateway_url"] = watching[1]
        async with running_node(url, tmp_path, **overrides) as node:
            if watching is not None:
                watching[0].target = node.url
            await node.submit(spec(task, session_id))
            result = await node.wait(session_id)
    with SQLiteStore(tmp_path / "node.db") as store:
        records = store.completions(session_id)
    (kept,) = (tmp_path / "runtimes").iterdir()
    routes = list(watching[0].seen) if watching is not None else []
    return CliRun(result, records, fake, kept / "artifacts", routes)


def check_capture(
    run: CliRun, harness: str, settings: dict[str, Any], dialect: str
) -> list[CompletionRecord]:
    """Issue 6's assertions on one run; returns the main-loop records in order."""
    result = run.result
    assert result.status == SessionStatus.COMPLETED, (result.reason, result.metadata)
    assert result.reason is None, result.reason  # the CLI exited 0
    assert result.reward == 1.0, result.metadata.get("evaluation")  # the file holds what the tool wrote
    assert run.records and len(run.records) == len(run.fake.requests)  # every model call captured
    for r in run.records:
        assert r.dialect == dialect
        assert r.trainable and r.prompt_ids and r.response_ids, r.seq
        assert r.response_logprobs is not None and len(r.response_logprobs) == len(r.response_ids)
    classifier = get_harness(harness, settings)
    tags = [tuple(classifier.classify(r)) for r in run.records]
    main = [r for r, t in zip(run.records, tags, strict=True) if not t]
    assert main and all(r.tools for r in main)
    assert all(t[0] == "side_call" for t in tags if t), tags
    trajectory = build(main, strategy="prefix_merging")
    report = audit(trajectory, main)
    assert len(trajectory.traces) == 1 and report.ok, report.errors
    sampled = sum(len(r.response_ids or []) for r in main)
    assert report.trainable_tokens == sampled  # every sampled token is trainable
    trace = trajectory.traces[0]
    assert 0 in trace.loss_mask and len(trace.response_ids) > sampled  # the tool output is in it, masked
    return main


_INET = re.compile(r"connect\(\d+, \{sa_family=AF_INET6?, .*?htons\((\d+)\).*?\"([^\"]+)\"")


async def traced_connections(
    tmp_path: Path, harness_name: str, script: Script
) -> tuple[int, list[tuple[str, int]], int]:
    """Run the preset's command under `strace -f -e trace=connect` against a real gateway (local runtime):
    (exit code, every (address, port) an internet socket was connected to, the gateway's port)."""
    with fake_policy(script) as (url, _):
        gateway = start_gateway(url, tmp_path)
        runtime = make_runtime(RuntimeSpec(root=tmp_path / "rt"), "traced")
        assert isinstance(runtime, LocalRuntime)
        await runtime.start()
        try:
            sid = gateway.new_session()
            ctx = HarnessContext(
                session_id=sid,
                gateway_url=gateway.url,
                model=SERVED_MODEL,
                instruction="Create the file hello.txt.",
                home=str(runtime.home),
                workdir=str(runtime.workdir),
                artifacts=str(runtime.artifacts),
            )
            harness = get_harness(harness_name)
            await harness.setup(runtime, ctx)
            command = harness.command(ctx)
            assert isinstance(command, list)
            trace = tmp_path / "connect.strace"
            argv = ["strace", "-f", "-qq", "-e", "trace=connect", "-o", str(trace), *command]
            result = await runtime.exec(argv, env=harness.env(ctx), timeout_s=180)
        finally:
            await runtime.stop()
            gateway.server.stop()
    found = [(addr, int(port)) for port, addr in _INET.findall(trace.read_text())]
    return result.exit_code, found, int(urlsplit(gateway.url).port or 0)
