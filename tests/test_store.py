"""The SQLite store: exact round trips, compact prompts, dedup'd bodies, group commit."""

from __future__ import annotations

import asyncio
import random
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polar.store import codec
from polar.store import sqlite as sqlite_module
from polar.store import writer as writer_module
from polar.store.records import CompletionRecord, FailureRecord, SessionInfo
from polar.store.sqlite import TOOL_HASHES, SQLiteStore
from polar.store.writer import AsyncWriter, completion

OLD_LAYOUT = sqlite_module.SCHEMA.replace(
    "    UNIQUE (session_id, seq)\n);", "    PRIMARY KEY (session_id, seq)\n) WITHOUT ROWID;", 1
)  # the completions table of stores made before 2026-12-05


def make_record(seq: int, prompt: list[int] | None, sid: str = "s1", **kw: object) -> CompletionRecord:
    fields: dict[str, object] = dict(
        session_id=sid,
        seq=seq,
        completion_id=f"c{seq}",
        dialect="chat",
        created_at=1000.0 + seq,
        request={"model": "m", "messages": [{"role": "user", "content": "x" * 300}] * (seq + 1)},
        upstream_request={"model": "served", "messages": [{"role": "user", "content": "x" * 300}]},
        prompt_ids=prompt,
        response_ids=[7, 8, 9],
        response_logprobs=[-0.1, -0.2000000000000001, -3.14159],
        finish_reason="stop",
        response_message={"role": "assistant", "content": "hi"},
        tools=[{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}],
        usage={"prompt_tokens": len(prompt or []), "completion_tokens": 3},
        model_requested="m",
        model_served="served",
        policy_version=2,
        flags=("x",),
    )
    fields.update(kw)
    return CompletionRecord(**fields)  # type: ignore[arg-type]


def add_session(store: SQLiteStore, sid: str = "s1", task: str = "t1") -> None:
    store.write(lambda w: w.add_session(SessionInfo(sid, 1.0, "open", {"task_id": task})))


def test_tool_lists_read_back_as_written_past_the_remembered_hashes(tmp_path: Path) -> None:
    """The writer remembers the blob hash of recent tool lists (`TOOL_HASHES`): more lists than that,
    each coming back, still read back as each record sent them."""
    lists = [
        [{"type": "function", "function": {"name": f"tool{i}", "description": "d" * 300}}]
        for i in range(TOOL_HASHES + 4)
    ]
    records = [make_record(i, None, tools=lists[(i * 7) % len(lists)]) for i in range(3 * len(lists))]
    with SQLiteStore(tmp_path / "s.db") as store:
        add_session(store)
        for r in records:
            store.write(lambda w, r=r: w.add_completion(r))
    with SQLiteStore(tmp_path / "s.db") as store:
        assert [r.tools for r in store.completions("s1")] == [r.tools for r in records]


def test_round_trip_is_exact(tmp_path: Path) -> None:
    with SQLiteStore(tmp_path / "s.db") as store:
        add_session(store)
        prompts = [list(range(100)), [*range(100), 5, 6, 7], [1, 2, 3], None]
        records = [make_record(i, p) for i, p in enumerate(prompts)]
        for r in records:
            store.write(lambda w, r=r: w.add_completion(r))
    with SQLiteStore(tmp_path / "s.db") as store:
        assert store.completions("s1") == records
        info = store.session("s1")
        assert info is not None and info.completions == 4 and info.metadata == {"task_id": "t1"}
        assert [s.session_id for s in store.sessions(task_id="t1")] == ["s1"]
        assert store.sessions(task_id="nope") == []
        assert store.next_seq("s1") == 4


def test_body_key_order_and_small_values_survive(tmp_path: Path) -> None:
    body = {"z": 1, "messages": [{"role": "user", "content": "y" * 500}], "a": "b" * 400, "n": None, "e": []}
    skeleton, blobs, state = codec.split_json(body)
    back, back_refs = codec.join_json(skeleton, blobs)
    assert back == body and list(back) == list(body)
    assert back_refs == {key: s.refs() for key, s in state.items()}


