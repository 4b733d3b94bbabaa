"""Weight sync against the real vLLM: the trainer's checkpoint goes in through vLLM's RL routes (pause,
`reload_weights`, reset the prefix cache, set the version, resume), the sync checks the server now scores a
fixed text as the trainer does, and the gateway records the next calls with the new policy version.

Found here: vLLM's CPU build (0.32) does not serve reloaded weights as it ships. `reload_weights` loads the
checkpoint, but linear layers run on weights prepacked at start-up (`dispatch_cpu_unquantized_gemm` keeps
them in a closure the layerwise reload does not replace), so the server keeps sampling from a mix of old and
new weights, silently. `scripts/install-vllm-cpu` installs a plugin that fixes it (contrib/vllm-cpu-reload);
the last test serves without it and proves the sync's check catches the stale weights (on CPUs where oneDNN
prepacks; see that test).

The session's server serves the tool-calling test model (`tests.vllm_support`); the default random-weight
model answers the same prompt very differently. Tests put the server's own weights back before they end.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from polar.store.records import CompletionRecord
from polar.train.packing import pack, response_logprobs
from polar.train.sync import GatewayGate, PartialSyncError, VLLMSync
from polar.train.trainer import Trainer, TrainerConfig
from tests.conftest import Gateway, start_gateway
from tests.vllm_support import ANSWER_TEXT, VLLMServer, start_vllm, tools_model_dir

pytestmark = pytest.mark.vllm

PROMPT = [{"role": "user", "content": "Pick a color for the logo."}]


async def ask(gw: Gateway, sid: str, **sampling: object) -> CompletionRecord:
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0) as client:
        await client.chat.completions.create(model="m", messages=PROMPT, max_tokens=12, **sampling)  # type: ignore[arg-type,call-overload]
    return gw.completions(sid)[-1]


def worst_gap(trainer: Trainer, rec: CompletionRecord) -> float:
    """The largest |recorded logprob - the trainer's teacher-forced one| over the record's tokens."""
    assert rec.prompt_ids and rec.response_ids and rec.response_logprobs
    batch = pack([(rec.prompt_ids, rec.response_ids)], len(rec.prompt_ids) + len(rec.response_ids))
    with torch.no_grad():
        mine = response_logprobs(trainer.model, batch, 1.0).tolist()
    return max(abs(a - b) for a, b in zip(mine, rec.response_logprobs, strict=True))


async def restore(server: VLLMServer) -> None:
    """The server's own weights back, unpaused (other tests share it)."""
    async with httpx.AsyncClient(timeout=300) as http:
        reload = {"method": "reload_weights", "kwargs": {"weights_path": str(server.model_dir)}}
        for path, body in (("/pause", None), ("/collective_rpc", reload), ("/reset_prefix_cache", None)):
            r = await http.post(f"{server.url}{path}", json=body)
            assert r.status_code == 200, r.text
        assert (await http.post(f"{server.url}/resume")).status_code == 200


async def is_paused(server: VLLMServer) -> bool:
    async with httpx.AsyncClient(timeout=30) as http:
        return bool((await http.get(f"{server.url}/is_paused")).json()["is_paused"])


async def test_sync_reloads_vllm_and_the_next_calls_are_sampled_from_the_new_weights(
    vllm_server: VLLMServer, tmp_path: Path
) -> None:
    gw = start_gateway(vllm_server.url, tmp_path, served_model=vllm_server.name)
    trainer = Trainer.load(TrainerConfig(device="cpu"))  # the default model: other weights than served
    gate = GatewayGate(gw.control_url, control_token=gw.control_token, timeout_s=60)
    sync = VLLMSync(vllm_server.url, tmp_path / "weights")
    try:
        sid = gw.new_session()
        greedy_before = await ask(gw, sid, temperature=0)
        assert greedy_before.policy_version is None  # nothing synced yet, and vLLM reports no version
        sampled_before = await ask(gw, sid, temperature=1.0, seed=7)
        assert worst_gap(trainer, sampled_before) > 1.0  # the check below can tell the weights apart

        async with gate.paused() as pause:
            await sync.push(trainer, 1)  # verified: the server scores the probe text as the trainer does
            pause.policy_version = 1
        assert not await is_paused(vllm_server)

        greedy_after = await ask(gw, sid, temperature=0)
        sampled_after = await ask(gw, sid, temperature=1.0, seed=7)
        assert greedy_after.response_ids != greedy_before.response_ids
        assert {greedy_after.policy_version, sampled_after.policy_version} == {1}
        # What vLLM now samples from is the trainer's model (bf16 server, fp32 trainer).
        assert worst_gap(trainer, sampled_after) < 0.1
        assert [p.name for p in (tmp_path / "weights").iterdir()] == ["v1"]
    finally:
        await gate.aclose()
        await sync.aclose()
        gw.server.stop()
        await restore(vllm_server)
    gw = start_gateway(vllm_server.url, tmp_path, served_model=vllm_server.name)
    try:  # its own weights again
        again = await ask(gw, gw.new_session(), temperature=0)
        assert again.response_message["content"] == ANSWER_TEXT
    finally:
        gw.server.stop()


@pytest.fixture(scope="module")
def vllm_as_shipped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """The CPU build without the reload plugin (a second server, for one test). Not started on a CPU
    without AVX-512: oneDNN prepacks only where it has AVX-512 kernels, and computes on the weights in
    place elsewhere, where the shipped build reloads correctly (measured on an AVX2-only AMD EPYC,
    2026-12-02, by the test below, which then skipped after a server start of 70-146 s)."""
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    if "avx512f" not in flags:
        pytest.skip("no AVX-512 on this CPU: vLLM's CPU build as shipped reloads weights correctly here")
    server = start_vllm(tools_model_dir(), tmp_path_factory.mktemp("vllm-shipped"), reload_plugin=False)
    try:
        yield server
    finally:
        server.stop()


async def test_a_reload_the_server_does_not_serve_fails_the_sync_and_stays_paused(
    vllm_as_shipped: VLLMServer, tmp_path: Path
) -> None:
    """The default model pushed to the CPU build as it ships: the check finds the server still scoring the
    probe text its old way, pauses it again and fails the sync, so no rollout samples from it.

    Whether the shipped build keeps stale weights depends on the CPU: oneDNN prepacks the linear weights into
    its own layout where it has AVX-512 kernels, and computes on them in place where it has not (an AMD EPYC
    with AVX2 only, 2026-12-02: the shipped build reloads correctly). Where the sync passes, the test
    samples from the server to tell which: a server that serves the trainer's weights means nothing was
    stale to catch (skipped); one that does not means the check missed stale weights (fails)."""
    trainer = Trainer.load(TrainerConfig(device="cpu"))
    sync = VLLMSync(vllm_as_shipped.url, tmp_path / "weights")
    try:
        try:
            await sync.push(trainer, 1)
        except PartialSyncError as failed:
            assert "does not serve the weights of version 1" in str(failed)
            assert list(failed.failed) == [vllm_as_shipped.url] and failed.synced == ()
            assert await is_paused(vllm_as_shipped)
            return
    finally:
        await sync.aclose()
    gw = start_gateway(vllm_as_shipped.url, tmp_path, served_model=vllm_as_shipped.name)
    try:
        sampled = await ask(gw, gw.new_session(), temperature=1.0, seed=7)
    finally:
        gw.server.stop()
    assert worst_gap(trainer, sampled) < 0.1, "the sync passed while the server samples from other weights"
    pytest.skip("vLLM's CPU build as shipped reloads weights correctly on this CPU: nothing stale to catch")
