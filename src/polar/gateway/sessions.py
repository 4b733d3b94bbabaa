"""The session registry: which API keys are live sessions, and the order of their calls.

A session id *is* the API key its harness is given. The registry never invents a session: a key that is not
in memory is looked up in the store (a gateway restarted mid-rollout keeps serving its sessions), and an
unknown key is refused.

Memory holds live sessions only: a session leaves it when it closes, or when it has had no call in flight for
`idle_s` (an RL run makes hundreds of thousands of sessions, and many are abandoned rather than closed). An
evicted session that calls again is loaded back from the store like after a restart: its next seq, its
counts, and the tool-call arguments its policy wrote, so nothing it records changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from polar import memory
from polar.gateway.backends.prompt_ids import IdsMemo, MemoBudget
from polar.gateway.render.chain import Chain
from polar.gateway.restore import ToolArguments
from polar.gateway.routing import Classifiers, SideRoute, side_route
from polar.store.cache import DEFAULT_IDLE_S
from polar.store.records import SessionInfo
from polar.store.sqlite import SQLiteStore
from polar.store.writer import AsyncWriter


@dataclass
class SessionState:
    session_id: str
    created_at: float
    metadata: dict[str, Any]
    next_seq: int = 0
    closed: bool = False
    counts: dict[str, int] = field(default_factory=lambda: {"completions": 0, "failures": 0})
    tool_arguments: ToolArguments = field(default_factory=ToolArguments)  # see polar.gateway.restore
    route: SideRoute | None = None  # where side calls go (see polar.gateway.routing); None: nowhere else
    ids_memo: IdsMemo = field(
        default_factory=IdsMemo
    )  # its last prompt ids (polar.gateway.backends.prompt_ids)
    chain: Chain = field(default_factory=Chain)  # its token chain, where the gateway renders (gateway.render)
    # Calls that took a seq and have not finished: such a session is never evicted, since reloading it would
    # hand out a seq that is in use.
    in_flight: int = 0
    used: float = 0.0  # monotonic time it was last looked up or finished a call

    def take_seq(self) -> int:
        """The next call's seq; the call is in flight until `SessionRegistry.release`."""
        seq = self.next_seq
        self.next_seq += 1
        self.in_flight += 1
        return seq


@dataclass
class Releases:
    """What the idle sweep gave back (`release_memory`): how often, and the resident bytes it returned."""

    count: int = 0
    bytes: int = 0  # RSS before each release minus after, summed
    last_rss: int = 0  # RSS after the last one


