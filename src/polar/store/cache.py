"""What the record writer remembers of live sessions, bounded: an LRU with a byte budget and an idle TTL.

Storing call k+1 of a session as a delta needs call k's prompt ids and its message lists' state
(`codec.ListState`). Kept for every session ever seen, that is ~0.3 MiB per 60k-token session, forever,
and an RL run makes hundreds of thousands of sessions. So the state is dropped when its session closes,
when it has not been used for `idle_s`, and oldest first when the whole exceeds `max_bytes`. Forgetting
is always safe: the next call of that session is stored whole (the slow path), never differently.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from polar.store import codec

DEFAULT_CACHE_BYTES = 64 << 20  # ~250 live 60k-token sessions; a node rarely runs more at once
DEFAULT_IDLE_S = 600.0  # longer than an agent's slowest tool call; past it, the next call is stored whole
_ENTRY_OVERHEAD = 400  # objects around the payload (dicts, tuples, the key): a rough, honest floor


@dataclass
class SessionMemory:
    """One session's state: its latest prompts (seq, int32 bytes) and its body chains' latest lists."""

    prompts: list[tuple[int, bytes]] = field(default_factory=list)
    chains: dict[str, tuple[int, codec.Chain]] = field(default_factory=dict)  # column -> (seq, state)
    nbytes: int = _ENTRY_OVERHEAD
    used: float = 0.0

    def measure(self) -> int:
        """Its bytes counted afresh (`nbytes` is kept up to date by each change instead)."""
        n = _ENTRY_OVERHEAD + sum(_prompt_bytes(ids) for _, ids in self.prompts)
        return n + sum(_chain_bytes(chain) for _, chain in self.chains.values())


def _prompt_bytes(ids: bytes) -> int:
    return len(ids) + 64


def _chain_bytes(chain: codec.Chain) -> int:
    return sum(s.nbytes for s in chain.values())


class SessionCache:
    """Per-session memory of the record writer; one thread uses it at a time (the writer's lock)."""

    def __init__(
        self,
        max_bytes: int = DEFAULT_CACHE_BYTES,
        idle_s: float = DEFAULT_IDLE_S,
        prompts_per_session: int = 4,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_bytes < 0 or not idle_s > 0:
            raise ValueError("max_bytes must be >= 0 and idle_s > 0")
        self.max_bytes = max_bytes
        self.idle_s = idle_s
        self._per_session = prompts_per_session
        self.clock = clock  # injectable: tests move time instead of waiting
        self._sessions: OrderedDict[str, SessionMemory] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.evictions = {"closed": 0, "idle": 0, "budget": 0}

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def prompts(self, session_id: str) -> list[tuple[int, bytes]]:
        entry = self._sessions.get(session_id)
        return [] if entry is None else entry.prompts

    def chain(self, session_id: str, column: str) -> tuple[int, codec.Chain] | None:
        entry = self._sessions.get(session_id)
        return None if entry is None else entry.chains.get(column)

    def add_prompt(self, session_id: str, seq: int, ids: bytes) -> None:
        entry = self._touch(session_id)
        entry.prompts.append((seq, ids))
        change = _prompt_bytes(ids)
        if len(entry.prompts) > self._per_session:
            change -= sum(_prompt_bytes(old) for _, old in entry.prompts[: -self._per_session])
            del entry.prompts[: -self._per_session]
        self._resize(entry, change)

    def set_chain(self, session_id: str, column: str, seq: int, chain: codec.Chain) -> None:
        entry = self._touch(session_id)
        old = entry.chains.get(column)
        entry.chains[column] = (seq, chain)
        self._resize(entry, _chain_bytes(chain) - (0 if old is None else _chain_bytes(old[1])))

    def forget(self, session_id: str, why: str = "closed") -> None:
        entry = self._sessions.pop(session_id, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
            self.evictions[why] += 1

    def evict_idle(self) -> int:
        """Drop every session unused for `idle_s`; how many were dropped."""
        limit = self.clock() - self.idle_s
        n = 0
        while self._sessions:
            sid, entry = next(iter(self._sessions.items()))
            if entry.used > limit:
                break
            self.forget(sid, "idle")
            n += 1
        return n

    def clear(self) -> None:
        self._sessions.clear()
        self.nbytes = 0

    def _touch(self, session_id: str) -> SessionMemory:
        entry = self._sessions.get(session_id)
        if entry is None:
            entry = self._sessions[session_id] = SessionMemory()
            self.nbytes += entry.nbytes
        else:
            self._sessions.move_to_end(session_id)
        entry.used = self.clock()
        return entry

    def _resize(self, entry: SessionMemory, change: int) -> None:
        entry.nbytes += change
        self.nbytes += change
        self.evict_idle()
        while self.nbytes > self.max_bytes and self._sessions:
            self.forget(next(iter(self._sessions)), "budget")


class RecentHashes:
    """The blob hashes most recently written, so a blob seen again skips its INSERT: two generations of
    at most `limit` each (a hit moves a hash to the current one), so hot blobs — system prompts, tool
    lists, a group's shared history — stay and memory is bounded (the unbounded set reached 2M hashes).

    Each hash is a small object in CPython's 1 MiB arenas (64 bytes). Two generations of 65,536 (~8 MiB)
    filled new arenas during a burst of sessions, and the few long-lived objects allocated beside them
    (metric values, the loop's timers) kept those arenas from ever being freed: +10-11 % RSS after a
    4,000-session burst had gone idle (bench/soak.py, docs/benchmarks.md). At 4,096 (~0.5 MiB) that is
    gone; a hot blob still hits (it is seen every session), a session's own later calls skip their
    known blobs through its chain (`SessionCache`), and a blob that comes back after 4,096-8,192 newer ones
    costs one INSERT OR IGNORE."""

    def __init__(self, limit: int = 1 << 12) -> None:
        self._limit = limit
        self._current: set[bytes] = set()
        self._previous: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._current) + len(self._previous)

    def __contains__(self, h: bytes) -> bool:
        if h in self._current:
            return True
        if h in self._previous:
            self.add(h)
            return True
        return False

    def add(self, h: bytes) -> None:
        self._current.add(h)
        if len(self._current) >= self._limit:
            self._previous, self._current = self._current, set()

    def clear(self) -> None:
        self._current.clear()
        self._previous.clear()
