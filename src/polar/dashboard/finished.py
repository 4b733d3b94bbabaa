"""A run's folder as the dashboard's data, after the run ended (`polar dashboard RUN_DIR`).

While `polar run` runs, its dashboard is served by its rollout server and reads each session's records from
the node that ran it. Both end with the run, and the link dies with them. The folder keeps everything those
pages show: the server's state (`server.db`: tasks, sessions, results) and the gateway's records
(`gateway.db`, or `nodes/<node>/gateway.db` for gateway nodes on Ray). `FinishedRun` serves the dashboard's
pages from those files, reading only: a run resumed into the folder meanwhile is not disturbed, and its
progress shows on the next page load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from polar.rollout.server.events import EventBus
from polar.rollout.server.store import ServerStore
from polar.store.sqlite import SQLiteStore


class NotARun(Exception):
    """The folder holds no run's state; the message says what it is missing."""


class FinishedRun:
    """What the dashboard asks of a rollout service, from a run folder's files: `store` for the task and
    session pages, `records(session_id)` for a session's gateway records, no nodes, nothing to cancel."""

    def __init__(self, out: Path) -> None:
        db = out / "server.db"
        if not db.is_file():
            raise NotARun(f"{out} holds no server.db: not the --out of a `polar run`, `generate` or `train`")
        self.out = out
        self.store = ServerStore(db)
        self.events = EventBus()  # nothing is published: the pages do not refresh on their own

    def close(self) -> None:
        self.store.close()

    def node_views(self, now: float | None = None) -> list[Any]:
        return []

    def cancel(self, task_id: str, reason: str) -> bool:
        if self.store.task(task_id) is None:
            raise KeyError(task_id)
        return False  # nothing of a finished run runs

    def records(self, session_id: str) -> list[dict[str, Any]]:
        """The session's completion records as a node serves them (`CompletionRecord.to_json`), from the
        gateway store that holds them; [] when none does."""
        for path in [self.out / "gateway.db", *sorted((self.out / "nodes").glob("*/gateway.db"))]:
            if not path.is_file():
                continue
            with SQLiteStore(path) as store:
                found = store.completions(session_id)
            if found:
                return [r.to_json() for r in found]
        return []
