"""`polar serve-model` with no model serves the offline default as a real process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.fakes.server import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_serve_model_default_answers_chat() -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "polar", "serve-model", "--port", str(port), "--max-model-len", "1024"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve-model did not come up"
            time.sleep(0.2)
        model = httpx.get(url + "/v1/models").json()["data"][0]
        assert model["id"] == "tiny-qwen3-v2" and model["max_model_len"] == 1024
        body = httpx.post(
            url + "/v1/chat/completions",
            json={
                "model": model["id"],
                "messages": [{"role": "user", "content": "hi"}],
                "return_token_ids": True,
            },
            timeout=60,
        ).json()
        # No max_tokens: the tiny model's documented default cap applies (it never stops by itself).
        assert len(body["choices"][0]["token_ids"]) == 256
        assert body["choices"][0]["finish_reason"] == "length"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