def test_lists_chain_to_the_previous_body() -> None:
    """A resent history stores only its new messages; a rewritten one is stored whole."""
    msgs = [{"role": "user", "content": f"message {i} " + "x" * 300} for i in range(6)]
    _, blobs, refs1 = codec.split_json({"messages": msgs[:4]})
    sk2, blobs2, refs2 = codec.split_json({"messages": msgs}, refs1, base=7)
    assert codec.skeleton_refs(sk2) == [bytes.fromhex(h) for h in refs2["messages"].refs()[4:]]
    assert set(blobs2) == set(codec.skeleton_refs(sk2))  # only the new messages were encoded
    blobs.update(blobs2)
    assert codec.join_json(sk2, blobs, {7: {"messages": refs1["messages"].refs()}})[0] == {"messages": msgs}
    with pytest.raises(ValueError, match="not read before"):
        codec.join_json(sk2, blobs, {})
    sk3, _, _ = codec.split_json({"messages": msgs[1:]}, refs2, base=8)  # history rewritten (compaction)
    assert len(codec.skeleton_refs(sk3)) == 5


def test_prompts_are_stored_as_deltas(tmp_path: Path) -> None:
    """A 200-call session growing to 30k tokens costs megabytes, not gigabytes."""
    path = tmp_path / "big.db"
    rng = random.Random(0)
    with SQLiteStore(path) as store:
        add_session(store)
        prompt: list[int] = []
        full_bytes = 0
        for seq in range(200):
            prompt = prompt + [rng.randrange(150_000) for _ in range(150)]
            full_bytes += 4 * len(prompt)
            r = make_record(
                seq, prompt, request={"messages": [{"content": "m" * 300, "i": i} for i in range(seq)]}
            )
            store.write(lambda w, r=r: w.add_completion(r))
        store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        size = store.size_bytes()
        records = store.completions("s1")
        # Bodies too: a late call (history of ~180 messages) stores no more than an early one.
        early, late = (
            store.conn.execute(
                "SELECT SUM(LENGTH(request) + LENGTH(upstream)) FROM completions WHERE seq BETWEEN ? AND ?",
                span,
            ).fetchone()[0]
            for span in ((20, 39), (180, 199))
        )
        assert late < 1.2 * early, (early, late)
        assert [r.request for r in records[-2:]] == [
            {"messages": [{"content": "m" * 300, "i": i} for i in range(seq)]} for seq in (198, 199)
        ]
    assert records[-1].prompt_ids == prompt and len(prompt) == 30_000
    assert full_bytes > 10 * 2**20
    assert size < 3 * 2**20, f"store is {size} bytes for {full_bytes} bytes of prompt ids"


def test_calls_written_out_of_seq_order_read_back(tmp_path: Path) -> None:
    """Concurrent calls of one session finish, and are written, out of seq order: a record's prompt delta
    and chained lists then extend a record with a *higher* seq. Found by killing a gateway under load
    (tests/test_gateway_durability.py): reading such a session raised KeyError."""
    prompts = {seq: list(range(100 + 10 * seq)) for seq in range(6)}
    records = [make_record(seq, prompts[seq]) for seq in range(6)]
    with SQLiteStore(tmp_path / "s.db") as store:
        add_session(store)
        for seq in (4, 5, 1, 0, 3, 2):  # the order the calls finished in
            store.write(lambda w, r=records[seq]: w.add_completion(r))
        bases = dict(store.conn.execute("SELECT seq, prompt_base FROM completions").fetchall())
        assert bases[1] == 4 and bases[0] in (1, 4)  # deltas against later seqs
        assert store.completions("s1") == records


def test_failures_round_trip(tmp_path: Path) -> None:
    with SQLiteStore(tmp_path / "s.db") as store:
        add_session(store)
        f = FailureRecord("s1", 3, "anthropic", 5.0, 502, "upstream_error", "boom", {"model": "m"})
        store.write(lambda w: w.add_failure(f))
        assert store.failures("s1") == [f]
        assert store.next_seq("s1") == 4


