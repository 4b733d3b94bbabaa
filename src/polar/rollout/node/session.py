"""One session's state on a node, and how a stage ends it early."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from polar.evaluate.base import Evaluator
from polar.harness.base import Harness, HarnessContext
from polar.rollout.node.deadline import Deadline
from polar.rollout.protocol import SessionResult, SessionSpec, SessionStatus
from polar.runtime.base import ExecResult, Runtime
from polar.trajectory.models import Trajectory


class SessionEnd(Exception):
    """Raised by a stage to end the session now with `status` and a reason (ERROR, TIMEOUT)."""

    def __init__(self, status: SessionStatus, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass
class NodeSession:
    """Mutable by design: the driver task advances it through the stages, routes read it."""

    spec: SessionSpec
    harness: Harness
    evaluator: Evaluator
    deadline: Deadline
    wants_fresh: bool = False  # prepare a clean runtime for the evaluator while the agent runs
    status: SessionStatus = SessionStatus.DISPATCHED
    submitted_at: float = field(default_factory=time.monotonic)
    marks: dict[str, float] = field(default_factory=dict)  # stage -> monotonic start time
    runtime: Runtime | None = None
    fresh: asyncio.Task[Runtime] | None = None  # the evaluator's runtime, prepared while the agent runs
    ctx: HarnessContext | None = None
    gateway_open: bool = False
    agent: ExecResult | None = None
    outcome: SessionStatus = SessionStatus.COMPLETED  # what the run ended as (TIMEOUT carries on to POSTRUN)
    reason: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)  # harness post-run output, evaluation details
    trajectory: Trajectory | None = None  # as built, before rewards (masked if the session fails later)
    final: Trajectory | None = None  # with fail-closed rewards, once POSTRUN finished
    cancel_reason: str | None = None
    handed_back: str | None = None  # why a drain gives it back to the server unrun (set before the cancel)
    driver: asyncio.Task[None] | None = None
    result: SessionResult | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    on_stage: Callable[[], None] | None = (
        None  # the node's heartbeat, sent at once: its stage counts stay true
    )

    @property
    def session_id(self) -> str:
        return self.spec.session_id

    def enter(self, status: SessionStatus) -> None:
        self.status = status
        self.marks.setdefault(status.value, time.monotonic())
        if self.on_stage is not None:
            self.on_stage()

    def timings(self, ended_at: float) -> dict[str, float]:
        """Seconds spent queued, in INIT, waiting READY, RUNNING and in POSTRUN (stages it reached)."""
        order = [
            ("queued_s", "DISPATCHED"),
            ("init_s", "INITIALIZING"),
            ("ready_wait_s", "READY"),
            ("run_s", "RUNNING"),
            ("post_s", "POST_RUN"),
        ]
        marks = {**self.marks, "DISPATCHED": self.submitted_at}
        out: dict[str, float] = {}
        reached = [(name, marks[key]) for name, key in order if key in marks]
        for i, (name, start) in enumerate(reached):
            end = reached[i + 1][1] if i + 1 < len(reached) else ended_at
            out[name] = round(max(0.0, end - start), 6)
        out["total_s"] = round(max(0.0, ended_at - self.submitted_at), 6)
        return out
