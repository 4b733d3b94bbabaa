"""One generation call as it goes through the proxy's layers, and where it was placed."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from polar.gateway.backends.base import Backend
from polar.gateway.canonical import CanonicalRequest
from polar.gateway.dialects.base import Dialect
from polar.gateway.sessions import SessionState
from polar.jsontypes import JSON


@dataclass(frozen=True, slots=True)
class Placed:
    """Where a call goes: the backend, the exact body sent to it, the harness's tags, the quirks applied,
    flags its record gets for what the gateway changed on the way (`polar.gateway.fit`), and, when a frozen
    model serves it instead of the policy (`polar.gateway.routing`), the flag its record gets for that."""

    backend: Backend
    upstream: dict[str, Any]
    tags: tuple[str, ...]
    quirks: tuple[str, ...]
    flags: tuple[str, ...] = ()
    routed: str = ""  # "routed:side_call", "routed:judge"; empty: the policy serves it


@dataclass
class Call:
    """One generation call on its way through the proxy's layers; a failure record needs what it got to."""

    state: SessionState
    seq: int
    dialect: Dialect
    created: float  # unix seconds at arrival
    started: float  # perf_counter at arrival
    body: JSON = None
    req: CanonicalRequest | None = None
    policy_version: int | None = None  # the gate's when the call entered generation


def completion_id(seq: int) -> str:
    """The gateway's own id for a session's call `seq`: unique in the session by its seq, and across sessions
    by its random part. Inference servers' ids are not unique (a restarted server counts from the start
    again, a frozen model's server counts alike, a hosted API may send none), and a session whose records
    repeat an id could not be built into a trajectory: one such repeat turned a whole session into ERROR."""
    return f"cmpl-{secrets.token_hex(8)}-{seq}"
