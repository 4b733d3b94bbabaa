"""What the rollout server and gateway nodes say to each other (JSON over HTTP, pydantic at both ends).

Server → node:  POST {node}/node/sessions        SessionSpec         → 202 {"session_id", "accepted": true}
                GET  {node}/node/sessions/{id}                       → NodeSessionState (or 404: never seen)
                DELETE {node}/node/sessions/{id}                     → cancel (kills the process tree)
                GET  {node}/node/status                              → NodeStatus
Node → server:  POST {server}/nodes/register     NodeRegistration    → {"node_id"}
                POST {server}/nodes/{id}/heartbeat NodeStatus
                POST {server}/callbacks/session_result SessionResult (retried until acknowledged)

A session id is single-use: a node refuses a second dispatch of an id it has seen (409), and the server,
when a dispatch answer was lost, asks the node (GET) before trying another node.

Every call in both directions carries the deployment's control token (`polar.auth`). A result POST also
carries the dispatch's own credential in the `x-polar-result-token` header: the server makes one per
dispatch and sends it in `SessionSpec.result_token`, so a result for a session is accepted only from the
node it was dispatched to, and a forged one is refused and counted.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from polar.rollout.task import Task


class SessionStatus(StrEnum):
    REGISTERED = "REGISTERED"  # created by the server, not yet on a node
    DISPATCHED = "DISPATCHED"  # a node accepted it
    INITIALIZING = "INITIALIZING"
    READY = "READY"
    RUNNING = "RUNNING"
    POST_RUN = "POST_RUN"
    BUILDING = "BUILDING"
    EVALUATING = "EVALUATING"
    COMPLETED = "COMPLETED"
    TIMEOUT = "TIMEOUT"
    ERROR = "ERROR"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (
            SessionStatus.COMPLETED,
            SessionStatus.TIMEOUT,
            SessionStatus.ERROR,
            SessionStatus.CANCELLED,
        )


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


RESULT_TOKEN_HEADER = "x-polar-result-token"


class SessionSpec(_Wire):
    session_id: str
    task: Task
    sample_index: int = 0
    group_id: str | None = None  # defaults to the task id: the GRPO group
    server_url: str | None = None  # where to POST the SessionResult (None: keep it on the node)
    result_token: str | None = None  # this dispatch's credential, sent back with the result (header)


class SessionResult(_Wire):
    session_id: str
    task_id: str
    node_id: str | None = None
    status: SessionStatus
    reason: str | None = None  # why it ended so (error message, "agent budget exhausted", ...)
    reward: float | None = None
    trajectory: dict[str, Any] | None = None  # polar.trajectory.Trajectory as JSON
    timings: dict[str, float] = Field(default_factory=dict)  # queued_s, init_s, ready_wait_s, run_s, post_s
    metadata: dict[str, Any] = Field(default_factory=dict)  # task metadata + sample index + group id


class NodeRegistration(_Wire):
    node_id: str
    url: str
    capacity: int = Field(ge=1)  # admission limit: sessions it takes at once


class NodeStatus(_Wire):
    node_id: str
    active: int = 0  # sessions admitted and not finished
    capacity: int = 1
    by_stage: dict[str, int] = Field(default_factory=dict)
    draining: bool = False


class NodeSessionState(_Wire):
    session_id: str
    status: SessionStatus
    result: SessionResult | None = None
