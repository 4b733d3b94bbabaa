"""The weight-sync gate: pauses new generations and drains in-flight ones while a trainer swaps weights."""

from __future__ import annotations

import asyncio

from polar.metrics import BusyClock


class Gate:
    """Pauses new generations and drains in-flight ones while a trainer swaps the policy's weights."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.clock = BusyClock()  # calls in flight, and the seconds there was one (polar.gateway.metrics)
        self._idle = asyncio.Event()
        self._idle.set()
        # The weights the server generates with, as the trainer said when it resumed the gate; stamped on
        # records whose server reports no version (vLLM does not).
        self.policy_version: int | None = None

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    @property
    def in_flight(self) -> int:
        return self.clock.in_flight

    async def enter(self) -> None:
        await self._open.wait()
        self.clock.enter()
        self._idle.clear()

    def leave(self) -> None:
        self.clock.leave()
        if self.clock.in_flight == 0:
            self._idle.set()

    async def pause(self, drain_timeout_s: float | None = None) -> bool:
        """Stop admitting calls; True once every call in flight has finished (False on timeout)."""
        self._open.clear()
        try:
            async with asyncio.timeout(drain_timeout_s):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False

    def resume(self, policy_version: int | None = None) -> None:
        if policy_version is not None:
            self.policy_version = policy_version
        self._open.set()
