"""HTTP calls from the server to gateway nodes (routes in `polar.rollout.protocol`).

Each call reports what the server may *conclude*, not just what happened: in particular a dispatch whose
answer never arrived is UNKNOWN (the node may have accepted it), while one whose connection was refused
is REFUSED (httpx raises ConnectError before a byte of the request is sent). Every call carries the
deployment's control token; a node that refuses it (401) refused the dispatch, and the server says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import orjson
from pydantic import ValidationError

from polar.auth import bearer
from polar.jsontypes import JSONObject
from polar.rollout.protocol import (
    NODE_ID_HEADER,
    RESULT_TOKEN_HEADER,
    DrainRequest,
    NodeSessionState,
    NodeStatus,
    SessionSpec,
    error_message,
)
from polar.rollout.server.scheduler import DispatchOutcome, classify_dispatch


@dataclass(frozen=True)
class ProbeAnswer:
    reachable: bool
    state: NodeSessionState | None  # None with reachable=True: the node says it never saw the session
    error: str | None = None


def _error_text(r: httpx.Response) -> str:
    return f"HTTP {r.status_code}: {error_message(r.content) or r.text[:300]}"


def outcome_is_auth(error: str | None) -> bool:
    """Whether a dispatch error is the node refusing our token (an operator must fix the deployment)."""
    return error is not None and error.startswith(("HTTP 401", "HTTP 403"))


class NodeLink:
    def __init__(self, timeout_s: float, token: str) -> None:
        self._client = httpx.AsyncClient(timeout=timeout_s, headers=bearer(token))

    async def aclose(self) -> None:
        await self._client.aclose()

    async def dispatch(self, node_url: str, spec: SessionSpec) -> tuple[DispatchOutcome, str | None]:
        try:
            r = await self._client.post(
                f"{node_url}/node/sessions",
                content=spec.model_dump_json(),
                headers={"content-type": "application/json"},
            )
        except httpx.ConnectError as exc:
            return classify_dispatch(None, connect_failed=True), f"connect: {exc}"
        except httpx.HTTPError as exc:
            return classify_dispatch(None), f"{type(exc).__name__}: {exc}"
        outcome = classify_dispatch(r.status_code)
        return outcome, None if outcome is DispatchOutcome.ACCEPTED else _error_text(r)

    async def probe(
        self, node_url: str, node_id: str, session_id: str, dispatch: str | None = None
    ) -> ProbeAnswer:
        """Ask node `node_id` about a session. With `dispatch` (the dispatch's result token) a 404 is final:
        the node fences that dispatch before answering, so it can never admit it later. A 404 that does not
        name `node_id` is no answer: a restarted node listens on new ports, and until it registers them its
        old address may be another listener (its own model API, another node) that knows nothing of the
        session; read as "not here", it would requeue a session whose outcome the node still owes."""
        headers = {RESULT_TOKEN_HEADER: dispatch} if dispatch else {}
        try:
            r = await self._client.get(f"{node_url}/node/sessions/{session_id}", headers=headers)
        except httpx.HTTPError as exc:
            return ProbeAnswer(False, None, f"{type(exc).__name__}: {exc}")
        if r.status_code == 404:
            answered_by = r.headers.get(NODE_ID_HEADER)
            if answered_by != node_id:
                return ProbeAnswer(
                    False, None, f"HTTP 404 from {answered_by or 'something'} at {node_url}, not {node_id}"
                )
            return ProbeAnswer(True, None)
        if r.status_code != 200:
            return ProbeAnswer(False, None, _error_text(r))
        try:
            return ProbeAnswer(True, NodeSessionState.model_validate_json(r.content))
        except ValidationError as exc:
            return ProbeAnswer(False, None, f"unreadable session state: {exc.errors()[0]['msg']}")

    async def drain(self, node_url: str, request: DrainRequest) -> tuple[NodeStatus | None, str | None]:
        """Ask the node to drain: its status (draining) or why it did not answer so."""
        try:
            r = await self._client.post(
                f"{node_url}/node/drain",
                content=request.model_dump_json(),
                headers={"content-type": "application/json"},
            )
        except httpx.HTTPError as exc:
            return None, f"{type(exc).__name__}: {exc}"
        if r.status_code != 202:
            return None, _error_text(r)
        try:
            return NodeStatus.model_validate_json(r.content), None
        except ValidationError as exc:
            return None, f"unreadable node status: {exc.errors()[0]['msg']}"

    async def cancel(self, node_url: str, session_id: str) -> str | None:
        """Ask the node to cancel; the error text, or None when it answered (404 included: nothing to do)."""
        try:
            r = await self._client.delete(f"{node_url}/node/sessions/{session_id}")
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None if r.status_code < 300 or r.status_code == 404 else _error_text(r)

    async def judge_group(
        self, node_url: str, body: bytes, timeout_s: float
    ) -> tuple[JSONObject | None, str | None]:
        """Ask the node to judge a group (`POST /node/judge_group`): its answer (`{"rewards": ...}` or
        `{"failed": why}`), else why there is none; an error starting "refused:" means the node refused the
        request itself (a config it cannot read): another node would too."""
        try:
            r = await self._client.post(
                f"{node_url}/node/judge_group",
                content=body,
                headers={"content-type": "application/json"},
                timeout=timeout_s,
            )
        except httpx.HTTPError as exc:
            return None, f"{type(exc).__name__}: {exc}"
        if r.status_code in (400, 413, 422):
            return None, f"refused: {_error_text(r)}"
        if r.status_code != 200:
            return None, _error_text(r)
        try:
            answer = orjson.loads(r.content)
        except orjson.JSONDecodeError:
            return None, "an answer that is not JSON"
        if not isinstance(answer, dict):
            return None, "an answer that is not a JSON object"
        return answer, None
