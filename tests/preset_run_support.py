"""Running a real harness CLI preset on a real node, and the checks every preset's end-to-end test makes.

`run_preset` submits one task whose agent is the preset to a node (gateway + runtime, `local` or `bwrap`
with only the gateway reachable) in front of the scripted fake vLLM, with an evaluator that reads the file
the CLI's tool wrote; every HTTP request that reaches the node's gateway is noted (`Recorder`), so a test
can see the routes and headers the CLI used (Gemini's stream is chosen by the path, not the body).
`check_capture` then asserts what the issue asks of every CLI: every call captured with token ids and
logprobs, side calls tagged, the main loop one prefix-merged trace whose tool outputs are masked and whose
sampled tokens are all trainable, and the audit passing. `traced_connections` runs a preset's command under
strace to prove it connects to nothing but the gateway.

Codex and Pi share a stricter session check (`run_cli`, `check_run`: the instruction arrives verbatim, only
generation routes are asked for, the node's own trajectory is one trace) and their own policy script.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from polar.harness.base import Harness, HarnessContext
from polar.harness.registry import get_harness
from polar.rollout.protocol import SessionResult, SessionStatus
from polar.runtime import LocalRuntime, RuntimeSpec, make_runtime
from polar.runtime.base import ExecResult
from polar.store.records import CompletionRecord
from polar.store.sqlite import SQLiteStore
from polar.trajectory import Trajectory, audit, build
from tests.conftest import SERVED_MODEL, start_gateway
from tests.fakes.fake_vllm import FakeInferenceServer, Reply, Script
from tests.node_support import fake_policy, running_node, shell_task, spec

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
needs_npm = pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not installed")
needs_strace = pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
HELLO_TASK = "Create the file hello.txt."


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    query: str
    headers: dict[str, str]


class Recorder:
    """Wraps the node's model API (the gateway's data app) and notes every HTTP request that reaches it."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.state = app.state
        self.seen: list[Seen] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            query = scope.get("query_string", b"").decode("latin-1")
            self.seen.append(Seen(scope["method"], scope["path"], query, headers))
        await self.app(scope, receive, send)


@dataclass(frozen=True)
class PresetRun:
    result: SessionResult
    records: list[CompletionRecord]  # as the gateway stored them (no tags: the node adds those)
    fake: FakeInferenceServer
    artifacts: Path  # the session's kept artifacts folder
    seen: list[Seen]  # every HTTP request that reached the gateway
    preset: Harness  # the preset as the task's settings built it (for its `classify`)

    @property
    def routes(self) -> list[tuple[str, str, str]]:
        return [(s.method, s.path, s.query) for s in self.seen]


async def run_preset(
    tmp_path: Path,
    harness: str,
    settings: dict[str, Any],
    script: Script,
    *,
    expect: str | None,
    backend: str = "local",
    session_id: str = "sess-cli",
    timeout_s: float = 240,
    instruction: str = HELLO_TASK,
    check: str = "cat hello.txt",
    backend_status: int | None = None,
    image: str | None = None,
    backend_faults: dict[str, Any] | None = None,
    agent: dict[str, Any] | None = None,
    runtime: dict[str, Any] | None = None,
) -> PresetRun:
    """Run `harness` with `settings` on a node; the evaluator runs `check` and compares its output with
    `expect` exactly (None: the session only has to complete). `backend_status` makes the policy's server
    fail every call with that HTTP status; `image` is the container image of a docker/podman backend;
    `backend_faults` are the fake's other settings (`FakeInferenceServer.set`, e.g. `max_model_len`);
    `agent` and `runtime` are more fields of the task's (`mcp_servers`, `skills`; `read_only_paths`)."""
    task = shell_task(
        "unused",
        instruction=instruction,
        timeout_seconds=timeout_s,
        agent={"harness": harness, "settings": dict(settings), **(agent or {})},
        runtime={"backend": backend, "network": "gateway", "image": image, **(runtime or {})},
        evaluator=(
            {"strategy": "session_completed"}
            if expect is None
            else {
                "strategy": "test_on_output",
                "config": {"command": check, "expect": expect, "match": "exact"},
            }
        ),
    )
    with fake_policy(script) as (url, fake):
        fake.status = backend_status  # every call fails with this status when set
        fake.set(**(backend_faults or {}))
        recorders: list[Recorder] = []

        def record(app: Any) -> Recorder:
            recorders.append(Recorder(app))
            return recorders[-1]

        async with running_node(url, tmp_path, keep="artifacts", wrap_model_api=record) as node:
            (recorder,) = recorders
            await node.submit(spec(task, session_id))
            result = await node.wait(session_id)
    with SQLiteStore(tmp_path / "node.db") as store:
        records = store.completions(session_id)
    (kept,) = (tmp_path / "runtimes").iterdir()  # keep="artifacts": only those survive
    preset = get_harness(harness, dict(settings))
    return PresetRun(result, records, fake, kept / "artifacts", recorder.seen, preset)


