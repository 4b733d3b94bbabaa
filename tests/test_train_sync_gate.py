"""The trainer's hold on the gateway's gate (`GatewayGate.paused`) never outlives it: a cancel (Ctrl-C) while
the pause still waits for calls in flight resumes the gateway. Was: the gateway stayed paused, and the
harnesses' next calls waited at its gate until their own timeout (`polar train` took 120 s to stop after
Ctrl-C, and left a subprocess transport to a closed loop: a traceback at exit)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from polar.gateway.backends.base import BackendOptions
from polar.gateway.config import GatewayConfig
from polar.train.sync import GatewayGate, SyncError
from tests.conftest import SERVED_MODEL, serve_gateway
from tests.fakes.fake_vllm import make_fake_backend
from tests.fakes.server import serve


def _paused(gw: object) -> bool:
    return bool(gw.control("GET", "/health").json()["paused"])  # type: ignore[attr-defined]


async def test_a_cancel_while_the_pause_drains_resumes_the_gateway(tmp_path: Path) -> None:
    fake = make_fake_backend("vllm", delay_s=3.0)  # a call in flight that the pause waits for
    with serve(fake) as backend:
        gw = serve_gateway(
            GatewayConfig(
                backend_url=backend.url,
                served_model=SERVED_MODEL,
                store_path=tmp_path / "gw.db",
                backend=BackendOptions(retries=0, timeout_s=30.0),
            )
        )
        try:
            sid = gw.new_session()
            async with httpx.AsyncClient(timeout=60) as client:
                call = asyncio.ensure_future(
                    client.post(
                        f"{gw.url}/v1/chat/completions",
                        headers={"authorization": f"Bearer {sid}"},
                        json={"model": SERVED_MODEL, "messages": [{"role": "user", "content": "hi"}]},
                    )
                )
                while gw.control("GET", "/health").json().get("in_flight", 0) == 0 and not call.done():
                    await asyncio.sleep(0.02)  # until the call is in flight at the gateway
                gate = GatewayGate(gw.control_url, control_token=gw.control_token, timeout_s=30)

                async def hold() -> None:
                    async with gate.paused():
                        raise AssertionError("the pause cannot answer while the call is in flight")

                holder = asyncio.ensure_future(hold())
                while not _paused(gw):  # the gateway paused; the pause request still drains
                    await asyncio.sleep(0.02)
                holder.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await holder
                assert not _paused(gw)
                assert (await call).status_code == 200
                await gate.aclose()
        finally:
            gw.server.stop()


async def test_a_failed_pause_still_resumes_and_raises_the_failure(tmp_path: Path) -> None:
    gate = GatewayGate("http://127.0.0.1:9", control_token="x" * 32, timeout_s=1)
    with pytest.raises(SyncError, match="admin/pause"):
        async with gate.paused():
            pass
    await gate.aclose()
