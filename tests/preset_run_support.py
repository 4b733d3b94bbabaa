"""Running a real harness CLI preset on a real node, and the checks every preset's end-to-end test makes.

`run_preset` submits one task whose agent is the preset to a node (gateway + runtime, `local` or `bwrap`
with only the gateway reachable) in front of the scripted fake vLLM, with an evaluator that reads the file
the CLI's tool wrote. `check_capture` then asserts what the issue asks of every CLI: every call captured
with token ids and logprobs, side calls tagged, the main loop one prefix-merged trace whose tool outputs are
masked and whose sampled tokens are all trainable, and the audit passing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polar.harness.base import HarnessContext
from polar.harness.registry import get_harness
from polar.rollout.protocol import SessionResult, SessionStatus
from polar.runtime import LocalRuntime, RuntimeSpec, make_runtime
from polar.runtime.base import ExecResult
from polar.store.records import CompletionRecord
from polar.store.sqlite import SQLiteStore
from polar.trajectory import audit, build
from tests.conftest import SERVED_MODEL
from tests.fakes.fake_vllm import FakeInferenceServer, Script
from tests.node_support import fake_policy, running_node, shell_task, spec


@dataclass(frozen=True)
class PresetRun:
    result: SessionResult
    records: list[CompletionRecord]  # as the gateway stored them (no tags: the node adds those)
    fake: FakeInferenceServer
    artifacts: Path  # the session's kept artifacts folder


async def run_preset(
    tmp_path: Path,
    harness: str,
    settings: dict[str, Any],
    script: Script,
    *,
    expect: str,
    backend: str = "local",
    session_id: str = "sess-cli",
    timeout_s: float = 240,
) -> PresetRun:
    task = shell_task(
        "unused",
        instruction="Create the file hello.txt.",
        timeout_seconds=timeout_s,
        agent={"harness": harness, "settings": settings},
        runtime={"backend": backend, "network": "gateway"},
        evaluator={
            "strategy": "test_on_output",
            "config": {"command": "cat hello.txt", "expect": expect, "match": "exact"},
        },
    )
    with fake_policy(script) as (url, fake):
        async with running_node(url, tmp_path, keep="artifacts") as node:
            await node.submit(spec(task, session_id))
            result = await node.wait(session_id)
    with SQLiteStore(tmp_path / "node.db") as store:
        records = store.completions(session_id)
    (kept,) = (tmp_path / "runtimes").iterdir()
    return PresetRun(result, records, fake, kept / "artifacts")


def check_capture(
    run: PresetRun, harness: str, settings: dict[str, Any], dialect: str
) -> list[CompletionRecord]:
    """The issue's assertions on one run; returns the main-loop records (in order)."""
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
    assert all(t[0] == "side_call" for t in tags if t)
    trajectory = build(main, strategy="prefix_merging")
    report = audit(trajectory, main)
    assert len(trajectory.traces) == 1 and report.ok, report.errors
    sampled = sum(len(r.response_ids or []) for r in main)
    assert report.trainable_tokens == sampled  # every sampled token is trainable
    trace = trajectory.traces[0]
    assert 0 in trace.loss_mask and len(trace.response_ids) > sampled  # the tool output is in it, masked
    return main


# `connect(...)`/`sendto(...)` addresses as strace prints them (AF_INET and AF_INET6).
_INET = re.compile(r'sa_family=AF_INET6?, sin6?_port=htons\((\d+)\), [^}]*?"([0-9a-fA-F.:]+)"')


async def traced_connections(
    harness_name: str, settings: dict[str, Any], gateway_url: str, session_id: str, tmp_path: Path
) -> tuple[ExecResult, set[tuple[str, int]]]:
    """Run the preset's command under `strace -f` in a local runtime: every IP address it connected or
    sent a datagram to (a DNS lookup included), as (address, port)."""
    runtime = make_runtime(RuntimeSpec(root=tmp_path / "rt"), session_id)
    assert isinstance(runtime, LocalRuntime)
    await runtime.start()
    try:
        harness = get_harness(harness_name, settings)
        ctx = HarnessContext(
            session_id=session_id,
            gateway_url=gateway_url,
            model=SERVED_MODEL,
            instruction="Create the file hello.txt.",
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
