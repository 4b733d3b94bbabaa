"""`polar dashboard RUN_DIR`: a run's dashboard after the run ended. Was: the `dashboard:` link of `polar run`
died with the run, and `polar dashboard` showed training curves only. A real `polar run` (real server, node,
gateway and sandbox, a fake policy), then the real command serving its folder, read over HTTP."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import yaml

from polar.serving import free_port
from tests.conftest import SERVED_MODEL
from tests.node_support import CALL_GATEWAY, fake_policy
from tests.server_support import AUTH, TOKEN, wait_until


def test_a_finished_run_is_browsed_from_its_folder(tmp_path: Path) -> None:
    (tmp_path / "call_gateway.py").write_text(CALL_GATEWAY)
    task = {
        "task_id": "say",
        "instruction": "say something",
        "num_samples": 2,
        "runtime": {"prepare": [{"type": "upload", "src": "call_gateway.py", "dst": "call_gateway.py"}]},
        "agent": {"harness": "shell", "settings": {"command": f"{sys.executable} call_gateway.py 2"}},
        "evaluator": {"strategy": "session_completed"},
    }
    (tmp_path / "tasks.yaml").write_text(yaml.safe_dump(task))
    out = tmp_path / "out"
    env = {**os.environ, "POLAR_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"}
    with fake_policy() as (url, _):
        argv = [sys.executable, "-m", "polar", "run", str(tmp_path / "tasks.yaml"), "--backend", url]
        done = subprocess.run(
            [*argv, "--model", SERVED_MODEL, "--out", str(out)],
            capture_output=True,
            text=True,
            env=env,
            timeout=180,
        )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "browse them: " in done.stdout and f" dashboard {out}\n" in done.stdout  # polar, or its path

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "polar", "dashboard", str(out), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                return httpx.get(f"{base}/ui/", headers=AUTH).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, timeout=60, what="the dashboard to serve")
        with httpx.Client(base_url=base, headers=AUTH) as client:
            overview = client.get("/ui/").text
            assert "say" in overview
            task_page = client.get("/ui/tasks/say").text
            sessions = sorted(set(re.findall(r"/ui/sessions/([\w-]+)", task_page)))
            assert len(sessions) == 2, task_page
            for sid in sessions:
                records = client.get(f"/ui/sessions/{sid}", params={"tab": "completions"}).text
                assert "No gateway records" not in records and "did not answer" not in records
                assert records.count('<details class="record"') == 2  # both calls of the session
                conversation = client.get(f"/ui/sessions/{sid}", params={"tab": "conversation"}).text
                assert "say something" in conversation and "more" in conversation
                tokens = client.get(f"/ui/sessions/{sid}", params={"tab": "tokens"})
                assert tokens.status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_folder_without_a_run_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "polar", "dashboard", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"{tmp_path} holds no server.db" in done.stderr