@given(st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=60), min_size=1, max_size=8))
@settings(max_examples=40, deadline=None)
def test_prefix_len_matches_naive(ids: list[list[int]]) -> None:
    for a in ids:
        for b in ids:
            naive = 0
            while naive < min(len(a), len(b)) and a[naive] == b[naive]:
                naive += 1
            assert codec.prefix_len(codec.ids_to_bytes(a), codec.ids_to_bytes(b)) == naive


BOTH = pytest.mark.parametrize("on_loop", [True, False], ids=["on-loop", "thread"])


@BOTH
async def test_group_commit_isolates_a_bad_write(tmp_path: Path, on_loop: bool) -> None:
    writer = AsyncWriter(tmp_path / "w.db", on_loop=on_loop)
    await writer.write(lambda w: w.add_session(SessionInfo("s1", 1.0, "open", {})))
    good = [make_record(i, list(range(i + 5))) for i in range(20)]
    dup = make_record(3, [1])  # same (session, seq) as a good one: must fail alone

    results = await asyncio.gather(
        *[writer.write(lambda w, r=r: w.add_completion(r)) for r in [*good[:10], dup, *good[10:]]],
        return_exceptions=True,
    )
    writer.close()
    errors = [r for r in results if isinstance(r, BaseException)]
    assert len(errors) == 1
    with SQLiteStore(tmp_path / "w.db") as store:
        assert store.completions("s1") == good


@BOTH
async def test_group_commit_batches_concurrent_writes(tmp_path: Path, on_loop: bool) -> None:
    writer = AsyncWriter(tmp_path / "w.db", on_loop=on_loop)
    await writer.write(lambda w: w.add_session(SessionInfo("s1", 1.0, "open", {})))
    recs = [make_record(i, list(range(i + 5))) for i in range(300)]
    await asyncio.gather(*[writer.write(lambda w, r=r: w.add_completion(r)) for r in recs])
    writer.close()
    assert writer.writes == 301 and writer.commits < 301
    if on_loop:  # written in one pass of the loop: one transaction (and the session's before it)
        assert writer.commits == 2
    with SQLiteStore(tmp_path / "w.db") as store:
        assert store.completions("s1") == recs


def test_a_record_of_about_a_kilobyte_stays_in_its_page_and_old_stores_still_work(tmp_path: Path) -> None:
    """A WITHOUT ROWID b-tree keeps only ~1 kB of a row in its 4 kB page, so a gateway record (~1 kB and up)
    took an overflow page of its own: ~4.7 kB a record where the rowid table takes ~1.4 kB
    (bench/store_layout.py). A store made with the old layout is read and written as before."""
    records = [
        make_record(
            i,
            list(range(300 + 10 * i)),  # a 10-token tail over the previous prompt
            request={"model": "m", "messages": [{"role": "user", "content": "x" * 300}]},
            response_ids=list(range(24)),
            response_logprobs=[-0.5] * 24,
            response_message={"role": "assistant", "content": "y" * 400},
        )
        for i in range(200)
    ]
    for name, schema in (("new.db", sqlite_module.SCHEMA), ("old.db", OLD_LAYOUT)):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sqlite_module, "SCHEMA", schema)
            store = SQLiteStore(tmp_path / name)
        with store:
            add_session(store)
            for r in records:
                store.write(lambda w, r=r: w.add_completion(r))
            store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            per_record = (tmp_path / name).stat().st_size / len(records)
        with SQLiteStore(tmp_path / name) as store:  # opened as a gateway opens it today
            assert store.completions("s1") == records
            with pytest.raises(Exception, match="UNIQUE"):
                store.write(lambda w: w.add_completion(records[3]))
        if name == "new.db":
            assert per_record < 2048, per_record
        else:
            assert per_record > 4096, per_record  # the quirk: a page of overflow per record


