"""Runs never destroy results: `polar run`/`generate` into a folder holding an earlier run resume it (finished
sessions kept, unfinished ones run, results.jsonl appended), `--overwrite` replaces it, and Ctrl-C stops
cleanly with a summary and exit status 130. Real subprocesses, a real server, node and gateway."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from tests.conftest import SERVED_MODEL
from tests.node_support import CALL_GATEWAY, alive, fake_policy, pids_under
from tests.server_support import interruptible, wait_until

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
SESSION_LINE = re.compile(r"^\[\d+/\d+\] (\S+) sample (\d): (\w+) reward (\S+) in [\d.]+s", re.M)


def polar(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "polar", *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


def say(task_id: str, command: str, *, on_host: bool = False) -> dict[str, Any]:
    """A task running `command`; the caller script next to the task file is uploaded into the sandbox as
    `call_gateway.py` (as a user ships a harness program). `on_host`: the command coordinates with the
    test through host files, which only the trusted `local` runtime sees."""
    runtime: dict[str, Any] = {"backend": "local"} if on_host else {}
    if "call_gateway.py" in command and not on_host:
        runtime["prepare"] = [{"type": "upload", "src": "call_gateway.py", "dst": "call_gateway.py"}]
    return {
        "task_id": task_id,
        "instruction": "say something",
        "num_samples": 2,
        "timeout_seconds": 120,
        "runtime": runtime,
        "agent": {"harness": "shell", "settings": {"command": command}},
        "evaluator": {"strategy": "session_completed"},
    }


def write_tasks(path: Path, tasks: list[dict[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump({"tasks": tasks}))
    return path


def results(out: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in (out / "results.jsonl").read_bytes().splitlines()]


def open_sessions(out: Path) -> int:
    with sqlite3.connect(out / "server.db") as db:
        terminal = "('COMPLETED', 'TIMEOUT', 'ERROR', 'CANCELLED')"
        return int(db.execute(f"SELECT COUNT(*) FROM sessions WHERE status NOT IN {terminal}").fetchone()[0])


def test_a_second_run_resumes_and_overwrite_replaces(tmp_path: Path) -> None:
    caller = tmp_path / "call_gateway.py"
    caller.write_text(CALL_GATEWAY)
    call = f"{sys.executable} call_gateway.py 2"
    taskfile = write_tasks(tmp_path / "tasks.yaml", [say("say-0", call), say("say-1", call)])
    out = tmp_path / "out"
    with fake_policy() as (url, backend):
        argv = ["run", str(taskfile), "--backend", url, "--model", SERVED_MODEL, "--out", str(out)]
        first = polar(*argv)
        assert first.returncode == 0, first.stdout + first.stderr
        assert f"new run in {out}: 4 sessions" in first.stdout
        # stdout is a pipe, not a terminal: one line per finished session, as it finishes
        lines = SESSION_LINE.findall(first.stdout)
        assert sorted((t, s, st, r) for t, s, st, r in lines) == [
            ("say-0", "0", "COMPLETED", "1.00"),
            ("say-0", "1", "COMPLETED", "1.00"),
            ("say-1", "0", "COMPLETED", "1.00"),
            ("say-1", "1", "COMPLETED", "1.00"),
        ]
        kept = (out / "results.jsonl").read_bytes()
        calls = len(backend.requests)
        assert len(results(out)) == 4 and calls == 8

        # The same command again: everything finished, so nothing runs and nothing is lost.
        again = polar(*argv)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "all 4 sessions finished earlier; nothing to run" in again.stdout
        assert (out / "results.jsonl").read_bytes() == kept and len(backend.requests) == calls
        assert "say-1" in again.stdout  # the summary covers the kept sessions

        # A task added to the file: the earlier sessions are kept, the new ones run and are appended.
        write_tasks(taskfile, [say("say-0", call), say("say-1", call), say("say-2", call)])
        more = polar(*argv)
        assert more.returncode == 0, more.stdout + more.stderr
        assert "4 of 6 sessions finished earlier (kept), 2 to run" in more.stdout
        assert (out / "results.jsonl").read_bytes().startswith(kept)
        assert [r["task_id"] for r in results(out)[4:]] == ["say-2", "say-2"]
        assert len({r["session_id"] for r in results(out)}) == 6

        # A task that changed cannot be resumed: refused in one line, nothing touched.
        write_tasks(taskfile, [say("say-0", call + " # changed"), say("say-1", call), say("say-2", call)])
        before = (out / "results.jsonl").read_bytes()
        changed = polar(*argv)
        assert changed.returncode == 2 and "Traceback" not in changed.stderr
        assert "task say-0" in changed.stderr and "differs in agent" in changed.stderr
        assert "--overwrite" in changed.stderr
        assert (out / "results.jsonl").read_bytes() == before

        # --overwrite is the one way to replace the run.
        replaced = polar(*argv, "--overwrite")
        assert replaced.returncode == 0, replaced.stdout + replaced.stderr
        assert f"overwrote {out} (removed results.jsonl, server.db, gateway.db)" in replaced.stdout
        fresh = results(out)
        assert len(fresh) == 6 and not {r["session_id"] for r in fresh} & {
            orjson.loads(line)["session_id"] for line in before.splitlines()
        }


def test_files_without_server_state_are_not_replaced(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.jsonl").write_text('{"session_id": "s"}\n')
    taskfile = write_tasks(tmp_path / "tasks.yaml", [say("t", "true")])
    with fake_policy() as (url, _):
        proc = polar("run", str(taskfile), "--backend", url, "--out", str(out))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "holds results.jsonl but no server.db to resume from" in proc.stderr
    assert (out / "results.jsonl").read_text() == '{"session_id": "s"}\n'


def test_ctrl_c_keeps_what_finished_and_a_resume_runs_the_rest(tmp_path: Path) -> None:
    caller = tmp_path / "call_gateway.py"
    caller.write_text(CALL_GATEWAY)
    flag, marks = tmp_path / "go-on", tmp_path / "started"
    # The slow task's sessions wait until `flag` exists: forever in the first run, not in the second.
    slow = f"echo $$ >> {marks}; test -f {flag} || sleep 601; {sys.executable} {caller} 1"  # 601: its own
    quick = f"{sys.executable} {caller} 1"
    taskfile = write_tasks(
        tmp_path / "tasks.yaml", [say("quick", quick, on_host=True), say("slow", slow, on_host=True)]
    )
    out = tmp_path / "out"
    with fake_policy() as (url, _):
        argv = [sys.executable, "-m", "polar", "run", str(taskfile), "--backend", url]
        argv += ["--model", SERVED_MODEL, "--out", str(out)]
        stdout, stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
        with open(stdout, "w") as so, open(stderr, "w") as se:
            proc = subprocess.Popen(argv, stdout=so, stderr=se, env=ENV, preexec_fn=interruptible)
            try:

                def ready() -> bool:
                    assert proc.poll() is None, stderr.read_text()
                    done = (out / "results.jsonl").is_file() and len(results(out)) == 2
                    return done and marks.is_file() and len(marks.read_text().split()) == 2

                wait_until(ready, timeout=120, what="the quick sessions to finish, the slow ones to run")
                # The slow agents' sleeps, by host pid (`$$` inside a session is its PID namespace's own).
                sleepers = wait_until(
                    lambda: (
                        len(found := pids_under(Path(tempfile.gettempdir()), "sleep", "601")) >= 2 and found
                    ),
                    what="the slow agents' sleeps",
                )
                proc.send_signal(signal.SIGINT)
                code = proc.wait(timeout=120)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        printed, errors = stdout.read_text(), stderr.read_text()
        assert code == 130, printed + errors
        assert "Traceback" not in errors and "Aborted" not in printed + errors
        assert len(SESSION_LINE.findall(printed)) == 2  # a line per session, though stdout is a file
        assert "interrupted: cancelled the running sessions; nothing finished was lost" in printed
        assert f"kept 2 of 4 sessions in {out / 'results.jsonl'} (2 finished by this run)" in printed
        assert "2 sessions left: run the same command again to resume them" in printed
        kept = (out / "results.jsonl").read_bytes()
        assert [r["task_id"] for r in results(out)] == ["quick", "quick"]
        for pid in sleepers:  # the agents were stopped, not left behind
            deadline = time.monotonic() + 10
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not alive(pid)

        flag.touch()
        resumed = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=ENV)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        assert "2 of 4 sessions finished earlier (kept), 2 to run" in resumed.stdout
    assert (out / "results.jsonl").read_bytes().startswith(kept)
    every = results(out)
    assert sorted(r["task_id"] for r in every) == ["quick", "quick", "slow", "slow"]
    assert len({r["session_id"] for r in every}) == 4
    assert all(r["status"] == "COMPLETED" for r in every)
    assert sorted(r["metadata"]["sample_index"] for r in every if r["task_id"] == "slow") == [0, 1]
    assert open_sessions(out) == 0


def test_generate_resumes_and_rewrites_its_data_from_every_session(tmp_path: Path) -> None:
    caller = tmp_path / "call_gateway.py"
    caller.write_text(CALL_GATEWAY)
    taskfile = write_tasks(tmp_path / "tasks.yaml", [say("g", f"{sys.executable} call_gateway.py 1")])
    out = tmp_path / "gen"
    with fake_policy() as (url, backend):
        argv = ["generate", str(taskfile), "--backend", url, "--model", SERVED_MODEL, "--out", str(out)]
        first = polar(*argv, "--format", "jsonl")
        assert first.returncode == 0, first.stdout + first.stderr
        kept, messages = (out / "results.jsonl").read_bytes(), (out / "messages.jsonl").read_bytes()
        assert len(kept.splitlines()) == 2 and len(messages.splitlines()) == 2
        again = polar(*argv, "--format", "jsonl")
        assert again.returncode == 0, again.stdout + again.stderr
        assert "nothing to run" in again.stdout and len(backend.requests) == 2
    assert (out / "results.jsonl").read_bytes() == kept
    assert len((out / "messages.jsonl").read_bytes().splitlines()) == 2


@pytest.mark.slow  # the shipped example with the embedded engine: a minute or two
def test_the_readme_command_twice_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "polar-run"
    argv = ["run", str(ROOT / "examples" / "tasks.yaml"), "--out", str(out)]
    first = polar(*argv, timeout=900)
    assert first.returncode == 0, first.stdout + first.stderr
    kept = (out / "results.jsonl").read_bytes()
    ids = [r["session_id"] for r in results(out)]
    assert len(ids) == len(set(ids)) == 10
    again = polar(*argv, timeout=900)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "Traceback" not in again.stderr
    assert "all 10 sessions finished earlier; nothing to run" in again.stdout
    assert (out / "results.jsonl").read_bytes() == kept
    assert "repair-moving-average" in again.stdout  # the summary table of the kept results


def test_sessions_the_infrastructure_failed_are_retried_by_a_plain_rerun(tmp_path: Path) -> None:
    """Was: a session that ended ERROR counted as finished, the run exited 0, and running the same command
    again said "nothing to run": only --overwrite (losing every good result) got out of it."""
    caller = tmp_path / "call_gateway.py"
    caller.write_text(CALL_GATEWAY)
    fixed = tmp_path / "fixed"
    # Until `fixed` exists, the harness command cannot start (exit 127): the node's infrastructure error.
    broken = f"test -f {fixed} || exit 127; {sys.executable} {caller} 1"
    good = f"{sys.executable} {caller} 1"
    taskfile = write_tasks(
        tmp_path / "tasks.yaml", [say("good", good, on_host=True), say("broken", broken, on_host=True)]
    )
    out = tmp_path / "out"
    with fake_policy() as (url, _):
        argv = ["run", str(taskfile), "--backend", url, "--model", SERVED_MODEL, "--out", str(out)]
        first = polar(*argv)
        assert first.returncode == 3, first.stdout + first.stderr
        assert "Traceback" not in first.stderr
        assert (
            "2 of 4 sessions ended in an infrastructure failure, not the policy's doing "
            "(2x harness command failed to start): fix it and run the same command again to retry just those"
        ) in first.stderr
        kept = (out / "results.jsonl").read_bytes()
        good_ids = {r["session_id"] for r in results(out) if r["task_id"] == "good"}

        fixed.touch()
        again = polar(*argv)
        assert again.returncode == 0, again.stdout + again.stderr
        assert (
            "2 of 4 sessions finished earlier (kept), 2 to run (2 after an infrastructure failure: run again)"
        ) in again.stdout
        # Only the failed ones ran again, under new ids; the failed attempts' lines stay in results.jsonl.
        every = results(out)
        assert (out / "results.jsonl").read_bytes().startswith(kept) and len(every) == 6
        retried = every[4:]
        assert {r["task_id"] for r in retried} == {"broken"}
        assert sorted(r["metadata"]["sample_index"] for r in retried) == [0, 1]
        assert all(r["status"] == "COMPLETED" for r in retried)
        assert not {r["session_id"] for r in retried} & {r["session_id"] for r in every[:4]}
        assert good_ids <= {r["session_id"] for r in every}

        third = polar(*argv)  # nothing failed now: nothing runs
        assert third.returncode == 0 and "all 4 sessions finished earlier; nothing to run" in third.stdout
    assert open_sessions(out) == 0


def test_sigterm_stops_a_run_as_ctrl_c_does(tmp_path: Path) -> None:
    """A batch system's or service manager's stop (SIGTERM, then SIGKILL after a grace period) used to kill
    `polar run` at once: running sessions' containers left until the next node start, nothing said. Now it
    is a Ctrl-C: the agents are stopped, what finished is kept, and the exit status is 143."""
    marks = tmp_path / "started"
    taskfile = write_tasks(
        tmp_path / "tasks.yaml", [say("slow", f"echo $$ >> {marks}; sleep 607", on_host=True)]
    )  # 607: no other test's sleep, which `pids_under` would find too
    out = tmp_path / "out"
    with fake_policy() as (url, _):
        argv = [sys.executable, "-m", "polar", "run", str(taskfile), "--backend", url]
        argv += ["--model", SERVED_MODEL, "--out", str(out)]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        try:
            wait_until(
                lambda: marks.is_file() and len(marks.read_text().split()) == 2,
                timeout=120,
                what="both sessions to run",
            )
            sleepers = wait_until(
                lambda: len(found := pids_under(Path(tempfile.gettempdir()), "sleep", "607")) >= 2 and found,
                what="the agents' sleeps",
            )
            proc.send_signal(signal.SIGTERM)
            printed, errors = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 143, printed + errors
    assert "Traceback" not in errors
    assert "interrupted: cancelled the running sessions; nothing finished was lost" in printed
    assert "2 sessions left: run the same command again to resume them" in printed
    assert open_sessions(out) == 2  # left to the next run, not lost
    for pid in sleepers:  # the agents were stopped, not left behind
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid)


def test_ctrl_c_twice_is_as_clean_as_once(tmp_path: Path) -> None:
    """Was: a second Ctrl-C while the first one's cleanup ran (a few seconds) raised KeyboardInterrupt
    inside that cleanup: ~190 lines of traceback, and what it had not cleaned up was left behind."""
    marks = tmp_path / "started"
    taskfile = write_tasks(
        tmp_path / "tasks.yaml", [say("slow", f"echo $$ >> {marks}; sleep 600", on_host=True)]
    )
    out = tmp_path / "out"
    with fake_policy() as (url, _):
        argv = [sys.executable, "-m", "polar", "run", str(taskfile), "--backend", url]
        argv += ["--model", SERVED_MODEL, "--out", str(out)]
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, preexec_fn=interruptible
        )
        try:
            wait_until(
                lambda: marks.is_file() and len(marks.read_text().split()) == 2,
                timeout=120,
                what="both sessions to run",
            )
            proc.send_signal(signal.SIGINT)
            time.sleep(0.05)  # the first press's cleanup has begun
            proc.send_signal(signal.SIGINT)
            printed, errors = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 130, printed + errors
    assert "Traceback" not in errors and "KeyboardInterrupt" not in errors
    assert errors.count("polar: stopping (cancelling what runs, keeping what finished)") == 1, errors
    assert "interrupted: cancelled the running sessions; nothing finished was lost" in printed
    assert "2 sessions left: run the same command again to resume them" in printed
    assert open_sessions(out) == 2  # left to the next run, not lost
