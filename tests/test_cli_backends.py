"""`--backend` repeated (or `@FILE`) on the commands, run as a user runs them, against fake vLLM servers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson

from polar.serving import free_port
from tests.conftest import SERVED_MODEL
from tests.fakes.fake_vllm import FakeInferenceServer, make_fake_backend
from tests.fakes.server import serve
from tests.node_support import caller_task, run_taskfile
from tests.server_support import AUTH, TOKEN

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "POLAR_TOKEN": TOKEN, "COLUMNS": "160"}


def polar(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "polar", *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


@contextlib.contextmanager
def two_fakes(**faults: Any) -> Iterator[list[tuple[str, FakeInferenceServer]]]:
    with contextlib.ExitStack() as stack:
        out = []
        for _ in range(2):
            app = make_fake_backend("vllm", **{"model": SERVED_MODEL, **faults})
            out.append((stack.enter_context(serve(app)).url, app))
        yield out


def test_gateway_serves_from_every_backend_given(tmp_path: Path) -> None:
    port, control = free_port(), free_port()
    with two_fakes() as fakes:
        (url_a, app_a), (url_b, app_b) = fakes
        listing = tmp_path / "backends.txt"
        listing.write_text(f"# the second server\n{url_b}  # on loopback\n\n")
        cmd = [sys.executable, "-m", "polar", "gateway", "--backend", url_a, "--backend", f"@{listing}"]
        cmd += ["--model", SERVED_MODEL, "--port", str(port), "--control-port", str(control)]
        cmd += ["--store", str(tmp_path / "gw.db")]
        proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            base, ctl = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{control}"
            deadline = time.monotonic() + 120
            while True:  # started: the control listener answers
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{ctl}/health").status_code == 200:
                        break
                assert time.monotonic() < deadline, "the gateway did not start"
                time.sleep(0.1)
            for i in range(4):
                sid = httpx.post(f"{ctl}/sessions", headers=AUTH, json={}).json()["session_id"]
                for turn in range(2):
                    r = httpx.post(
                        f"{base}/v1/chat/completions",
                        headers={"authorization": f"Bearer {sid}"},
                        json={
                            "model": SERVED_MODEL,
                            "messages": [{"role": "user", "content": f"{i} {turn}"}],
                        },
                        timeout=60,
                    )
                    assert r.status_code == 200, r.text
            state = httpx.get(f"{ctl}/backends", headers=AUTH).json()["backends"]
            assert [b["url"] for b in state] == [url_a, url_b]
            assert all(b["healthy"] and b["calls"] == 4 for b in state)
            for app in (app_a, app_b):  # two sessions each, both calls of a session on one server
                firsts = [r["messages"][0]["content"].split()[0] for r in app.requests]
                assert len(firsts) == 4 and len(set(firsts)) == 2
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)


def test_gateway_refuses_backends_serving_different_models(tmp_path: Path) -> None:
    with serve(make_fake_backend("vllm", model="m1")) as a, serve(make_fake_backend("vllm", model="m2")) as b:
        proc = polar(
            "gateway", "--backend", a.url, "--backend", b.url, "--port", "0", "--control-port", "0",
            "--store", str(tmp_path / "g.db"),
        )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (
        f"polar gateway: the inference servers do not serve the same model: {a.url} serves ['m1'], "
        f"{b.url} serves ['m2']"
    )


def test_backend_list_mistakes_are_usage_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n")
    for args, message in [
        (["--backend", f"@{tmp_path / 'missing.txt'}"], "No such file or directory"),
        (["--backend", f"@{empty}"], "names no server URL"),
        (["--backend", "http://a:1", "--backend", "http://a:1"], "names a server twice: http://a:1"),
        (["--backend", "a:1"], "'a:1' is not an http(s) URL"),
    ]:
        proc = polar("gateway", *args, "--model", "m", "--store", str(tmp_path / "g.db"))
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_run_spreads_sessions_over_every_backend(tmp_path: Path) -> None:
    task = caller_task("say", f"{sys.executable} call.py 2", instruction="say something twice", num_samples=4)
    taskfile = run_taskfile(tmp_path, task)
    out = tmp_path / "out"
    with two_fakes() as fakes:
        (url_a, app_a), (url_b, app_b) = fakes
        proc = polar(
            "run", str(taskfile), "--backend", url_a, "--backend", url_b, "--model", SERVED_MODEL,
            "--out", str(out),
        )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [orjson.loads(line) for line in (out / "results.jsonl").read_bytes().splitlines()]
    assert len(results) == 4 and all(r["status"] == "COMPLETED" for r in results)
    assert len(app_a.requests) + len(app_b.requests) == 8
    for app in (app_a, app_b):
        assert app.requests, "every server served sessions"
        # each session's second call went where its first did
        turns = [len(r["messages"]) for r in app.requests]
        assert turns.count(1) == turns.count(3), turns
