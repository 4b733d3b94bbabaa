"""What the server refused for security reasons, so a misconfigured node or an attack is visible in
`polar status` (`GET /rollout/status` → `security`) instead of failing silently.

Counts are since the server started; the last few refusals of each kind are kept with who sent them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_KEEP = 20


@dataclass
class SecurityLog:
    auth_refused: int = 0  # requests without the control token, or with a wrong one
    results_refused: int = 0  # results not carrying the credential of the session's dispatch
    recent: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=_KEEP))

    def refused_auth(self, client: str, method: str, path: str, why: str) -> None:
        self.auth_refused += 1
        self.recent.append(
            {"kind": "auth", "at": time.time(), "client": client, "request": f"{method} {path}", "why": why}
        )

    def refused_result(self, session_id: str, node_id: str | None, client: str, why: str) -> None:
        self.results_refused += 1
        self.recent.append(
            {
                "kind": "result",
                "at": time.time(),
                "client": client,
                "session_id": session_id,
                "node_id": node_id,
                "why": why,
            }
        )

    def view(self) -> dict[str, Any]:
        return {
            "auth_refused": self.auth_refused,
            "results_refused": self.results_refused,
            "recent": list(self.recent),
        }


def client_of(scope: Mapping[str, Any]) -> str:
    """`host:port` of the peer, for the log."""
    peer = scope.get("client")
    return f"{peer[0]}:{peer[1]}" if peer else "unknown"
