"""The node's durable word about each session id: one table in the node's store file (beside the gateway's
records), written before the node acts or answers.

A row says the latest thing this node told anyone about a session id, and what it still owes the server:

    fenced    it refused dispatch `dispatch` of this id (full, draining, invalid, or a probe it answered
              "never had it"): that dispatch is never admitted later, even if its request is still in
              flight. A later dispatch of the id with another credential may be admitted.
    admitted  it accepted the session (written before the 202 leaves). A row still `admitted` when a node
              starts belongs to a session its predecessor was running when it died: it is ended ERROR.
    ended     the session ended; `result` holds the SessionResult until the server acknowledges it.
    returned  it handed the session back to the server unrun (a drain): owed as a hand-back report.
    settled   the server acknowledged the outcome, or refused it for good: only status and reason remain.

Settled and fenced rows are tombstones: kept for `ttl_s`, so a dispatch retried after a lost reply is
answered "already have it" (same credential) instead of being run twice. Ended and returned rows are kept
until the server has them, however long that takes.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from polar.rollout.protocol import SessionResult, SessionStatus
from polar.store.files import private_database

SCHEMA = """
CREATE TABLE IF NOT EXISTS node_outcomes (
    session_id TEXT PRIMARY KEY,
    state TEXT NOT NULL CHECK (state IN ('fenced', 'admitted', 'ended', 'returned', 'settled')),
    dispatch TEXT,          -- the credential (SessionSpec.result_token) of the dispatch this row is about
    task_id TEXT,
    server_url TEXT,        -- where the outcome is reported (NULL: nowhere, a standalone node)
    status TEXT,            -- the terminal SessionStatus once ended
    reason TEXT,
    result BLOB,            -- the SessionResult as JSON while the server has not acknowledged it
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS node_outcomes_state ON node_outcomes (state, updated_at);
"""

RESTARTED = "node restarted while the session ran; it was not run again"


class State(StrEnum):
    FENCED = "fenced"
    ADMITTED = "admitted"
    ENDED = "ended"
    RETURNED = "returned"
    SETTLED = "settled"


@dataclass(frozen=True)
class Entry:
    session_id: str
    state: State
    dispatch: str | None
    task_id: str | None
    server_url: str | None
    status: SessionStatus | None
    reason: str | None
    result: SessionResult | None

    def same_dispatch(self, token: str | None) -> bool:
        return token is not None and self.dispatch == token


_COLS = "session_id, state, dispatch, task_id, server_url, status, reason, result"


def _entry(row: tuple[Any, ...]) -> Entry:
    result = SessionResult.model_validate_json(row[7]) if row[7] is not None else None
    status = SessionStatus(row[5]) if row[5] is not None else None
    return Entry(row[0], State(row[1]), row[2], row[3], row[4], status, row[6], result)


class Journal:
    """One connection behind a lock; every method is one short transaction (called from the event loop,
    like the rollout server's store)."""

    def __init__(self, path: str | Path, durability: Literal["normal", "full"] = "normal") -> None:
        private_database(path)  # 0600, and so its -wal and -shm (polar.store.files)
        self._conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=30.0)
        self._conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL: a killed process loses nothing committed; FULL (the gateway's `durability`): power loss too
        self._conn.execute(f"PRAGMA synchronous={'FULL' if durability == 'full' else 'NORMAL'}")
        self._conn.execute("PRAGMA busy_timeout=30000")
        self._conn.executescript(SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _exec(self, sql: str, args: tuple[Any, ...]) -> int:
        with self._lock:
            return int(self._conn.execute(sql, args).rowcount)

    def _rows(self, sql: str, args: tuple[Any, ...] = ()) -> list[Entry]:
        with self._lock:
            return [_entry(r) for r in self._conn.execute(sql, args).fetchall()]

    def get(self, session_id: str) -> Entry | None:
        rows = self._rows(f"SELECT {_COLS} FROM node_outcomes WHERE session_id = ?", (session_id,))
        return rows[0] if rows else None

    def admit(self, session_id: str, dispatch: str | None, task_id: str, server_url: str | None) -> None:
        """Accepted: replaces a fence of another dispatch of the same id (the caller checked)."""
        self._exec(
            "INSERT OR REPLACE INTO node_outcomes (session_id, state, dispatch, task_id, server_url, "
            "updated_at) VALUES (?, 'admitted', ?, ?, ?, ?)",
            (session_id, dispatch, task_id, server_url, time.time()),
        )

    def fence(self, session_id: str, dispatch: str) -> None:
        """This dispatch of the id is refused for good. A row about an admitted session is left alone."""
        self._exec(
            "INSERT INTO node_outcomes (session_id, state, dispatch, updated_at) VALUES (?, 'fenced', ?, ?) "
            "ON CONFLICT(session_id) DO UPDATE SET dispatch = excluded.dispatch, updated_at = "
            "excluded.updated_at WHERE state = 'fenced'",
            (session_id, dispatch, time.time()),
        )

    def end(self, result: SessionResult, *, owed: bool) -> None:
        """The session's outcome, written before it is reported; `owed=False`: nobody is to be told."""
        blob = result.model_dump_json().encode() if owed else None
        self._exec(
            "UPDATE node_outcomes SET state = ?, status = ?, reason = ?, result = ?, updated_at = ? "
            "WHERE session_id = ?",
            (
                "ended" if owed else "settled",
                result.status.value,
                result.reason,
                blob,
                time.time(),
                result.session_id,
            ),
        )

    def hand_back(self, session_id: str, reason: str, *, owed: bool) -> None:
        self._exec(
            "UPDATE node_outcomes SET state = ?, status = NULL, reason = ?, updated_at = ? WHERE session_id = ?",
            ("returned" if owed else "settled", reason, time.time(), session_id),
        )

    def settle(self, session_id: str) -> None:
        """The server has the outcome (or will never take it): drop the payload, keep the tombstone."""
        self._exec(
            "UPDATE node_outcomes SET state = 'settled', result = NULL, updated_at = ? "
            "WHERE session_id = ? AND state IN ('ended', 'returned')",
            (time.time(), session_id),
        )

    def interrupted(self, node_id: str) -> list[Entry]:
        """Sessions a previous process admitted and never ended: each is ended ERROR now (`RESTARTED`),
        never run again (its sandbox died with that process, its id is spent)."""
        out = []
        for e in self._rows(f"SELECT {_COLS} FROM node_outcomes WHERE state = 'admitted'"):
            result = SessionResult(
                session_id=e.session_id,
                task_id=e.task_id or "",
                node_id=node_id,
                status=SessionStatus.ERROR,
                reason=RESTARTED,
            )
            self.end(result, owed=e.server_url is not None)
            out.append(e)
        return out

    def owed(self) -> list[Entry]:
        """Outcomes the server has not acknowledged yet (ended or handed back), oldest first."""
        return self._rows(
            f"SELECT {_COLS} FROM node_outcomes WHERE state IN ('ended', 'returned') ORDER BY updated_at"
        )

    def prune(self, ttl_s: float, now: float | None = None) -> int:
        """Drop tombstones (settled, fenced) older than `ttl_s`; owed outcomes are never dropped."""
        now = time.time() if now is None else now
        return self._exec(
            "DELETE FROM node_outcomes WHERE state IN ('settled', 'fenced') AND updated_at < ?",
            (now - ttl_s,),
        )

    def counts(self) -> dict[str, int]:
        with self._lock:
            rows = self._conn.execute("SELECT state, COUNT(*) FROM node_outcomes GROUP BY state").fetchall()
        return {state: n for state, n in rows}
