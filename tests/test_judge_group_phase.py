"""`judge_group` end to end: a real rollout server and a real node run a task's sessions, the node renders
each outcome and holds its reward, the server holds the results until the group has ended, one node judges
the group (a scripted judge behind the node's gateway: tests/judge_support.py), and the results are
released rewarded, or masked when the judging fails; a server restarted mid-phase resumes it, a task
cancelled mid-phase releases its results masked. The pieces (store, rewards, combination) are tested alone
first."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar.dashboard.views import judge_sessions as judge_sessions_of
from polar.evaluate.base import GROUP_PENDING, EvalResult
from polar.evaluate.judge_group import pending, settle
from polar.evaluate.registry import FieldProblem, build_evaluator
from polar.rollout.protocol import SessionResult, SessionStatus
from polar.rollout.rewards import REWARD_PENDING, assign_rewards, settle_group
from polar.rollout.server.grouping import GroupAnswer, settled
from polar.rollout.server.store import ServerStore
from polar.store.sqlite import SQLiteStore
from polar.task import Task
from polar.trajectory.models import Trajectory, TrajectoryStatus
from tests.fakes.fake_vllm import Reply
from tests.judge_support import answered, judge_config, scripted_judge
from tests.node_support import PY, eventually, fake_policy, program, running_node, write_caller
from tests.server_support import AUTH, start_server

BLOCK = re.compile(r'<outcome id="(\d+)">\n(.*?)\n</outcome>', re.S)


def _task(task_id: str, **over: Any) -> Task:
    base: dict[str, Any] = {
        "task_id": task_id,
        "instruction": "do it",
        "num_samples": 3,
        "agent": {"harness": "shell", "settings": {"command": "true"}},
        "evaluator": {
            "strategy": "judge_group",
            "config": judge_config("http://127.0.0.1:9", files=["a.md"]),
        },
    }
    return Task.model_validate(base | over)


def _pending_result(sid: str, task_id: str = "t1", text: str = "outcome") -> SessionResult:
    evaluation = EvalResult(reward=None, details={GROUP_PENDING: {"outcome": text}})
    traj = assign_rewards(answered(text), "COMPLETED", evaluation)
    return SessionResult(
        session_id=sid,
        task_id=task_id,
        node_id="n1",
        status=SessionStatus.COMPLETED,
        trajectory=traj.model_dump(mode="json"),
        metadata={"evaluation": traj.metadata["evaluation"]},
    )


def test_a_pending_trajectory_is_masked_whole_and_keeps_its_traces() -> None:
    """Trainers leave out masked trajectories; the traces keep their loss mask and logprobs so that the
    settled trajectory is trainable again, and nothing but a pending one is ever settled."""
    evaluation = EvalResult(reward=None, details={GROUP_PENDING: {"outcome": "Paris"}})
    traj = assign_rewards(answered("Paris"), "COMPLETED", evaluation)
    assert traj.metadata["masked"] is True and traj.metadata[REWARD_PENDING] == "judge_group"
    assert traj.metadata["reward"] is None and traj.traces[0].loss_mask == [1]
    assert pending(traj.metadata["evaluation"]["details"]) == "Paris"

    rewarded = settle_group(traj, settle(traj.metadata["evaluation"]["details"], 0.7, {"score": 7}, 1))
    assert rewarded.status is TrajectoryStatus.COMPLETED and rewarded.metadata["masked"] is False
    assert rewarded.metadata["reward"] == 0.7 and rewarded.traces[0].reward == 0.7
    assert REWARD_PENDING not in rewarded.metadata and "reward_reason" not in rewarded.metadata
    assert rewarded.metadata["evaluation"]["details"]["group"] == {"score": 7}
    assert GROUP_PENDING not in rewarded.metadata["evaluation"]["details"]

    failed = settle_group(traj, None, "judge_group: no valid answer")
    assert failed.status is TrajectoryStatus.ERROR and failed.metadata["masked"] is True
    assert (
        failed.traces[0].loss_mask == [0]
        and failed.metadata["reward_reason"] == "judge_group: no valid answer"
    )

    plain = assign_rewards(answered("Paris"), "COMPLETED", EvalResult(reward=1.0))
    assert settle_group(plain, None, "x") == plain


def test_a_combined_reward_waits_for_its_group_part() -> None:
    """tests pass AND the group's judge gives at least 0.5: the node keeps the tests' counted value, the
    server folds in the group's reward once it is known."""
    details = {
        "combine": "min",
        "parts": {
            "tests": {"reward": 1.0, "counted": 1.0, "weight": 1.0, "passed": True, "details": {}},
            "quality": {"pending": True, "weight": 1.0, "threshold": 0.5, "details": {}},
        },
        GROUP_PENDING: {"outcome": "x", "part": "quality"},
    }
    high, low = settle(details, 0.6, {"score": 6}, 1), settle(details, 0.4, {"score": 4}, 1)
    assert (high.reward, high.passed) == (1.0, True) and (low.reward, low.passed) == (0.0, False)
    assert high.details["parts"]["quality"]["details"]["group"] == {"score": 6}
    assert "pending" not in high.details["parts"]["quality"]


