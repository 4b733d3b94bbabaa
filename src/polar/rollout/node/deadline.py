"""A session's clocks: one deadline from INIT start, and an optional agent budget from RUN start.

Time a session waits in the node's queue before INIT is not charged (a busy node must not eat a session's
budget before it starts); time waiting in the READY buffer is, since its runtime already exists.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class Deadline:
    timeout_s: float
    started_at: float | None = None  # monotonic time INIT began

    def start(self) -> None:
        if self.started_at is None:
            self.started_at = time.monotonic()

    @property
    def at(self) -> float:
        """The monotonic time the session must end by (INIT not started: counted from now)."""
        return (self.started_at if self.started_at is not None else time.monotonic()) + self.timeout_s

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return self.started_at is not None and time.monotonic() >= self.at


@dataclass(frozen=True)
class RunLimit:
    """How long the agent may run, and which clock set that limit (it decides the TIMEOUT's reward)."""

    seconds: float
    by_budget: bool  # True: the agent's own budget; False: the session deadline

    @classmethod
    def of(cls, deadline: Deadline, budget_s: float | None) -> RunLimit:
        left = deadline.remaining()
        if budget_s is not None and budget_s <= left:
            return cls(budget_s, True)
        return cls(left, False)
