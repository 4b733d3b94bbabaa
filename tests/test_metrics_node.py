"""The node's Prometheus metrics over real HTTP: real sessions (the shell harness calling the gateway with
the official openai SDK, real evaluators) on a real node, then `GET /metrics` on its control listener. One
scrape answers for the node and its gateway."""

from __future__ import annotations

from pathlib import Path

import httpx

from polar.auth import bearer
from polar.rollout.protocol import SessionStatus
from tests.fakes.fake_vllm import Reply
from tests.node_support import (
    ON_HOST,
    PY,
    control_client,
    fake_policy,
    running_node,
    shell_task,
    spec,
    until,
    write_caller,
)
from tests.test_metrics_gateway import Samples, parse, value


class Exploding:
    """An evaluator that raises (loaded by import path): the evaluation's outcome is `error`."""

    name = "exploding"
    needs_fresh_runtime = False

    async def evaluate(self, ctx: object) -> object:
        raise ValueError("scoring exploded")


async def scrape(client: httpx.AsyncClient) -> Samples:
    r = await client.get("/metrics")
    assert r.status_code == 200, r.text
    return parse(r.text)


async def test_sessions_by_stage_pools_evaluations_and_ends(tmp_path: Path) -> None:
    caller, flag = write_caller(tmp_path), tmp_path / "go"
    passing = shell_task(
        f"{PY} {caller} 2 > answer.txt",
        evaluator={"strategy": "test_on_output", "config": {"command": "cat answer.txt", "expect": "Done."}},
    )
    waiting = shell_task(f"while [ ! -e {flag} ]; do sleep 0.05; done; exit 3", task_id="t2", runtime=ON_HOST)
    exploding = shell_task("true", task_id="t3", evaluator={"strategy": "tests.test_metrics_node:Exploding"})
    with fake_policy([Reply("Working."), Reply("Done.")]) as (url, _):
        async with running_node(url, tmp_path, run_workers=1) as node, control_client(node) as client:
            empty = await scrape(client)
            assert value(empty, "polar_node_sessions", stage="RUNNING") == 0
            assert value(empty, "polar_node_evaluations_total", outcome="passed") == 0
            assert value(empty, "polar_node_capacity") == node.config.capacity
            assert value(empty, "polar_node_pool_size", pool="run") == 1
            assert value(empty, "polar_node_ready_buffer_size") == node.config.ready_buffer

            # One run slot: the waiting session holds it, the next one waits READY for it.
            await node.submit(spec(waiting, "sess-wait"))
            await until(lambda: node.status().by_stage.get("RUNNING") == 1, "the waiting session to run")
            await node.submit(spec(passing, "sess-pass"))
            await until(lambda: node.status().by_stage.get("READY") == 1, "the next session to be READY")
            busy = await scrape(client)
            assert value(busy, "polar_node_sessions", stage="RUNNING") == 1
            assert value(busy, "polar_node_sessions", stage="READY") == 1
            assert value(busy, "polar_node_pool_busy", pool="run") == 1
            assert value(busy, "polar_node_pool_waiting", pool="run") == 1
            assert value(busy, "polar_node_pool_busy", pool="init") == 0
            assert value(busy, "polar_node_ready_buffer") == 1

            await node.submit(spec(exploding, "sess-explode"))
            flag.touch()
            ended = await node.wait("sess-wait")
            # exit 3: evaluated, and failed
            assert ended.status == SessionStatus.COMPLETED and ended.reward == 0.0
            assert (await node.wait("sess-pass")).status == SessionStatus.COMPLETED
            assert (await node.wait("sess-explode")).status == SessionStatus.ERROR
            after = await scrape(client)

    assert value(after, "polar_node_evaluations_total", outcome="passed") == 1
    assert value(after, "polar_node_evaluations_total", outcome="failed") == 1
    assert value(after, "polar_node_evaluations_total", outcome="error") == 1
    assert value(after, "polar_node_evaluations_total", outcome="timeout") == 0
    assert value(after, "polar_node_session_ends_total", status="COMPLETED") == 2
    assert value(after, "polar_node_session_ends_total", status="ERROR") == 1
    for stage in ("RUNNING", "INITIALIZING", "POST_RUN", "EVALUATING"):
        assert value(after, "polar_node_sessions", stage=stage) == 0
    assert value(after, "polar_node_pool_busy", pool="run") == 0
    assert value(after, "polar_node_ready_buffer") == 0
    # The gateway's metrics are in the same scrape: the passing session's two calls.
    assert value(after, "polar_gateway_calls_total", dialect="chat", status="200") == 2
    assert value(after, "polar_gateway_records_committed_total") == 2
    # No rollout server: nothing was reported.
    assert value(after, "polar_node_result_reports_total", outcome="delivered") == 0


async def test_node_metrics_need_the_token_and_are_not_on_the_model_api(tmp_path: Path) -> None:
    with fake_policy() as (url, _):
        async with (
            running_node(url, tmp_path, control_token="s3cret-s3cret-s3cret") as node,
            httpx.AsyncClient(base_url=node.control_url) as control,
            httpx.AsyncClient(base_url=node.url) as data,
        ):
            for headers in ({}, bearer("wrong-wrong-wrong-wrong")):
                r = await control.get("/metrics", headers=headers)
                assert r.status_code == 401 and "polar_node" not in r.text
            ok = await control.get("/metrics", headers=bearer("s3cret-s3cret-s3cret"))
            assert ok.status_code == 200 and "polar_node_sessions" in ok.text
            for headers in ({}, bearer("s3cret-s3cret-s3cret")):
                r = await data.get("/metrics", headers=headers)
                assert r.status_code == 404 and "polar_node" not in r.text