def test_a_group_too_large_for_one_call_or_two_group_judges_are_refused() -> None:
    with pytest.raises(FieldProblem, match=r"num_samples: judge_group shows the judge every session"):
        build_evaluator(_task("big", num_samples=65))
    two = {
        "evaluator": {"strategy": "session_completed"},
        "evaluators": {
            "a": {"strategy": "judge_group", "config": judge_config("http://127.0.0.1:9")},
            "b": {"strategy": "judge_group", "config": judge_config("http://127.0.0.1:9")},
        },
    }
    with pytest.raises(FieldProblem, match=r"evaluators\.b\.strategy: one judge_group per task"):
        build_evaluator(_task("two", **two))


def test_held_results_are_invisible_until_released_with_their_callbacks(tmp_path: Path) -> None:
    store = ServerStore(tmp_path / "server.db")
    try:
        store.add_tasks([(_task("t1"), ["s0", "s1"])])
        first, second = _pending_result("s0"), _pending_result("s1")
        assert store.finish(first, "http://trainer/cb", b"{}", hold=True) == 0
        assert store.finish(first, "http://trainer/cb", b"{}", hold=True) is None  # first result wins
        assert store.finish(second, "http://trainer/cb", b"{}", hold=True) == 0
        assert store.results(["t1"]) == [] and store.callbacks("t1") == []
        assert store.holds("t1") and store.held_task_ids() == ["t1"]
        assert [r.session_id for r in store.held("t1")] == ["s0", "s1"]

        answer = GroupAnswer(rewards={"s0": 0.9, "s1": 0.2}, scores={"s0": 9, "s1": 2}, orderings=2)
        out = [settled(r, answer) for r in store.held("t1")]
        assert [r.reward for r in out] == [0.9, 0.2]
        assert store.release_held(out, "http://trainer/cb", [b"a", b"b"]) == ["s0", "s1"]
        assert store.release_held(out, "http://trainer/cb", [b"a", b"b"]) == []  # released once
        rows = store.results(["t1"])
        assert [SessionResult.model_validate_json(blob).reward for _, blob in rows] == [0.9, 0.2]
        assert [c.payload for c in store.callbacks("t1")] == [b"a", b"b"]
        assert not store.holds("t1")
    finally:
        store.close()


def test_a_failed_group_masks_its_completed_sessions_and_keeps_the_others() -> None:
    failed = GroupAnswer(failed="judge_group: ordering 1 of 2 has no valid answer")
    done = settled(_pending_result("s0"), failed)
    assert done.status is SessionStatus.ERROR and done.reward is None
    assert done.reason == "judge_group: ordering 1 of 2 has no valid answer"
    traj = Trajectory.model_validate(done.trajectory)
    assert traj.metadata["masked"] and all(sum(t.loss_mask) == 0 for t in traj.traces)
    timeout = SessionResult(session_id="s1", task_id="t1", status=SessionStatus.TIMEOUT, reason="deadline")
    assert settled(timeout, failed) == timeout


# -- end to end -------------------------------------------------------------------------------------------


class Judge:
    """Scores each outcome by the session id its file holds; `gate` (when set) holds every answer until the
    test opens it, so the test can look at the server mid-phase."""

    def __init__(self) -> None:
        self.scores: dict[str, int] = {}
        self.gate: threading.Event | None = None
        self.seen = 0

    def __call__(self, body: dict[str, Any]) -> Reply:
        self.seen += 1
        if self.gate is not None:
            self.gate.wait(60)
        blocks = BLOCK.findall(body["messages"][-1]["content"])
        got = {}
        for label, text in blocks:
            sid = re.search(r"polar-[0-9a-f]+", text)
            got[label] = self.scores.get(sid.group(0) if sid else "", 0)
        return Reply(content=json.dumps({"reasoning": "compared", "scores": got}))


