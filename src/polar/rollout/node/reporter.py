"""The node's side of talking to the rollout server: registration, heartbeats, and result delivery.

A finished session's result is POSTed to the server until it is acknowledged (connection errors, 5xx, 408,
425 and 429 are retried, `attempts` tries in all, with a doubling backoff capped at 30 s; any other 4xx means
the server refuses this result and retrying cannot help). Either answer *settles* it (`on_settled`: the
node's journal drops the payload); a result that got neither stays owed in the journal, is sent again when
the node registers again or restarts, and a server that missed it can still GET it. Registration retries
the same way, without end (see `polar.retry`).

Every call carries the deployment's control token; a result also carries the credential the server gave
with that session's dispatch (`SessionSpec.result_token`), so only the node a session was dispatched to can
report it. A server that refuses the token is logged loudly and retried: a node never sits silent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import httpx
from tenacity import RetryCallState, retry_if_exception_type, retry_if_result

from polar.auth import bearer
from polar.retry import backoff, retrying
from polar.rollout.protocol import (
    RESULT_TOKEN_HEADER,
    HeartbeatReply,
    NodeRegistration,
    NodeStatus,
    SessionResult,
    error_message,
)

log = logging.getLogger("polar.node")

_RETRY_STATUS = {408, 425, 429}
_AUTH_RETRY_S = 30.0  # a refused token needs an operator; retry slowly, loudly
_MAX_DELAY_S = 30.0


def _transient(r: httpx.Response) -> bool:
    """A result delivery the server may accept when asked again."""
    return r.status_code >= 500 or r.status_code in _RETRY_STATUS


class Reporter:
    def __init__(
        self,
        token: str,
        attempts: int = 8,
        backoff_s: float = 0.5,
        timeout_s: float = 30.0,
        on_settled: Callable[[str], None] = lambda _: None,
    ) -> None:
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.on_settled = on_settled  # the server acknowledged a result, or refused it for good
        self._client = httpx.AsyncClient(timeout=timeout_s, headers=bearer(token))
        self._tasks: set[asyncio.Task[bool]] = set()
        self._sending: set[str] = set()  # session ids with a delivery in flight
        self._beat = asyncio.Event()  # set: send the next heartbeat now (the node started draining)
        self.delivered: dict[str, bool] = {}  # session id -> acknowledged (False: gave up)
        self.reports = {"delivered": 0, "failed": 0}  # results acknowledged / given up on (metrics)
        self.heartbeat_failures = 0  # heartbeats that reached no server (metrics)

    def report(self, server_url: str, result: SessionResult, result_token: str | None) -> asyncio.Task[bool]:
        """Deliver `result` in the background; the task's value says whether the server acknowledged."""
        self._sending.add(result.session_id)
        task = asyncio.create_task(self.post_result(server_url, result, result_token))
        self._tasks.add(task)

        def done(t: asyncio.Task[bool]) -> None:
            self._tasks.discard(t)
            self._sending.discard(result.session_id)

        task.add_done_callback(done)
        return task

    def sending(self, session_id: str) -> bool:
        return session_id in self._sending

    async def flush(self) -> None:
        """Until every delivery started so far has been acknowledged, refused or given up on."""
        while self._tasks:
            await asyncio.gather(*set(self._tasks), return_exceptions=True)

    async def post_result(self, server_url: str, result: SessionResult, result_token: str | None) -> bool:
        url = f"{server_url.rstrip('/')}/callbacks/session_result"
        body = result.model_dump_json().encode()
        headers = {"content-type": "application/json"}
        if result_token is not None:
            headers[RESULT_TOKEN_HEADER] = result_token
        policy = retrying(
            attempts=self.attempts,
            first_s=self.backoff_s,
            cap_s=_MAX_DELAY_S,
            retry=retry_if_exception_type(httpx.HTTPError) | retry_if_result(_transient),
            give_last=True,
        )
        try:
            r: httpx.Response = await policy(self._client.post, url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
        else:
            if r.is_success:
                self.delivered[result.session_id] = True
                self.reports["delivered"] += 1
                self.on_settled(result.session_id)
                return True
            last = f"HTTP {r.status_code}: {r.text[:200]}"
            if not _transient(r):  # refused for good (unknown session, another dispatch's): never resent
                self.on_settled(result.session_id)
        log.warning("result of session %s not delivered to %s: %s", result.session_id, url, last)
        self.delivered[result.session_id] = False
        self.reports["failed"] += 1
        return False

    async def register(self, server_url: str, registration: NodeRegistration) -> str:
        """Register with the server (retrying until it answers); returns the node id it acknowledged.

        Connection errors and 5xx are retried with the delivery backoff, a refused token (401) every 30 s
        with an error in the log; another 4xx raises RuntimeError (nothing to retry)."""
        url = f"{server_url.rstrip('/')}/nodes/register"
        exponential = backoff(self.backoff_s, _MAX_DELAY_S)

        def wait(state: RetryCallState) -> float:
            refused = _refused_token(state)
            return _AUTH_RETRY_S if refused is not None else exponential(state)

        def before_sleep(state: RetryCallState) -> None:
            refused = _refused_token(state)
            if refused is not None:
                log.error(
                    "the rollout server at %s refused this node's control token (%s); the node gets no "
                    "work until it has the server's token (POLAR_TOKEN or --token-file). Retrying in %gs",
                    server_url,
                    _message(refused),
                    _AUTH_RETRY_S,
                )
                return
            assert state.outcome is not None
            exc = state.outcome.exception()
            why = f"{type(exc).__name__}: {exc}" if exc else f"HTTP {state.outcome.result().status_code}"
            log.warning("cannot register with %s (%s); retrying", server_url, why)

        policy = retrying(
            first_s=self.backoff_s,
            wait=wait,
            retry=retry_if_exception_type(httpx.HTTPError)
            | retry_if_result(lambda r: r.status_code >= 500 or r.status_code == 401),
            before_sleep=before_sleep,
        )
        r: httpx.Response = await policy(
            self._client.post,
            url,
            content=registration.model_dump_json().encode(),
            headers={"content-type": "application/json"},
        )
        if not r.is_success:
            raise RuntimeError(f"the server at {server_url} refused registration: {r.text[:300]}")
        return str(r.json().get("node_id", registration.node_id))

    async def heartbeats(
        self,
        server_url: str,
        registration: NodeRegistration,
        status: Callable[[], NodeStatus],
        interval_s: float,
        on_registered: Callable[[], Awaitable[None]] | None = None,
        on_reply: Callable[[HeartbeatReply | None], None] | None = None,
    ) -> None:
        """Register, then send the node's status every `interval_s` (at once after `beat_now`); re-register
        when the server has forgotten this node (it restarted), and keep trying through outages. After each
        registration `on_registered` runs (the node resends the outcomes it still owes); each heartbeat's
        answer goes to `on_reply` (None: the server forgot this node, and with it what it was told).
        Runs until cancelled."""
        try:
            node_id = await self.register(server_url, registration)
        except RuntimeError as exc:  # refused (4xx): nothing to retry; the node still serves standalone
            log.error("%s", exc)
            return
        if on_registered is not None:
            await on_registered()
        base = server_url.rstrip("/")
        while True:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that comes as its
            # inner wait completes. A drain's beat_now() and its cancel of this task fall in one loop pass
            # when nothing runs, and the idle node never left (tests/test_node_drain.py).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval_s):
                    await self._beat.wait()
            self._beat.clear()
            try:
                r = await self._client.post(
                    f"{base}/nodes/{node_id}/heartbeat",
                    content=status().model_dump_json().encode(),
                    headers={"content-type": "application/json"},
                )
                if r.status_code in (401, 404):  # forgotten (a restart) or a token changed: register again
                    if on_reply is not None:
                        on_reply(None)
                    node_id = await self.register(server_url, registration)
                    if on_registered is not None:
                        await on_registered()
                elif r.is_success and on_reply is not None:
                    try:
                        on_reply(HeartbeatReply.model_validate_json(r.content))
                    except ValueError:  # not a reply of this protocol: act as if the server knew nothing
                        on_reply(None)
            except RuntimeError as exc:
                log.error("%s", exc)
                return
            except httpx.HTTPError as exc:
                self.heartbeat_failures += 1
                log.warning("heartbeat to %s failed: %s", server_url, exc)

    def beat_now(self) -> None:
        self._beat.set()

    async def leave(self, server_url: str, node_id: str) -> str | None:
        """Tell the server this node is gone for good (after a drain). None when it agreed; else why not:
        409 while the server still counts sessions on this node (their outcomes are still on the way)."""
        try:
            r = await self._client.post(f"{server_url.rstrip('/')}/nodes/{node_id}/leave")
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None if r.is_success or r.status_code == 404 else f"HTTP {r.status_code}: {_message(r)}"

    async def aclose(self, timeout_s: float = 5.0) -> None:
        """Give pending deliveries `timeout_s` to finish, then drop them and close the client."""
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await self._client.aclose()


def _refused_token(state: RetryCallState) -> httpx.Response | None:
    """The 401 response an attempt ended with, if that is how it ended."""
    outcome = state.outcome
    if outcome is None or outcome.failed:
        return None
    r: httpx.Response = outcome.result()
    return r if r.status_code == 401 else None


def _message(r: httpx.Response) -> str:
    return error_message(r.content) or f"HTTP {r.status_code}"
