"""The server's SQLite state: atomic submission, the dispatch write-ahead, first-result-wins, durability."""

from __future__ import annotations

from pathlib import Path

import pytest

from polar.rollout.protocol import SessionResult, SessionStatus
from polar.rollout.server.store import ServerStore
from polar.task import Task


def _task(task_id: str, n: int = 2, priority: int = 0) -> Task:
    return Task(task_id=task_id, instruction="x", num_samples=n, priority=priority)


def _res(sid: str, task_id: str, status: SessionStatus = SessionStatus.COMPLETED) -> SessionResult:
    return SessionResult(session_id=sid, task_id=task_id, status=status, reward=1.0)


def test_submission_is_all_or_nothing(tmp_path: Path) -> None:
    store = ServerStore(tmp_path / "s.db")
    store.add_tasks([(_task("a"), ["a0", "a1"])])
    with pytest.raises(KeyError, match="a"):
        store.add_tasks([(_task("b"), ["b0", "b1"]), (_task("a"), ["x0", "x1"])])
    assert store.task("b") is None and store.session("b0") is None
    assert store.active_task_ids() == ["a"]


def test_queue_order_priority_then_submission_then_sample(tmp_path: Path) -> None:
    store = ServerStore(tmp_path / "s.db")
    store.add_tasks([(_task("low"), ["l0", "l1"])])
    store.add_tasks([(_task("high", priority=5), ["h0", "h1"])])
    store.add_tasks([(_task("low2"), ["m0", "m1"])])
    assert [s.session_id for s in store.queued(10)] == ["h0", "h1", "l0", "l1", "m0", "m1"]
    assert [s.session_id for s in store.queued(3)] == ["h0", "h1", "l0"]


def test_claim_confirm_release(tmp_path: Path) -> None:
    store = ServerStore(tmp_path / "s.db")
    store.add_tasks([(_task("a", 1), ["a0"])])
    assert store.claim("a0", "n1")
    assert not store.claim("a0", "n2")  # one node at a time
    s = store.session("a0")
    assert s is not None and s.node_id == "n1" and not s.confirmed and s.attempts == 1
    assert store.queued(10) == []  # a claimed session is not queued again, even before confirmation
    assert store.load_by_node() == {"n1": 1}
    store.release("a0", "n2")  # the wrong node cannot release it
    assert store.session("a0").node_id == "n1"  # type: ignore[union-attr]
    store.release("a0", "n1")
    s = store.session("a0")
    assert s is not None and s.node_id is None and s.status is SessionStatus.REGISTERED
    assert store.claim("a0", "n2")
    store.confirm("a0", "n2")
    s = store.session("a0")
    assert s is not None and s.confirmed and s.status is SessionStatus.DISPATCHED and s.attempts == 2


def test_first_terminal_result_wins_and_results_come_in_finish_order(tmp_path: Path) -> None:
    store = ServerStore(tmp_path / "s.db")
    store.add_tasks([(_task("a", 3), ["a0", "a1", "a2"])])
    assert store.finish(_res("a2", "a"), None, None) == 1
    assert store.finish(_res("a0", "a", SessionStatus.ERROR), None, None) == 2
    assert store.finish(_res("a2", "a", SessionStatus.ERROR), None, None) is None
    rows = store.results(["a"])
    assert [SessionResult.model_validate_json(b).session_id for _, b in rows] == ["a2", "a0"]
    assert store.results(["a"], after=1)[0][0] == 2
    assert store.counts("a") == {"COMPLETED": 1, "ERROR": 1, "REGISTERED": 1}
    store.set_stage("a2", SessionStatus.RUNNING)  # a late progress report cannot reopen a session
    assert store.session("a2").status is SessionStatus.COMPLETED  # type: ignore[union-attr]


def test_result_and_its_callback_are_one_transaction(tmp_path: Path) -> None:
    store = ServerStore(tmp_path / "s.db")
    store.add_tasks([(_task("a", 1), ["a0"])])
    store.finish(_res("a0", "a"), "http://trainer/cb", b"{}")
    (cb,) = store.due_callbacks(10)
    assert cb.session_id == "a0" and cb.url == "http://trainer/cb" and cb.state == "pending"
    store.callback_attempt(cb.id, "pending", "HTTP 500", next_at=1e18)
    assert store.due_callbacks(10) == []
    (cb,) = store.callbacks("a")
    assert cb.attempts == 1 and cb.last_error == "HTTP 500"


def test_everything_survives_reopening(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    store = ServerStore(path)
    store.add_tasks([(_task("a", 2), ["a0", "a1"])])
    store.register_node("n1", "http://n1", 4, "http://server")
    store.claim("a1", "n1")
    store.finish(_res("a0", "a"), "http://trainer", b"{}")
    store.close()
    again = ServerStore(path)
    assert again.active_task_ids() == ["a"]
    assert again.session("a1").node_id == "n1"  # type: ignore[union-attr]
    assert len(again.results(["a"])) == 1 and len(again.due_callbacks(10)) == 1
    assert [n.node_id for n in again.nodes()] == ["n1"]
    again.close()
