"""Durable capture without a commit per call: group commit, on the event loop or on a writer thread.

The gateway must not answer a harness before its record is committed (a record must survive the process
being killed right after the response left). Committing each record alone would cap throughput at the
commit rate; instead the writes that arrive together share one transaction, and the waiting requests are
released only after its commit.

On the loop (`on_loop`, the default for `durability="normal"`): a write joins a list, and the first one of a
loop iteration schedules its commit for the next (`loop.call_soon`), so everything written during one pass
of the loop is committed together, on the loop, with no thread. The encoding a record needs is Python work
that holds the interpreter wherever it runs; on a thread it also made the loop wait for the interpreter at
each of its socket calls, and made both sides hand it over (bench/gateway_cpu.py, docs/benchmarks.md: 0.70
-> 0.56 ms of CPU per call at concurrency 16, 0.66 -> 0.51 at 64). A commit of `normal` durability does not
wait for the disk (WAL: only a checkpoint, every ~4 MB of log, calls fsync), so the loop rarely does.

Processes sharing one store (`polar gateway --workers`) commit on their loops too: another worker may hold
the store's write lock, so the loop's connection never waits for it (busy timeout 0): a `BEGIN IMMEDIATE`
that finds it taken is tried again a moment later (`LOCK_RETRY_S`, backing off as SQLite's own busy handler
does, up to the same 30 s), the batch's records already encoded and the writes that arrive meanwhile joining
it. The thread they used instead cost ~20 % more CPU a call (bench/gateway_workers.py, docs/benchmarks.md).

On a thread (`durability="full"`, whose commits wait for fsync): every request hands its write to one
thread, which takes everything queued, runs it in one transaction, commits, and only then releases the
waiting requests; when the caller knows it is alone (no other call in flight) and nothing is queued, it
commits its one record itself, saving the two hand-offs. A lock keeps the connection to one user at a time.

A completion is written in two steps (`completion`): its record is encoded before the transaction and only
its rows are inserted inside it, so the store's write lock, which the gateway's workers share
(`polar gateway --workers`), is held for the inserts alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from polar.store.cache import SessionCache
from polar.store.records import CompletionRecord
from polar.store.sqlite import BUSY_TIMEOUT_MS, BUSY_TIMEOUT_S, Durability, RecordWriter, connect

log = logging.getLogger(__name__)

WriteOp = Callable[[RecordWriter], None]
_STOP = object()
# On the loop, the waits before trying the store's write lock again while another process holds it: short
# first (a worker holds it for one batch's inserts, ~0.1-0.5 ms), then SQLite's own busy handler's steps.
LOCK_RETRY_S = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.025, 0.05, 0.1)
# As a connection's busy timeout: past it the batch fails ("database is locked").
LOCK_TIMEOUT_S = BUSY_TIMEOUT_S
# A write waiting on the loop: the write, its inserts once encoded, its caller's future.
_Waiting = tuple[WriteOp, WriteOp | None, asyncio.Future[None]]
_Staged = tuple[WriteOp, WriteOp, asyncio.Future[None]]


@dataclass(frozen=True)
class StagedCompletion:
    """A completion's write whose encoding runs before the transaction (`stage`); also a plain `WriteOp`."""

    record: CompletionRecord

    def __call__(self, w: RecordWriter) -> None:
        w.add_completion(self.record)

    def stage(self, w: RecordWriter) -> Callable[[], None]:
        return w.stage_completion(self.record)


def completion(record: CompletionRecord) -> StagedCompletion:
    """The write of one completion record, for `AsyncWriter.write`."""
    return StagedCompletion(record)


def _staged(op: WriteOp, w: RecordWriter) -> WriteOp:
    """`op` with its encoding done now, if it has a stage to do first (`StagedCompletion`)."""
    if isinstance(op, StagedCompletion):
        insert = op.stage(w)
        return lambda _: insert()
    return op