def _task_body(task_id: str, judge_url: str, tmp_path: Path, **config: Any) -> dict[str, Any]:
    caller = write_caller(tmp_path)
    script = program("sign.sh", 'echo "signed by $POLAR_SESSION_ID" > a.md\n')
    return {
        "task_id": task_id,
        "instruction": "do it",
        "num_samples": 3,
        "timeout_seconds": 60,
        "agent": {"harness": "shell", "settings": {"command": f"{PY} {caller} && bash {script}"}},
        "evaluator": {
            "strategy": "judge_group",
            "config": judge_config(judge_url, files=["a.md"], answer=False, repeats=2, **config),
            "timeout_seconds": 60,
        },
    }


async def _results(client: httpx.AsyncClient, task_id: str, wait: float = 0) -> dict[str, Any]:
    r = await client.get("/rollout/results", params={"task": task_id, "wait": wait})
    body: dict[str, Any] = r.json()
    return body


async def _all_ended(client: httpx.AsyncClient, task_id: str) -> bool:
    view = (await client.get(f"/rollout/task/{task_id}")).json()
    return all(s["status"] in ("COMPLETED", "ERROR", "TIMEOUT", "CANCELLED") for s in view["sessions"])


async def test_the_server_holds_the_group_then_releases_it_judged(tmp_path: Path) -> None:
    judge = Judge()
    judge.gate = threading.Event()
    server = start_server(tmp_path / "server.db")
    try:
        with fake_policy() as (policy, _), scripted_judge(judge) as (judge_url, _app):
            async with (
                running_node(policy, tmp_path, server_url=server.url, heartbeat_s=0.05) as node,
                httpx.AsyncClient(base_url=server.url, timeout=30, headers=AUTH) as client,
            ):
                r = await client.post("/rollout/task/submit", json=_task_body("g1", judge_url, tmp_path))
                assert r.status_code == 201, r.text
                sids = r.json()["tasks"][0]["session_ids"]
                judge.scores = dict(zip(sids, (9, 5, 1), strict=True))
                await eventually(lambda: _all_ended(client, "g1"), "every session ended")
                await eventually(lambda: _judging(judge), "the judge asked")
                held = await _results(client, "g1")
                assert held["results"] == [] and held["tasks"] == {"g1": "ACTIVE"}
                status = (await client.get("/rollout/status")).json()
                assert status["groups"] == {"held_sessions": 3, "judging": {"g1": 3}}
                judge.gate.set()
                got = await _collect(client, "g1", 3)
                status = (await client.get("/rollout/status")).json()
                assert status["groups"] == {"held_sessions": 0, "judging": {}}
        store_path = node.config.gateway.store_path
    finally:
        server.stop()
    rewards = {r["session_id"]: r["reward"] for r in got}
    assert rewards == {sids[0]: 0.9, sids[1]: 0.5, sids[2]: 0.1}
    for one in got:
        assert one["status"] == "COMPLETED"
        traj = Trajectory.model_validate(one["trajectory"])
        assert not traj.metadata["masked"] and all(sum(t.loss_mask) > 0 for t in traj.traces)
        group = one["metadata"]["evaluation"]["details"]["group"]
        assert group["orderings"] == 2 and sorted(group["group"]) == sorted(sids)
    judges = got[0]["metadata"]["evaluation"]["details"]["group"]["judges"]
    judge_sessions = {j["judge"]["session_id"] for j in judges}
    assert [(sid, on) for sid, _, on in judge_sessions_of(got[0]["metadata"]["evaluation"])] == [
        (j["judge"]["session_id"], "node-test") for j in judges
    ]  # what the dashboard's evaluation tab shows, fetched from the node that judged
    assert len(judge_sessions) >= 1 and judge.seen == 2
    with SQLiteStore(store_path) as store:
        for jsid in judge_sessions:
            info = store.session(jsid)
            assert info is not None and sorted(info.metadata["judged_sessions"]) == sorted(sids)
            assert all("judge" in rec.tags for rec in store.completions(jsid))


