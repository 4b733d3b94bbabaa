"""`agent.side_calls`: train on, exclude, or route a harness's side calls, on a real node and gateway.

The harness (`tests.side_call_harness:SideCallShell`) runs a script that makes a title call without tools and
a main-loop call with tools through the official openai SDK; its `classify` tags the first as a side call.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from pydantic import ValidationError

from polar.gateway.routing import FLAG_ROUTED, ROUTE_KEY
from polar.rollout.node.side_calls import FLAG_EXCLUDED, apply_policy
from polar.rollout.protocol import SessionResult, SessionStatus
from polar.rollout.server.validate import SubmitError, check_task
from polar.store.records import CompletionRecord
from polar.store.sqlite import SQLiteStore
from polar.task import Task
from polar.trajectory import Trajectory, audit
from tests.conftest import SERVED_MODEL, serve_gateway
from tests.fakes.fake_vllm import Reply, make_fake_backend
from tests.fakes.server import serve
from tests.node_support import PY, fake_policy, program, running_node, shell_task, spec
from tests.server_support import AUTH, start_server
from tests.side_call_harness import SIDE_CALL_SCRIPT, TITLE_SYSTEM

HARNESS = "tests.side_call_harness:SideCallShell"
FROZEN_MODEL = "frozen-titler"


def side_task(tmp_path: Path, **agent: Any) -> Task:
    script = program("side_calls.py", SIDE_CALL_SCRIPT)
    return shell_task(
        f"{PY} {script} > out.txt",
        agent={"harness": HARNESS, **agent},
        evaluator={
            "strategy": "test_on_output",
            "config": {"command": "cat out.txt", "expect": "MAIN: Done.", "match": "contains"},
        },
    )


async def run(
    tmp_path: Path, task: Task, sid: str, policy_url: str
) -> tuple[SessionResult, list[CompletionRecord]]:
    async with running_node(policy_url, tmp_path) as node:
        await node.submit(spec(task, sid))
        result = await node.wait(sid)
    with SQLiteStore(tmp_path / "node.db") as store:
        records = store.completions(sid)
    return result, records


def has_system(body: dict[str, Any], text: str) -> bool:
    return any(m.get("role") == "system" and text in str(m.get("content")) for m in body["messages"])


def side_and_main(records: list[CompletionRecord]) -> tuple[CompletionRecord, CompletionRecord]:
    side, main = sorted(records, key=lambda r: r.seq)
    assert side.tools is None and main.tools
    return side, main


async def test_train_keeps_side_calls_trainable(tmp_path: Path) -> None:
    with fake_policy([Reply("Bug fix title"), Reply("Done.")]) as (url, fake):
        result, records = await run(tmp_path, side_task(tmp_path), "sess-side-train", url)
    assert result.status == SessionStatus.COMPLETED, result.reason
    assert result.reward == 1.0
    assert len(fake.requests) == 2
    side, main = side_and_main(records)
    assert side.trainable and main.trainable
    traj = Trajectory.model_validate(result.trajectory)
    summary = traj.metadata["side_calls"]
    assert summary == {
        "policy": "train",
        "calls": 1,
        "completion_ids": [side.completion_id],
        "sampled_tokens": len(side.response_ids or []),
    }
    # Every sampled token of both calls is trainable somewhere.
    assert sum(t.trainable_tokens for t in traj.traces) == len(side.response_ids or []) + len(
        main.response_ids or []
    )


async def test_exclude_masks_side_calls_and_lists_them(tmp_path: Path) -> None:
    with fake_policy([Reply("Bug fix title"), Reply("Done.")]) as (url, fake):
        result, records = await run(tmp_path, side_task(tmp_path, side_calls="exclude"), "sess-side-ex", url)
    assert result.status == SessionStatus.COMPLETED, result.reason
    assert len(fake.requests) == 2  # excluded, not routed: the policy served both
    side, main = side_and_main(records)
    traj = Trajectory.model_validate(result.trajectory)
    n_side = len(side.response_ids or [])
    assert n_side > 0
    assert traj.metadata["side_calls"] == {
        "policy": "exclude",
        "calls": 1,
        "completion_ids": [side.completion_id],
        "sampled_tokens": n_side,
    }
    # Nothing dropped: the side call is still in a trace, masked, with its exclusion flag on record.
    by_call = {cid: t for t in traj.traces for cid in t.metadata["completion_ids"]}
    side_trace = by_call[side.completion_id]
    assert side_trace.trainable_tokens == 0
    assert FLAG_EXCLUDED in side_trace.metadata["flags"][side.completion_id]
    assert by_call[main.completion_id].trainable_tokens == len(main.response_ids or [])
    # The audit, given the records as the node built from them, proves it: coverage 1.0 over trainable calls.
    classified = [r if r.tools else replace(r, tags=("side_call", "title")) for r in records]
    built_from, _ = apply_policy(classified, "exclude")
    report = audit(traj, built_from)
    assert report.ok, report.errors
    assert report.coverage == 1.0
    assert report.trainable_tokens == len(main.response_ids or [])
    # Against the raw records the side call's tokens would be missing: the exclusion is real, not cosmetic.
    assert not audit(traj, records).ok


async def test_route_sends_side_calls_to_the_frozen_backend(tmp_path: Path) -> None:
    frozen = make_fake_backend("vllm", [Reply("Frozen title")], model=FROZEN_MODEL)
    with serve(frozen) as frozen_srv, fake_policy([Reply("Done.")]) as (url, policy):
        backend = {"url": frozen_srv.url, "kind": "vllm", "model": FROZEN_MODEL}
        task = side_task(tmp_path, side_calls="route", side_call_backend=backend)
        result, records = await run(tmp_path, task, "sess-side-route", url)
    assert result.status == SessionStatus.COMPLETED, result.reason
    assert result.reward == 1.0
    # Each backend saw exactly its call.
    assert len(frozen.requests) == 1 and has_system(frozen.requests[0], TITLE_SYSTEM)
    assert frozen.requests[0]["model"] == FROZEN_MODEL and "tools" not in frozen.requests[0]
    assert len(policy.requests) == 1 and policy.requests[0].get("tools")
    assert policy.requests[0]["model"] == SERVED_MODEL
    # Both recorded; the routed one shows where it came from and is never trainable (even with token data).
    side, main = side_and_main(records)
    assert side.response_message["content"] == "Frozen title"
    assert side.model_served == FROZEN_MODEL and side.upstream_request["model"] == FROZEN_MODEL
    assert FLAG_ROUTED in side.flags and not side.trainable
    assert side.response_ids  # the frozen vLLM returned tokens; they are kept, flagged
    assert "side_call" in side.tags
    assert main.trainable and FLAG_ROUTED not in main.flags and not main.tags
    traj = Trajectory.model_validate(result.trajectory)
    summary = traj.metadata["side_calls"]
    assert summary["policy"] == "route"
    assert summary["completion_ids"] == summary["routed_completion_ids"] == [side.completion_id]
    assert ROUTE_KEY not in traj.metadata  # the route is gateway-session metadata only
    report = audit(traj, records)
    assert report.ok, report.errors
    assert report.trainable_tokens == len(main.response_ids or [])


async def test_route_to_an_openai_kind_frozen_model(tmp_path: Path) -> None:
    frozen = make_fake_backend("openai", [Reply("Hosted title")], model=FROZEN_MODEL)
    with serve(frozen) as frozen_srv, fake_policy([Reply("Done.")]) as (url, policy):
        backend = {"url": frozen_srv.url + "/v1", "kind": "openai", "model": FROZEN_MODEL}
        task = side_task(tmp_path, side_calls="route", side_call_backend=backend)
        result, records = await run(tmp_path, task, "sess-side-route-oai", url)
    assert result.status == SessionStatus.COMPLETED, result.reason
    assert len(frozen.requests) == 1 and len(policy.requests) == 1
    side, main = side_and_main(records)
    assert side.response_message["content"] == "Hosted title"
    assert not side.trainable and main.trainable


async def test_route_failure_of_the_frozen_backend_is_an_infrastructure_error(tmp_path: Path) -> None:
    frozen = make_fake_backend("vllm", model=FROZEN_MODEL, status=503)
    with serve(frozen) as frozen_srv, fake_policy([Reply("Done.")]) as (url, policy):
        backend = {"url": frozen_srv.url, "kind": "vllm", "model": FROZEN_MODEL}
        task = side_task(tmp_path, side_calls="route", side_call_backend=backend)
        result, records = await run(tmp_path, task, "sess-side-route-down", url)
    assert result.status == SessionStatus.ERROR
    assert "inference backend failed" in (result.reason or "")
    assert policy.requests == [] and records == []


def test_route_requires_a_backend() -> None:
    with pytest.raises(ValidationError) as err:
        Task.model_validate({"task_id": "t", "instruction": "x", "agent": {"side_calls": "route"}})
    (e,) = err.value.errors()
    assert e["loc"] == ("agent", "side_call_backend")
    assert "required when agent.side_calls is 'route'" in e["msg"]
    with pytest.raises(ValidationError):
        Task.model_validate({"task_id": "t", "instruction": "x", "agent": {"side_calls": "sometimes"}})
    with pytest.raises(ValidationError):  # kind is one of openai, vllm, sglang
        Task.model_validate(
            {
                "task_id": "t",
                "instruction": "x",
                "agent": {
                    "side_calls": "route",
                    "side_call_backend": {"url": "http://h", "kind": "x", "model": "m"},
                },
            }
        )


def test_submit_check_refuses_a_backend_url_that_is_not_http() -> None:
    task = Task.model_validate(
        {
            "task_id": "t",
            "instruction": "x",
            "agent": {"side_calls": "route", "side_call_backend": {"url": "frozen:8000", "model": "m"}},
        }
    )
    with pytest.raises(SubmitError) as err:
        check_task(task, "tasks[1].")
    assert err.value.param == "tasks[1].agent.side_call_backend.url"


def test_server_submit_refuses_route_without_backend(tmp_path: Path) -> None:
    srv = start_server(tmp_path / "server.db")
    try:
        body = {"task_id": "t", "instruction": "x", "agent": {"harness": HARNESS, "side_calls": "route"}}
        r = httpx.post(f"{srv.url}/rollout/task/submit", json=body, timeout=30, headers=AUTH)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "agent.side_call_backend"
        backend = {"url": "ftp://frozen", "kind": "vllm", "model": "m"}
        body["agent"] = {
            "harness": HARNESS,
            "settings": {"command": "true"},
            "side_calls": "route",
            "side_call_backend": backend,
        }
        r = httpx.post(f"{srv.url}/rollout/task/submit", json=[body], timeout=30, headers=AUTH)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "[0].agent.side_call_backend.url"
    finally:
        srv.stop()


def test_gateway_refuses_a_malformed_route_in_session_metadata(tmp_path: Path) -> None:
    from polar.gateway.config import GatewayConfig

    with fake_policy() as (url, _):
        config = GatewayConfig(
            backend_url=url, served_model=SERVED_MODEL, store_path=tmp_path / "g.db", port=0
        )
        gw = serve_gateway(config)
        try:
            bad = {
                "metadata": {ROUTE_KEY: {"harness": HARNESS, "backend": {"url": "http://h", "kind": "tpu"}}}
            }
            r = gw.control("POST", "/sessions", json=bad)
            assert r.status_code == 400, r.text
            assert "side_call_route.backend.kind" in r.text
            unknown = {
                "metadata": {
                    ROUTE_KEY: {"harness": "no.such:Thing", "backend": {"url": "http://h", "model": "m"}}
                }
            }
            r = gw.control("POST", "/sessions", json=unknown)
            assert r.status_code == 400, r.text
            assert "side_call_route.harness" in r.text
        finally:
            gw.server.stop()


def test_a_failing_classifier_is_an_error_in_the_callers_dialect(tmp_path: Path) -> None:
    from polar.gateway.config import GatewayConfig

    with fake_policy([Reply("never")]) as (url, policy):
        config = GatewayConfig(
            backend_url=url, served_model=SERVED_MODEL, store_path=tmp_path / "g.db", port=0
        )
        gw = serve_gateway(config)
        try:
            route = {
                "harness": "tests.side_call_harness:BrokenClassifier",
                "settings": {"command": "true"},
                "backend": {"url": "http://127.0.0.1:9", "kind": "vllm", "model": FROZEN_MODEL},
            }
            r = gw.control("POST", "/sessions", json={"metadata": {ROUTE_KEY: route}})
            assert r.status_code == 201, r.text
            sid = r.json()["session_id"]
            client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=sid, max_retries=0)
            with pytest.raises(openai.APIStatusError) as err:
                client.chat.completions.create(
                    model=SERVED_MODEL, messages=[{"role": "user", "content": "hi"}]
                )
            assert err.value.status_code == 502
            assert "side-call classifier failed: classifier bug" in str(err.value)
        finally:
            gw.server.stop()
    assert policy.requests == []  # nothing was served for a call the gateway could not place
    with SQLiteStore(tmp_path / "g.db") as store:
        (failure,) = store.failures(sid)
    assert failure.kind == "upstream_error"
