"""The node's HTTP routes as the rollout server uses them: admission (capacity, single-use ids, invalid
specs named by field), state queries after a lost answer, status, and the control token."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from polar.rollout.node import AdmissionError
from polar.rollout.protocol import NodeSessionState, NodeStatus, SessionResult, SessionStatus
from tests.node_support import ON_HOST, control_client, fake_policy, running_node, shell_task, spec, until


def _body(session_id: str, **task: object) -> dict[str, object]:
    return spec(shell_task("true", **task), session_id).model_dump(mode="json")  # type: ignore[arg-type]


async def test_submit_get_and_single_use(tmp_path: Path) -> None:
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node, control_client(node) as client:
            r = await client.post("/node/sessions", json=_body("sess-http-1"))
            assert r.status_code == 202, r.text
            assert r.json() == {"session_id": "sess-http-1", "accepted": True, "duplicate": False}
            again = await client.post("/node/sessions", json=_body("sess-http-1"))
            assert again.status_code == 409
            assert "single-use" in again.json()["error"]["message"]
            await node.wait("sess-http-1")
            r = await client.get("/node/sessions/sess-http-1")
            state = NodeSessionState.model_validate(r.json())
            assert state.status == SessionStatus.COMPLETED and state.result is not None
            assert state.result.node_id == "node-test" and state.result.reward == 1.0
            # Still refused once finished: a session never runs twice.
            assert (await client.post("/node/sessions", json=_body("sess-http-1"))).status_code == 409
            listing = (await client.get("/node/sessions")).json()["sessions"]
            assert listing == [{"session_id": "sess-http-1", "status": "COMPLETED"}]
            assert (await client.get("/node/sessions/never-seen")).status_code == 404
            assert (await client.get("/node/nope")).status_code == 404
            # The gateway's control routes are served beside the node's; its model API is not.
            assert (await client.get("/health")).json()["status"] == "ok"
            assert (await client.get("/v1/models")).status_code == 404


async def test_capacity_is_the_admission_limit(tmp_path: Path) -> None:
    gate = tmp_path / "go"
    hold = f"while [ ! -f {gate} ]; do sleep 0.05; done"
    with fake_policy() as (url, _):
        async with (
            running_node(url, tmp_path, capacity=2) as node,
            control_client(node) as client,
        ):
            for sid in ("sess-cap-1", "sess-cap-2"):
                assert (
                    await client.post(
                        "/node/sessions",
                        json=_body(sid, agent={"settings": {"command": hold}}, runtime=ON_HOST),
                    )
                ).status_code == 202
            full = await client.post("/node/sessions", json=_body("sess-cap-3"))
            assert full.status_code == 429 and "full" in full.json()["error"]["message"]
            status = NodeStatus.model_validate((await client.get("/node/status")).json())
            assert status.active == 2 and status.capacity == 2 and status.node_id == "node-test"
            gate.touch()
            await node.wait("sess-cap-1")
            await until(lambda: node.status().active < 2, "a free place")
            assert (await client.post("/node/sessions", json=_body("sess-cap-3"))).status_code == 202
            # A refused id was never admitted, so it is not burnt.
            assert (await node.wait("sess-cap-3")).status == SessionStatus.COMPLETED


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"session_id": "x1"}, "task"),
        (
            {"session_id": "x1", "task": {"task_id": "t", "instruction": "i", "timeout_seconds": -1}},
            "task.timeout_seconds",
        ),
        (
            {"session_id": "x1", "task": {"task_id": "t", "instruction": "i", "agent": {"harness": "nope"}}},
            "task.agent.harness",
        ),
        (
            {"session_id": "x1", "task": {"task_id": "t", "instruction": "i", "agent": {"harness": "shell"}}},
            "task.agent.settings",  # the shell preset without its command
        ),
        (
            {
                "session_id": "x1",
                "task": {"task_id": "t", "instruction": "i", "evaluator": {"strategy": "nope"}},
            },
            "task.evaluator.strategy",
        ),
        (
            {"session_id": "x1", "task": {"task_id": "t", "instruction": "i", "builder": "nope"}},
            "task.builder",
        ),
        (
            {
                "session_id": "x1",
                "task": {"task_id": "t", "instruction": "i", "runtime": {"backend": "docker"}},
            },
            "task.runtime.image",
        ),
    ],
)
async def test_invalid_specs_are_refused_naming_the_field(
    tmp_path: Path, body: dict[str, object], field: str
) -> None:
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node, control_client(node) as client:
            r = await client.post("/node/sessions", json=body)
            assert r.status_code == 422, r.text
            assert r.json()["error"]["field"] == field
            assert node.status().active == 0
            assert (await client.post("/node/sessions", content=b"{not json")).status_code == 422


async def test_node_routes_live_on_the_control_listener_behind_the_token(tmp_path: Path) -> None:
    with fake_policy() as (url, _):
        async with (
            running_node(url, tmp_path, control_token="s3cret-s3cret-s3cret") as node,
            httpx.AsyncClient(base_url=node.control_url) as client,
            httpx.AsyncClient(base_url=node.url) as data,
        ):
            assert (await client.get("/node/status")).status_code == 401
            assert (await client.post("/node/sessions", json=_body("sess-tok"))).status_code == 401
            assert (await client.post("/node/drain")).status_code == 401
            assert not node.draining  # refused before it was read
            wrong = await client.get("/node/status", headers={"authorization": "Bearer nope"})
            assert wrong.status_code == 401 and "wrong control token" in wrong.json()["error"]["message"]
            ok = await client.get("/node/status", headers={"authorization": "Bearer s3cret-s3cret-s3cret"})
            assert ok.status_code == 200
            # The model API (what sandboxes reach) serves no node or session route, token or not.
            auth = {"authorization": "Bearer s3cret-s3cret-s3cret"}
            for method, path in [("POST", "/node/sessions"), ("GET", "/node/sessions"), ("GET", "/node/status"), ("POST", "/node/drain"),
                                 ("POST", "/sessions"), ("POST", "/admin/pause"), ("GET", "/metrics")]:  # fmt: skip
                r = await data.request(method, path, headers=auth, json={})
                assert r.status_code in (404, 405), (method, path, r.status_code)
            assert node.status().active == 0


async def test_python_api_refusals(tmp_path: Path) -> None:
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(shell_task("true"), "sess-api"))
            with pytest.raises(AdmissionError) as dup:
                await node.submit(spec(shell_task("true"), "sess-api"))
            assert dup.value.status == 409
            result = await node.wait("sess-api")
            assert isinstance(result, SessionResult)
            with pytest.raises(KeyError):
                await node.wait("never-seen")
        with pytest.raises(AdmissionError) as stopped:
            await node.submit(spec(shell_task("true"), "sess-after-stop"))
        assert stopped.value.status == 503


async def test_ids_in_the_store_survive_a_node_restart(tmp_path: Path) -> None:
    """A node restarted on the same store refuses ids its predecessor took, and answers GET for them with
    the outcome its predecessor journaled."""
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(shell_task("true"), "sess-before-restart"))
            await node.wait("sess-before-restart")
        async with running_node(url, tmp_path) as node:
            with pytest.raises(AdmissionError) as dup:
                await node.submit(spec(shell_task("true"), "sess-before-restart"))
            assert dup.value.status == 409
            state = node.state("sess-before-restart")
            assert state is not None and state.status == SessionStatus.COMPLETED
            assert state.result is not None and state.result.task_id == "t1"
