"""The trainer's client for the rollout server.

    async with RolloutClient("http://127.0.0.1:8300", max_in_flight=4) as client:
        async for result in client.run(tasks):      # submits while at most 4 task groups are unfinished
            trainer.add(result)

`submit` stores task groups (a Task with `num_samples` sessions is one GRPO group), `results` yields each
finished session as soon as the server has it (long polling `GET /rollout/results`, which answers the
moment a result lands), `cancel` stops a group. The client rides out a server restart: reads are retried
on connection errors, and the server keeps every finished result across restarts.

Every request carries the deployment's control token: `token=`, else `POLAR_TOKEN`, else the default token
file (`polar.auth.load_token`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import httpx
from tenacity import retry_if_exception_type, retry_if_result

from polar.auth import bearer, load_token
from polar.jsontypes import JSON
from polar.retry import retrying
from polar.rollout.protocol import SessionResult
from polar.task import Task


class RolloutError(RuntimeError):
    """The server refused a request (4xx) or could not be reached within the retry window."""

    def __init__(self, message: str, status: int | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def _raise_for(r: httpx.Response) -> None:
    if r.status_code < 400:
        return
    try:
        err = r.json().get("error", {})
        message, param = err.get("message") or r.text, err.get("param")
    except (ValueError, AttributeError):
        message, param = r.text[:500], None
    raise RolloutError(f"HTTP {r.status_code}: {message}", r.status_code, param)


class RolloutClient:
    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        max_in_flight: int | None = None,
        poll_wait_s: float = 20.0,
        retry_window_s: float = 60.0,
        timeout_s: float = 30.0,
    ) -> None:
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.url = url.rstrip("/")
        self.max_in_flight = max_in_flight
        self.poll_wait_s = poll_wait_s
        self.retry_window_s = retry_window_s
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, read=timeout_s + poll_wait_s),
            headers=bearer(token if token is not None else load_token()),
        )
        self.in_flight: set[str] = set()  # submitted task ids not yet seen finished
        self.session_ids: dict[str, list[str]] = {}
        self._freed = asyncio.Event()

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # -- transport --------------------------------------------------------------------------------------
    async def _get(self, path: str, params: Any = None) -> JSON:  # params: httpx's, passed on
        """GET with retries on connection errors and 5xx (0.1 s doubling to 2 s between tries), for at most
        `retry_window_s` (a server restart)."""
        policy = retrying(
            within_s=self.retry_window_s,
            first_s=0.1,
            cap_s=2.0,
            retry=retry_if_exception_type(httpx.TransportError)
            | retry_if_result(lambda r: r.status_code >= 500),
            give_last=True,
        )
        try:
            r: httpx.Response = await policy(self._http.get, f"{self.url}{path}", params=params)
        except httpx.TransportError as exc:
            error = f"{type(exc).__name__}: {exc}"
        else:
            if r.status_code < 500:
                _raise_for(r)
                return r.json()
            error = f"HTTP {r.status_code}"
        raise RolloutError(f"GET {path}: server unreachable for {self.retry_window_s:g}s ({error})")

    # -- tasks ------------------------------------------------------------------------------------------
    async def submit(self, tasks: Task | Sequence[Task]) -> list[str]:
        """Submit task groups; returns their task ids. With `max_in_flight`, waits (one group at a time)
        until fewer than that many submitted groups are unfinished."""
        group = [tasks] if isinstance(tasks, Task) else list(tasks)
        if not group:
            return []
        if self.max_in_flight is None:
            await self._post_tasks(group)
        else:
            for task in group:
                await self._wait_for_slot()
                await self._post_tasks([task])
        return [t.task_id for t in group]

    async def _post_tasks(self, tasks: list[Task]) -> None:
        body = {"tasks": [t.model_dump(mode="json") for t in tasks]}
        url = f"{self.url}/rollout/task/submit"
        # A connect error means it was never sent: one more try after a pause (a server restarting).
        policy = retrying(attempts=2, first_s=1.0, retry=retry_if_exception_type(httpx.ConnectError))
        try:
            r: httpx.Response = await policy(self._http.post, url, json=body)
        except httpx.HTTPError as exc:
            # Not retried past a connect error: the server may have stored the tasks (a resubmit gets 409).
            raise RolloutError(f"POST {url}: {type(exc).__name__}: {exc}") from None
        _raise_for(r)
        for created in r.json()["tasks"]:
            self.session_ids[created["task_id"]] = created["session_ids"]
            self.in_flight.add(created["task_id"])

    async def _wait_for_slot(self) -> None:
        assert self.max_in_flight is not None
        while len(self.in_flight) >= self.max_in_flight:
            self._freed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._freed.wait()
            if len(self.in_flight) >= self.max_in_flight:  # nobody is reading results: look ourselves
                for task_id in list(self.in_flight):
                    if (await self.task(task_id, results=False))["state"] != "ACTIVE":
                        self._ended(task_id)

    def _ended(self, task_id: str) -> None:
        if task_id in self.in_flight:
            self.in_flight.discard(task_id)
            self._freed.set()

    async def task(self, task_id: str, *, results: bool = True) -> dict[str, Any]:
        """`GET /rollout/task/{id}`: state, counts, sessions, callbacks (and results)."""
        data: dict[str, Any] = await self._get(
            f"/rollout/task/{task_id}", {"results": "true" if results else "false"}
        )
        return data

    async def status(self) -> dict[str, Any]:
        data: dict[str, Any] = await self._get("/rollout/status")
        return data

    async def nodes(self) -> list[dict[str, Any]]:
        """`GET /nodes`: each node's load, health and last reported status."""
        data: list[dict[str, Any]] = (await self._get("/nodes"))["nodes"]
        return data

    async def images_where(self, images: Sequence[tuple[str, str]]) -> dict[str, Any]:
        """`POST /images/where`: for each (engine, image), the live nodes holding or fetching it, and per
        engine the live nodes that report their images at all."""
        body = {"images": [{"engine": e, "image": i} for e, i in images]}
        try:
            r = await self._http.post(f"{self.url}/images/where", json=body)
        except httpx.HTTPError as exc:
            raise RolloutError(f"POST /images/where: {type(exc).__name__}: {exc}") from None
        _raise_for(r)
        data: dict[str, Any] = r.json()
        return data

    async def drain_node(
        self, node_id: str, *, timeout_s: float | None = None, reason: str | None = None
    ) -> dict[str, Any]:
        """`POST /nodes/{id}/drain`: the node takes nothing new, hands back what has not started, lets what
        runs finish (cancelled after `timeout_s`, if given), then leaves."""
        body: dict[str, Any] = {"timeout_s": timeout_s}
        if reason is not None:
            body["reason"] = reason
        try:
            r = await self._http.post(f"{self.url}/nodes/{node_id}/drain", json=body)
        except httpx.HTTPError as exc:
            raise RolloutError(f"POST drain {node_id}: {type(exc).__name__}: {exc}") from None
        _raise_for(r)
        data: dict[str, Any] = r.json()
        return data

    async def node_lost(self, node_id: str, reason: str) -> dict[str, Any]:
        """`POST /nodes/{id}/lost`: the node is dead (a cluster manager says so); its open sessions end
        ERROR "node lost" with `reason` now. They are not re-run elsewhere."""
        try:
            r = await self._http.post(f"{self.url}/nodes/{node_id}/lost", json={"reason": reason})
        except httpx.HTTPError as exc:
            raise RolloutError(f"POST lost {node_id}: {type(exc).__name__}: {exc}") from None
        _raise_for(r)
        data: dict[str, Any] = r.json()
        return data

    async def cancel(self, task_id: str) -> bool:
        """Cancel a task group; False if it had already finished."""
        try:
            r = await self._http.delete(f"{self.url}/rollout/task/{task_id}")
        except httpx.HTTPError as exc:
            raise RolloutError(f"DELETE task {task_id}: {type(exc).__name__}: {exc}") from None
        _raise_for(r)
        self._ended(task_id)
        return bool(r.json()["cancelled"])

    # -- results ----------------------------------------------------------------------------------------
    async def results(self, task_ids: str | Iterable[str]) -> AsyncIterator[SessionResult]:
        """Each finished session of these tasks, in the order they finished, until all tasks ended."""
        ids = [task_ids] if isinstance(task_ids, str) else list(task_ids)
        cursor = 0
        while ids:
            page = await self._get(
                "/rollout/results",
                [("task", t) for t in ids] + [("after", cursor), ("wait", self.poll_wait_s)],
            )
            for item in page["results"]:
                yield SessionResult.model_validate(item)
            cursor = page["next"]
            ended = [t for t, state in page["tasks"].items() if state != "ACTIVE"]
            for t in ended:
                self._ended(t)
            if not page["results"] and len(ended) == len(ids):
                return

    async def run(self, tasks: Iterable[Task]) -> AsyncIterator[SessionResult]:
        """Submit `tasks` (keeping at most `max_in_flight` groups unfinished) and yield every session
        result as it completes. Cancelling the iteration leaves submitted tasks running on the server."""
        pending = list(tasks)
        watched: list[str] = []
        joined: list[str] = []  # submitted, not yet caught up
        arrived = asyncio.Event()
        seen: set[str] = set()
        cursor = 0

        async def feed() -> None:
            for task in pending:
                await self.submit(task)
                joined.append(task.task_id)
                arrived.set()

        def fresh(items: list[Any]) -> list[SessionResult]:
            out = [SessionResult.model_validate(item) for item in items]
            out = [r for r in out if r.session_id not in seen]
            seen.update(r.session_id for r in out)
            return out

        submitter = asyncio.create_task(feed())
        try:
            while True:
                if joined:
                    # A joining task may have results already, possibly behind `cursor` (which follows
                    # the other tasks): read its own from the start once, then it joins the long poll.
                    new, joined[:] = list(joined), []
                    after = 0
                    while True:
                        page = await self._get(
                            "/rollout/results", [*[("task", t) for t in new], ("after", after)]
                        )
                        for result in fresh(page["results"]):
                            yield result
                        if not page["results"]:
                            break
                        after = page["next"]
                    watched.extend(new)
                if not watched:
                    if submitter.done():
                        submitter.result()
                        return
                    arrived.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(1.0):
                            await arrived.wait()
                    continue
                wait = self.poll_wait_s if submitter.done() else min(self.poll_wait_s, 0.5)
                params = [*[("task", t) for t in watched], ("after", cursor), ("wait", wait)]
                page = await self._get("/rollout/results", params)
                for result in fresh(page["results"]):
                    yield result
                cursor = page["next"]
                for t, state in page["tasks"].items():
                    if state != "ACTIVE":
                        self._ended(t)
                if submitter.done():
                    submitter.result()  # a refused submission surfaces here
                    ended = all(state != "ACTIVE" for state in page["tasks"].values())
                    if not joined and not page["results"] and ended:
                        return
        finally:
            if not submitter.done():
                submitter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await submitter

    # -- sync wrappers ----------------------------------------------------------------------------------
    @classmethod
    def run_sync(cls, url: str, tasks: Iterable[Task], **kwargs: Any) -> list[SessionResult]:
        """Submit and wait for every result, from code without an event loop (scripts, notebooks)."""

        async def go() -> list[SessionResult]:
            async with cls(url, **kwargs) as client:
                return [r async for r in client.run(tasks)]

        return asyncio.run(go())
