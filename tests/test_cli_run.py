"""`polar run`: server, node and client in one process, against a policy on loopback."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from polar.store.sqlite import SQLiteStore
from tests.conftest import SERVED_MODEL
from tests.fakes.fake_vllm import Reply
from tests.judge_support import judge_config, scripted_judge
from tests.node_support import CALL_GATEWAY, caller_task, fake_policy, run_taskfile
from tests.server_support import interruptible, wait_until

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "160"}


def polar(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "polar", *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


@pytest.mark.parametrize("workers", [1, 2])
def test_run_executes_every_session_and_writes_results(tmp_path: Path, workers: int) -> None:
    """With --gateway-workers 2 the node's gateway runs on two processes over one store: every call is
    still recorded there, once."""
    # the caller arrives by an upload relative to the task file (the node may read its dir)
    tasks = [
        caller_task(
            f"say-{i}",
            f"{sys.executable} call.py 2",
            instruction="say something twice",
            metadata={"group_id": f"g{i}", "policy_version": 3},
        )
        for i in range(2)
    ]
    taskfile = run_taskfile(tmp_path, *tasks)
    out = tmp_path / "out"
    with fake_policy() as (url, backend):
        args = [
            "--backend",
            url,
            "--model",
            SERVED_MODEL,
            "--out",
            str(out),
            "--gateway-workers",
            str(workers),
        ]
        proc = polar("run", str(taskfile), *args, "--log-level", "info")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if workers > 1:  # the gateway's own start-up line: its per-worker model APIs
        assert re.search(r"per worker http://\S+, http://\S+\), control at .*; 2 workers", proc.stderr)
    lines = [orjson.loads(line) for line in (out / "results.jsonl").read_bytes().splitlines()]
    assert sorted(r["task_id"] for r in lines) == ["say-0", "say-0", "say-1", "say-1"]
    assert len({r["session_id"] for r in lines}) == 4  # each sample its own single-use session
    for r in lines:
        assert r["status"] == "COMPLETED" and r["reward"] == 1.0, r
        traj = r["trajectory"]
        assert traj["metadata"]["coverage"] == 1.0 and traj["metadata"]["calls"] == 2
        assert r["metadata"]["group_id"] in ("g0", "g1") and r["metadata"]["policy_version"] == 3
    with SQLiteStore(out / "gateway.db") as store:
        assert sum(len(store.completions(r["session_id"])) for r in lines) == 8 == len(backend.requests)
    assert "say-0" in proc.stdout and "results" in proc.stdout


@pytest.mark.slow  # loads the tiny model into the embedded engine and runs the whole stack
def test_run_render_gateway_on_the_embedded_engine_makes_each_session_one_trace(tmp_path: Path) -> None:
    """`polar run --render gateway` without --backend: the embedded engine (the tiny random policy, whose
    turns drift when re-rendered) and the gateway continuing each session's chain: three calls, one trace."""
    (tmp_path / "call.py").write_text(CALL_GATEWAY)
    task = {
        "task_id": "chat",
        "instruction": "say something",
        "timeout_seconds": 120,
        "runtime": {"prepare": [{"type": "upload", "src": "call.py", "dst": "call.py"}]},
        "agent": {"harness": "shell", "settings": {"command": f"{sys.executable} call.py 3"}},
        "evaluator": {"strategy": "session_completed"},
    }
    taskfile = tmp_path / "tasks.yaml"
    taskfile.write_text(yaml.safe_dump({"tasks": [task]}))
    out = tmp_path / "out"
    proc = polar("run", str(taskfile), "--render", "gateway", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = [orjson.loads(x) for x in (out / "results.jsonl").read_bytes().splitlines()]
    assert line["status"] == "COMPLETED" and line["trajectory"]["metadata"]["calls"] == 3
    assert len(line["trajectory"]["traces"]) == 1, line["trajectory"]["metadata"]
    with SQLiteStore(out / "gateway.db") as store:
        flags = [r.flags for r in store.completions(line["session_id"])]
    assert flags == [("render:gateway", "chain:first"), ("render:gateway",), ("render:gateway",)]
    bad = polar(
        "run",
        str(taskfile),
        "--render",
        "gateway",
        "--backend-kind",
        "openai",
        "--backend",
        "http://127.0.0.1:9",
    )
    assert bad.returncode == 2 and "--render gateway" in bad.stderr and "Traceback" not in bad.stderr


def test_run_refuses_a_bad_task_file_with_its_line(tmp_path: Path) -> None:
    taskfile = tmp_path / "tasks.yaml"
    taskfile.write_text("tasks:\n  - task_id: a\n    instruction: x\n    runtime:\n      backend: vm\n")
    proc = polar("run", str(taskfile), "--backend", "http://127.0.0.1:9", "--out", str(tmp_path / "o"))
    assert proc.returncode == 2
    assert f"{taskfile}:5: tasks[0].runtime.backend" in proc.stderr
    missing = polar("run", str(tmp_path / "nope.yaml"), "--backend", "http://127.0.0.1:9")
    assert missing.returncode != 0 and "nope.yaml" in missing.stderr


def test_ctrl_c_of_a_run_on_gateway_workers_stops_them_after_its_sessions(tmp_path: Path) -> None:
    """A terminal's Ctrl-C reaches the whole foreground process group. The gateway's workers run in a
    session of their own, so the node alone gets it: it cancels its sessions (closing them through the
    workers), then stops the workers. In the node's group they began draining at once and the node's
    SIGTERM reached their supervisor as a second signal: a traceback, and a worker left serving."""
    task = caller_task("wait", f"{sys.executable} call.py 1 && sleep 600", timeout_seconds=300)
    taskfile = run_taskfile(tmp_path, task)
    out = tmp_path / "out"
    with fake_policy() as (url, backend):
        argv = [
            sys.executable,
            "-m",
            "polar",
            "run",
            str(taskfile),
            "--backend",
            url,
            "--model",
            SERVED_MODEL,
        ]
        argv += ["--out", str(out), "--gateway-workers", "2"]
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
            preexec_fn=interruptible,
            start_new_session=True,  # its own group, as a terminal's foreground job: killpg reaches it all
        )
        try:
            wait_until(lambda: len(backend.requests) >= 2, timeout=120, what="both sessions' calls")
            supervisors = [p for p in children(proc.pid) if b"polar.cli.node_gateway" in cmdline(p)]
            assert len(supervisors) == 1, "the gateway's workers run as the node's child"
            tree = [*supervisors, *children(supervisors[0])]
            assert len(tree) == 3  # the supervisor and its 2 workers
            os.killpg(proc.pid, signal.SIGINT)
            stdout, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert proc.returncode == 130, stdout + stderr
    assert "Traceback" not in stderr, stderr
    assert "interrupted: cancelled the running sessions; nothing finished was lost" in stdout
    wait_until(lambda: not any(running(p) for p in tree), timeout=30, what="the gateway's processes to exit")
    with sqlite3.connect(out / "gateway.db") as db:  # each session's key closed through the workers
        closed = db.execute("SELECT id, closed_at FROM sessions").fetchall()
    assert len(closed) == 2 and all(at is not None for _, at in closed), closed


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (/proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def running(pid: int) -> bool:
    """Alive and not a zombie waiting for its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_run_refuses_gateway_workers_it_cannot_serve(tmp_path: Path) -> None:
    taskfile = tmp_path / "tasks.yaml"
    taskfile.write_text("tasks:\n  - task_id: a\n    instruction: x\n")
    none = polar("run", str(taskfile), "--backend", "http://127.0.0.1:9", "--gateway-workers", "0")
    assert none.returncode == 2 and "--gateway-workers" in none.stderr and "at least 1" in none.stderr
    assert "Traceback" not in none.stderr


def test_run_says_when_a_group_is_being_judged(tmp_path: Path) -> None:
    """A judge_group task's results wait for its group's judgement: with stdout not a terminal, `polar run`
    prints a line when the server starts judging the group, before the session lines it releases."""

    def slow_judge(body: dict[str, Any]) -> Reply:
        time.sleep(1.5)  # longer than the run's one-second look at the server's group phases
        labels = re.findall(r'<outcome id="(\d+)">', body["messages"][-1]["content"])
        return Reply(content=json.dumps({"reasoning": "alike", "scores": dict.fromkeys(labels, 6)}))

    with fake_policy() as (url, _backend), scripted_judge(slow_judge) as (judge_url, _judge):
        task = caller_task(
            "grouped",
            f'{sys.executable} call.py 1 && echo "by $POLAR_SESSION_ID" > a.md',
            instruction="sign it",
            evaluator={
                "strategy": "judge_group",
                "config": judge_config(judge_url, files=["a.md"], answer=False, repeats=1),
                "timeout_seconds": 60,
            },
        )
        taskfile = run_taskfile(tmp_path, task)
        out = tmp_path / "out"
        refused = polar("run", str(taskfile), "--backend", url, "--model", SERVED_MODEL, "--out", str(out))
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
        assert f"{taskfile}:13: tasks[0].evaluator.config.backend.url: '{judge_url}' is refused: " in (
            refused.stderr
        )  # the local server would refuse the loopback judge at submit: said at its line, nothing started
        assert not out.exists()
        argv = ["--backend", url, "--model", SERVED_MODEL, "--out", str(out), "--allow-callback", "127.0.0.1"]
        proc = polar("run", str(taskfile), *argv)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    said = [i for i, line in enumerate(lines) if line == "judging the group of grouped: 2 session(s)"]
    released = [i for i, line in enumerate(lines) if line.startswith("[") and " grouped sample " in line]
    assert len(said) == 1 and len(released) == 2 and said[0] < min(released), proc.stdout
    results = [orjson.loads(line) for line in (out / "results.jsonl").read_bytes().splitlines()]
    assert [r["reward"] for r in results] == [0.6, 0.6], results