class AsyncWriter:
    """Runs write operations in shared transactions and resolves each caller's future after the commit:
    on the caller's event loop (`on_loop`; default: when `durability` is "normal") or on a thread."""

    def __init__(
        self,
        path: str | Path,
        durability: Durability = "normal",
        max_batch: int = 512,
        cache: SessionCache | None = None,
        *,
        on_loop: bool | None = None,
    ) -> None:
        self.path = Path(path)
        self._conn = connect(self.path, durability)
        self._writer = RecordWriter(self._conn, cache)
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._max_batch = max_batch
        self._lock = threading.Lock()  # one user of the connection at a time: the thread or an inline write
        self.on_loop = durability == "normal" if on_loop is None else on_loop
        self._pending: list[tuple[WriteOp, asyncio.Future[None]]] = []  # on the loop: the next commit's
        self._loop: asyncio.AbstractEventLoop | None = None  # on the loop: the one it serves
        # On the loop, while another process holds the write lock: the writes staged for the next try
        # (each with its stage's inserts), the try's timer, and when the first try found the lock taken.
        self._waiting: list[_Waiting] = []
        self._retry: asyncio.TimerHandle | None = None
        self._busy_since, self._tries = 0.0, 0
        self.lock_retries = 0
        if self.on_loop:
            self._conn.execute("PRAGMA busy_timeout=0")  # the loop never waits for another's lock
        self._thread: threading.Thread | None = None
        if not self.on_loop:
            self._thread = threading.Thread(target=self._run, name="polar-store-writer", daemon=True)
            self._thread.start()
        self.commits = 0
        self.writes = 0
        self.inline = 0

    async def write(self, op: WriteOp, *, alone: bool = False) -> None:
        """Run `op` in the next transaction; returns once it is committed, raises what `op` raised.

        `alone` (on a thread): the caller has no concurrent writes to share a commit with, so when the writer
        is idle the commit is done here, blocking this loop for one small transaction instead of two thread
        hand-offs. On the loop every write waits for the next pass of the loop, whatever `alone` says.
        """
        if self.on_loop:
            loop = asyncio.get_running_loop()
            if self._loop is None:
                self._loop = loop
            elif loop is not self._loop:  # its callers' futures are resolved from that loop's thread
                raise RuntimeError("a store writer that commits on the loop serves the loop that first wrote")
            fut_here: asyncio.Future[None] = loop.create_future()
            self._pending.append((op, fut_here))
            if len(self._pending) == 1 and self._retry is None:  # the first of this pass: commit after it
                loop.call_soon(self._flush)
            await fut_here
            return
        if alone and self._queue.empty() and self._lock.acquire(blocking=False):
            try:  # nothing else is being written: commit here rather than hand off twice
                exc = self._commit_one(op)
                self.commits += 1
                self.writes += 1
                self.inline += 1
            finally:
                self._lock.release()
            if exc is not None:
                raise exc
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._queue.put((op, fut, loop))
        await fut

    @property
    def cache(self) -> SessionCache:
        """The per-session state of the record writer (read its `nbytes` for accounting, not its contents)."""
        return self._writer.cache

    async def evict_idle(self) -> None:
        """Drop the writer's state of idle sessions, in its turn with the writes (`SessionCache`)."""
        await self.write(_evict_idle)

    async def release(self) -> None:
        """Drop all of the writer's cached state, in its turn with the writes (`RecordWriter.release`)."""
        await self.write(_release)

    def _flush(self) -> None:
        """Commit the writes of the last pass of the loop (`max_batch` at a time) and release their callers;
        when another process holds the store's write lock, try again later (`LOCK_RETRY_S`)."""
        self._retry = None
        self._waiting += [(op, None, fut) for op, fut in self._pending]
        self._pending = []
        while self._waiting:
            part = self._stage(self._waiting[: self._max_batch])
            del self._waiting[: self._max_batch]
            with self._lock:
                outcome = self._commit_staged(part) if part else []
            if outcome is None:  # the lock is another's: this part, encoded, and the rest wait for a next try
                self._waiting[:0] = part
                self._try_later()
                return
            _resolve([(fut, exc) for (_, _, fut), exc in zip(part, outcome, strict=True)])
        self._busy_since, self._tries = 0.0, 0

    def _stage(self, part: list[_Waiting]) -> list[_Staged]:
        """`part` with each write's encoding done (once: a write that waited for the lock keeps its own); a
        write whose encoding fails is answered with its error and left out, its cached state forgotten."""
        staged: list[_Staged] = []
        for op, insert, fut in part:
            if insert is None:
                try:
                    insert = _staged(op, self._writer)
                except Exception as exc:
                    log.exception("store write failed")
                    self._writer.reset()
                    _resolve([(fut, exc)])
                    continue
            staged.append((op, insert, fut))
        return staged

    def _commit_staged(self, part: list[_Staged]) -> list[BaseException | None] | None:
        """Insert `part`'s encoded rows in one transaction; what each raised, or None when the write lock is
        another process's and waiting for it is not over (`LOCK_TIMEOUT_S`)."""
        begun = False
        try:
            self._conn.execute("BEGIN IMMEDIATE")
            begun = True
            for _, insert, _ in part:
                insert(self._writer)
            self._conn.execute("COMMIT")
            results: list[BaseException | None] = [None] * len(part)
        except Exception as exc:
            if not begun and _busy(exc):  # the lock is another process's
                now = time.monotonic()
                self._busy_since = self._busy_since or now
                if now - self._busy_since < LOCK_TIMEOUT_S:
                    return None
                self._writer.reset()  # these rows will never land: what the cache counts of them is forgotten
                return [exc] * len(part)
            results = self._one_by_one([op for op, _, _ in part])
        self.commits += 1
        self.writes += len(part)
        return results

    def _one_by_one(self, ops: list[WriteOp]) -> list[BaseException | None]:
        """One bad write must not take its batch-mates down: roll back (the cache too, since staged records
        count as written), then commit each alone, encoded again; on the loop too this waits for another
        process's lock (a rare path), the connection's own busy timeout restored after."""
        self._rollback()
        (busy_ms,) = self._conn.execute("PRAGMA busy_timeout").fetchone()
        self._conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        try:
            return [self._commit_one(op) for op in ops]
        finally:
            self._conn.execute(f"PRAGMA busy_timeout={int(busy_ms)}")

    def _try_later(self) -> None:
        assert self._loop is not None
        self._retry = self._loop.call_later(
            LOCK_RETRY_S[min(self._tries, len(LOCK_RETRY_S) - 1)], self._flush
        )
        self._tries += 1
        self.lock_retries += 1

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            batch = [item]
            stop = False
            while len(batch) < self._max_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    stop = True
                    break
                batch.append(nxt)
            with self._lock:
                self._commit(batch)  # type: ignore[arg-type]
            if stop:
                break
        self._conn.close()

    def _commit_ops(self, ops: list[WriteOp]) -> list[BaseException | None]:
        """Run `ops` in one transaction; what each raised (None: committed)."""
        try:
            staged = [_staged(op, self._writer) for op in ops]  # before taking the store's lock
            self._conn.execute("BEGIN IMMEDIATE")
            for one in staged:
                one(self._writer)
            self._conn.execute("COMMIT")
            results: list[BaseException | None] = [None] * len(ops)
        except Exception:
            results = self._one_by_one(ops)
        self.commits += 1
        self.writes += len(ops)
        return results

    def _commit(self, batch: list[tuple[WriteOp, asyncio.Future[None], asyncio.AbstractEventLoop]]) -> None:
        results = self._commit_ops([op for op, _, _ in batch])
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[None], BaseException | None]]] = {}
        for (_, fut, loop), exc in zip(batch, results, strict=True):
            by_loop.setdefault(loop, []).append((fut, exc))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_resolve, items)
            except RuntimeError:  # the caller's loop is gone (shutdown); nothing waits any more
                pass

    def _commit_one(self, op: WriteOp) -> BaseException | None:
        try:
            staged = _staged(op, self._writer)
            self._conn.execute("BEGIN IMMEDIATE")
            staged(self._writer)
            self._conn.execute("COMMIT")
            return None
        except Exception as exc:
            log.exception("store write failed")
            self._rollback()
            return exc

    def _rollback(self) -> None:
        with contextlib.suppress(Exception):
            self._conn.execute("ROLLBACK")
        self._writer.reset()

    def close(self) -> None:
        """Commit everything written so far, then stop the thread (it closes the connection) or, on the
        loop, close the connection."""
        if self._retry is not None:
            self._retry.cancel()
        if self._pending or self._waiting:  # on the loop: written, not committed yet
            # No later try: wait for the lock here, as long as the connection's busy timeout, then give up.
            self._conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            self._busy_since = time.monotonic() - LOCK_TIMEOUT_S
            self._flush()
        if self._thread is None:
            with self._lock:
                self._conn.close()
            return
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout=30)
        with self._lock:  # an inline write may still hold the connection
            pass


def _busy(exc: Exception) -> bool:
    """Whether `exc` is SQLite saying the lock is another connection's (any SQLITE_BUSY_*, extended codes too)."""
    return isinstance(exc, sqlite3.OperationalError) and exc.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY


def _evict_idle(w: RecordWriter) -> None:
    w.evict_idle()


def _release(w: RecordWriter) -> None:
    w.release()


def _resolve(items: list[tuple[asyncio.Future[None], BaseException | None]]) -> None:
    for fut, exc in items:
        if fut.done():
            continue
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)
