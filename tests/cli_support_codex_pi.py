"""Running a real CLI preset on a real node: the scripted policy, a record of every HTTP request the CLI sent
to the gateway, and the checks every CLI test makes (file written, calls captured with tokens, one trace)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from polar.harness.registry import get_harness
from polar.rollout.protocol import SessionResult, SessionStatus
from polar.store.records import CompletionRecord
from polar.store.sqlite import SQLiteStore
from polar.trajectory import Trajectory, audit
from tests.fakes.fake_vllm import Reply
from tests.node_support import fake_policy, running_node, shell_task, spec

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
needs_npm = pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not installed")
needs_strace = pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
FINAL = "Done: hello.txt is written."
INSTRUCTION = "-Create the file hello.txt as asked, then say you are done. @not-a-file"  # as text, not flags


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    query: str
    headers: dict[str, str]


class Recorder:
    """Wraps the node's gateway ASGI app and notes every HTTP request that reaches it."""

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


def tool_script(tool: str, arguments: str, reasoning: str | None = None) -> Any:
    """The policy: call `tool` with `arguments` (compact JSON) once, then answer FINAL, each turn thinking
    `reasoning` first when given. Calls without that tool (side calls) get a plain answer."""

    def script(body: dict[str, Any]) -> Reply:
        names = [t["function"]["name"] for t in body.get("tools") or []]
        answered = any(m.get("role") == "tool" for m in body.get("messages") or [])
        if tool in names and not answered:
            return Reply("Creating the file.", reasoning, tool_calls=[(tool, arguments)])
        return Reply(FINAL, reasoning)

    return script


@dataclass
class CliRun:
    result: SessionResult
    records: list[CompletionRecord]
    seen: list[Seen]
    backend_requests: list[dict[str, Any]]
    artifacts: Path
    harness: Any


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
) -> CliRun:
    """Run `harness` on a node (runtime `backend`, network "gateway") with the policy scripted to call `tool`;
        the evaluator checks hello.txt's exact bytes (their Python repr) against `expect`. `backend_status`
    makes the policy's server fail every call with that HTTP status."""
    task = shell_task(
        "unused",
        instruction=INSTRUCTION,
        timeout_seconds=150,
        runtime={"backend": backend, "network": "gateway"},
        agent={"harness": harness, "settings": dict(settings or {})},
        evaluator={
            "strategy": "test_on_output",
            "config": {"command": "python3 -c \"print(repr(open('hello.txt').read()))\"", "expect": expect},
        },
    )
    with fake_policy(tool_script(tool, arguments, reasoning)) as (url, fake):
        fake.status = backend_status  # every call fails with this status when set
        async with running_node(url, tmp_path, keep="artifacts") as node:
            recorder = Recorder(node.asgi.gateway)
            node.asgi.gateway = recorder
            await node.submit(spec(task, session_id))
            result = await node.wait(session_id)
    with SQLiteStore(tmp_path / "node.db") as store:
        records = store.completions(session_id)
    (artifacts,) = (tmp_path / "runtimes").glob("*/artifacts")  # keep="artifacts": only those survive
    preset = get_harness(harness, dict(settings or {}))
    return CliRun(result, records, recorder.seen, list(fake.requests), artifacts, preset)


def check_run(run: CliRun, *, dialect: str, tool: str, paths: set[str]) -> Trajectory:
    """What every CLI session must show; returns the trajectory for preset-specific checks."""
    result, records = run.result, run.records
    assert result.status == SessionStatus.COMPLETED, result.reason
    assert result.reason in (None, ""), result.reason  # the CLI exited 0
    assert result.reward == 1.0, result.metadata.get("evaluation")  # hello.txt as expected
    # Every model call the CLI made reached the policy and was captured, with token ids and logprobs.
    assert len(records) == len(run.backend_requests) >= 2
    assert all(r.dialect == dialect for r in records)
    # The instruction reached the model verbatim (never parsed as the CLI's flags or file references).
    users = [m for m in records[0].upstream_request["messages"] if m["role"] == "user"]
    assert any(t.strip() == INSTRUCTION for m in users for t in _texts(m["content"])), users
    for r in records:
        assert r.trainable, (r.seq, r.flags)
        assert r.prompt_ids and r.response_ids
        assert len(r.response_logprobs or []) == len(r.response_ids)
    main = [r for r in records if not run.harness.classify(r)]
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
