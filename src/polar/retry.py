"""Retries, one way: every loop in polar that tries again is a tenacity policy built here.

Each retrying call site states what it retries (an exception type, a result such as a 5xx response), how
often (`attempts`, or a time window), and its exponential backoff (`first_s` doubling, capped at `cap_s`;
no jitter: these are a handful of clients, not a herd). tenacity runs the loop, the sleeps (cancellable),
the stop rule and the hooks; nothing here counts attempts or sleeps by hand.

    policy = retrying(attempts=8, first_s=0.5, cap_s=30, retry=retry_if_exception_type(httpx.HTTPError))
    response = await policy(client.post, url)

Two helpers cover what a plain loop does not:
- `continue_after`: the gateway's upstream calls run a first attempt without the policy (tenacity costs tens
  of microseconds per call, a noticeable share of the gateway's per-call budget) and hand a retryable
  failure to the policy, which goes on from attempt 2 with the same delays.
- `delay_after`: the same backoff for a schedule kept in a database (the rollout server's callbacks, whose
  next attempt is a row's due time so that it survives a restart).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    stop_after_attempt,
    stop_before_delay,
    stop_never,
    wait_exponential,
)
from tenacity.retry import retry_base
from tenacity.stop import stop_base

T = TypeVar("T")

__all__ = ["backoff", "continue_after", "delay_after", "last_outcome", "retrying"]


def backoff(first_s: float, cap_s: float | None = None) -> wait_exponential:
    """Waits of `first_s`, 2 x `first_s`, 4 x `first_s`, ... after attempts 1, 2, 3, ..., at most `cap_s`."""
    if cap_s is None:
        return wait_exponential(multiplier=first_s)
    return wait_exponential(multiplier=first_s, max=cap_s)


def retrying(
    *,
    retry: retry_base,
    first_s: float,
    cap_s: float | None = None,
    attempts: int | None = None,
    within_s: float | None = None,
    wait: Callable[[RetryCallState], float] | None = None,
    before_sleep: Callable[[RetryCallState], Any] | None = None,
    give_last: bool = False,
) -> AsyncRetrying:
    """An async retry policy.

    `attempts`: tries in all (the first included); `within_s`: no attempt starts after this many seconds
    from the first (a sleep that would end later stops instead); neither: retry until it succeeds or is
    cancelled. `wait` replaces the backoff when a call site needs a different delay for some outcomes.
    When the attempts run out, the last exception is raised; with `give_last`, a last *result* that was
    still retryable (a 5xx response) is returned instead, for the caller to report.
    """
    stop: stop_base = stop_never
    if attempts is not None:
        stop = stop_after_attempt(attempts)
    if within_s is not None:
        stop = stop | stop_before_delay(within_s) if attempts is not None else stop_before_delay(within_s)
    return AsyncRetrying(
        stop=stop,
        wait=wait if wait is not None else backoff(first_s, cap_s),
        retry=retry,
        before_sleep=before_sleep,
        reraise=True,
        retry_error_callback=last_outcome if give_last else None,
    )


def last_outcome(state: RetryCallState) -> Any:
    """The last attempt's result, or its exception raised (tenacity's `retry_error_callback`)."""
    assert state.outcome is not None
    return state.outcome.result()


async def continue_after(policy: AsyncRetrying, failure: BaseException, fn: Callable[[], Awaitable[T]]) -> T:
    """Run `policy` as if its first attempt had just failed with `failure`: it waits the first delay, then
    calls `fn` for attempt 2 and on. For call sites that try once without a policy (no per-call cost) and
    only pay for one when that attempt fails."""
    replay: list[BaseException] = [failure]

    async def attempt() -> T:
        if replay:
            raise replay.pop()
        return await fn()

    result: T = await policy(attempt)
    return result


def delay_after(wait: Callable[[RetryCallState], float], attempts_made: int) -> float:
    """The delay `wait` puts after `attempts_made` failed attempts (>= 1), for a schedule kept elsewhere."""
    state = RetryCallState(retry_object=AsyncRetrying(), fn=None, args=(), kwargs={})
    state.attempt_number = max(1, attempts_made)
    return float(wait(state))
