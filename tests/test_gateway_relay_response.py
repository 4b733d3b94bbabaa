"""`polar.gateway.relay.RelayResponse` on its own: the body sent from the caller's task while one task
watches for the client hanging up. A hang-up ends the body (its generator closed) and the response quietly;
a cancellation from elsewhere (the server shutting down) still propagates; either way the flight ends
exactly once. The end-to-end hang-up, through uvicorn and the fake vLLM, is in tests/test_gateway_streaming.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from polar.gateway.relay import Flight, RelayResponse


class Ends:
    """What `RelayResponse` needs of a `Flight`: `finish()`, counted."""

    def __init__(self) -> None:
        self.finished = 0

    def finish(self) -> None:
        self.finished += 1


class Body:
    """Two pieces, then waits on `more` for a third; records whether its generator was closed."""

    def __init__(self) -> None:
        self.more = asyncio.Event()
        self.closed = False

    async def __call__(self) -> AsyncIterator[bytes]:
        try:
            yield b"one"
            yield b"two"
            await self.more.wait()
            yield b"three"
        finally:
            self.closed = True


def response(body: Body, ends: Ends) -> RelayResponse:
    return RelayResponse(body(), cast(Flight, ends), media_type="text/event-stream")


class Client:
    """The ASGI side: `send` records the messages; `receive` says the client left once `leave` is set."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.leave = asyncio.Event()

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    async def receive(self) -> dict[str, Any]:
        await self.leave.wait()
        return {"type": "http.disconnect"}

    def bodies(self) -> list[tuple[bytes, bool]]:
        return [(m["body"], m["more_body"]) for m in self.sent if m["type"] == "http.response.body"]


async def test_a_whole_answer_is_sent_and_the_watcher_goes_away() -> None:
    body, ends, client = Body(), Ends(), Client()
    body.more.set()
    before = len(asyncio.all_tasks())
    await response(body, ends)({"type": "http"}, client.receive, client.send)
    assert client.sent[0]["type"] == "http.response.start" and client.sent[0]["status"] == 200
    assert client.bodies() == [(b"one", True), (b"two", True), (b"three", True), (b"", False)]
    await asyncio.sleep(0)  # the cancelled watcher runs its cancellation
    assert ends.finished == 1 and body.closed and len(asyncio.all_tasks()) == before


async def test_a_hang_up_ends_the_body_and_the_response_quietly() -> None:
    body, ends, client = Body(), Ends(), Client()
    task = asyncio.create_task(response(body, ends)({"type": "http"}, client.receive, client.send))
    while len(client.bodies()) < 2:
        await asyncio.sleep(0.001)
    client.leave.set()  # while the body waits for its third piece
    await asyncio.wait_for(task, 5)  # returns: no CancelledError out of the response
    assert not task.cancelled() and task.cancelling() == 0
    assert client.bodies() == [(b"one", True), (b"two", True)]  # no closing message to a gone client
    assert ends.finished == 1 and body.closed


async def test_a_cancellation_from_elsewhere_still_propagates() -> None:
    body, ends, client = Body(), Ends(), Client()
    task = asyncio.create_task(response(body, ends)({"type": "http"}, client.receive, client.send))
    while len(client.bodies()) < 2:
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ends.finished == 1 and body.closed


async def test_a_hang_up_after_the_last_piece_changes_nothing() -> None:
    body, ends, client = Body(), Ends(), Client()
    body.more.set()
    sent_last = client.send

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and not message["more_body"]:
            client.leave.set()  # the client goes as the closing message leaves
            await asyncio.sleep(0.01)  # and the watcher gets to run before the send returns
        await sent_last(message)

    await response(body, ends)({"type": "http"}, client.receive, send)
    assert client.bodies()[-1] == (b"", False) and ends.finished == 1
