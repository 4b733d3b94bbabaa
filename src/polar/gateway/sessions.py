"""The session registry: which API keys are live sessions, and the order of their calls.

A session id *is* the API key its harness is given. The registry never invents a session: a key that is not
in memory is looked up in the store (a gateway restarted mid-rollout keeps serving its sessions), and an
unknown key is refused.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from polar.gateway.restore import ToolArguments
from polar.gateway.routing import Classifiers, SideRoute, side_route
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

    def take_seq(self) -> int:
        seq = self.next_seq
        self.next_seq += 1
        return seq


class SessionRegistry:
    def __init__(
        self, writer: AsyncWriter, reader: SQLiteStore, classifiers: Classifiers | None = None
    ) -> None:
        self._writer = writer
        self._classifiers = classifiers  # builds side-call routes (polar.gateway.routing)
        self._reader = reader  # used only on the event loop thread
        self._live: dict[str, SessionState] = {}

    async def create(self, metadata: dict[str, Any], session_id: str | None = None) -> SessionState:
        """A new session; KeyError if the id was used, ValueError if its side-call route is malformed."""
        sid = session_id or "polar-" + secrets.token_urlsafe(18)
        if sid in self._live or self._reader.session(sid) is not None:
            raise KeyError(sid)
        route = side_route(metadata, self._classifiers)
        state = SessionState(session_id=sid, created_at=time.time(), metadata=metadata, route=route)
        info = SessionInfo(session_id=sid, created_at=state.created_at, status="open", metadata=metadata)
        await self._writer.write(lambda w: w.add_session(info))
        self._live[sid] = state
        return state

    def get(self, session_id: str) -> SessionState | None:
        """The live state of a session, loading it from the store when this process has not seen it."""
        state = self._live.get(session_id)
        if state is not None:
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
        )
        self._live[session_id] = state
        return state

    async def close(self, session_id: str) -> bool:
        state = self.get(session_id)
        if state is None:
            return False
        state.closed = True
        await self._writer.write(lambda w: w.close_session(session_id))
        # A closed session is read back from the store if asked for again; memory holds live ones only.
        self._live.pop(session_id, None)
        return True