def test_unknown_session(tmp_path: Path) -> None:
    with SQLiteStore(tmp_path / "s.db") as store:
        assert store.session("nope") is None
        assert store.completions("nope") == []
        with pytest.raises(ZeroDivisionError):
            store.write(lambda w: w.add_session(SessionInfo("gone", 1.0, "open", {})) or 1 / 0)
        assert store.session("gone") is None  # rolled back


async def test_a_lone_write_commits_inline_and_failures_still_raise(tmp_path: Path) -> None:
    writer = AsyncWriter(tmp_path / "w.db", on_loop=False)
    await writer.write(lambda w: w.add_session(SessionInfo("s1", 1.0, "open", {})), alone=True)
    rec = make_record(0, [1, 2, 3])
    await writer.write(lambda w: w.add_completion(rec), alone=True)
    assert writer.inline == 2
    with pytest.raises(
        Exception, match="UNIQUE"
    ):  # the same (session, seq) again: refused, nothing half-written
        await writer.write(lambda w: w.add_completion(rec), alone=True)
    nxt = make_record(1, [1, 2, 3, 4])
    await writer.write(lambda w: w.add_completion(nxt))  # the thread path still works after an inline failure
    writer.close()
    with SQLiteStore(tmp_path / "w.db") as store:
        assert store.completions("s1") == [rec, nxt]


@BOTH
async def test_staged_completions_fail_alone_whether_encoding_or_insert_fails(
    tmp_path: Path, on_loop: bool
) -> None:
    """`completion(r)` encodes before the transaction (the cache counts its rows as written): a record that
    cannot be encoded, and one refused by the insert, fail alone; their batch-mates commit, and records
    written after the failures, as deltas over a cache that was reset, read back exactly."""
    writer = AsyncWriter(tmp_path / "w.db", on_loop=on_loop)
    await writer.write(lambda w: w.add_session(SessionInfo("s1", 1.0, "open", {})))
    good = [make_record(i, list(range(i + 5))) for i in range(20)]
    dup = make_record(3, [1])  # same (session, seq) as a good one: refused by the insert
    unencodable = replace(make_record(40, [1, 2]), request={"messages": [{"x": object()}]})
    writes = [*good[:10], dup, unencodable, *good[10:]]
    results = await asyncio.gather(*[writer.write(completion(r)) for r in writes], return_exceptions=True)
    assert sum(isinstance(r, BaseException) for r in results) == 2
    # Each alone waited for the lock as a busy timeout would; the loop's connection is back to never waiting.
    assert writer._conn.execute("PRAGMA busy_timeout").fetchone()[0] == (0 if on_loop else 30000)
    later = [make_record(i, list(range(i + 5))) for i in range(20, 30)]
    await asyncio.gather(*[writer.write(completion(r)) for r in later])
    await writer.write(completion(make_record(30, list(range(35)))), alone=True)
    writer.close()
    with SQLiteStore(tmp_path / "w.db") as store:
        assert store.completions("s1") == [*good, *later, make_record(30, list(range(35)))]


async def test_writes_commit_on_the_loop_by_pass_unless_commits_wait_for_the_disk(tmp_path: Path) -> None:
    """`durability="normal"` commits on the caller's loop (no thread), the writes of one pass of the loop
    together and each caller released only after its commit; `"full"` (fsync at commit) uses the thread."""
    full = AsyncWriter(tmp_path / "f.db", durability="full")
    assert not full.on_loop and full._thread is not None
    full.close()
    writer = AsyncWriter(tmp_path / "w.db")
    assert writer.on_loop and writer._thread is None
    await writer.write(lambda w: w.add_session(SessionInfo("s1", 1.0, "open", {})))
    first = [make_record(i, [1, 2, i]) for i in range(5)]
    await asyncio.gather(*[writer.write(completion(r)) for r in first])
    assert (writer.commits, writer.writes) == (2, 6)
    with SQLiteStore(tmp_path / "w.db") as store:  # another connection sees them: committed, not pending
        assert store.completions("s1") == first
    one = make_record(5, [1, 2, 5])
    await writer.write(completion(one))  # a later pass: a transaction of its own
    assert (writer.commits, writer.writes) == (3, 7)
    pending = asyncio.ensure_future(writer.write(completion(make_record(6, [1, 2, 6]))))
    await asyncio.sleep(0)  # written, its commit scheduled for the next pass
    writer.close()  # commits what was written before closing
    await pending
    with SQLiteStore(tmp_path / "w.db") as store:
        assert len(store.completions("s1")) == 7


