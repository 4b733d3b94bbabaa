"""The embedded store: one SQLite file in WAL mode.

Writes go through `RecordWriter` (one connection, used by one thread at a time); reads open their own
connection, so readers never block the writer. Prompt ids are stored as a delta against an earlier prompt
of the same session and JSON bodies as skeletons over content-addressed blobs (see `codec`), which keeps a
200-call session with 30k-token contexts at megabytes.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

import orjson

from polar.store import codec
from polar.store.cache import RecentHashes, SessionCache
from polar.store.files import private_database
from polar.store.records import CompletionRecord, FailureRecord, SessionInfo

Durability = Literal["normal", "full"]
BUSY_TIMEOUT_S = 30.0  # how long a transaction waits for another connection's write lock before it fails
BUSY_TIMEOUT_MS = int(BUSY_TIMEOUT_S * 1000)  # the same, as `PRAGMA busy_timeout` takes it
# Tool lists whose blob hash is remembered: a session resends its tools every call (30-60 kB of JSON for
# some harnesses, ~45 us of blake2b for 40 kB here), and a node serves a handful of harnesses' lists at a time.
TOOL_HASHES = 16

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    status TEXT NOT NULL,
    task_id TEXT,
    metadata BLOB NOT NULL,
    closed_at REAL
);
CREATE INDEX IF NOT EXISTS sessions_task ON sessions (task_id);
CREATE TABLE IF NOT EXISTS blobs (hash BLOB PRIMARY KEY, data BLOB NOT NULL) WITHOUT ROWID;
-- A rowid table: a record's row (~1 kB and up) is more than a WITHOUT ROWID b-tree keeps in its page (~1 kB
-- of 4 kB), so each spilled onto an overflow page of its own. Stores made before 2026-12-05 keep that layout.
CREATE TABLE IF NOT EXISTS completions (
    session_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    completion_id TEXT NOT NULL,
    dialect TEXT NOT NULL,
    created_at REAL NOT NULL,
    request BLOB NOT NULL,
    upstream BLOB NOT NULL,
    prompt_len INTEGER NOT NULL,   -- -1 when the server returned no prompt ids
    prompt_base INTEGER,           -- seq of the earlier record whose prompt this one extends
    prompt_shared INTEGER NOT NULL,
    prompt_tail BLOB,
    response_ids BLOB,
    response_logprobs BLOB,
    finish_reason TEXT NOT NULL,
    response_message BLOB NOT NULL,
    tools BLOB,                    -- blob hash of the canonical tools list
    usage BLOB NOT NULL,
    model_requested TEXT NOT NULL,
    model_served TEXT NOT NULL,
    policy_version INTEGER,
    upstream_ms REAL NOT NULL,
    overhead_ms REAL NOT NULL,
    flags TEXT NOT NULL,
    tags TEXT NOT NULL,
    upstream_id TEXT,              -- the inference server's id (completion_id is the gateway's own)
    UNIQUE (session_id, seq)
);
CREATE TABLE IF NOT EXISTS failures (
    session_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    dialect TEXT NOT NULL,
    created_at REAL NOT NULL,
    status INTEGER NOT NULL,
    kind TEXT NOT NULL,
    message TEXT NOT NULL,
    request BLOB,
    PRIMARY KEY (session_id, seq)
) WITHOUT ROWID;
"""

_COMPLETION_COLUMNS = (
    "session_id, seq, completion_id, dialect, created_at, request, upstream, prompt_len, prompt_base, "
    "prompt_shared, prompt_tail, response_ids, response_logprobs, finish_reason, response_message, tools, "
    "usage, model_requested, model_served, policy_version, upstream_ms, overhead_ms, flags, tags, upstream_id"
)


_INSERT_COMPLETION = f"INSERT INTO completions ({_COMPLETION_COLUMNS}) VALUES ({', '.join('?' * 25)})"


def connect(path: str | Path, durability: Durability = "normal") -> sqlite3.Connection:
    """Open the store, creating the schema. WAL + synchronous=NORMAL survives a killed process (every
    committed transaction is in the WAL); `full` also survives power loss, at an fsync per commit."""
    private_database(path)  # 0600, and so its -wal and -shm (polar.store.files)
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_S)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={'FULL' if durability == 'full' else 'NORMAL'}")
    conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    conn.executescript(SCHEMA)
    _migrate(conn)
    return conn