def check_capture(
    run: PresetRun,
    harness: str,
    settings: dict[str, Any],
    dialect: str,
    *,
    main_has_tools: bool = True,
    allow_subagents: bool = False,
) -> list[CompletionRecord]:
    """The issue's assertions on one run; returns the main-loop records (in order). `main_has_tools=False`
    for a preset whose loop may run without tools (mini-SWE-agent's text mode); `allow_subagents` for a run
    whose policy starts subagents (tagged `subagent`), else every tagged call must be a side call."""
    result = run.result
    assert result.status == SessionStatus.COMPLETED, (result.reason, result.metadata)
    assert result.reason is None, result.reason  # the CLI exited 0
    assert result.reward == 1.0, result.metadata.get("evaluation")  # hello.txt holds what the tool wrote
    assert run.records and len(run.records) == len(run.fake.requests)  # every model call captured
    for r in run.records:
        assert r.dialect == dialect
        assert r.trainable and r.prompt_ids and r.response_ids, r.seq
        assert r.response_logprobs is not None and len(r.response_logprobs) == len(r.response_ids)
    classifier = get_harness(harness, settings)
    tags = [tuple(classifier.classify(r)) for r in run.records]
    main = [r for r, t in zip(run.records, tags, strict=True) if not t]
    assert main
    if main_has_tools:
        assert all(r.tools for r in main)
    assert all(t[0] == "side_call" or (allow_subagents and t == ("subagent",)) for t in tags if t), tags
    trajectory = build(main, strategy="prefix_merging")
    report = audit(trajectory, main)
    assert len(trajectory.traces) == 1 and report.ok, report.errors
    sampled = sum(len(r.response_ids or []) for r in main)
    assert report.trainable_tokens == sampled  # every sampled token is trainable
    trace = trajectory.traces[0]
    assert 0 in trace.loss_mask and len(trace.response_ids) > sampled  # the tool output is in it, masked
    return main


def captured_record(dialect: str, request: dict[str, Any], *, tools: bool) -> CompletionRecord:
    """A minimal stored record of `request` (what `classify` reads), with or without a tool offered."""
    return CompletionRecord(
        session_id="s",
        seq=0,
        completion_id="c",
        dialect=dialect,
        created_at=0.0,
        request=request,
        upstream_request={},
        prompt_ids=[1],
        response_ids=[2],
        response_logprobs=[-0.1],
        finish_reason="stop",
        response_message={"role": "assistant", "content": "x"},
        tools=[{"type": "function", "function": {"name": "t", "parameters": {}}}] if tools else None,
        usage={},
        model_requested="m",
        model_served="m",
    )


# -- no connection but the gateway -----------------------------------------------------------------------
# `connect(...)`/`sendto(...)` addresses as strace prints them (AF_INET and AF_INET6).
_INET = re.compile(r'sa_family=AF_INET6?, sin6?_port=htons\((\d+)\), [^}]*?"([0-9a-fA-F.:]+)"')


