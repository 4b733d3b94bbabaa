"""Hygiene (issue #24, point 6), each finding reproduced as it was measured on main: stores were created
0644 (their WAL files too), a node killed with SIGKILL left its sessions' directories behind for good, and
one completion id an inference server repeated turned a whole session into ERROR (fully masked: a way out of
a negative reward, if an agent ever found how to cause it)."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from polar.rollout.node.journal import Journal
from polar.rollout.protocol import SessionStatus
from polar.rollout.rundir import locked
from polar.rollout.server.store import ServerStore
from polar.store.sqlite import SQLiteStore
from tests.conftest import SERVED_MODEL
from tests.node_support import (
    PY,
    fake_policy,
    pids_under,
    running_node,
    shell_task,
    spec,
    until,
    write_caller,
)


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The usual umask, whatever the test runner's: files 0644 and directories 0755 unless polar says."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _modes(db: Path) -> dict[str, int]:
    """The database and its WAL files (they exist while a connection is open)."""
    return {p.name: _mode(p) for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm"))}


@pytest.mark.usefixtures("umask_022")
def test_every_store_and_its_wal_files_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    gateway, server, node = tmp_path / "gateway.db", tmp_path / "server.db", tmp_path / "node.db"
    with SQLiteStore(gateway):
        assert _modes(gateway) == {"gateway.db": 0o600, "gateway.db-wal": 0o600, "gateway.db-shm": 0o600}
    store = ServerStore(server)
    try:
        assert _modes(server) == {"server.db": 0o600, "server.db-wal": 0o600, "server.db-shm": 0o600}
    finally:
        store.close()
    journal = Journal(node)
    try:
        assert _modes(node) == {"node.db": 0o600, "node.db-wal": 0o600, "node.db-shm": 0o600}
    finally:
        journal.close()


@pytest.mark.usefixtures("umask_022")
def test_a_store_an_earlier_version_left_readable_is_made_private(tmp_path: Path) -> None:
    db = tmp_path / "gateway.db"
    sqlite3.connect(db).execute("CREATE TABLE t (x)").connection.close()
    assert _mode(db) == 0o644
    with SQLiteStore(db):
        assert set(_modes(db).values()) == {0o600}


@pytest.mark.usefixtures("umask_022")
def test_the_run_folder_polar_makes_for_its_stores_is_private(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "first"
    with locked(out):
        pass
    assert (_mode(tmp_path / "runs"), _mode(out)) == (0o700, 0o700)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    with locked(mine):  # one that exists is the operator's: left as it is
        pass
    assert _mode(mine) == 0o755


# A node in its own process: one session running COMMAND under RUNTIME; prints "submitted", serves on.
_NODE = """
import asyncio, sys
from pathlib import Path
from polar.gateway.config import GatewayConfig
from polar.rollout.node import Node, NodeConfig
from polar.rollout.protocol import SessionSpec
from polar.task import Task

backend_url, store, runtimes, backend, command, model = sys.argv[1:7]

async def main() -> None:
    gateway = GatewayConfig(backend_url=backend_url, served_model=model, store_path=Path(store), port=0)
    node = Node(NodeConfig(gateway=gateway, runtime_root=Path(runtimes), node_id="doomed"))
    await node.start()
    task = Task.model_validate({"task_id": "t", "instruction": "x", "timeout_seconds": 600,
                                "runtime": {"backend": backend},
                                "agent": {"harness": "shell", "settings": {"command": command}}})
    await node.submit(SessionSpec(session_id="doomed-session", task=task))
    print("submitted", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""

BACKENDS = [
    "local",
    pytest.param("bwrap", marks=pytest.mark.skipif(shutil.which("bwrap") is None, reason="no bubblewrap")),
]


@pytest.fixture
def cleanup(tmp_path: Path) -> Iterator[None]:
    """Whatever a failing test leaves running is killed (never a stray sleeper on a shared machine)."""
    yield
    for pid in pids_under(tmp_path / "runtimes"):
        if pid != os.getpid():
            os.kill(pid, signal.SIGKILL)


def _dirs(runtimes: Path, session: str) -> list[Path]:
    return [p for p in runtimes.glob(f"polar-{session}-*") if p.is_dir()]


@pytest.mark.usefixtures("cleanup")
@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_restarted_node_removes_the_session_directories_a_killed_one_left(
    tmp_path: Path, backend: str
) -> None:
    """The doomed node (its own process) is killed with SIGKILL while its session runs; a live node shares
    the runtime root and runs a session too. A node started next on that root removes the dead node's
    session directory and leaves the live one's."""
    runtimes = tmp_path / "runtimes"
    for folder in (runtimes, tmp_path / "live", tmp_path / "again"):
        folder.mkdir()
    task = shell_task("sleep 3606", runtime={"backend": backend})
    with fake_policy() as (url, _):
        argv = [
            PY,
            "-c",
            _NODE,
            url,
            str(tmp_path / "doomed.db"),
            str(runtimes),
            backend,
            "sleep 3605",
            SERVED_MODEL,
        ]
        doomed = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        try:
            assert doomed.stdout is not None and doomed.stdout.readline().strip() == "submitted"
            async with running_node(url, tmp_path / "live", runtime_root=runtimes) as live:
                await live.submit(spec(task, "live-session"))
                await until(
                    lambda: bool(pids_under(runtimes, "sleep", "3605")), "the doomed session to run", 60
                )
                await until(
                    lambda: bool(pids_under(runtimes, "sleep", "3606")), "the live session to run", 60
                )
                (left,) = _dirs(runtimes, "doomed-session")
                doomed.kill()
                doomed.wait()
                await until(
                    lambda: not pids_under(runtimes, "sleep", "3605"), "the doomed session to die", 60
                )
                assert left.exists()  # nothing removes it until a node starts
                async with running_node(url, tmp_path / "again", runtime_root=runtimes):
                    assert not left.exists()
                    assert len(_dirs(runtimes, "live-session")) == 1  # a live node's session is left alone
                    assert pids_under(runtimes, "sleep", "3606")
                await live.cancel("live-session")
                await live.wait("live-session")
        finally:
            if doomed.poll() is None:
                doomed.kill()
                doomed.wait()
    assert not list(runtimes.iterdir())  # the live node removed its own, claims included


async def test_an_inference_server_that_repeats_a_completion_id_fails_no_session(tmp_path: Path) -> None:
    """Every answer of the server carries the same id: the session still completes, its records have ids of
    the gateway's own (distinct), and each keeps the server's id as `upstream_id`."""
    caller = write_caller(tmp_path)
    with fake_policy() as (url, fake):
        fake.transform = lambda body: {**body, "id": "chatcmpl-repeated"}
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(shell_task(f"{PY} {caller} 3"), "same-ids"))
            result = await node.wait("same-ids")
    assert result.status == SessionStatus.COMPLETED, result.reason
    with SQLiteStore(tmp_path / "node.db") as store:
        records = store.completions("same-ids")
    assert [r.upstream_id for r in records] == ["chatcmpl-repeated"] * 3
    assert len({r.completion_id for r in records}) == 3
    assert result.trajectory is not None
