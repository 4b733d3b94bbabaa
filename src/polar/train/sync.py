"""Weight sync after each step: pause and drain the gateway, push the weights, resume.

The gateway gate (`POST /admin/pause?timeout=`, `POST /admin/resume`, see `polar.gateway.control`) holds
harness calls at the model boundary while the policy changes, so no call straddles two versions and agents
just see a slower answer. Two ways to push:

- `EngineSync`: the embedded engine in this process; `Engine.update_weights` copies the trainer's tensors
  (validated first, all or nothing), drains its own queue, and bumps `policy_version`, which every later
  response (and so every gateway record) carries.
- `VLLMSync`: one or several vLLM servers over HTTP. vLLM's RL routes are served with `VLLM_SERVER_DEV_MODE=1` (read:
  `vllm/entrypoints/rl/online/api_router.py` on main, and `serve/rlhf/api_router.py` in v0.16):
  `POST /pause?mode=wait` (finish in-flight requests), `POST /collective_rpc {"method": "reload_weights",
  "kwargs": {"weights_path": DIR}}` (every worker reloads the checkpoint folder the trainer just wrote; the
  same call NeMo RL's remote refit makes), `POST /reset_prefix_cache`, `POST /update_weight_version
  {"new_version": "N"}`, `POST /resume` (checked against vLLM 0.32 on CPU: tests/test_vllm_sync.py). The NCCL / CUDA-IPC data planes of
  vLLM's weight-transfer API need vLLM's own Python package on the trainer side, so the reference trainer
  goes through a checkpoint folder the server can read (same machine or shared storage). vLLM does not put
  a policy version on its responses: records from it carry none, and staleness falls back to the version
  a group was submitted at (task metadata `policy_version`).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from polar.auth import bearer
from polar.train.trainer import Trainer

if TYPE_CHECKING:
    from polar.engine.engine import Engine


class SyncError(RuntimeError):
    """A weight sync that failed; the message names the server, the route and its answer."""


class WeightSync(Protocol):
    # True when the policy server cannot serve rollouts until a first push (a LoRA adapter it loads by
    # name): the loop pushes version 0 before it submits anything.
    push_before_rollouts: bool

    async def push(self, trainer: Trainer, version: int) -> None: ...

    async def aclose(self) -> None: ...


async def _get(http: httpx.AsyncClient, url: str) -> httpx.Response:
    try:
        r = await http.get(url)
    except httpx.HTTPError as exc:
        raise SyncError(f"GET {url}: {type(exc).__name__}: {exc}") from None
    if r.status_code >= 400:
        raise SyncError(f"GET {url}: HTTP {r.status_code}: {r.text[:500]}")
    return r


async def _post(http: httpx.AsyncClient, url: str, **kwargs: Any) -> httpx.Response:
    try:
        r = await http.post(url, **kwargs)
    except httpx.HTTPError as exc:
        raise SyncError(f"POST {url}: {type(exc).__name__}: {exc}") from None
    if r.status_code >= 400:
        raise SyncError(f"POST {url}: HTTP {r.status_code}: {r.text[:500]}")
    return r


@dataclass
class PauseReport:
    drained: bool  # every call in flight finished before the timeout
    in_flight: int  # calls still running when the pause answered
    policy_version: int | None = None  # set once new weights serve: the gateway records calls with it


class GatewayGate:
    """The gateway's weight-sync gate, over its control plane."""

    def __init__(self, url: str, *, control_token: str, timeout_s: float = 600.0) -> None:
        """`url` is the gateway's control listener (not the model API harnesses call)."""
        self.url = url.rstrip("/")
        self._http = httpx.AsyncClient(headers=bearer(control_token), timeout=timeout_s + 30.0)
        self.timeout_s = timeout_s

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[PauseReport]:
        """Pause (waiting up to `timeout_s` for calls in flight), yield, and always resume; with the
        report's `policy_version` when the caller set it (the weights now served)."""
        report = PauseReport(False, 0)
        try:
            # The pause inside the `try`: it answers once calls in flight finished (up to `timeout_s`), and
            # a cancel meanwhile (Ctrl-C) left the gateway paused, so harnesses' calls waited at its gate
            # until their own timeout (`polar train` took 120 s to stop: tests/test_train_sync_gate.py).
            r = await _post(self._http, f"{self.url}/admin/pause", params={"timeout": self.timeout_s})
            body = r.json()
            report = PauseReport(bool(body.get("drained")), int(body.get("in_flight", 0)))
            yield report
        except BaseException:
            with contextlib.suppress(Exception):  # the error or the cancel that got here is the one to raise
                await _post(self._http, f"{self.url}/admin/resume", params=self._version(report))
            raise
        await _post(self._http, f"{self.url}/admin/resume", params=self._version(report))

    @staticmethod
    def _version(report: PauseReport) -> dict[str, int]:
        return {} if report.policy_version is None else {"policy_version": report.policy_version}

    async def set_backend(self, url: str, *, enabled: bool) -> None:
        """Take one of the gateway's inference servers out of rotation (or back in)."""
        await _post(self._http, f"{self.url}/admin/backends", json={"url": url, "enabled": enabled})

    async def aclose(self) -> None:
        await self._http.aclose()


