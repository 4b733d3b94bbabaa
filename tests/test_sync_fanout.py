"""Weight sync over several vLLM servers (`polar.train.sync.VLLMSync`), against fake vLLM servers with its
dev-mode routes: every server is paused, reloaded, versioned and resumed; one that fails a step is left
paused and named while the others are resumed, and the training loop takes it out of the gateway's rotation
before the gateway resumes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from polar.gateway.backends.base import BackendOptions
from polar.gateway.config import GatewayConfig
from polar.train.loop import LoopConfig, TrainLoop
from polar.train.sync import GatewayGate, PartialSyncError, VLLMSync
from polar.train.trainer import Trainer
from tests.conftest import SERVED_MODEL, serve_gateway
from tests.fakes.fake_vllm import FakeInferenceServer, make_fake_backend
from tests.fakes.server import serve
from tests.node_support import shell_task

ROUTES = ["/pause", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume"]


class _Saver:
    def save_pretrained(self, path: Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "model.safetensors").write_bytes(b"weights")


class StubTrainer:
    """What a sync reads of a trainer: something to save, and the step count."""

    model = tokenizer = _Saver()
    step_count = 1

    def save_weights(self, folder: Path) -> Path:
        self.model.save_pretrained(folder)
        return folder


TRAINER = cast(Trainer, StubTrainer())


@contextlib.contextmanager
def fakes(*fail_routes: str | None, **faults: Any) -> Iterator[list[tuple[str, FakeInferenceServer]]]:
    with contextlib.ExitStack() as stack:
        out = []
        for fail in fail_routes:
            app = make_fake_backend("vllm", fail_route=fail, **faults)
            out.append((stack.enter_context(serve(app)).url, app))
        yield out


async def test_sync_pauses_reloads_and_resumes_every_server(tmp_path: Path) -> None:
    with fakes(None, None, None, delay_s=0.5) as servers:
        url0, app0 = servers[0]
        async with httpx.AsyncClient(timeout=60) as client:
            in_flight = asyncio.create_task(
                client.post(
                    f"{url0}/v1/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                )
            )
            while app0.calls == 0:  # the call has reached the server
                await asyncio.sleep(0.01)
            sync = VLLMSync([u for u, _ in servers], tmp_path / "sync", verify=False)
            await sync.push(TRAINER, 1)
            # pause?mode=wait let the call in flight finish first
            assert in_flight.done() and in_flight.result().status_code == 200
            await sync.push(TRAINER, 2)
            await sync.aclose()
    target = str((tmp_path / "sync" / "v2").resolve())
    for _, app in servers:
        assert [c[0] for c in app.control_calls] == ROUTES * 2
        assert app.control_calls[0][1] == {"mode": "wait"}
        assert app.weights_path == target and app.weight_version == "2" and not app.paused
    assert [p.name for p in (tmp_path / "sync").iterdir()] == ["v2"]


async def test_a_server_that_fails_stays_paused_and_the_others_resume(tmp_path: Path) -> None:
    with fakes(None, "/collective_rpc", None, "/pause") as servers:
        sync = VLLMSync([u for u, _ in servers], tmp_path / "sync", verify=False)
        with pytest.raises(PartialSyncError) as info:
            await sync.push(TRAINER, 3)
        await sync.aclose()
    err = info.value
    (ok_a, app_a), (bad_rpc, app_rpc), (ok_c, app_c), (bad_pause, app_pause) = servers
    assert err.synced == (ok_a, ok_c) and set(err.failed) == {bad_rpc, bad_pause}
    message = str(err)
    assert (
        "failed on 2 of 4 server(s), not resumed" in message
        and "the other 2 resumed with version 3" in message
    )
    assert f"{bad_rpc}/collective_rpc: HTTP 500" in message and f"{bad_pause}/pause: HTTP 500" in message
    for app in (app_a, app_c):
        assert [c[0] for c in app.control_calls] == ROUTES and not app.paused
        assert app.weight_version == "3"
    # half-loaded weights never serve: no version, no resume
    assert [c[0] for c in app_rpc.control_calls] == ["/pause", "/collective_rpc"] and app_rpc.paused
    assert [c[0] for c in app_pause.control_calls] == ["/pause"]
    assert app_rpc.weight_version is None


async def test_the_loop_takes_a_failed_server_out_of_the_gateways_rotation(tmp_path: Path) -> None:
    with fakes(None, "/collective_rpc") as servers:
        (ok, app_ok), (bad, app_bad) = servers
        gw = serve_gateway(
            GatewayConfig(
                backend_urls=(ok, bad),
                served_model=SERVED_MODEL,
                store_path=tmp_path / "gw.db",
                backend=BackendOptions(retries=0, timeout_s=30.0),
            )
        )
        try:
            gate = GatewayGate(gw.control_url, control_token=gw.control_token, timeout_s=5)
            sync = VLLMSync([ok, bad], tmp_path / "sync", verify=False)
            loop = TrainLoop(
                [shell_task("true")], TRAINER, cast(Any, None), gate, sync, cast(Any, None), LoopConfig()
            )
            _, drained = await loop._sync()
            assert drained and loop.version == 1
            state = {b["url"]: b for b in gw.control("GET", "/backends").json()["backends"]}
            assert state[bad]["enabled"] is False and state[ok]["enabled"] is True
            assert gw.control("GET", "/health").json()["paused"] is False
            async with httpx.AsyncClient(timeout=60) as client:
                for _ in range(4):  # the paused server would hold these
                    sid = gw.new_session()
                    r = await client.post(
                        f"{gw.url}/v1/chat/completions",
                        headers={"authorization": f"Bearer {sid}"},
                        json={"model": SERVED_MODEL, "messages": [{"role": "user", "content": "hi"}]},
                    )
                    assert r.status_code == 200
            assert len(app_ok.requests) == 4 and app_bad.requests == []
            # every server failing: nothing serves the new weights, and the loop stops
            app_ok.set(fail_route="/collective_rpc")
            with pytest.raises(PartialSyncError, match="no server resumed"):
                await loop._sync()
            assert gw.control("GET", "/health").json()["paused"] is False  # the gate always resumes
            await gate.aclose()
            await sync.aclose()
        finally:
            gw.server.stop()


def test_train_config_takes_one_server_or_a_list() -> None:
    from pydantic import ValidationError

    from polar.train.config import TrainConfig

    tasks = [{"task_id": "t", "instruction": "x"}]
    assert TrainConfig(tasks=tasks, backend="http://a:8000/").backend == "http://a:8000"
    both = TrainConfig(tasks=tasks, backend=["http://a:8000", "http://b:8000/"]).backend
    assert both == ["http://a:8000", "http://b:8000"]
    for bad in (["http://a:8000", "http://a:8000/"], [], ["a:8000"], "vllm"):
        with pytest.raises(ValidationError):
            TrainConfig(tasks=tasks, backend=bad)
