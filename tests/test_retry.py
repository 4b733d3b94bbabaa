"""`polar.retry`: the one retry policy (tenacity) every retrying call site uses, with the schedules,
attempt counts and decisions of the hand-written loops it replaced. Delays are read off the policies, never
timed; the HTTP cases count what a real server received."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from tenacity import retry_if_exception_type

from polar.client import RolloutClient, RolloutError
from polar.retry import backoff, continue_after, delay_after, retrying
from polar.rollout.node import reporter as reporter_module
from polar.rollout.node.reporter import Reporter
from polar.rollout.protocol import NodeRegistration, SessionResult, SessionStatus
from polar.rollout.server.callbacks import RetryPolicy
from tests.fakes.server import serve


def delays(wait: Any, n: int) -> list[float]:
    return [delay_after(wait, k) for k in range(1, n + 1)]


def test_the_schedules_of_the_replaced_loops() -> None:
    # node result delivery and registration: 0.5 s doubling, capped at 30 s
    assert delays(backoff(0.5, 30.0), 8) == [0.5, 1, 2, 4, 8, 16, 30, 30]
    # the rollout client's GETs: 0.1 s doubling to 2 s
    assert delays(backoff(0.1, 2.0), 7) == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0])
    # prepare commands: min(0.1 * 2**k, 2) before attempt k+1
    assert delays(backoff(0.2, 2.0), 6) == pytest.approx([0.2, 0.4, 0.8, 1.6, 2.0, 2.0])
    # the gateway's upstream: retry_backoff_s * 2**attempt, uncapped
    assert delays(backoff(0.25), 4) == [0.25, 0.5, 1.0, 2.0]


def test_callback_redelivery_keeps_its_schedule() -> None:
    policy = RetryPolicy()
    old = [min(policy.backoff_max_s, policy.backoff_s * 2 ** max(0, n - 1)) for n in range(12)]
    assert [policy.delay(n) for n in range(12)] == old


class Flaky:
    """An async function failing `failures` times with `exc`, then answering "ok"; counts its calls."""

    def __init__(self, failures: int, exc: type[Exception] = OSError) -> None:
        self.failures, self.exc, self.calls = failures, exc, 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.exc(f"failure {self.calls}")
        return "ok"


async def test_attempts_count_the_first_try_and_the_last_error_is_raised() -> None:
    flaky = Flaky(5)
    policy = retrying(attempts=3, first_s=0.001, retry=retry_if_exception_type(OSError))
    with pytest.raises(OSError, match="failure 3"):
        await policy(flaky)
    assert flaky.calls == 3
    assert await retrying(attempts=3, first_s=0.001, retry=retry_if_exception_type(OSError))(Flaky(2)) == "ok"


async def test_what_is_not_retried_is_raised_at_once() -> None:
    flaky = Flaky(5, ValueError)
    with pytest.raises(ValueError):
        await retrying(attempts=3, first_s=0.001, retry=retry_if_exception_type(OSError))(flaky)
    assert flaky.calls == 1


async def test_a_window_stops_before_a_sleep_that_would_end_past_it() -> None:
    flaky = Flaky(100)
    with pytest.raises(OSError):
        await retrying(within_s=0.5, first_s=10.0, retry=retry_if_exception_type(OSError))(flaky)
    assert flaky.calls == 1  # the first wait (10 s) would end past the window


async def test_continue_after_goes_on_from_attempt_two() -> None:
    flaky = Flaky(5)
    policy = retrying(attempts=3, first_s=0.001, retry=retry_if_exception_type(OSError))
    with pytest.raises(OSError, match="failure 2"):
        await continue_after(policy, OSError("first"), flaky)
    assert flaky.calls == 2  # the first attempt was the caller's own
    assert await continue_after(policy, OSError("first"), Flaky(1)) == "ok"


# -- the call sites, against a real server ------------------------------------------------------------
@pytest.fixture
def scripted() -> Iterator[tuple[str, list[int], list[str]]]:
    """A server answering each request with the next status of a script (then 200); logs the paths."""
    script: list[int] = []
    seen: list[str] = []

    async def any_route(request: Request) -> JSONResponse:
        seen.append(request.url.path)
        status = script.pop(0) if script else 200
        body = {"node_id": "n-1"} if status < 300 else {"error": {"message": f"scripted {status}"}}
        return JSONResponse(body, status_code=status)

    app = Starlette(routes=[Route("/{path:path}", any_route, methods=["GET", "POST"])])
    with serve(app) as srv:
        yield srv.url, script, seen


def result() -> SessionResult:
    return SessionResult(session_id="s-1", task_id="t-1", status=SessionStatus.COMPLETED)


@pytest.mark.parametrize(
    ("script", "delivered", "posts"),
    [
        ([503, 502, 429, 408, 425], True, 6),  # transient answers are retried until acknowledged
        ([503] * 10, False, 4),  # at most `attempts` tries
        ([404], False, 1),  # a refusal is final
        ([401], False, 1),
    ],
    ids=["transient", "exhausted", "refused", "token"],
)
async def test_result_delivery(scripted: Any, script: list[int], delivered: bool, posts: int) -> None:
    url, todo, seen = scripted
    todo.extend(script)
    reporter = Reporter("tok", attempts=4 if not delivered else 8, backoff_s=0.001)
    try:
        assert await reporter.post_result(url, result(), "rt") is delivered
    finally:
        await reporter.aclose()
    assert len(seen) == posts and reporter.delivered["s-1"] is delivered


async def test_result_delivery_retries_a_server_that_is_down() -> None:
    reporter = Reporter("tok", attempts=3, backoff_s=0.001)
    try:
        assert await reporter.post_result("http://127.0.0.1:9", result(), None) is False
    finally:
        await reporter.aclose()


async def test_registration_retries_outages_and_a_refused_token(
    scripted: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, todo, seen = scripted
    monkeypatch.setattr(reporter_module, "_AUTH_RETRY_S", 0.001)
    todo.extend([503, 401, 500, 401])
    reporter = Reporter("tok", backoff_s=0.001)
    registration = NodeRegistration(node_id="n-1", url="http://127.0.0.1:1", capacity=1)
    try:
        assert await reporter.register(url, registration) == "n-1"
        assert len(seen) == 5
        todo.append(403)
        with pytest.raises(RuntimeError, match="refused registration"):
            await reporter.register(url, registration)
        assert len(seen) == 6
    finally:
        await reporter.aclose()


async def test_the_client_retries_gets_within_its_window(scripted: Any) -> None:
    url, todo, seen = scripted
    todo.extend([503, 502])
    async with RolloutClient(url, token="tok", retry_window_s=30) as client:
        assert await client._get("/x") == {"node_id": "n-1"}
        assert len(seen) == 3
        todo.append(404)
        with pytest.raises(RolloutError):
            await client._get("/x")  # a 4xx is an answer, not an outage
        assert len(seen) == 4
    async with RolloutClient(url, token="tok", retry_window_s=0.05) as client:
        todo.extend([503] * 50)
        with pytest.raises(RolloutError, match=r"server unreachable for 0.05s \(HTTP 503\)"):
            await client._get("/x")


async def test_the_client_gives_up_a_submission_after_a_second_connect_error() -> None:
    async with RolloutClient("http://127.0.0.1:9", token="tok") as client:
        with pytest.raises(RolloutError, match="ConnectError"):
            await client._post_tasks([])
