"""Per-session memory is bounded and returned (issue 12, point 5), and forgetting it changes no record.

The byte accounting of `SessionCache` and tracemalloc are the measures; time is a clock the tests move, never
a wait. The soak over 10,000 sessions of 60k tokens is `bench/soak.py`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import re
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from polar.gateway.app import create_app
from polar.gateway.backends.base import BackendOptions
from polar.gateway.config import GatewayConfig
from polar.harness.registry import classifier
from polar.serving import ServerThread
from polar.store import codec
from polar.store.cache import RecentHashes, SessionCache
from polar.store.records import CompletionRecord, SessionInfo
from polar.store.sqlite import SQLiteStore
from tests.conftest import SERVED_MODEL, FakeBackend
from tests.fakes.fake_vllm import Reply
from tests.json_strategies import json_values

# -- the list chain: the fast path stores exactly what the element-by-element path stored ----------------


def reference_split(
    obj: dict[str, Any], previous: codec.Refs | None, base: int | None
) -> tuple[bytes, codec.Refs]:
    """`codec.split_json` as it was before the prefix digest: every element encoded and hashed each call."""
    inline: dict[str, Any] = {}
    lists: dict[str, Any] = {}
    full: codec.Refs = {}
    values: dict[str, str] = {}
    for key, value in obj.items():
        if isinstance(value, list) and value:
            encoded = [orjson.dumps(v) for v in value]
            if sum(len(e) for e in encoded) < codec.INLINE_LIMIT:
                inline[key] = value
                continue
            refs = [codec.blob_hash(e).hex() for e in encoded]
            full[key] = refs
            prev = None if previous is None else previous.get(key)
            if base is not None and prev and len(prev) <= len(refs) and refs[: len(prev)] == prev:
                lists[key] = {"b": base, "n": len(prev), "t": refs[len(prev) :]}
            else:
                lists[key] = refs
        elif isinstance(value, (dict, str)):
            e = orjson.dumps(value)
            if len(e) < codec.INLINE_LIMIT:
                inline[key] = value
                continue
            values[key] = codec.blob_hash(e).hex()
        else:
            inline[key] = value
    return orjson.dumps({"order": list(obj), "inline": inline, "lists": lists, "values": values}), full


element = json_values(text_size=120, size=3, max_leaves=8)


@given(
    st.lists(element, min_size=1, max_size=12),
    st.lists(
        st.tuples(st.sampled_from(["grow", "same", "rewrite", "truncate", "number"]), element), max_size=6
    ),
)
@settings(max_examples=150, deadline=None)
def test_chained_lists_store_what_the_element_path_stored(start: list[Any], steps: list[Any]) -> None:
    messages = list(start)
    state: codec.Chain | None = None
    refs: codec.Refs | None = None
    blobs: dict[bytes, bytes] = {}
    resolved: dict[int, codec.Refs] = {}
    for seq, (op, value) in enumerate([("same", None), *steps]):
        if op == "grow":
            messages = [*messages, value, "x" * 300]
        elif op == "rewrite" and messages:
            messages = [value, *messages[1:]]
        elif op == "truncate":
            messages = messages[: len(messages) // 2]
        elif op == "number" and messages:  # 12 then 123: equal bytes up to a non-delimiter
            messages = [*messages[:-1], 12] if messages[-1] != 12 else [*messages[:-1], 123]
        body = {"model": "m", "messages": messages, "system": "s" * 300}
        base = seq - 1 if seq else None
        skeleton, new_blobs, state = codec.split_json(body, state, base)
        expected, refs = reference_split(body, refs, base)
        assert skeleton == expected
        assert {k: s.refs() for k, s in state.items()} == refs
        blobs.update(new_blobs)
        assert set(codec.skeleton_refs(skeleton)) <= set(blobs)
        back, resolved[seq] = codec.join_json(skeleton, blobs, resolved)
        assert back == body


@given(
    st.lists(element, min_size=1, max_size=8),
    st.lists(
        st.tuples(
            st.sampled_from(["grow", "same", "rewrite", "truncate"]),
            st.sampled_from(["as sent", "changed", "extra key", "no tools"]),
            element,
        ),
        max_size=6,
    ),
)
# Found by CI: the request's list small enough to stay inline, the upstream body's (one message more) not.
@example(
    start=[None] * 6,
    steps=[("rewrite", "changed", {"": [None] * 3, "\x1f" * 9: "0" * 5, "0" * 8: -(10**15)})],
)
@settings(max_examples=150, deadline=None)
def test_a_list_split_for_the_request_is_reused_only_where_the_upstream_body_has_it_too(
    start: list[Any], steps: list[Any]
) -> None:
    """The upstream body's split with the request's `splits` is byte for byte the split made alone, whether
    its lists are the request's, differ from them, or a chain has history the other lacks."""
    messages = list(start)
    tools = [{"name": f"t{i}", "schema": "s" * 100} for i in range(3)]
    chains: dict[str, codec.Chain | None] = {"request": None, "upstream": None}
    for seq, (op, upstream_op, value) in enumerate([("same", "as sent", None), *steps]):
        if op == "grow":
            messages = [*messages, value, "x" * 300]
        elif op == "rewrite":
            messages = [value, *messages[1:]]
        elif op == "truncate":
            messages = messages[: max(1, len(messages) // 2)]
        request = {"model": "m", "messages": messages, "tools": tools}
        upstream: dict[str, Any] = {**request, "logprobs": True}
        if upstream_op == "changed":
            upstream["messages"] = [*messages[:-1], {"role": "user", "content": value}]
        elif upstream_op == "extra key":
            upstream = {"first": 1, **upstream}
        elif upstream_op == "no tools":
            del upstream["tools"]
        base = seq - 1 if seq else None
        splits: dict[str, codec.ListSplit] = {}
        request_split = codec.split_json(request, chains["request"], base, splits)
        assert request_split == codec.split_json(request, chains["request"], base)
        before = {key: st for key, st in (chains["upstream"] or {}).items()}
        reused = codec.split_json(upstream, chains["upstream"], base, splits)
        assert reused == codec.split_json(upstream, chains["upstream"], base)
        for key in reused[2]:  # taken over (the same objects) exactly where the request's split fits
            fits = (
                key in request_split[2]
                and orjson.dumps(upstream[key]) == orjson.dumps(request[key])
                and before.get(key) == (chains["request"] or {}).get(key)
            )
            taken = key in request_split[2] and reused[2][key] is request_split[2][key]
            assert taken == fits
        chains["request"], chains["upstream"] = request_split[2], reused[2]


# -- the cache's accounting ----------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_cache_stays_within_its_budget_and_forgets_closed_and_idle_sessions() -> None:
    clock = Clock()
    cache = SessionCache(max_bytes=1 << 20, idle_s=60, clock=clock)
    prompt = bytes(240_000)  # a 60k-token prompt
    for i in range(20):
        cache.add_prompt(f"s{i}", 0, prompt)
        cache.add_prompt(f"s{i}", 1, prompt + bytes(400))
        assert cache.nbytes <= 1 << 20
    assert 0 < len(cache) <= 2 and cache.evictions["budget"] >= 18
    assert cache.nbytes == sum(cache._sessions[s].measure() for s in cache._sessions)
    cache.forget("s19")
    assert "s19" not in cache and cache.evictions["closed"] == 1
    clock.now += 59
    cache.add_prompt("fresh", 0, bytes(4000))
    clock.now += 2  # everything but "fresh" is now idle for more than 60 s
    before = len(cache)
    assert before >= 2 and cache.evict_idle() == before - 1 and list(cache._sessions) == ["fresh"]
    cache.forget("fresh")
    assert cache.nbytes == 0 and len(cache) == 0


@given(
    st.lists(
        st.tuples(st.sampled_from(["prompt", "chain", "forget"]), st.integers(0, 3), st.integers(0, 5)),
        max_size=60,
    )
)
@settings(max_examples=100, deadline=None)
def test_the_cache_counts_each_change_as_a_fresh_count_would(ops: list[tuple[str, int, int]]) -> None:
    """`nbytes` is kept by each change (prompts rolling over, a chain replaced), never recounted: it must
    equal counting every session afresh after any sequence of changes."""
    cache = SessionCache(max_bytes=1 << 30, idle_s=60, prompts_per_session=2, clock=Clock())
    for seq, (op, session, size) in enumerate(ops):
        sid = f"s{session}"
        if op == "prompt":
            cache.add_prompt(sid, seq, bytes(4 * size))
        elif op == "chain":
            state = codec.ListState(bytes(16 * size), size, bytes(32))
            cache.set_chain(
                sid, "request" if size % 2 else "upstream", seq, {"messages": state} if size else {}
            )
        else:
            cache.forget(sid)
        for entry in cache._sessions.values():
            assert entry.nbytes == entry.measure()
        assert cache.nbytes == sum(entry.nbytes for entry in cache._sessions.values())


def test_recent_hashes_are_bounded_and_keep_hot_ones() -> None:
    seen = RecentHashes(limit=100)
    hot = b"h" * 16
    seen.add(hot)
    for i in range(10_000):
        seen.add(i.to_bytes(16, "little"))
        assert hot in seen  # a hit carries it into the current generation
    assert len(seen) <= 200


def test_recent_hashes_by_default_hold_under_one_arena_of_small_objects() -> None:
    # Each hash is a small object in CPython's 1 MiB arenas; two generations of 65,536 (~8 MiB) filled new
    # arenas in a burst and a few long-lived neighbours kept them after it (bench/soak.py: +10-11 % RSS).
    seen = RecentHashes()
    for i in range(200_000):
        seen.add(i.to_bytes(16, "little"))
    held = seen._current | seen._previous
    assert len(held) == len(seen) <= 2 * 4096
    assert sum(map(sys.getsizeof, held)) < 1 << 20


# -- the record writer: memory returns when sessions close ---------------------------------------------


def _record(sid: str, seq: int, prompt: list[int], messages: list[dict[str, Any]]) -> CompletionRecord:
    return CompletionRecord(
        session_id=sid,
        seq=seq,
        completion_id=f"{sid}-{seq}",
        dialect="chat",
        created_at=1.0,
        request={"model": "m", "messages": messages},
        upstream_request={"model": "served", "messages": messages},
        prompt_ids=prompt,
        response_ids=[1, 2],
        response_logprobs=[-0.5, -0.25],
        finish_reason="stop",
        response_message={"role": "assistant", "content": "ok"},
        tools=None,
        usage={"prompt_tokens": len(prompt), "completion_tokens": 2},
        model_requested="m",
        model_served="served",
    )


def test_writer_memory_returns_when_sessions_close(tmp_path: Path) -> None:
    rng = random.Random(0)
    with SQLiteStore(tmp_path / "s.db") as store:
        cache = store._writer.cache
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            sids = [f"s{i}" for i in range(60)]
            for sid in sids:
                store.write(lambda w, sid=sid: w.add_session(SessionInfo(sid, 1.0, "open", {})))
                prompt = [rng.randrange(150_000) for _ in range(20_000)]
                messages = [{"role": "user", "content": f"{sid} {i} " + "x" * 400} for i in range(40)]
                for seq in range(3):
                    prompt += [rng.randrange(150_000) for _ in range(300)]
                    messages += [{"role": "assistant", "content": f"{sid} turn {seq} " + "y" * 300}]
                    r = _record(sid, seq, list(prompt), list(messages))
                    store.write(lambda w, r=r: w.add_completion(r))
            del prompt, messages, r  # the test's own last session
            held = tracemalloc.get_traced_memory()[0] - base
            assert cache.nbytes > 60 * 3 * 80_000  # three 80 kB prompts a session, all live
            assert held > cache.nbytes  # what the accounting counts is really there
            for sid in sids:
                store.write(lambda w, sid=sid: w.close_session(sid))
            assert cache.nbytes == 0 and len(cache) == 0
            gc.collect()
            after = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
        # What stays is the bounded set of recent blob hashes (2,600 here) and SQLite's statement cache.
        assert after < 1 << 20 and after < held / 40, (held, after)
        assert store.completions("s7")[-1].prompt_ids == _prompt_of(store, "s7")


def _prompt_of(store: SQLiteStore, sid: str) -> list[int]:
    return store.completions(sid)[-1].prompt_ids or []


# -- the gateway: an evicted session comes back and records exactly as one that was never evicted --------

SPACED = '{"command": "ls -la", "timeout": 10}'
COMPACT = '{"command":"ls -la","timeout":10}'
SHELL: Any = {"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}


def _script(body: dict[str, Any]) -> Reply:
    turns = sum(1 for m in body["messages"] if m.get("role") == "tool")
    return Reply(content="done") if turns >= 3 else Reply(tool_calls=[("shell", SPACED)])


def _converse(url: str, sid: str, between: Any) -> None:
    """A harness that re-serializes tool arguments compactly; `between(i)` runs after call i."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=sid, max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "sys " * 200},
        {"role": "user", "content": "go"},
    ]
    for i in range(4):
        out = client.chat.completions.create(model="m", messages=messages, tools=[SHELL])  # type: ignore[arg-type]
        between(i)
        for call in out.choices[0].message.tool_calls or []:
            fn = {"name": "shell", "arguments": COMPACT}
            messages += [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": call.id, "type": "function", "function": fn}],
                },
                {"role": "tool", "tool_call_id": call.id, "content": f"a.txt {i}"},
            ]


def _essence(r: CompletionRecord) -> tuple[Any, ...]:
    return (r.seq, r.request, r.upstream_request, r.prompt_ids, r.response_ids, r.response_logprobs, r.flags)


def test_a_session_evicted_while_idle_records_as_if_it_never_was(
    fake_backend: FakeBackend, tmp_path: Path
) -> None:
    fake_backend.app.reset(_script)
    config = GatewayConfig(
        backend_url=fake_backend.url,
        served_model=SERVED_MODEL,
        store_path=tmp_path / "gw.db",
        backend=BackendOptions(retries=0, timeout_s=30.0),
    )
    app = create_app(config, classifier)
    server = ServerThread(app.data, also=[app.control]).start()
    try:
        proxy = app.state.proxy
        loop = server._loop
        assert loop is not None
        admin = {"authorization": f"Bearer {config.control_token}"}
        sessions = {
            name: httpx.post(server.urls[1] + "/sessions", json={}, headers=admin).json()["session_id"]
            for name in ("kept", "evicted")
        }

        async def go_idle(sid: str) -> None:
            """Move both clocks past the idle TTL, as an hour without calls would."""
            registry, cache = proxy.sessions, proxy.writer.cache
            later = registry.clock() + config.session_idle_s + 1
            registry.clock = cache.clock = lambda: later
            try:
                assert registry.evict_idle() >= 1
                await proxy.writer.evict_idle()
                assert sid not in cache and sid not in registry._live
            finally:
                registry.clock = cache.clock = time.monotonic

        fake_backend.app.reset(_script)  # after the gateway's start-up call: both sessions get the same ids
        _converse(server.url, sessions["kept"], lambda i: None)
        fake_backend.app.reset(_script)  # the same call ids again
        _converse(
            server.url,
            sessions["evicted"],
            lambda i: asyncio.run_coroutine_threadsafe(go_idle(sessions["evicted"]), loop).result(10),
        )
        with SQLiteStore(config.store_path) as store:
            kept, evicted = (store.completions(sessions[n]) for n in ("kept", "evicted"))
            bases = {
                name: [
                    row[0]
                    for row in store.conn.execute(
                        "SELECT prompt_base FROM completions WHERE session_id = ? ORDER BY seq", (sid,)
                    )
                ]
                for name, sid in sessions.items()
            }
        assert len(kept) == len(evicted) == 4
        assert [_essence(r) for r in kept] == [_essence(r) for r in evicted]
        assert sum("quirk:tool_arguments_restored" in r.flags for r in evicted) == 3  # restored after reload
        assert bases["evicted"] == [None] * 4  # every call after an eviction took the slow path
        assert bases["kept"] == [None, 0, 1, 2]  # and the fast path is what it replaces
    finally:
        server.stop()


def test_once_no_session_is_live_the_gateway_gives_its_memory_back_and_records_as_before(
    fake_backend: FakeBackend, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The idle sweep, after the last live session went: the registry's table is new, the writer's session
    cache and blob hashes are empty, glibc was asked to trim (bench/soak.py measures the RSS); a session
    after that records exactly as one before it (its blobs are written again, or found)."""
    fake_backend.app.reset(_script)
    config = GatewayConfig(
        backend_url=fake_backend.url,
        served_model=SERVED_MODEL,
        store_path=tmp_path / "gw.db",
        backend=BackendOptions(retries=0, timeout_s=30.0),
        session_idle_s=0.5,  # sweeps every 0.25 s
    )
    app = create_app(config, classifier)
    caplog.set_level(logging.DEBUG, logger="polar.gateway")
    server = ServerThread(app.data, also=[app.control]).start()
    try:
        proxy = app.state.proxy
        admin = {"authorization": f"Bearer {config.control_token}"}
        released = "no live session: memory released"
        sids = []
        for _ in range(2):
            sid = httpx.post(server.urls[1] + "/sessions", json={}, headers=admin).json()["session_id"]
            sids.append(sid)
            fake_backend.app.reset(_script)  # the same call ids for both sessions
            before = sum(released in r.getMessage() for r in caplog.records)
            _converse(server.url, sid, lambda i: None)
            assert proxy.writer.cache.nbytes > 0 and len(proxy.writer._writer._known_blobs) > 0
            deadline = time.monotonic() + 30
            while sum(released in r.getMessage() for r in caplog.records) == before:  # the sweep's log line
                assert time.monotonic() < deadline, "the gateway never released its memory"
                time.sleep(0.05)
            assert len(proxy.sessions) == 0 and proxy.writer.cache.nbytes == 0
            assert len(proxy.writer._writer._known_blobs) == 0
        # Each release is counted and what it returned is read from the RSS and reported (docs/prometheus.md).
        assert proxy.sessions.released.count >= 2 and proxy.sessions.released.last_rss > 0
        assert any(
            re.search(r"memory released, RSS [0-9.]+ -> [0-9.]+ MiB", r.getMessage()) for r in caplog.records
        )
        scraped = httpx.get(server.urls[1] + "/metrics", headers=admin).text
        releases = re.search(r"^polar_gateway_memory_releases_total ([0-9.e+]+)$", scraped, re.M)
        returned = re.search(r"^polar_gateway_memory_released_bytes_total ([0-9.e+]+)$", scraped, re.M)
        assert releases is not None and float(releases.group(1)) == proxy.sessions.released.count
        assert returned is not None and float(returned.group(1)) == proxy.sessions.released.bytes
        with SQLiteStore(config.store_path) as store:
            first, second = (store.completions(s) for s in sids)
        assert len(first) == len(second) == 4
        assert [_essence(r) for r in first] == [_essence(r) for r in second]
    finally:
        server.stop()


def test_a_session_that_came_and_went_between_two_sweeps_is_given_back_too(
    fake_backend: FakeBackend, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Was: the sweep gave memory back only after it had seen a live session, so sessions that opened and
    closed between two sweeps (60 s apart by default) never triggered it."""
    fake_backend.app.reset(_script)
    config = GatewayConfig(
        backend_url=fake_backend.url,
        served_model=SERVED_MODEL,
        store_path=tmp_path / "gw.db",
        backend=BackendOptions(retries=0, timeout_s=30.0),
        session_idle_s=6.0,  # sweeps every 3 s: the session below lives well inside one period
    )
    app = create_app(config, classifier)
    caplog.set_level(logging.DEBUG, logger="polar.gateway")
    server = ServerThread(app.data, also=[app.control]).start()
    try:
        admin = {"authorization": f"Bearer {config.control_token}"}
        released = "no live session: memory released"
        sid = httpx.post(server.urls[1] + "/sessions", json={}, headers=admin).json()["session_id"]
        _converse(server.url, sid, lambda i: None)
        assert httpx.delete(f"{server.urls[1]}/sessions/{sid}", headers=admin).status_code == 200
        assert len(app.state.proxy.sessions) == 0
        deadline = time.monotonic() + 20
        while not any(released in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "the gateway never released its memory"
            time.sleep(0.1)
    finally:
        server.stop()
