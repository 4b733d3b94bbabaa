"""A cancel that arrives as the scheduler is woken ends the scheduler (Python 3.11's `asyncio.wait_for`
returned the woken wait's result instead, swallowing the cancel, so `aclose` waited forever)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from polar.rollout.server import ServerConfig
from polar.rollout.server.service import RolloutService
from tests.server_support import FAST, TOKEN


@pytest.mark.asyncio
async def test_cancel_in_the_same_tick_as_a_wake_ends_the_scheduler(tmp_path: Path) -> None:
    service = RolloutService(ServerConfig(db_path=tmp_path / "server.db", token=TOKEN, **FAST))
    service.start()
    try:
        await asyncio.sleep(0.05)  # the loop waits on its wake event
        loop = service._loop
        assert loop is not None
        service.wake()
        await asyncio.sleep(0)  # the event's waiter has finished; the scheduler has not resumed yet
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(loop, 5)
    finally:
        await service.aclose()
