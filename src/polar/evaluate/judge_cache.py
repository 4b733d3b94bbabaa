"""The judge's cache: a judgement per content hash, in one table of the node's store file.

The key hashes everything that decides the judge's answer (its messages, which hold the rubric and the
outcome, the judge model, the sampling settings and the answer's schema), never the backend's URL: the same
frozen model served elsewhere judges alike. A re-run of a local run (same store) does not ask the judge
again for an outcome it already scored; the cached value names the judge session and call that scored it,
whose record stays in the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import sqlite3
import time
from pathlib import Path
from typing import Any

import orjson

from polar.store.files import private_database

SCHEMA = """
CREATE TABLE IF NOT EXISTS judge_cache (
    key TEXT PRIMARY KEY,   -- sha256 of the canonical JSON of what decides the judgement
    value BLOB NOT NULL,    -- the judgement as JSON (verdict, judge session, call seq)
    created_at REAL NOT NULL
);
"""


def content_key(what: Any) -> str:
    """The sha256 of `what` as canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(orjson.dumps(what, option=orjson.OPT_SORT_KEYS)).hexdigest()


class JudgeCache:
    """Reads and writes in a worker thread, each on a connection of its own: a judgement is one or two
    statements per session, and nothing stays open between them."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def _connect(self) -> sqlite3.Connection:
        private_database(self.path)  # 0600, like the store it lives in
        conn = sqlite3.connect(str(self.path), isolation_level=None, timeout=30.0)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA busy_timeout=30000")
        conn.executescript(SCHEMA)
        return conn

    def _get(self, key: str) -> dict[str, Any] | None:
        with contextlib.closing(self._connect()) as conn:
            row = conn.execute("SELECT value FROM judge_cache WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        value = orjson.loads(row[0])
        return value if isinstance(value, dict) else None

    def _put(self, key: str, value: dict[str, Any]) -> None:
        with contextlib.closing(self._connect()) as conn:
            conn.execute(
                "INSERT OR IGNORE INTO judge_cache (key, value, created_at) VALUES (?, ?, ?)",
                (key, orjson.dumps(value), time.time()),
            )

    async def get(self, key: str) -> dict[str, Any] | None:
        return await asyncio.to_thread(self._get, key)

    async def put(self, key: str, value: dict[str, Any]) -> None:
        """Keep the first judgement of a key (two sessions judged at once with equal outcomes both ask)."""
        await asyncio.to_thread(self._put, key, value)