class SessionRegistry:
    def __init__(
        self,
        writer: AsyncWriter,
        reader: SQLiteStore,
        classifiers: Classifiers | None = None,
        idle_s: float = DEFAULT_IDLE_S,
        clock: Callable[[], float] = time.monotonic,
        memos: MemoBudget | None = None,
    ) -> None:
        self._writer = writer
        self.memos = memos if memos is not None else MemoBudget()  # sessions' prompt-ids memos, bounded
        self._classifiers = classifiers  # builds side-call routes (polar.gateway.routing)
        self._reader = reader  # used only on the event loop thread
        self._live: OrderedDict[str, SessionState] = OrderedDict()  # least recently used first
        self.loaded = 0  # sessions that entered memory (created, or read back from the store), ever
        self.released = Releases()
        self.idle_s = idle_s
        self.clock = clock  # injectable: tests move time instead of waiting

    def __len__(self) -> int:
        return len(self._live)

    async def create(self, metadata: dict[str, Any], session_id: str | None = None) -> SessionState:
        """A new session; KeyError if the id was used, ValueError if its side-call route is malformed."""
        sid = session_id or "polar-" + secrets.token_urlsafe(18)
        if sid in self._live or self._reader.session(sid) is not None:
            raise KeyError(sid)
        route = side_route(metadata, self._classifiers)
        state = SessionState(
            session_id=sid, created_at=time.time(), metadata=metadata, route=route, ids_memo=self.memos.new()
        )
        info = SessionInfo(session_id=sid, created_at=state.created_at, status="open", metadata=metadata)
        await self._writer.write(lambda w: w.add_session(info))
        state.used = self.clock()
        self._live[sid] = state
        self.loaded += 1
        self.evict_idle()
        return state

    def get(self, session_id: str) -> SessionState | None:
        """The live state of a session, loading it from the store when this process has not seen it."""
        state = self._live.get(session_id)
        if state is not None:
            self._live.move_to_end(session_id)
            state.used = self.clock()
            return state
        info = self._reader.session(session_id)
        if info is None:
            return None
        state = SessionState(
            session_id=info.session_id,
            created_at=info.created_at,
            metadata=info.metadata,
            next_seq=self._reader.next_seq(session_id),
            closed=info.status == "closed",
            counts={"completions": info.completions, "failures": info.failures},
            route=side_route(info.metadata, self._classifiers),  # checked when the session was created
            ids_memo=self.memos.new(),
            used=self.clock(),
        )
        for content, calls in self._reader.tool_call_turns(session_id):
            state.tool_arguments.remember_text(calls)
            if content is not None:
                state.tool_arguments.remember_content(calls[0][0], content)
        self._live[session_id] = state
        self.loaded += 1
        return state

    def release(self, state: SessionState) -> None:
        """A call of `state` finished (recorded, or failed and recorded as a failure)."""
        state.in_flight -= 1
        state.used = self.clock()
        if self._live.get(state.session_id) is state:
            self._live.move_to_end(state.session_id)
        self.evict_idle()

    def evict_idle(self) -> int:
        """Forget sessions with no call in flight that were not used for `idle_s`; how many."""
        limit = self.clock() - self.idle_s
        idle = []
        for sid, state in self._live.items():
            if state.used > limit:
                break  # least recently used first: the rest are fresher
            if state.in_flight == 0:
                idle.append(sid)
        for sid in idle:
            del self._live[sid]
        return len(idle)

    def compact(self) -> None:
        """With no session live: a fresh table (a dict never shrinks as its entries go) and the reader's
        SQLite page cache shrunk."""
        if not self._live:
            self._live = OrderedDict()
            with contextlib.suppress(Exception):
                self._reader.conn.execute("PRAGMA shrink_memory")

    async def close(self, session_id: str) -> bool:
        state = self.get(session_id)
        if state is None:
            return False
        state.closed = True
        await self._writer.write(lambda w: w.close_session(session_id))
        # A closed session is read back from the store if asked for again; memory holds live ones only.
        self._live.pop(session_id, None)
        return True


async def sweep_idle(registry: SessionRegistry, writer: AsyncWriter, every_s: float) -> None:
    """Every `every_s`, drop idle sessions from the registry and from the record writer's cache, so memory
    returns even when no call arrives to trigger it; once the last live session is gone, give the memory
    back (`release_memory`). Runs until cancelled."""
    log = logging.getLogger("polar.gateway")
    given_back = registry.loaded  # sessions loaded when memory was last given back
    while True:
        await asyncio.sleep(every_s)
        registry.evict_idle()
        with contextlib.suppress(Exception):  # a store that fails here fails the next call, loudly
            await writer.evict_idle()
        # Counted, not seen: sessions that came and went between two sweeps used memory too.
        if not len(registry) and registry.loaded != given_back:
            given_back = registry.loaded
            await release_memory(registry, writer)
        log.debug("sessions in memory: %d; writer cache %d bytes", len(registry), writer.cache.nbytes)


async def release_memory(registry: SessionRegistry, writer: AsyncWriter) -> int:
    """With no session live, hand the memory a burst of sessions used back to the system; the resident
    bytes returned (also counted in `registry.released` and logged). Evicting them frees their objects,
    but the process keeps the pages: CPython and glibc keep freed memory for reuse (and where records are
    written on a thread, `durability="full"` or `--workers`, that thread has a glibc arena of its own).
    So: the registry's table, the writer's caches and both connections' SQLite page caches go, a full
    collection runs, and glibc trims every arena (measured with bench/soak.py, docs/benchmarks.md)."""
    before = memory.rss_bytes()
    registry.compact()
    with contextlib.suppress(Exception):
        await writer.release()
    collected = gc.collect()
    trimmed = memory.trim()
    after = memory.rss_bytes()
    returned = max(0, before - after)
    registry.released.count += 1
    registry.released.bytes += returned
    registry.released.last_rss = after
    logging.getLogger("polar.gateway").info(
        "no live session: memory released, RSS %.1f -> %.1f MiB (%d objects collected, trimmed: %s)",
        before / 2**20,
        after / 2**20,
        collected,
        trimmed,
    )
    return returned
