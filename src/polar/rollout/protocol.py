"""What the rollout server and gateway nodes say to each other (JSON over HTTP, pydantic at both ends).

Server → node:  POST {node}/node/sessions        SessionSpec         → 202 {"session_id", "accepted", "duplicate"}
                GET  {node}/node/sessions/{id}                       → NodeSessionState (or 404: not there)
                DELETE {node}/node/sessions/{id}                     → cancel (kills the process tree)
                GET  {node}/node/status                              → NodeStatus
                POST {node}/node/drain            DrainRequest        → 202 NodeStatus (then the node leaves)
Node → server:  POST {server}/nodes/register     NodeRegistration    → {"node_id"}
                POST {server}/nodes/{id}/heartbeat NodeStatus          → HeartbeatReply
                POST {server}/nodes/{id}/leave                       → 409 while sessions are open there
                POST {server}/callbacks/session_result SessionResult (retried until acknowledged)

A session id is single-use: a node refuses a second dispatch of an id it has seen (409). A dispatch is
named by its result token, and every answer a node gives about one is final and journaled before it is
sent: a resend of an accepted dispatch is answered 202 "duplicate" (nothing runs twice), and a refused one
(429, 503, 422, or a probe answered 404 with the dispatch's token in `x-polar-result-token`) is fenced, so
a copy still in flight is never admitted after the server requeued the session. The server, when a
dispatch answer was lost, resends it once, then asks the node (GET with the token) before requeueing.

A result with status REGISTERED is a hand-back: a draining node stopped the session before its agent
started, and the server puts it back in the queue (same id) instead of ending it.

Every call in both directions carries the deployment's control token (`polar.auth`). A result POST also
carries the dispatch's own credential in the `x-polar-result-token` header: the server makes one per
dispatch and sends it in `SessionSpec.result_token`, so a result for a session is accepted only from the
node it was dispatched to, and a forged one is refused and counted.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

from polar.task import Task


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


def error_message(body: bytes) -> str | None:
    """The `message` of an error as polar's servers answer one (`{"error": {"message": ..., "field": ...}}`:
    the rollout server, nodes, the gateway's control routes); None when `body` is not such an error."""
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    message = error.get("message") if isinstance(error, dict) else None
    return None if message is None else str(message)


RESULT_TOKEN_HEADER = "x-polar-result-token"
# The node's id on its answer about a session: a 404 means "not here" only from the node the session is
# bound to, never from whatever now listens at that node's old address (a restarted node's ports move).
NODE_ID_HEADER = "x-polar-node"


class SessionSpec(_Wire):
    session_id: str
    task: Task
    sample_index: int = 0
    group_id: str | None = None  # defaults to the task id: the GRPO group
    server_url: str | None = None  # where to POST the SessionResult (None: keep it on the node)
    result_token: str | None = None  # this dispatch's credential, sent back with the result (header)


class SessionResult(_Wire):
    """How one session ended: what the node reports to the server, and one line of `results.jsonl`."""

    session_id: str = Field(description="The session (single-use: one session, one trajectory).")
    task_id: str = Field(description="The task it sampled.")
    node_id: str | None = Field(
        None, description="The node that ran it; null when the server ended it (cancelled, node lost)."
    )
    status: SessionStatus = Field(description="COMPLETED, TIMEOUT, ERROR or CANCELLED.")
    reason: str | None = Field(
        None, description='Why it ended so: an error message, "agent budget exhausted (N s)", ...'
    )
    reward: float | None = Field(
        None,
        description="The outcome reward after the fail-closed rules (0 for an agent-budget TIMEOUT); null "
        "when the session is masked, has no trajectory, or was scored per trace (see the traces' rewards).",
    )
    trajectory: dict[str, Any] | None = Field(
        None, description="The trajectory the node built and rewarded (`Trajectory` as JSON), or null."
    )
    timings: dict[str, float] = Field(
        default_factory=dict, description="Seconds per stage the session reached, and in all."
    )
    metadata: dict[str, Any] = Field(
        default_factory=dict,
        description="The task's metadata plus task_id, group_id, sample_index, the harness's post-run "
        "output and the evaluation.",
    )


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
    # The stage pools' sizes (init, run, post workers; the READY buffer): what the dashboard's topology shows.
    workers: dict[str, int] = Field(default_factory=dict)
    # The container images it holds, for placement (`polar.rollout.server.scheduler`). A fleet's nodes may
    # hold thousands (SWE-bench: one per instance), so the list travels only when the server's copy is not
    # `images_digest` (the server's reply says which it has); `fetching` (a few) travels every time.
    engines: list[str] = Field(default_factory=list)  # the engines whose images it reports
    images_digest: str | None = None
    images: dict[str, list[str]] | None = None  # engine -> normalized references
    fetching: dict[str, list[str]] = Field(default_factory=dict)


class ImageRef(_Wire):
    engine: str = Field(min_length=1, max_length=40)
    image: str = Field(min_length=1, max_length=500)


class ImagesQuery(_Wire):
    """`POST /images/where`: which live nodes hold (or fetch) these images (`polar submit`'s check)."""

    images: list[ImageRef] = Field(max_length=10_000)


class HeartbeatReply(_Wire):
    ok: bool = True
    images_digest: str | None = None  # the node's image list the server now holds (None: none)
    prefetch: list[ImageRef] = Field(default_factory=list)  # images of queued sessions to fetch now


class DrainRequest(_Wire):
    reason: str = Field("node drained", max_length=500)
    timeout_s: float | None = Field(None, gt=0)  # then running sessions are cancelled (None: let them end)


class NodeSessionState(_Wire):
    session_id: str
    status: SessionStatus
    result: SessionResult | None = None
