"""The node's side of talking to the rollout server: registration, heartbeats, and result delivery.

A finished session's result is POSTed to the server until it is acknowledged (connection errors and 5xx are
retried with a doubling backoff; a 4xx means the server refuses this result and retrying cannot help). The
result stays on the node either way, so a server that missed it can still GET it.

Every call carries the deployment's control token; a result also carries the credential the server gave
with that session's dispatch (`SessionSpec.result_token`), so only the node a session was dispatched to can
report it. A server that refuses the token is logged loudly and retried: a node never sits silent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

from polar.auth import bearer
from polar.rollout.protocol import RESULT_TOKEN_HEADER, NodeRegistration, NodeStatus, SessionResult

log = logging.getLogger("polar.node")

_RETRY_STATUS = {408, 425, 429}
_AUTH_RETRY_S = 30.0  # a refused token needs an operator; retry slowly, loudly


class Reporter:
    def __init__(
        self, token: str, attempts: int = 8, backoff_s: float = 0.5, timeout_s: float = 30.0
    ) -> None:
        self.attempts = attempts
        self.backoff_s = backoff_s
        self._client = httpx.AsyncClient(timeout=timeout_s, headers=bearer(token))
        self._tasks: set[asyncio.Task[bool]] = set()
        self.delivered: dict[str, bool] = {}  # session id -> acknowledged (False: gave up)

    def _delay(self, attempt: int) -> float:
        return float(min(self.backoff_s * 2**attempt, 30.0))

    def report(self, server_url: str, result: SessionResult, result_token: str | None) -> asyncio.Task[bool]:
        """Deliver `result` in the background; the task's value says whether the server acknowledged."""
        task = asyncio.create_task(self.post_result(server_url, result, result_token))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def post_result(self, server_url: str, result: SessionResult, result_token: str | None) -> bool:
        url = f"{server_url.rstrip('/')}/callbacks/session_result"
        body = result.model_dump_json().encode()
        headers = {"content-type": "application/json"}
        if result_token is not None:
            headers[RESULT_TOKEN_HEADER] = result_token
        last = ""
        for attempt in range(self.attempts):
            if attempt:
                await asyncio.sleep(self._delay(attempt - 1))
            try:
                r = await self._client.post(url, content=body, headers=headers)
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            if r.is_success:
                self.delivered[result.session_id] = True
                return True
            last = f"HTTP {r.status_code}: {r.text[:200]}"
            if r.status_code < 500 and r.status_code not in _RETRY_STATUS:
                break
        log.warning("result of session %s not delivered to %s: %s", result.session_id, url, last)
        self.delivered[result.session_id] = False
        return False

    async def register(self, server_url: str, registration: NodeRegistration) -> str:
        """Register with the server (retrying until it answers); returns the node id it acknowledged."""
        url = f"{server_url.rstrip('/')}/nodes/register"
        attempt = 0
        while True:
            try:
                r = await self._client.post(
                    url,
                    content=registration.model_dump_json().encode(),
                    headers={"content-type": "application/json"},
                )
                if r.is_success:
                    node_id = r.json().get("node_id", registration.node_id)
                    return str(node_id)
                if r.status_code == 401:
                    log.error(
                        "the rollout server at %s refused this node's control token (%s); the node gets no "
                        "work until it has the server's token (POLAR_TOKEN or --token-file). Retrying in %gs",
                        server_url,
                        _message(r),
                        _AUTH_RETRY_S,
                    )
                    await asyncio.sleep(_AUTH_RETRY_S)
                    continue
                if r.status_code < 500:
                    raise RuntimeError(f"the server at {server_url} refused registration: {r.text[:300]}")
                why = f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                why = f"{type(exc).__name__}: {exc}"
            log.warning("cannot register with %s (%s); retrying", server_url, why)
            await asyncio.sleep(self._delay(attempt))
            attempt += 1

    async def heartbeats(
        self,
        server_url: str,
        registration: NodeRegistration,
        status: Callable[[], NodeStatus],
        interval_s: float,
    ) -> None:
        """Register, then send the node's status every `interval_s`; re-register when the server has
        forgotten this node (it restarted), and keep trying through outages. Runs until cancelled."""
        try:
            node_id = await self.register(server_url, registration)
        except RuntimeError as exc:  # refused (4xx): nothing to retry; the node still serves standalone
            log.error("%s", exc)
            return
        base = server_url.rstrip("/")
        while True:
            await asyncio.sleep(interval_s)
            try:
                r = await self._client.post(
                    f"{base}/nodes/{node_id}/heartbeat",
                    content=status().model_dump_json().encode(),
                    headers={"content-type": "application/json"},
                )
                if r.status_code in (401, 404):  # forgotten (a restart) or a token changed: register again
                    node_id = await self.register(server_url, registration)
            except RuntimeError as exc:
                log.error("%s", exc)
                return
            except httpx.HTTPError as exc:
                log.warning("heartbeat to %s failed: %s", server_url, exc)

    async def aclose(self, timeout_s: float = 5.0) -> None:
        """Give pending deliveries `timeout_s` to finish, then drop them and close the client."""
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await self._client.aclose()


def _message(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {r.status_code}"