class EngineSync:
    """Copy the trainer's weights into the embedded engine serving the rollouts (same process)."""

    push_before_rollouts = False

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def push(self, trainer: Trainer, version: int) -> None:
        state = trainer.state_dict()
        got = await self.engine.update_weights_async(state, version)
        if got != version:
            raise SyncError(f"the engine reports policy version {got} after an update to {version}")

    async def aclose(self) -> None:
        return None


class PartialSyncError(SyncError):
    """A sync that failed on some servers: `synced` serve the new weights and were resumed, `failed` (URL ->
    why) were left as they are (paused, maybe half-loaded) and must leave the gateway's rotation."""

    def __init__(self, version: int, synced: Sequence[str], failed: dict[str, str]) -> None:
        self.version, self.synced, self.failed = version, tuple(synced), dict(failed)
        why = "; ".join(failed.values())
        kept = f"the other {len(synced)} resumed with version {version}" if synced else "no server resumed"
        super().__init__(
            f"weight sync to version {version} failed on {len(failed)} of {len(failed) + len(synced)} "
            f"server(s), not resumed: {', '.join(failed)} ({why}); {kept}"
        )


class VLLMSync:
    """Push a checkpoint folder to one or several vLLM servers through their RL HTTP routes (see the module
    doc). Each step runs on every server at once, and a server that fails a step skips the rest: the others
    are resumed with the new weights, it is not (it may hold half-loaded weights, which must not serve),
    and `PartialSyncError` names it."""

    def __init__(
        self,
        url: str | Sequence[str],
        folder: Path,
        *,
        timeout_s: float = 600.0,
        verify: bool = True,
        adapter: str | None = None,
    ) -> None:
        """`verify`: after the reload, check that each server's logprobs of a fixed text are the trainer's
        own (`_served_gap`); a server that does not serve the new weights is paused again and fails.

        `adapter`: a LoRA trainer's adapter is loaded at runtime under this name instead of reloading the
        whole model (`POST /v1/load_lora_adapter`, `load_inplace`: megabytes instead of the model). The
        servers run with `--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`, and rollouts ask for
        the adapter by name, so it is pushed once before any rollout (`push_before_rollouts`)."""
        urls = [url] if isinstance(url, str) else list(url)
        if not urls:
            raise ValueError("VLLMSync needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.url = self.urls[0]
        self.verify = verify
        self.adapter = adapter
        self.push_before_rollouts = adapter is not None
        self.folder = folder  # where the weights are written; every server must be able to read it
        self._http = httpx.AsyncClient(timeout=timeout_s)

    async def push(self, trainer: Trainer, version: int) -> None:
        target = self.folder / f"v{version}"
        load: tuple[str, dict[str, Any]]
        if self.adapter is not None:
            await asyncio.to_thread(_write_adapter, trainer, target)
            body = {"lora_name": self.adapter, "lora_path": str(target.resolve()), "load_inplace": True}
            load = ("/v1/load_lora_adapter", {"json": body})
        else:
            await asyncio.to_thread(_write_weights, trainer, target)
            reload = {"method": "reload_weights", "kwargs": {"weights_path": str(target.resolve())}}
            load = ("/collective_rpc", {"json": reload})
        steps: list[tuple[str, dict[str, Any]]] = [
            # wait, not abort or keep: the gateway has drained its calls already, and a request still
            # running here (one the drain timed out on, or another client's) finishes on the weights it
            # started with. abort would fail it for its harness; keep would finish it on the new weights,
            # one sequence sampled from two policies.
            ("/pause", {"params": {"mode": "wait"}}),
            load,
            # The prefix cache holds KV computed by the old weights (`/pause`'s clear_cache is deprecated).
            ("/reset_prefix_cache", {}),
            ("/update_weight_version", {"json": {"new_version": str(version)}}),
            ("/resume", {}),
        ]
        live, failed = list(self.urls), {}
        for path, kwargs in steps:
            results = await asyncio.gather(
                *(_post(self._http, f"{url}{path}", **kwargs) for url in live), return_exceptions=True
            )
            for url, result in zip(live, results, strict=True):
                if isinstance(result, SyncError):
                    failed[url] = str(result)
                elif isinstance(result, BaseException):
                    raise result
            live = [url for url in live if url not in failed]
        if self.verify and live:
            for url in list(live):
                why = await self._check_served(url, trainer, version)
                if why is not None:
                    # The gateway is still paused: no rollout has been sampled from these weights.
                    await _post(self._http, f"{url}/pause", params={"mode": "abort"})
                    failed[url] = why
                    live.remove(url)
        if failed:
            raise PartialSyncError(version, live, failed)
        for old in self.folder.glob("v*"):  # keep only the weights being served
            if old != target and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _check_served(self, url: str, trainer: Trainer, version: int) -> str | None:
        """None when `url` scores `PROBE_TEXT` as the trainer does (mean |logprob difference| within
        VERIFY_TOLERANCE), else why not. A reload that silently leaves some weights as they were would
        otherwise label off-policy samples with the new version (seen: vLLM's CPU build 0.32 keeps its
        prepacked linear layers through `reload_weights`; docs/backends.md)."""
        # With the tokenizer's own special tokens: Gemma 3 scored without its BOS is lost (mean logprob -9
        # instead of -4 on PROBE_TEXT) and its bf16 server then differs from the fp32 trainer by 0.11 on
        # average, a false alarm; with BOS, 0.02 (measured with Gemma 3 270M on vLLM 0.32 CPU).
        ids = [int(i) for i in trainer.tokenizer.encode(PROBE_TEXT)]
        if self.adapter is not None:
            model = self.adapter
        else:
            model = (await _get(self._http, f"{url}/v1/models")).json()["data"][0]["id"]
        body = {
            "model": model,
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": 0,
        }
        got = (await _post(self._http, f"{url}/v1/completions", json=body)).json()
        try:
            served = [
                float(entry[str(tok)]["logprob"])
                for entry, tok in zip(got["choices"][0]["prompt_logprobs"][1:], ids[1:], strict=True)
            ]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            return f"{url}: /v1/completions gave no prompt logprobs to check the reload with ({exc!r})"
        mine = await asyncio.to_thread(trainer.logprobs, ids[:1], ids[1:])
        gap = sum(abs(a - b) for a, b in zip(mine, served, strict=True)) / len(mine)
        if gap > VERIFY_TOLERANCE:
            return (
                f"{url} does not serve the weights of version {version} after reload_weights: its logprobs "
                f"of a fixed text differ from the trainer's by {gap:.3f} on average (tolerance "
                f"{VERIFY_TOLERANCE})"
            )
        return None


# A fixed text both sides score after a reload; 0.1 nats on average is far above bf16-vs-fp32 rounding
# (0.006 on the test model) and far below what stale weights give (0.5 and more).
PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog, then writes a short Python function to sort a list."
)
VERIFY_TOLERANCE = 0.1


def _write_adapter(trainer: Trainer, target: Path) -> None:
    from polar.train.lora import is_lora

    if not is_lora(trainer.model):
        raise SyncError("adapter sync needs a LoRA trainer (the config's `lora:` section)")
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    trainer.model.save_pretrained(tmp)  # peft: adapter_config.json + adapter_model.safetensors only
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


def _write_weights(trainer: Trainer, target: Path) -> None:
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    trainer.save_weights(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)  # the server never sees a half-written folder