async def traced_connections(
    harness_name: str, settings: dict[str, Any], gateway_url: str, session_id: str, tmp_path: Path
) -> tuple[ExecResult, set[tuple[str, int]]]:
    """Run the preset's command under `strace -f` in a local runtime: every IP address it connected or
    sent a datagram to (a DNS lookup included), as (address, port)."""
    runtime = make_runtime(
        RuntimeSpec(backend="local", root=tmp_path / "rt"), session_id, gateway_url=gateway_url
    )
    assert isinstance(runtime, LocalRuntime) and runtime.gateway_url is not None
    await runtime.start()
    try:
        harness = get_harness(harness_name, settings)
        ctx = HarnessContext(
            session_id=session_id,
            gateway_url=runtime.gateway_url,  # the gateway's port on the sandbox's own loopback
            model=SERVED_MODEL,
            instruction=HELLO_TASK,
            home=str(runtime.home),
            workdir=str(runtime.workdir),
            artifacts=str(runtime.artifacts),
        )
        await harness.setup(runtime, ctx)
        command = harness.command(ctx)
        argv = ["bash", "-lc", command] if isinstance(command, str) else command
        log = tmp_path / "strace.txt"
        trace = ["strace", "-f", "-qq", "-e", "trace=connect,sendto,sendmsg", "-o", str(log)]
        result = await runtime.exec([*trace, *argv], env=harness.env(ctx), timeout_s=180)
        addresses = {(m.group(2), int(m.group(1))) for m in _INET.finditer(log.read_text())}
        return result, addresses
    finally:
        await runtime.stop()


async def traced_against_gateway(
    tmp_path: Path, harness_name: str, script: Script, settings: dict[str, Any] | None = None
) -> tuple[ExecResult, set[tuple[str, int]], int]:
    """`traced_connections` against a real gateway in front of the scripted policy:
    (the command's result, every address it reached, the gateway's port)."""
    with fake_policy(script) as (url, _):
        gateway = start_gateway(url, tmp_path)
        try:
            sid = gateway.new_session()
            result, addresses = await traced_connections(
                harness_name, settings or {}, gateway.url, sid, tmp_path
            )
        finally:
            gateway.server.stop()
    return result, addresses, int(gateway.url.rsplit(":", 1)[1])


# -- policy scripts --------------------------------------------------------------------------------------
FINAL = "Done: hello.txt is written."
SIDE_ANSWER = "A short side answer."


def tool_script(tool: str, arguments: str, reasoning: str | None = None) -> Script:
    """The policy: call `tool` with `arguments` (compact JSON) once, then answer FINAL, each turn thinking
    `reasoning` first when given. Calls without that tool (side calls) get a plain answer."""

    def script(body: dict[str, Any]) -> Reply:
        names = [t["function"]["name"] for t in body.get("tools") or []]
        answered = any(m.get("role") == "tool" for m in body.get("messages") or [])
        if tool in names and not answered:
            return Reply("Creating the file.", reasoning, tool_calls=[(tool, arguments)])
        return Reply(FINAL, reasoning)

    return script


def offered_tool_script(tool: str, arguments: str, answer: str) -> Script:
    """The policy: call `tool` with `arguments` (compact JSON) once, then answer; a call without tools (a
    side call) gets SIDE_ANSWER. A CLI that does not offer `tool` gets a text naming what it offered, so the
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


# -- Codex and Pi ----------------------------------------------------------------------------------------
INSTRUCTION = "-Create the file hello.txt as asked, then say you are done. @not-a-file"  # as text, not flags


async def run_cli(
    tmp_path: Path,
    harness: str,
    tool: str,
    arguments: str,
    expect: str,
    *,
    settings: dict[str, Any] | None = None,
    backend: str = "local",
    session_id: str = "sess-cli",
    reasoning: str | None = None,
    backend_status: int | None = None,
    image: str | None = None,
    agent: dict[str, Any] | None = None,
) -> PresetRun:
    """`run_preset` with INSTRUCTION (a dash and an @ in it) and the policy scripted to call `tool`; the
    evaluator checks hello.txt's exact bytes (their Python repr) against `expect`; `agent`: more fields of
    the task's agent."""
    return await run_preset(
        tmp_path,
        harness,
        dict(settings or {}),
        tool_script(tool, arguments, reasoning),
        expect=expect,
        backend=backend,
        session_id=session_id,
        timeout_s=150,
        instruction=INSTRUCTION,
        check="python3 -c \"print(repr(open('hello.txt').read()))\"",
        backend_status=backend_status,
        image=image,
        agent=agent,
    )