async def _judging(judge: Judge) -> bool:
    return judge.seen > 0


async def _collect(client: httpx.AsyncClient, task_id: str, n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    after = 0
    for _ in range(50):
        r = await client.get("/rollout/results", params={"task": task_id, "wait": 2, "after": after})
        body = r.json()
        out += body["results"]
        after = body["next"]
        if len(out) >= n and body["tasks"][task_id] != "ACTIVE":
            return out
    raise AssertionError(f"{len(out)} of {n} results for {task_id}")


async def test_a_group_the_judge_cannot_score_is_released_masked(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server.db")
    try:
        with fake_policy() as (policy, _), scripted_judge(lambda body: Reply(content="nine")) as (url, _a):
            async with (
                running_node(policy, tmp_path, server_url=server.url, heartbeat_s=0.05),
                httpx.AsyncClient(base_url=server.url, timeout=30, headers=AUTH) as client,
            ):
                body = _task_body("g2", url, tmp_path, attempts=1)
                assert (await client.post("/rollout/task/submit", json=body)).status_code == 201
                got = await _collect(client, "g2", 3)
    finally:
        server.stop()
    for r in got:
        assert r["status"] == "ERROR" and r["reward"] is None
        assert "judge_group: ordering 1 of 2 has no valid answer" in r["reason"]
        traj = Trajectory.model_validate(r["trajectory"])
        assert traj.metadata["masked"] and all(sum(t.loss_mask) == 0 for t in traj.traces)


async def test_a_restarted_server_resumes_the_phase_and_a_cancel_releases_masked(tmp_path: Path) -> None:
    """The server stops while the judge is answering; the new one judges the group from its store. Then
    a second task is cancelled mid-phase: its results come out masked, never rewarded."""
    judge = Judge()
    judge.gate = threading.Event()
    db = tmp_path / "server.db"
    server = start_server(db)
    port = int(server.url.rsplit(":", 1)[1])
    try:
        with fake_policy() as (policy, _), scripted_judge(judge) as (judge_url, _app):
            async with running_node(policy, tmp_path, server_url=server.url, heartbeat_s=0.05):
                async with httpx.AsyncClient(base_url=server.url, timeout=30, headers=AUTH) as client:
                    r = await client.post("/rollout/task/submit", json=_task_body("g3", judge_url, tmp_path))
                    sids = r.json()["tasks"][0]["session_ids"]
                    judge.scores = dict(zip(sids, (2, 4, 6), strict=True))
                    await eventually(lambda: _judging(judge), "the judge asked")
                server.stop()  # mid-phase: the held results are in its store
                judge.gate.set()
                server = start_server(db, port=port)
                async with httpx.AsyncClient(base_url=server.url, timeout=30, headers=AUTH) as client:
                    got = await _collect(client, "g3", 3)
                    assert {r["session_id"]: r["reward"] for r in got} == dict(
                        zip(sids, (0.2, 0.4, 0.6), strict=True)
                    )
                    judge.gate.clear()
                    seen = judge.seen
                    r = await client.post("/rollout/task/submit", json=_task_body("g4", judge_url, tmp_path))
                    await eventually(lambda: _asked_since(judge, seen), "the judge asked again")
                    assert (await client.delete("/rollout/task/g4")).status_code == 200
                    cancelled = await _collect(client, "g4", 3)
                    judge.gate.set()
    finally:
        server.stop()
    for one in cancelled:
        assert one["status"] == "ERROR" and one["reward"] is None
        assert one["reason"].startswith("cancelled before its group was judged")


async def _asked_since(judge: Judge, seen: int) -> bool:
    return judge.seen > seen


def test_polar_status_shows_the_results_held_and_the_groups_being_judged() -> None:
    from rich.console import Console

    from polar.cli.status import _overview

    console = Console(record=True, width=200)
    groups = {"held_sessions": 5, "judging": {"g1": 3}}
    _overview(console, {"tasks": {"ACTIVE": 2}, "sessions": {"COMPLETED": 5}, "groups": groups}, [])
    assert "groups:   5 result(s) held for judge_group; judging g1 (3)" in console.export_text()
    console = Console(record=True, width=200)
    _overview(console, {"tasks": {}, "sessions": {}, "groups": {"held_sessions": 0, "judging": {}}}, [])
    assert "groups:" not in console.export_text()