async def test_on_the_loop_a_write_lock_held_elsewhere_is_waited_for_without_blocking_the_loop(
    tmp_path: Path,
) -> None:
    """Another process (here another connection) holding the store's write lock, as a second gateway worker
    does: the loop goes on (its connection never waits inside SQLite), the writes wait encoded, later writes
    join them, and all commit in one transaction once the lock is free, reading back exactly."""
    writer = AsyncWriter(tmp_path / "w.db")
    await writer.write(lambda w: w.add_session(SessionInfo("s1", 1.0, "open", {})))
    other = sqlite3.connect(tmp_path / "w.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # the lock is another's
    first = [make_record(i, list(range(i + 5))) for i in range(5)]
    waiting = [asyncio.ensure_future(writer.write(completion(r))) for r in first]
    ticks = 0
    for _ in range(20):  # the loop keeps turning while they wait
        await asyncio.sleep(0.005)
        ticks += 1
    assert ticks == 20 and not any(w.done() for w in waiting) and writer.lock_retries > 0
    later = make_record(5, list(range(10)))  # a delta over records that are not committed yet
    waiting.append(asyncio.ensure_future(writer.write(completion(later))))
    await asyncio.sleep(0.01)
    commits = writer.commits
    other.execute("COMMIT")
    await asyncio.wait_for(asyncio.gather(*waiting), 5)
    assert writer.commits == commits + 1  # the ones that waited, together
    writer.close()
    other.close()
    with SQLiteStore(tmp_path / "w.db") as store:
        assert store.completions("s1") == [*first, later]


async def test_on_the_loop_a_write_lock_held_past_the_timeout_fails_the_waiting_writes_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past `LOCK_TIMEOUT_S` (the busy timeout the thread's connection has) the waiting writes fail with
    SQLite's own error; their cached state is forgotten, so the writes after them still read back exactly."""
    monkeypatch.setattr(writer_module, "LOCK_TIMEOUT_S", 0.1)
    writer = AsyncWriter(tmp_path / "w.db")
    await writer.write(lambda w: w.add_session(SessionInfo("s1", 1.0, "open", {})))
    done = make_record(0, list(range(5)))
    await writer.write(completion(done))
    other = sqlite3.connect(tmp_path / "w.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    lost = [make_record(i, list(range(i + 5))) for i in (1, 2)]
    results = await asyncio.gather(*[writer.write(completion(r)) for r in lost], return_exceptions=True)
    assert all(isinstance(r, sqlite3.OperationalError) and "locked" in str(r) for r in results)
    other.execute("COMMIT")
    after = make_record(3, list(range(8)))
    await writer.write(completion(after))
    writer.close()
    other.close()
    with SQLiteStore(tmp_path / "w.db") as store:
        assert store.completions("s1") == [done, after]


def test_a_writer_that_commits_on_the_loop_serves_one_loop(tmp_path: Path) -> None:
    """Its callers' futures are resolved on the loop that commits: a write from a second loop is refused
    instead of being resolved from the wrong thread."""
    writer = AsyncWriter(tmp_path / "w.db")
    asyncio.run(writer.write(lambda w: w.add_session(SessionInfo("s1", 1.0, "open", {}))))
    with pytest.raises(RuntimeError, match="serves the loop that first wrote"):
        asyncio.run(writer.write(lambda w: w.close_session("s1")))
    writer.close()
    with SQLiteStore(tmp_path / "w.db") as store:
        info = store.session("s1")
        assert info is not None and info.status == "open"
