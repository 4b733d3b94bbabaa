"""The polar servers start or say why in one line: `polar gateway`, `node`, `serve` and `serve-model`, run
as a user runs them, with a port in use, a backend down, a model that is not here, a token that cannot be
read. Each is one line on stderr naming the problem, exit status 2, no traceback, and nothing of uvicorn's
start-up log before a bind error.

Was: a 15-line uvicorn traceback with the useful line buried (the backend down); "Application startup
complete" and then the bind error (a port in use); 48 s of retried Hugging Face requests, each warning
printed twice, before the error (a model offline).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from polar.serving import free_port
from tests.server_support import TOKEN

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "POLAR_TOKEN": TOKEN}


def polar(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "polar", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**ENV, **(env or {})},
    )


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The single line a server that cannot start prints (and nothing else), with exit status 2."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out and "startup complete" not in out, out
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and not proc.stdout.strip(), out
    return lines[0]


@pytest.fixture
def taken() -> Iterator[int]:
    """A port another process listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_gateway_port_in_use(taken: int, tmp_path: Path) -> None:
    common = ["gateway", "--backend", "http://127.0.0.1:9", "--model", "m", "--store", str(tmp_path / "g.db")]
    proc = polar(*common, "--port", str(taken), "--control-port", "0")
    assert one_line(proc) == f"polar gateway: port {taken} on 127.0.0.1 is in use (another polar gateway?)"
    proc = polar(*common, "--port", "0", "--control-port", str(taken))
    assert (
        one_line(proc)
        == f"polar gateway: control port {taken} on 127.0.0.1 is in use (another polar gateway?)"
    )
    assert not (tmp_path / "g.db").exists()  # bound first: the store was never opened


def test_gateway_backend_down_without_model(tmp_path: Path) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    proc = polar(
        "gateway", "--backend", down, "--port", "0", "--control-port", "0", "--store", str(tmp_path / "g.db")
    )
    assert one_line(proc) == (
        f"polar gateway: could not list the backend's models (inference server unreachable at {down}); "
        "pass --model"
    )


def test_serve_and_node_port_in_use(taken: int, tmp_path: Path) -> None:
    proc = polar("serve", "--port", str(taken), "--db", str(tmp_path / "s.db"))
    assert one_line(proc) == f"polar serve: port {taken} on 127.0.0.1 is in use (another polar serve?)"
    proc = polar(
        "node",
        "--backend",
        "http://127.0.0.1:9",
        "--model",
        "m",
        "--port",
        "0",
        "--control-port",
        str(taken),
        "--store",
        str(tmp_path / "n.db"),
    )
    assert one_line(proc) == f"polar node: control port {taken} on 127.0.0.1 is in use (another polar node?)"


def test_serve_database_and_token_problems(tmp_path: Path) -> None:
    proc = polar("serve", "--port", "0", "--db", str(tmp_path / "no" / "such" / "dir" / "s.db"))
    assert (
        one_line(proc)
        == f"polar serve: {tmp_path / 'no' / 'such' / 'dir' / 's.db'}: unable to open database file"
    )
    missing = tmp_path / "token"
    proc = polar("serve", "--port", "0", "--db", str(tmp_path / "s.db"), "--token-file", str(missing))
    assert one_line(proc) == f"polar serve: {missing}: cannot read the token file: No such file or directory"


def test_serve_model_port_in_use(taken: int) -> None:
    proc = polar("serve-model", "--port", str(taken))  # said before the model is loaded
    assert (
        one_line(proc)
        == f"polar serve-model: port {taken} on 127.0.0.1 is in use (another polar serve-model?)"
    )


def test_serve_model_offline_fails_at_once(tmp_path: Path) -> None:
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}  # an empty cache
    proc = polar("serve-model", "polar-tests/no-such-model", "--port", "0", env=env)
    assert one_line(proc) == (
        "polar serve-model: polar-tests/no-such-model is not a local folder and not in the Hugging Face cache "
        f"({tmp_path / 'hf' / 'hub'}), and HF_HUB_OFFLINE is set: download it first, or pass a local folder"
    )
    folder = tmp_path / "models" / "mine"
    proc = polar("serve-model", str(folder), "--port", "0", env=env)
    assert one_line(proc) == f"polar serve-model: {folder}: no such file or folder"


def test_run_with_its_backend_down(tmp_path: Path) -> None:
    """`polar run` starts a gateway in-process: the same one line when it cannot."""
    taskfile = tmp_path / "tasks.yaml"
    taskfile.write_text("task_id: a\ninstruction: x\nagent: {harness: shell, settings: {command: 'true'}}\n")
    down = f"http://127.0.0.1:{free_port()}"
    for model in ([], ["--model", "m"]):  # was, with --model: every session ERROR, exit 0
        proc = polar("run", str(taskfile), "--backend", down, *model, "--out", str(tmp_path / "out"))
        # Checked before anything starts: one line, exit 2, no output folder made.
        assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr
        assert proc.stderr.strip().splitlines() == [
            f"polar run: --backend {down}: inference server unreachable at {down}"
        ]
        assert proc.stdout == "" and not (tmp_path / "out").exists()


def test_serve_model_on_a_device_that_is_not_here() -> None:
    """Was: torch's AssertionError traceback ("Torch not compiled with CUDA enabled")."""
    proc = polar("serve-model", "--device", "cuda:99", "--port", "0")
    assert one_line(proc).startswith("polar serve-model: cannot load the default model: device 'cuda:99': ")


@pytest.mark.parametrize("fake", ["openai", "vllm-without-token-ids"])
def test_gateway_refuses_a_backend_without_token_data(fake: str, tmp_path: Path) -> None:
    """An OpenAI-compatible server declared `vllm` (the default kind), or a vLLM that ignores
    `return_token_ids`, would make a whole run of untrainable records: one test call at start-up finds out."""
    from tests.fakes.fake_vllm import make_fake_backend
    from tests.fakes.server import serve

    app = make_fake_backend("openai") if fake == "openai" else make_fake_backend("vllm", no_token_ids=True)
    with serve(app) as srv:
        common = ["gateway", "--backend", srv.url, "--model", "fake-policy", "--port", "0"]
        proc = polar(*common, "--control-port", "0", "--store", str(tmp_path / "g.db"))
        line = one_line(proc)
        assert line.startswith(f"polar gateway: the vllm server at {srv.url} answered without token data (")
        assert "(no prompt ids, no sampled ids, no logprobs)" in line and line.endswith(
            "pass --backend-kind openai to serve it anyway"
        )
        # Declared on purpose, the same server is served (records flagged untrainable, as documented).
        served = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "polar",
                *common,
                "--control-port",
                "0",
                "--backend-kind",
                "openai",
                "--store",
                str(tmp_path / "o.db"),
            ],
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        try:
            assert served.stderr is not None
            for text in served.stderr:
                if "gateway serving" in text:
                    break
            else:
                raise AssertionError(f"polar gateway exited with {served.wait()}")
        finally:
            served.terminate()
            served.wait(timeout=30)
