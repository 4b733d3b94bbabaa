"""The pieces behind "runs never destroy results" (`polar.rollout.rundir`, `ServerStore.requeue_orphans`):
results.jsonl is append-only and survives a torn write, one process owns a folder, sessions a dead local
node held go back to the queue under new ids."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from polar.rollout.protocol import SessionResult, SessionStatus
from polar.rollout.rundir import ResultsFile, RunDirError, locked, remove
from polar.rollout.server.store import ServerStore
from polar.task import Task


def result(session_id: str) -> SessionResult:
    return SessionResult(session_id=session_id, task_id="t", status=SessionStatus.COMPLETED, reward=1.0)


def test_results_file_appends_each_session_once_and_cuts_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    with ResultsFile(path) as sink:
        assert sink.append(result("a")) and sink.append(result("b")) and not sink.append(result("a"))
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"session_id": "c", "task_id": "t", "sta')  # killed mid-write
    again = ResultsFile(path)
    assert again.session_ids == {"a", "b"} and path.read_bytes() == whole
    with again:
        assert again.append(result("c")) and not again.append(result("b"))
    assert [orjson.loads(line)["session_id"] for line in path.read_bytes().splitlines()] == ["a", "b", "c"]


def test_one_process_owns_a_folder(tmp_path: Path) -> None:
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, fcntl; f = open(sys.argv[1], 'a+'); f.write('4242'); f.flush();"
         "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()", str(out / ".polar.lock")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    out.mkdir()
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirError, match=r"in use by another polar process \(pid 4242\)"), locked(out):
            pass
    finally:
        holder.kill()
        holder.wait()
    with locked(out), locked(out):  # re-entrant in one process: a run's CLI, then its local stack
        pass


def test_remove_takes_only_the_named_files_and_sqlite_sidecars(tmp_path: Path) -> None:
    for name in ("server.db", "server.db-wal", "notes.txt"):
        (tmp_path / name).write_text("x")
    (tmp_path / "checkpoints" / "step-1").mkdir(parents=True)
    assert remove(tmp_path, ("server.db", "checkpoints", "gateway.db")) == ["server.db", "checkpoints"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_orphans_of_a_dead_local_node_are_requeued_under_new_ids(tmp_path: Path) -> None:
    store = ServerStore(tmp_path / "server.db")
    task = Task(task_id="t", instruction="x", num_samples=3)
    store.add_tasks([(task, ["s0", "s1", "s2"])])
    for sid in ("s0", "s1"):
        assert store.claim(sid, "node-a") is not None
    store.set_stage("s1", SessionStatus.RUNNING)
    store.finish(result("s0").model_copy(update={"node_id": "node-a"}), None, None)
    fresh = iter(["n1", "n2"])
    assert store.requeue_orphans(lambda: next(fresh)) == 1  # s1 only: s0 finished, s2 never left
    rows = {s.sample_index: s for s in store.sessions_of("t")}
    assert rows[0].session_id == "s0" and rows[0].status == SessionStatus.COMPLETED
    assert rows[1].session_id == "n1" and rows[1].status == SessionStatus.REGISTERED
    assert rows[1].node_id is None and rows[1].attempts == 0
    assert rows[2].session_id == "s2" and store.session("s1") is None
    store.close()
