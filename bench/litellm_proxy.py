"""LiteLLM's proxy beside the gateway in bench/gateway.py: its own venv, made on first use, and its config.

Pinned to 1.106.12: the newest releases on the package index (1.108 to 1.110) require `litellm-proxy` or
`litellm-proxy-extras` versions the index does not have, so their `[proxy]` extra does not install; 1.106.12
is the newest whose extra does.

Configured as close to the gateway as it offers (facts from LiteLLM 1.106.12's code and docs):
- one model `m` served by `hosted_vllm/m` at the fake backend, LiteLLM's provider for a vLLM server. With the
  `openai/` provider its `/v1/messages` route goes to the backend's Responses API, which neither vLLM's chat
  path nor the fake serves; `hosted_vllm` translates Anthropic calls to Chat Completions, as the gateway does.
- capture: `logprobs: true` and `return_token_ids` sent upstream on every call, and a custom callback
  (bench/litellm_capture.py) writing each call's logging payload to a JSON-lines file. For non-streamed
  calls that payload holds the messages, parameters, the answer with its logprobs, `prompt_token_ids` and
  the sampled `token_ids`; for streamed calls LiteLLM rebuilds the answer from the chunks and keeps text and
  usage only (no ids, no logprobs). It is written after the answer is sent (a success callback), not
  committed before it as the gateway's record is, and the client's answer carries the logprobs and ids too.
- a master key (one string compared per call: no database, no per-key budgets), no cooldowns (a backend
  error does not take the only deployment out), access logs off (`LITELLM_LOG=WARNING`, as the gateway
  runs with `--log-level warning`), the local model price list (`LITELLM_LOCAL_MODEL_COST_MAP`: no
  download attempt at start-up), one uvicorn worker (one process, as the gateway).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import orjson
from bench.processes import start

VERSION = "1.106.12"
VENV = Path.home() / ".cache" / "polar" / f"litellm-{VERSION}"
CAPTURE = Path(__file__).resolve().parent / "litellm_capture.py"


def install() -> Path | None:
    """The `litellm` command of its venv, made the first time (about a minute, 750 MB); None, with one line
    saying why, when pip cannot install it."""
    exe, ready = VENV / "bin" / "litellm", VENV / ".polar-ready"
    if ready.exists() and exe.exists():
        return exe
    print(
        f"bench: installing litellm[proxy]=={VERSION} into {VENV} (its own venv, ~750 MB, once)", flush=True
    )
    shutil.rmtree(VENV, ignore_errors=True)
    log = VENV.with_name(VENV.name + "-install.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        made = (
            subprocess.run([sys.executable, "-m", "venv", str(VENV)], stdout=out, stderr=out).returncode == 0
        )
        python = str(VENV / "bin" / "python")
        pip = [python, "-m", "pip", "install", "-q", f"litellm[proxy]=={VERSION}"]
        if not made or subprocess.run(pip, stdout=out, stderr=out).returncode != 0:
            print(f"bench: LiteLLM left out: pip could not install litellm[proxy]=={VERSION} (see {log})")
            return None
    ready.touch()
    return exe


def serve(exe: Path, backend: str, port: int, key: str, folder: Path) -> subprocess.Popen[bytes]:
    """LiteLLM's proxy on `port` in front of `backend`, capturing to `folder`/litellm.jsonl."""
    deployment = {
        "model": "hosted_vllm/m",
        "api_base": backend + "/v1",
        "api_key": "none",
        "logprobs": True,
        "extra_body": {"return_token_ids": True},
    }
    config = {
        "model_list": [{"model_name": "m", "litellm_params": deployment}],
        "litellm_settings": {"callbacks": "litellm_capture.handler"},
        "general_settings": {"master_key": key},
        "router_settings": {"disable_cooldowns": True},
    }
    (folder / "litellm.yaml").write_bytes(orjson.dumps(config))  # JSON is YAML
    shutil.copy(CAPTURE, folder / "litellm_capture.py")
    argv = [str(exe), "--config", str(folder / "litellm.yaml"), "--host", "127.0.0.1", "--port", str(port)]
    env = {
        "POLAR_BENCH_CAPTURE": str(folder / "litellm.jsonl"),
        "LITELLM_LOG": "WARNING",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    url = f"http://127.0.0.1:{port}"
    argv += ["--num_workers", "1"]
    return start(
        argv, url, env, pythonpath=str(folder), health="/health/liveliness", log=folder / "litellm.log"
    )
