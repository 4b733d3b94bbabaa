"""The rollout server's durable state: tasks, sessions, nodes and pending trainer callbacks, in one SQLite
file (WAL), separate from any gateway's record store.

Everything the server promises survives a restart because it is written here *before* it is acted on:
a session's node is recorded before the dispatch request leaves (so a lost answer can be reconciled), a
result is committed before the node's callback is acknowledged, and a trainer callback is queued in the
same transaction as the result it carries.
"""

from __future__ import annotations

import hmac
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from polar.rollout.protocol import SessionResult, SessionStatus
from polar.store.files import private_database
from polar.task import Task

SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    task_id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,            -- submission order (FIFO within a priority)
    priority INTEGER NOT NULL,
    spec BLOB NOT NULL,              -- the Task as JSON
    state TEXT NOT NULL,             -- ACTIVE, DONE, CANCELLED
    submitted_at REAL NOT NULL,
    finished_at REAL,
    reason TEXT
);
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    task_id TEXT NOT NULL,
    sample_index INTEGER NOT NULL,
    status TEXT NOT NULL,
    node_id TEXT,                    -- set before the dispatch request leaves
    confirmed INTEGER NOT NULL DEFAULT 0,  -- 1 once the node acknowledged the dispatch
    attempts INTEGER NOT NULL DEFAULT 0,   -- dispatches tried (a refused one returns it to the queue)
    created_at REAL NOT NULL,
    dispatched_at REAL,
    finished_at REAL,
    finish_seq INTEGER,              -- order in which sessions reached a terminal status
    reason TEXT,
    reward REAL,
    result BLOB,                     -- the terminal SessionResult as JSON
    result_token TEXT                -- this dispatch's credential: only its node may report the result
);
CREATE INDEX IF NOT EXISTS sessions_task ON sessions (task_id, sample_index);
CREATE INDEX IF NOT EXISTS sessions_status ON sessions (status);
CREATE INDEX IF NOT EXISTS sessions_finish ON sessions (finish_seq);
-- The queue (`queued`): active tasks in placement order, and only the sessions still waiting for a node, so
-- the head of a queue of any depth is read without sorting it (bench/ray_scale.py: flat to 10,000 queued).
CREATE INDEX IF NOT EXISTS tasks_queue ON tasks (state, priority DESC, seq, task_id);
CREATE INDEX IF NOT EXISTS sessions_queued ON sessions (task_id, sample_index)
    WHERE status = 'REGISTERED' AND node_id IS NULL;
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    capacity INTEGER NOT NULL,
    server_url TEXT,                 -- this server's URL as the node reached it
    registered_at REAL NOT NULL,
    last_heartbeat REAL NOT NULL,
    last_contact REAL NOT NULL,      -- last time the node answered anything (heartbeat, dispatch, probe)
    status BLOB,                     -- the last NodeStatus as JSON
    draining INTEGER NOT NULL DEFAULT 0,
    lost INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS callbacks (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id TEXT NOT NULL,
    session_id TEXT,                 -- NULL for the task-done event
    url TEXT NOT NULL,
    payload BLOB NOT NULL,
    state TEXT NOT NULL,             -- pending, delivered, failed
    attempts INTEGER NOT NULL DEFAULT 0,
    next_at REAL NOT NULL,
    last_error TEXT,
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS callbacks_due ON callbacks (state, next_at);
"""

OPEN = tuple(s.value for s in SessionStatus if not s.terminal)
# Open sessions bound to a node, written out (no parameters) so that SQLite uses the partial index below:
# what every tick reads (`on_nodes`, `load_by_node`) stays bounded by what runs, not by the queue's depth.
ON_NODE = "node_id IS NOT NULL AND status IN (" + ", ".join(f"'{s}'" for s in OPEN) + ")"
SCHEMA += f"CREATE INDEX IF NOT EXISTS sessions_on_nodes ON sessions (node_id) WHERE {ON_NODE};\n"


@dataclass(frozen=True)
class TaskRow:
    task: Task
    seq: int
    state: str  # ACTIVE, DONE, CANCELLED
    submitted_at: float
    finished_at: float | None
    reason: str | None


@dataclass(frozen=True)
class SessionRow:
    session_id: str
    task_id: str
    sample_index: int
    status: SessionStatus
    node_id: str | None
    confirmed: bool
    attempts: int
    created_at: float
    dispatched_at: float | None
    finish_seq: int | None
    reason: str | None


@dataclass(frozen=True)
class NodeRow:
    node_id: str
    url: str
    capacity: int
    server_url: str | None
    last_heartbeat: float
    last_contact: float
    draining: bool
    lost: bool
    status: dict[str, Any] | None


@dataclass(frozen=True)
class CallbackRow:
    id: int
    task_id: str
    session_id: str | None
    url: str
    payload: bytes
    state: str
    attempts: int
    last_error: str | None


_SESSION_COLS = (
    "session_id, task_id, sample_index, status, node_id, confirmed, attempts, created_at, dispatched_at, "
    "finish_seq, reason"
)


def _session(row: tuple[Any, ...]) -> SessionRow:
    return SessionRow(row[0], row[1], row[2], SessionStatus(row[3]), row[4], bool(row[5]), *row[6:11])


_NODE_COLS = "node_id, url, capacity, server_url, last_heartbeat, last_contact, draining, lost, status"


def _node(row: tuple[Any, ...]) -> NodeRow:
    status = orjson.loads(row[8]) if row[8] is not None else None
    return NodeRow(row[0], row[1], row[2], row[3], row[4], row[5], bool(row[6]), bool(row[7]), status)


class ServerStore:
    """One connection shared by the server's event loop (and, rarely, worker threads), behind a lock.

    Every method is one short transaction; none does I/O other than SQLite, so calling them from the
    event loop costs microseconds to a millisecond.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        private_database(path)  # 0600, and so its -wal and -shm (polar.store.files)
        self._conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=30.0)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a killed process loses nothing
        self._conn.execute("PRAGMA busy_timeout=30000")
        self._conn.executescript(SCHEMA)
        self._migrate()
        self._lock = threading.RLock()

    def _migrate(self) -> None:
        """Columns added since a database was made (a server upgraded in place keeps its state)."""
        cols = {row[1] for row in self._conn.execute("PRAGMA table_info(sessions)")}
        if "result_token" not in cols:
            self._conn.execute("ALTER TABLE sessions ADD COLUMN result_token TEXT")

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def _all(self, sql: str, args: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return list(self._conn.execute(sql, tuple(args)).fetchall())

    def read(self, sql: str, args: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        """A read-only query for views over the state (the dashboard's, `polar.dashboard.queries`)."""
        if not sql.lstrip().upper().startswith("SELECT"):
            raise ValueError("read() runs SELECT statements only")
        return self._all(sql, args)

    # -- tasks ------------------------------------------------------------------------------------------
    def add_tasks(self, tasks: list[tuple[Task, list[str]]]) -> None:
        """Insert tasks and their sessions atomically; raises KeyError naming a task id already known."""
        now = time.time()
        with self._tx() as c:
            for task, _ in tasks:
                if c.execute("SELECT 1 FROM tasks WHERE task_id = ?", (task.task_id,)).fetchone():
                    raise KeyError(task.task_id)
            seq = c.execute("SELECT COALESCE(MAX(seq), 0) FROM tasks").fetchone()[0]
            for task, session_ids in tasks:
                seq += 1
                c.execute(
                    "INSERT INTO tasks (task_id, seq, priority, spec, state, submitted_at) "
                    "VALUES (?, ?, ?, ?, 'ACTIVE', ?)",
                    (task.task_id, seq, task.priority, task.model_dump_json(), now),
                )
                c.executemany(
                    "INSERT INTO sessions (session_id, task_id, sample_index, status, created_at) "
                    "VALUES (?, ?, ?, 'REGISTERED', ?)",
                    [(sid, task.task_id, i, now) for i, sid in enumerate(session_ids)],
                )

    def task(self, task_id: str) -> TaskRow | None:
        rows = self._all(
            "SELECT spec, seq, state, submitted_at, finished_at, reason FROM tasks WHERE task_id = ?",
            (task_id,),
        )
        if not rows:
            return None
        spec, seq, state, submitted, finished, reason = rows[0]
        return TaskRow(Task.model_validate_json(spec), seq, state, submitted, finished, reason)

    def task_states(self) -> dict[str, int]:
        return {state: n for state, n in self._all("SELECT state, COUNT(*) FROM tasks GROUP BY state")}

    def active_task_ids(self) -> list[str]:
        return [r[0] for r in self._all("SELECT task_id FROM tasks WHERE state = 'ACTIVE' ORDER BY seq")]

    def finish_task(self, task_id: str, state: str, reason: str | None = None) -> bool:
        """Mark an ACTIVE task DONE or CANCELLED; False if it was not active (so callers act once)."""
        with self._tx() as c:
            cur = c.execute(
                "UPDATE tasks SET state = ?, finished_at = ?, reason = ? WHERE task_id = ? AND state = 'ACTIVE'",
                (state, time.time(), reason, task_id),
            )
            return cur.rowcount == 1

    # -- sessions ---------------------------------------------------------------------------------------
    def session(self, session_id: str) -> SessionRow | None:
        rows = self._all(f"SELECT {_SESSION_COLS} FROM sessions WHERE session_id = ?", (session_id,))
        return _session(rows[0]) if rows else None

    def sessions_of(self, task_id: str) -> list[SessionRow]:
        rows = self._all(
            f"SELECT {_SESSION_COLS} FROM sessions WHERE task_id = ? ORDER BY sample_index", (task_id,)
        )
        return [_session(r) for r in rows]

    def counts(self, task_id: str | None = None) -> dict[str, int]:
        if task_id is None:
            rows = self._all("SELECT status, COUNT(*) FROM sessions GROUP BY status")
        else:
            rows = self._all(
                "SELECT status, COUNT(*) FROM sessions WHERE task_id = ? GROUP BY status", (task_id,)
            )
        return {status: n for status, n in rows}

    def queued(self, limit: int) -> list[SessionRow]:
        """REGISTERED sessions of active tasks, highest priority first, then submission order."""
        # Tasks first, in order (CROSS JOIN fixes the loop order), then each one's waiting sessions from the
        # partial index: the planner's own choice sorted every REGISTERED session on every tick.
        rows = self._all(
            f"SELECT {', '.join('s.' + c.strip() for c in _SESSION_COLS.split(','))} "
            "FROM tasks t CROSS JOIN sessions s INDEXED BY sessions_queued ON s.task_id = t.task_id "
            "WHERE s.status = 'REGISTERED' AND s.node_id IS NULL AND t.state = 'ACTIVE' "
            "ORDER BY t.priority DESC, t.seq, t.task_id, s.sample_index LIMIT ?",
            (limit,),
        )
        return [_session(r) for r in rows]

    def queue_depth(self) -> int:
        """How many sessions `queued` would give: waiting for a node."""
        rows = self._all(
            "SELECT COUNT(*) FROM sessions s JOIN tasks t ON t.task_id = s.task_id "
            "WHERE s.status = 'REGISTERED' AND s.node_id IS NULL AND t.state = 'ACTIVE'"
        )
        return int(rows[0][0])

    def on_nodes(self) -> list[SessionRow]:
        """Open sessions that have a node (dispatched or being dispatched)."""
        rows = self._all(f"SELECT {_SESSION_COLS} FROM sessions INDEXED BY sessions_on_nodes WHERE {ON_NODE}")
        return [_session(r) for r in rows]

    def load_by_node(self) -> dict[str, int]:
        rows = self._all(
            f"SELECT node_id, COUNT(*) FROM sessions INDEXED BY sessions_on_nodes WHERE {ON_NODE} GROUP BY node_id"
        )
        return {node: n for node, n in rows}

    def claim(self, session_id: str, node_id: str) -> str | None:
        """Write-ahead of a dispatch: the session is bound to `node_id` before the request is sent, with a
        fresh credential for its result. Returns that credential, or None if the session was not free."""
        token = secrets.token_urlsafe(24)
        with self._tx() as c:
            cur = c.execute(
                "UPDATE sessions SET node_id = ?, confirmed = 0, dispatched_at = ?, attempts = attempts + 1, "
                "result_token = ? WHERE session_id = ? AND status = 'REGISTERED' AND node_id IS NULL",
                (node_id, time.time(), token, session_id),
            )
            return token if cur.rowcount == 1 else None

    def reported_by_dispatch(self, session_id: str, node_id: str | None, token: str | None) -> bool:
        """Whether a report carries the credential of the session's current dispatch, from its node."""
        rows = self._all("SELECT node_id, result_token FROM sessions WHERE session_id = ?", (session_id,))
        if not rows or token is None or rows[0][1] is None:
            return False
        bound, expected = rows[0]
        same_node = node_id is None or node_id == bound
        return same_node and hmac.compare_digest(token.encode(), str(expected).encode())

    def confirm(self, session_id: str, node_id: str) -> None:
        """The node acknowledged (or reported) the session: it is DISPATCHED unless already further on."""
        with self._tx() as c:
            c.execute(
                "UPDATE sessions SET confirmed = 1, "
                "status = CASE status WHEN 'REGISTERED' THEN 'DISPATCHED' ELSE status END "
                "WHERE session_id = ? AND node_id = ?",
                (session_id, node_id),
            )

    def release(self, session_id: str, node_id: str, *, refund: bool = False) -> bool:
        """The node certainly does not have the session: it goes back to the queue, same id. `refund`: the
        dispatch does not count against `max_dispatch_attempts` (a draining node handed it back)."""
        marks = ", ".join("?" * len(OPEN))
        with self._tx() as c:
            cur = c.execute(
                "UPDATE sessions SET node_id = NULL, confirmed = 0, dispatched_at = NULL, status = 'REGISTERED', "
                f"result_token = NULL, attempts = MAX(0, attempts - ?) WHERE session_id = ? AND node_id = ? "
                f"AND status IN ({marks})",
                (int(refund), session_id, node_id, *OPEN),
            )
            return cur.rowcount == 1

    def dispatch_token(self, session_id: str) -> str | None:
        """The credential of the session's current dispatch (sent with a probe, which the node fences)."""
        rows = self._all("SELECT result_token FROM sessions WHERE session_id = ?", (session_id,))
        return rows[0][0] if rows else None

    def unconfirm(self, node_id: str | None = None) -> int:
        """Make open sessions (of one node, or all) unsettled, so each is asked about once more."""
        marks = ", ".join("?" * len(OPEN))
        where = "node_id IS NOT NULL" if node_id is None else "node_id = ?"
        args = () if node_id is None else (node_id,)
        with self._tx() as c:
            cur = c.execute(
                f"UPDATE sessions SET confirmed = 0 WHERE {where} AND status IN ({marks})", (*args, *OPEN)
            )
            return int(cur.rowcount)

    def requeue_orphans(self, new_id: Callable[[], str]) -> int:
        """Put open sessions bound to a node back in the queue, each under a fresh id from `new_id`.

        Only for a caller that knows every node of this database is gone: a local run (`polar run`) whose
        node died with its process, interrupted or killed. The old id may have started running there, and
        ids are single-use (they key the gateway's records), so a rerun gets a new one; the session keeps
        its task and sample index, and its dispatch attempts start over. Returns how many were requeued."""
        marks = ", ".join("?" * len(OPEN))
        with self._tx() as c:
            rows = c.execute(
                f"SELECT session_id FROM sessions WHERE node_id IS NOT NULL AND status IN ({marks})", OPEN
            ).fetchall()
            for (old,) in rows:
                c.execute(
                    "UPDATE sessions SET session_id = ?, node_id = NULL, confirmed = 0, dispatched_at = NULL, "
                    "status = 'REGISTERED', result_token = NULL, attempts = 0 WHERE session_id = ?",
                    (new_id(), old),
                )
            return len(rows)

    def retry(self, session_ids: Sequence[str], new_id: Callable[[], str]) -> int:
        """Put these finished sessions back in the queue under fresh ids (their tasks active again).

        For a local run resumed after sessions ended in an infrastructure failure (`polar.rollout.rundir`):
        the old id keys the failed attempt's records and its line in results.jsonl, so the retry gets a new
        one; task and sample index stay. Returns how many were requeued."""
        marks = ", ".join("?" * len(OPEN))
        n = 0
        with self._tx() as c:
            for old in session_ids:
                row = c.execute(
                    f"SELECT task_id FROM sessions WHERE session_id = ? AND status NOT IN ({marks})",
                    (old, *OPEN),
                ).fetchone()
                if row is None:
                    continue
                c.execute(
                    "UPDATE sessions SET session_id = ?, status = 'REGISTERED', node_id = NULL, confirmed = 0, "
                    "attempts = 0, dispatched_at = NULL, finished_at = NULL, finish_seq = NULL, reason = NULL, "
                    "reward = NULL, result = NULL, result_token = NULL WHERE session_id = ?",
                    (new_id(), old),
                )
                c.execute(
                    "UPDATE tasks SET state = 'ACTIVE', finished_at = NULL, reason = NULL "
                    "WHERE task_id = ? AND state = 'DONE'",
                    (row[0],),
                )
                n += 1
        return n

    def set_stage(self, session_id: str, status: SessionStatus) -> None:
        """A non-terminal progress report from a node (INITIALIZING, RUNNING, ...)."""
        marks = ", ".join("?" * len(OPEN))
        with self._tx() as c:
            c.execute(
                f"UPDATE sessions SET status = ?, confirmed = 1 WHERE session_id = ? AND status IN ({marks})",
                (status.value, session_id, *OPEN),
            )

    def finish(
        self, result: SessionResult, callback_url: str | None, payload: bytes | None, *, hold: bool = False
    ) -> int | None:
        """Record a terminal result (first one wins) and queue its trainer callback in the same transaction.

        With `hold` the result is kept but not released (no finish sequence number, so no reader sees it,
        and no callback) until `release_held`: its group is judged first (`grouping`).
        Returns the session's finish sequence number (0 when held), or None if it was already terminal."""
        now = time.time()
        marks = ", ".join("?" * len(OPEN))
        with self._tx() as c:
            seq = None if hold else self._next_finish(c)
            cur = c.execute(
                "UPDATE sessions SET status = ?, finished_at = ?, finish_seq = ?, reason = ?, reward = ?, "
                "result = ?, node_id = COALESCE(?, node_id) "
                f"WHERE session_id = ? AND status IN ({marks})",
                (
                    result.status.value,
                    now,
                    seq,
                    result.reason,
                    result.reward,
                    result.model_dump_json().encode(),
                    result.node_id,
                    result.session_id,
                    *OPEN,
                ),
            )
            if cur.rowcount != 1:
                return None
            if seq is None:
                return 0
            if callback_url and payload is not None:
                self._queue_callback(c, result.task_id, result.session_id, callback_url, payload, now)
            return int(seq)

    @staticmethod
    def _next_finish(c: sqlite3.Connection) -> int:
        return int(c.execute("SELECT COALESCE(MAX(finish_seq), 0) + 1 FROM sessions").fetchone()[0])

    def held(self, task_id: str) -> list[SessionResult]:
        """The task's results kept back by `finish(hold=True)`, in sample order."""
        rows = self._all(
            "SELECT result FROM sessions WHERE task_id = ? AND finish_seq IS NULL AND result IS NOT NULL "
            "ORDER BY sample_index",
            (task_id,),
        )
        return [SessionResult.model_validate_json(bytes(r[0])) for r in rows]

    def holds(self, task_id: str) -> bool:
        rows = self._all(
            "SELECT 1 FROM sessions WHERE task_id = ? AND finish_seq IS NULL AND result IS NOT NULL LIMIT 1",
            (task_id,),
        )
        return bool(rows)

    def held_counts(self) -> dict[str, int]:
        """Results kept back for their group, by task."""
        rows = self._all(
            "SELECT task_id, COUNT(*) FROM sessions WHERE finish_seq IS NULL AND result IS NOT NULL "
            "GROUP BY task_id"
        )
        return {task_id: n for task_id, n in rows}

    def held_task_ids(self) -> list[str]:
        """Tasks with results kept back (a server that stopped during a group phase resumes them)."""
        rows = self._all(
            "SELECT DISTINCT task_id FROM sessions WHERE finish_seq IS NULL AND result IS NOT NULL"
        )
        return [r[0] for r in rows]

    def release_held(
        self, results: Sequence[SessionResult], callback_url: str | None, payloads: Sequence[bytes]
    ) -> list[str]:
        """Release held results, settled, in one transaction: each replaces the kept one, gets its finish
        sequence number and its callback. The sessions released (one already released is skipped)."""
        now, released = time.time(), []
        with self._tx() as c:
            seq = self._next_finish(c)
            for result, payload in zip(results, payloads, strict=True):
                cur = c.execute(
                    "UPDATE sessions SET status = ?, reason = ?, reward = ?, result = ?, finish_seq = ? "
                    "WHERE session_id = ? AND finish_seq IS NULL AND result IS NOT NULL",
                    (
                        result.status.value,
                        result.reason,
                        result.reward,
                        result.model_dump_json().encode(),
                        seq,
                        result.session_id,
                    ),
                )
                if cur.rowcount != 1:
                    continue
                if callback_url:
                    self._queue_callback(c, result.task_id, result.session_id, callback_url, payload, now)
                released.append(result.session_id)
                seq += 1
        return released

    def results(self, task_ids: list[str], after: int = 0, limit: int = 1000) -> list[tuple[int, bytes]]:
        """Terminal results of these tasks with finish_seq > after, in finish order: (finish_seq, json)."""
        if not task_ids:
            return []
        marks = ", ".join("?" * len(task_ids))
        return [
            (int(seq), bytes(blob))
            for seq, blob in self._all(
                f"SELECT finish_seq, result FROM sessions WHERE task_id IN ({marks}) AND finish_seq > ? "
                "ORDER BY finish_seq LIMIT ?",
                (*task_ids, after, limit),
            )
        ]

    # -- nodes ------------------------------------------------------------------------------------------
    def register_node(self, node_id: str, url: str, capacity: int, server_url: str | None) -> None:
        now = time.time()
        with self._tx() as c:
            c.execute(
                "INSERT INTO nodes (node_id, url, capacity, server_url, registered_at, last_heartbeat, "
                "last_contact) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(node_id) DO UPDATE SET url = "
                "excluded.url, capacity = excluded.capacity, server_url = excluded.server_url, "
                "registered_at = excluded.registered_at, last_heartbeat = excluded.last_heartbeat, "
                "last_contact = excluded.last_contact, draining = 0, lost = 0",
                (node_id, url, capacity, server_url, now, now, now),
            )

    def heartbeat(self, node_id: str, status: dict[str, Any], capacity: int, draining: bool) -> bool:
        now = time.time()
        with self._tx() as c:
            cur = c.execute(
                "UPDATE nodes SET last_heartbeat = ?, last_contact = ?, status = ?, capacity = ?, draining = ?, "
                "lost = 0 WHERE node_id = ?",
                (now, now, orjson.dumps(status), capacity, int(draining), node_id),
            )
            return cur.rowcount == 1

    def set_draining(self, node_id: str) -> bool:
        with self._tx() as c:
            return c.execute("UPDATE nodes SET draining = 1 WHERE node_id = ?", (node_id,)).rowcount == 1

    def remove_node(self, node_id: str) -> int | None:
        """A drained node leaves: forgotten, unless sessions are still open on it (their count is returned
        and the node stays). None: no such node. Its sessions' history keeps its id."""
        marks = ", ".join("?" * len(OPEN))
        with self._tx() as c:
            if c.execute("SELECT 1 FROM nodes WHERE node_id = ?", (node_id,)).fetchone() is None:
                return None
            (n,) = c.execute(
                f"SELECT COUNT(*) FROM sessions WHERE node_id = ? AND status IN ({marks})", (node_id, *OPEN)
            ).fetchone()
            if n == 0:
                c.execute("DELETE FROM nodes WHERE node_id = ?", (node_id,))
            return int(n)

    def touch_node(self, node_id: str) -> None:
        with self._tx() as c:
            c.execute("UPDATE nodes SET last_contact = ? WHERE node_id = ?", (time.time(), node_id))

    def mark_lost(self, node_id: str) -> None:
        with self._tx() as c:
            c.execute("UPDATE nodes SET lost = 1 WHERE node_id = ?", (node_id,))

    def grace_nodes(self) -> None:
        """At startup: the server was down, not necessarily the nodes; restart their loss clocks."""
        now = time.time()
        with self._tx() as c:
            c.execute("UPDATE nodes SET last_contact = MAX(last_contact, ?) WHERE lost = 0", (now,))

    def nodes(self) -> list[NodeRow]:
        return [_node(r) for r in self._all(f"SELECT {_NODE_COLS} FROM nodes ORDER BY node_id")]

    def node(self, node_id: str) -> NodeRow | None:
        rows = self._all(f"SELECT {_NODE_COLS} FROM nodes WHERE node_id = ?", (node_id,))
        return _node(rows[0]) if rows else None

    # -- trainer callbacks ------------------------------------------------------------------------------
    @staticmethod
    def _queue_callback(
        c: sqlite3.Connection, task_id: str, session_id: str | None, url: str, payload: bytes, now: float
    ) -> None:
        c.execute(
            "INSERT INTO callbacks (task_id, session_id, url, payload, state, next_at, updated_at) "
            "VALUES (?, ?, ?, ?, 'pending', ?, ?)",
            (task_id, session_id, url, payload, now, now),
        )

    def queue_callback(self, task_id: str, session_id: str | None, url: str, payload: bytes) -> None:
        with self._tx() as c:
            self._queue_callback(c, task_id, session_id, url, payload, time.time())

    def due_callbacks(self, limit: int) -> list[CallbackRow]:
        rows = self._all(
            "SELECT id, task_id, session_id, url, payload, state, attempts, last_error FROM callbacks "
            "WHERE state = 'pending' AND next_at <= ? ORDER BY next_at, id LIMIT ?",
            (time.time(), limit),
        )
        return [CallbackRow(r[0], r[1], r[2], r[3], bytes(r[4]), r[5], r[6], r[7]) for r in rows]

    def next_callback_at(self) -> float | None:
        rows = self._all("SELECT MIN(next_at) FROM callbacks WHERE state = 'pending'")
        return rows[0][0] if rows else None

    def callback_attempt(self, cb_id: int, state: str, error: str | None, next_at: float) -> None:
        with self._tx() as c:
            c.execute(
                "UPDATE callbacks SET state = ?, attempts = attempts + 1, last_error = ?, next_at = ?, "
                "updated_at = ? WHERE id = ?",
                (state, error, next_at, time.time(), cb_id),
            )

    def callback_states(self) -> dict[str, int]:
        """Trainer callbacks by state: pending, delivered, failed."""
        return {state: n for state, n in self._all("SELECT state, COUNT(*) FROM callbacks GROUP BY state")}

    def callbacks(self, task_id: str) -> list[CallbackRow]:
        rows = self._all(
            "SELECT id, task_id, session_id, url, payload, state, attempts, last_error FROM callbacks "
            "WHERE task_id = ? ORDER BY id",
            (task_id,),
        )
        return [CallbackRow(r[0], r[1], r[2], r[3], bytes(r[4]), r[5], r[6], r[7]) for r in rows]
