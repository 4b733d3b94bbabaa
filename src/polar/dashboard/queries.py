"""What the dashboard reads from the rollout server's state (`ServerStore`), as plain values for templates.

Read-only SQL over the same database the server writes; each call is one short query (no I/O beyond
SQLite), so pages are rendered from the server's own truth, never from a cache that could lag it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from polar.dashboard.views import evaluator_label
from polar.rollout.protocol import SessionStatus
from polar.task import Task

if TYPE_CHECKING:
    from polar.rollout.server.store import ServerStore

OPEN = tuple(s.value for s in SessionStatus if not s.terminal)
DAY_S = 24 * 3600.0


@dataclass(frozen=True)
class TaskFilter:
    """The overview's filters, exactly as in the URL (so a link shows the same list)."""

    task: str = ""  # substring of the task id
    state: str = ""  # ACTIVE, DONE, CANCELLED
    harness: str = ""
    reward_min: float | None = None  # on the task's mean reward
    reward_max: float | None = None


@dataclass(frozen=True)
class TaskSummary:
    task_id: str
    state: str
    reason: str | None
    harness: str
    evaluator: str
    num_samples: int
    submitted_at: float
    finished_at: float | None
    counts: dict[str, int]
    mean_reward: float | None

    @property
    def done(self) -> int:
        return sum(n for s, n in self.counts.items() if SessionStatus(s).terminal)

    @property
    def progress(self) -> int:
        """Percent of the task's sessions that ended."""
        return round(100 * self.done / self.num_samples) if self.num_samples else 100


@dataclass(frozen=True)
class SessionSummary:
    session_id: str
    task_id: str
    sample_index: int
    status: str
    node_id: str | None
    reward: float | None
    reason: str | None
    created_at: float
    dispatched_at: float | None
    finished_at: float | None


@dataclass(frozen=True)
class SessionDetail:
    summary: SessionSummary
    task: Task
    result: dict[str, Any] | None  # the terminal SessionResult as JSON, once there is one
    timings: dict[str, float] = field(default_factory=dict)


def _task(spec: bytes) -> Task:
    return Task.model_validate_json(spec)


def recent_tasks(store: ServerStore, flt: TaskFilter, limit: int = 200) -> list[TaskSummary]:
    """Newest first: the last `limit` tasks submitted, then narrowed by the filter."""
    rows = store.read(
        "SELECT task_id, state, reason, spec, submitted_at, finished_at FROM tasks ORDER BY seq DESC LIMIT ?",
        (limit,),
    )
    if not rows:
        return []
    ids = [r[0] for r in rows]
    marks = ", ".join("?" * len(ids))
    counts: dict[str, dict[str, int]] = {t: {} for t in ids}
    sums: dict[str, list[float]] = {t: [0.0, 0.0] for t in ids}
    for task_id, status, n, total, rewarded in store.read(
        f"SELECT task_id, status, COUNT(*), SUM(reward), COUNT(reward) FROM sessions WHERE task_id IN ({marks}) "
        "GROUP BY task_id, status",
        ids,
    ):
        counts[task_id][status] = n
        sums[task_id][0] += total or 0.0
        sums[task_id][1] += rewarded
    out = []
    for task_id, state, reason, spec, submitted_at, finished_at in rows:
        task = _task(spec)
        total, n = sums[task_id]
        summary = TaskSummary(
            task_id=task_id,
            state=state,
            reason=reason,
            harness=task.agent.harness,
            evaluator=evaluator_label(task),
            num_samples=task.num_samples,
            submitted_at=submitted_at,
            finished_at=finished_at,
            counts=counts[task_id],
            mean_reward=total / n if n else None,
        )
        if _keep(summary, flt):
            out.append(summary)
    return out


def _keep(t: TaskSummary, flt: TaskFilter) -> bool:
    if flt.task and flt.task.lower() not in t.task_id.lower():
        return False
    if flt.state and t.state != flt.state:
        return False
    if flt.harness and t.harness != flt.harness:
        return False
    if flt.reward_min is not None and (t.mean_reward is None or t.mean_reward < flt.reward_min):
        return False
    return not (flt.reward_max is not None and (t.mean_reward is None or t.mean_reward > flt.reward_max))


def harnesses(store: ServerStore, limit: int = 200) -> list[str]:
    """Harness names of recent tasks, for the filter's choices."""
    rows = store.read("SELECT spec FROM tasks ORDER BY seq DESC LIMIT ?", (limit,))
    return sorted({_task(r[0]).agent.harness for r in rows})


def counters(store: ServerStore, now: float | None = None) -> dict[str, int]:
    """Sessions running now (on a node, not ended), completed in the last 24 h, and all sessions."""
    now = time.time() if now is None else now
    marks = ", ".join("?" * len(OPEN))
    running = store.read(
        f"SELECT COUNT(*) FROM sessions WHERE node_id IS NOT NULL AND status IN ({marks})", OPEN
    )[0][0]
    queued = store.read("SELECT COUNT(*) FROM sessions WHERE status = 'REGISTERED' AND node_id IS NULL")[0][0]
    day = store.read(
        "SELECT COUNT(*) FROM sessions WHERE status = 'COMPLETED' AND finished_at >= ?", (now - DAY_S,)
    )[0][0]
    total = store.read("SELECT COUNT(*) FROM sessions")[0][0]
    active = store.read("SELECT COUNT(*) FROM tasks WHERE state = 'ACTIVE'")[0][0]
    return {
        "running": running,
        "queued": queued,
        "completed_24h": day,
        "total": total,
        "active_tasks": active,
    }


_SESSION_SQL = (
    "SELECT session_id, task_id, sample_index, status, node_id, reward, reason, created_at, dispatched_at, "
    "finished_at FROM sessions"
)


def sessions_of(store: ServerStore, task_id: str) -> list[SessionSummary]:
    rows = store.read(f"{_SESSION_SQL} WHERE task_id = ? ORDER BY sample_index", (task_id,))
    return [SessionSummary(*r) for r in rows]


def session(store: ServerStore, session_id: str) -> SessionDetail | None:
    rows = store.read(f"{_SESSION_SQL} WHERE session_id = ?", (session_id,))
    if not rows:
        return None
    summary = SessionSummary(*rows[0])
    task = store.task(summary.task_id)
    assert task is not None
    blob = store.read("SELECT result FROM sessions WHERE session_id = ?", (session_id,))[0][0]
    result = orjson.loads(blob) if blob is not None else None
    timings = dict(result.get("timings") or {}) if result else {}
    return SessionDetail(summary, task.task, result, timings)


def find_sessions(store: ServerStore, prefix: str, limit: int = 20) -> list[SessionSummary]:
    """Sessions whose id starts with `prefix` (the search box: a full id, or its first characters)."""
    escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    rows = store.read(
        f"{_SESSION_SQL} WHERE session_id LIKE ? ESCAPE '\\' ORDER BY created_at DESC LIMIT ?",
        (escaped + "%", limit),
    )
    return [SessionSummary(*r) for r in rows]