def harness_image(request: pytest.FixtureRequest, backend: str) -> str | None:
    """For a container backend, the engine (its fixture: started, or the test skipped) and an image with
    Node.js, which the CLI presets whose launcher is a node script need; None for local and bwrap."""
    if backend not in ("docker", "podman"):
        return None
    from tests.container_support import node_image

    return node_image(str(request.getfixturevalue(f"{backend}_engine")))


def check_run(run: PresetRun, *, dialect: str, tool: str, paths: set[str]) -> Trajectory:
    """What every Codex/Pi session must show; returns the node's trajectory for preset-specific checks."""
    result, records = run.result, run.records
    assert result.status == SessionStatus.COMPLETED, result.reason
    assert result.reason in (None, ""), result.reason  # the CLI exited 0
    assert result.reward == 1.0, result.metadata.get("evaluation")  # hello.txt as expected
    # Every model call the CLI made reached the policy and was captured, with token ids and logprobs.
    assert len(records) == len(run.fake.requests) >= 2
    assert all(r.dialect == dialect for r in records)
    # The instruction reached the model verbatim (never parsed as the CLI's flags or file references).
    users = [m for m in records[0].upstream_request["messages"] if m["role"] == "user"]
    assert any(t.strip() == INSTRUCTION for m in users for t in _texts(m["content"])), users
    for r in records:
        assert r.trainable, (r.seq, r.flags)
        assert r.prompt_ids and r.response_ids
        assert len(r.response_logprobs or []) == len(r.response_ids)
    main = [r for r in records if not run.preset.classify(r)]
    assert main and all(tool in [t["function"]["name"] for t in r.tools or []] for r in main)
    assert main[0].response_message["tool_calls"][0]["function"]["name"] == tool
    # Only generation routes (and nothing but the gateway: bwrap has no other network) were asked for.
    asked = {s.path for s in run.seen}
    assert asked <= paths, asked
    # prefix_merging: the main loop is one trace, the tool output masked, every sampled token trainable.
    traj = Trajectory.model_validate(result.trajectory)
    main_ids = {r.completion_id for r in main}
    traces = [t for t in traj.traces if set(t.metadata.get("completion_ids", [])) & main_ids]
    assert len(traces) == 1, [t.metadata.get("completion_ids") for t in traj.traces]
    trace = traces[0]
    assert set(trace.metadata["completion_ids"]) == main_ids
    assert 0 in trace.loss_mask and 1 in trace.loss_mask
    assert trace.trainable_tokens == sum(len(r.response_ids or []) for r in main)
    report = audit(traj, records)
    assert report.ok, report
    return traj


def _texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    return [p.get("text", "") for p in content if isinstance(p, dict)]


def streamed(record: CompletionRecord, seen: list[Seen]) -> bool:
    """Whether the call streamed in its dialect: the body's `stream` flag, or Gemini's stream route."""
    if record.dialect == "gemini":
        model = record.model_requested
        route = f"/v1beta/models/{model}:streamGenerateContent"
        return any(s.path == route and "alt=sse" in s.query for s in seen)
    return record.request.get("stream") is True


def jsonl_lines(folder: Path) -> list[dict[str, Any]]:
    """Every JSON line of every .jsonl file under `folder` (a CLI's own transcripts)."""
    out = []
    for path in sorted(folder.rglob("*.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out