def _migrate(conn: sqlite3.Connection) -> None:
    """Columns added since a store was made (a gateway upgraded in place keeps its records)."""
    cols = {row[1] for row in conn.execute("PRAGMA table_info(completions)")}
    if "upstream_id" not in cols:
        conn.execute("ALTER TABLE completions ADD COLUMN upstream_id TEXT")


class RecordWriter:
    """Turns records into rows. Remembers, per live session, its latest prompts and body lists, so the next
    call is stored as a delta (`polar.store.cache`: bounded by bytes, dropped when the session closes or goes
    idle; a miss only costs a full copy)."""

    def __init__(self, conn: sqlite3.Connection, cache: SessionCache | None = None) -> None:
        self.conn = conn
        self.cache = cache if cache is not None else SessionCache()
        self._known_blobs = RecentHashes()
        self._tool_hashes: dict[bytes, bytes] = {}  # a tool list's JSON -> its blob hash (a pure function)

    def reset(self) -> None:
        """Forget cached state after a rollback: cached prompts and blobs may name rows that never landed."""
        self.cache.clear()
        self._known_blobs.clear()

    def evict_idle(self) -> int:
        """Drop the state of sessions idle longer than the cache's TTL (also done on every write)."""
        return self.cache.evict_idle()

    def release(self) -> None:
        """Forget every cached session and blob hash and shrink SQLite's page cache: for when no session is
        live (a later call only costs full copies; nothing is lost)."""
        self.reset()
        self.conn.execute("PRAGMA shrink_memory")

    # -- blobs ------------------------------------------------------------------------------------------
    def _put_blobs(self, blobs: dict[bytes, bytes]) -> None:
        new = self._new_blobs(blobs)
        if new:
            self.conn.executemany("INSERT OR IGNORE INTO blobs (hash, data) VALUES (?, ?)", new)

    def _new_blobs(
        self, blobs: dict[bytes, bytes], into: list[tuple[bytes, bytes]] | None = None
    ) -> list[tuple[bytes, bytes]]:
        """The rows of the blobs not written yet (packed), counted as written from now on (`reset` forgets
        that if their transaction does not commit)."""
        new = [] if into is None else into
        for h, data in blobs.items():
            if h not in self._known_blobs:
                new.append((h, codec.pack_blob(data)))
                self._known_blobs.add(h)
        return new

    def _put_json(
        self,
        obj: dict[str, Any],
        chain: tuple[str, str] | None = None,
        seq: int = 0,
        blobs_into: list[tuple[bytes, bytes]] | None = None,
        splits: dict[str, codec.ListSplit] | None = None,
    ) -> bytes:
        """Store a body; with `chain` (session, column) its lists extend the previous record's of that chain.
        `blobs_into`: collect its new blob rows there instead of writing them now; `splits`: the lists of the
        record's other bodies (`codec.split_json`)."""
        prev = self.cache.chain(*chain) if chain is not None else None
        base, previous = prev if prev is not None else (None, None)
        skeleton, blobs, state = codec.split_json(obj, previous, base, splits)
        if blobs_into is None:
            self._put_blobs(blobs)
        else:
            self._new_blobs(blobs, blobs_into)
        if chain is not None:
            self.cache.set_chain(chain[0], chain[1], seq, state)
        return skeleton

    # -- prompts ----------------------------------------------------------------------------------------
    def _prompt_delta(self, session_id: str, seq: int, ids: bytes) -> tuple[int | None, int, bytes]:
        best_seq, best = None, 0
        for prev_seq, prev in self.cache.prompts(session_id):
            n = codec.prefix_len(prev, ids)
            if n > best:
                best_seq, best = prev_seq, n
        self.cache.add_prompt(session_id, seq, ids)
        if best_seq is None:
            return None, 0, ids
        return best_seq, best, ids[best * 4 :]

    # -- rows -------------------------------------------------------------------------------------------
    def add_session(self, info: SessionInfo) -> None:
        self.conn.execute(
            "INSERT INTO sessions (id, created_at, status, task_id, metadata) VALUES (?, ?, ?, ?, ?)",
            (
                info.session_id,
                info.created_at,
                info.status,
                _task_id(info.metadata),
                orjson.dumps(info.metadata),
            ),
        )

    def close_session(self, session_id: str) -> None:
        self.conn.execute(
            "UPDATE sessions SET status = 'closed', closed_at = ? WHERE id = ?", (time.time(), session_id)
        )
        self.cache.forget(session_id)  # a closed session makes no more calls

    def add_completion(self, r: CompletionRecord) -> None:
        self.stage_completion(r)()

    def stage_completion(self, r: CompletionRecord) -> Callable[[], None]:
        """Encode `r` (prompt delta, body skeletons, new blobs: the Python work, ~80 % of a record's time in
        a transaction, bench/store_writers.py) and return what writes its rows, so the encoding can happen
        before the transaction and the store's write lock is held only for the inserts (workers share it:
        docs/gateway-workers.md). The cache counts the rows as written: if they are not committed, `reset`."""
        if r.prompt_ids is None:
            prompt_len, base, shared, tail = -1, None, 0, None
        else:
            prompt_len = len(r.prompt_ids)
            base, shared, tail = self._prompt_delta(r.session_id, r.seq, codec.ids_to_bytes(r.prompt_ids))
        blob_rows: list[tuple[bytes, bytes]] = []
        tools_ref = None
        if r.tools is not None:
            data = orjson.dumps(r.tools)
            tools_ref = self._tool_hashes.get(data)
            if tools_ref is None:
                tools_ref = self._tool_hashes[data] = codec.blob_hash(data)
                if len(self._tool_hashes) > TOOL_HASHES:
                    del self._tool_hashes[next(iter(self._tool_hashes))]
            self._new_blobs({tools_ref: data}, blob_rows)
        splits: dict[str, codec.ListSplit] = {}
        row = (
            r.session_id,
            r.seq,
            r.completion_id,
            r.dialect,
            r.created_at,
            self._put_json(r.request, (r.session_id, "request"), r.seq, blob_rows, splits),
            self._put_json(r.upstream_request, (r.session_id, "upstream"), r.seq, blob_rows, splits),
            prompt_len,
            base,
            shared,
            tail,
            None if r.response_ids is None else codec.ids_to_bytes(r.response_ids),
            None if r.response_logprobs is None else codec.floats_to_bytes(r.response_logprobs),
            r.finish_reason,
            orjson.dumps(r.response_message),
            tools_ref,
            orjson.dumps(r.usage),
            r.model_requested,
            r.model_served,
            r.policy_version,
            r.upstream_latency_ms,
            r.gateway_overhead_ms,
            orjson.dumps(list(r.flags)).decode(),
            orjson.dumps(list(r.tags)).decode(),
            r.upstream_id,
        )

        def insert() -> None:
            if blob_rows:
                self.conn.executemany("INSERT OR IGNORE INTO blobs (hash, data) VALUES (?, ?)", blob_rows)
            self.conn.execute(_INSERT_COMPLETION, row)

        return insert

    def add_failure(self, f: FailureRecord) -> None:
        self.conn.execute(
            "INSERT INTO failures (session_id, seq, dialect, created_at, status, kind, message, request) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                f.session_id,
                f.seq,
                f.dialect,
                f.created_at,
                f.status,
                f.kind,
                f.message,
                None if f.request is None else self._put_json(f.request),
            ),
        )


def _task_id(metadata: dict[str, Any]) -> str | None:
    task = metadata.get("task_id")
    return None if task is None else str(task)


class SQLiteStore:
    """Read access to a store (and simple synchronous writes for tools and tests).

    The gateway writes through `polar.store.writer.AsyncWriter`; everything else (CLI, trajectories,
    the control plane's reads) uses this class.
    """

    def __init__(self, path: str | Path, durability: Durability = "normal") -> None:
        self.path = Path(path)
        self.conn = connect(self.path, durability)
        self._writer = RecordWriter(self.conn)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> SQLiteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writes (synchronous, one transaction each) -------------------------------------------------------
    def write(self, fn: Callable[[RecordWriter], object]) -> None:
        """Run `fn(writer)` in one transaction with a `RecordWriter` on this connection."""
        self.conn.execute("BEGIN")
        try:
            fn(self._writer)
        except BaseException:
            self.conn.execute("ROLLBACK")
            self._writer.reset()
            raise
        self.conn.execute("COMMIT")

    # -- sessions ---------------------------------------------------------------------------------------
    def session(self, session_id: str) -> SessionInfo | None:
        row = self.conn.execute(
            "SELECT id, created_at, status, metadata FROM sessions WHERE id = ?", (session_id,)
        ).fetchone()
        if row is None:
            return None
        return self._session_info(row)

    def sessions(self, task_id: str | None = None) -> list[SessionInfo]:
        if task_id is None:
            rows = self.conn.execute(
                "SELECT id, created_at, status, metadata FROM sessions ORDER BY created_at, id"
            ).fetchall()
        else:
            rows = self.conn.execute(
                "SELECT id, created_at, status, metadata FROM sessions WHERE task_id = ? "
                "ORDER BY created_at, id",
                (task_id,),
            ).fetchall()
        return [self._session_info(r) for r in rows]

    def _session_info(self, row: tuple[Any, ...]) -> SessionInfo:
        sid = row[0]
        (n_ok,) = self.conn.execute(
            "SELECT COUNT(*) FROM completions WHERE session_id = ?", (sid,)
        ).fetchone()
        (n_fail,) = self.conn.execute("SELECT COUNT(*) FROM failures WHERE session_id = ?", (sid,)).fetchone()
        return SessionInfo(
            session_id=sid,
            created_at=row[1],
            status=row[2],
            metadata=orjson.loads(row[3]),
            completions=n_ok,
            failures=n_fail,
        )

    def tool_call_turns(
        self, session_id: str, limit: int = 4096
    ) -> list[tuple[str | None, list[tuple[str, str]]]]:
        """(content, [(call id, arguments text)]) of the latest turns in which the session's policy called
        tools, oldest first: what a gateway remembers to give the policy its own text back
        (`polar.gateway.restore`)."""
        rows = self.conn.execute(
            "SELECT response_message FROM completions WHERE session_id = ? ORDER BY seq", (session_id,)
        ).fetchall()
        turns: list[tuple[str | None, list[tuple[str, str]]]] = []
        for (raw,) in rows:
            message = orjson.loads(raw)
            calls: list[tuple[str, str]] = []
            for call in message.get("tool_calls") or ():
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    calls.append((str(call.get("id")), fn["arguments"]))
            if calls:
                content = message.get("content")
                turns.append((content if isinstance(content, str) else None, calls))
        return turns[-limit:]

    def next_seq(self, session_id: str) -> int:
        row = self.conn.execute(
            "SELECT MAX(m) FROM (SELECT MAX(seq) AS m FROM completions WHERE session_id = ? "
            "UNION ALL SELECT MAX(seq) FROM failures WHERE session_id = ?)",
            (session_id, session_id),
        ).fetchone()
        return 0 if row[0] is None else int(row[0]) + 1

    # -- records ----------------------------------------------------------------------------------------
    def _blobs(self, hashes: Iterable[bytes]) -> dict[bytes, bytes]:
        wanted = list(set(hashes))
        out: dict[bytes, bytes] = {}
        for i in range(0, len(wanted), 500):
            chunk = wanted[i : i + 500]
            rows = self.conn.execute(
                f"SELECT hash, data FROM blobs WHERE hash IN ({', '.join('?' * len(chunk))})", chunk
            ).fetchall()
            out.update((h, codec.unpack_blob(d)) for h, d in rows)
        return out

    def completions(self, session_id: str) -> list[CompletionRecord]:
        """Every completion of a session, in call order, with prompts rebuilt from their deltas."""
        rows = self.conn.execute(
            f"SELECT {_COMPLETION_COLUMNS} FROM completions WHERE session_id = ? ORDER BY seq", (session_id,)
        ).fetchall()
        refs: list[bytes] = []
        for row in rows:
            refs += codec.skeleton_refs(row[5]) + codec.skeleton_refs(row[6])
            if row[15] is not None:
                refs.append(row[15])
        blobs = self._blobs(refs)
        prompts: dict[int, bytes] = {}
        requests: dict[int, codec.Refs] = {}
        upstreams: dict[int, codec.Refs] = {}
        built: dict[int, CompletionRecord] = {}
        # A record extends an earlier-*written* one (its prompt delta, its chained lists). Calls of one
        # session that run at once are written in the order they finish, not in seq order, so a base may
        # have a higher seq: build each record once the records it extends are built.
        pending = list(rows)
        while pending:
            waiting = []
            for row in pending:
                base = row[8]
                needs = codec.chain_bases(row[5]) | codec.chain_bases(row[6])
                if base is not None and row[7] >= 0:
                    needs.add(base)
                if not needs <= built.keys():
                    waiting.append(row)
                    continue
                built[row[1]] = self._completion(row, blobs, prompts, requests, upstreams)
            if len(waiting) == len(pending):
                missing = sorted({row[1] for row in waiting})
                raise ValueError(
                    f"session {session_id}: records {missing} extend records that are not stored"
                )
            pending = waiting
        return [built[row[1]] for row in rows]

    @staticmethod
    def _completion(
        row: tuple[Any, ...],  # a row of the completions query: SQL values by column
        blobs: dict[bytes, bytes],
        prompts: dict[int, bytes],
        requests: dict[int, codec.Refs],
        upstreams: dict[int, codec.Refs],
    ) -> CompletionRecord:
        """One row as a record, its prompt and bodies joined to the (already built) records they extend."""
        seq, prompt_len, base, shared, tail = row[1], row[7], row[8], row[9], row[10]
        prompt_ids = None
        if prompt_len >= 0:
            full = (prompts[base][: shared * 4] if base is not None else b"") + (tail or b"")
            prompts[seq] = full
            prompt_ids = codec.bytes_to_ids(full)
        request, requests[seq] = codec.join_json(row[5], blobs, requests)
        upstream, upstreams[seq] = codec.join_json(row[6], blobs, upstreams)
        return CompletionRecord(
            session_id=row[0],
            seq=seq,
            completion_id=row[2],
            dialect=row[3],
            created_at=row[4],
            request=request,
            upstream_request=upstream,
            prompt_ids=prompt_ids,
            response_ids=None if row[11] is None else codec.bytes_to_ids(row[11]),
            response_logprobs=None if row[12] is None else codec.bytes_to_floats(row[12]),
            finish_reason=row[13],
            response_message=orjson.loads(row[14]),
            tools=None if row[15] is None else orjson.loads(blobs[row[15]]),
            usage=orjson.loads(row[16]),
            model_requested=row[17],
            model_served=row[18],
            policy_version=row[19],
            upstream_latency_ms=row[20],
            gateway_overhead_ms=row[21],
            flags=tuple(orjson.loads(row[22])),
            tags=tuple(orjson.loads(row[23])),
            # Stored before the gateway had ids of its own: the record's id was the server's
            upstream_id=row[2] if row[24] is None else row[24],
        )

    def failures(self, session_id: str) -> list[FailureRecord]:
        rows = self.conn.execute(
            "SELECT session_id, seq, dialect, created_at, status, kind, message, request FROM failures "
            "WHERE session_id = ? ORDER BY seq",
            (session_id,),
        ).fetchall()
        blobs = self._blobs(h for r in rows if r[7] is not None for h in codec.skeleton_refs(r[7]))
        return [
            FailureRecord(
                session_id=r[0],
                seq=r[1],
                dialect=r[2],
                created_at=r[3],
                status=r[4],
                kind=r[5],
                message=r[6],
                request=None if r[7] is None else codec.join_json(r[7], blobs)[0],
            )
            for r in rows
        ]

    def size_bytes(self) -> int:
        """Bytes the store occupies on disk (database + WAL), for the storage benchmark."""
        total = 0
        for suffix in ("", "-wal"):
            p = Path(str(self.path) + suffix)
            if p.exists():
                total += p.stat().st_size
        return total

    def meta(self, key: str) -> bytes | None:
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else bytes(row[0])

    def set_meta(self, key: str, value: bytes) -> None:
        self.conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))
