"""A session's processes die with its node, however the node dies. A node killed with SIGKILL runs no
cleanup, so what it started must die by other means: the PID namespace of each command (local through
`unshare --kill-child` under `setpriv --pdeathsig`, bwrap through `--die-with-parent`) takes every process
along, daemons that left their process group with `setsid` included. Where no namespace can be made, the
node's direct child dies by its parent-death signal and the next node start kills the rest, from the
process groups the dead node recorded."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from polar.rollout.protocol import SessionStatus
from polar.runtime import bridge
from tests.conftest import SERVED_MODEL
from tests.node_support import fake_policy, pids_under, running_node, shell_task, spec, until

# A node in its own process: submits one session running COMMAND, prints "submitted", then serves on.
_NODE = """
import asyncio, sys
from pathlib import Path
from polar.gateway.config import GatewayConfig
from polar.rollout.node import Node, NodeConfig
from polar.rollout.protocol import SessionSpec
from polar.task import Task

backend_url, root, backend, network, command, records = sys.argv[1:7]
if records:  # a machine where namespaces are forbidden; groups recorded where the test looks
    from polar.runtime import leftovers, namespaces
    namespaces.probe = lambda: "namespaces disabled by the test"
    leftovers.records_dir = lambda: Path(records)

async def main() -> None:
    gateway = GatewayConfig(backend_url=backend_url, served_model=sys.argv[7], store_path=Path(root) / "node.db", port=0)
    node = Node(NodeConfig(gateway=gateway, runtime_root=Path(root) / "runtimes", node_id="doomed"))
    await node.start()
    task = Task.model_validate({"task_id": "t", "instruction": "x", "timeout_seconds": 600,
                                "runtime": {"backend": backend, "network": network},
                                "agent": {"harness": "shell", "settings": {"command": command}}})
    await node.submit(SessionSpec(session_id="orphan-maker", task=task))
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
    """Whatever a failing test leaves behind is killed (never a stray sleeper on a shared machine)."""
    yield
    for pid in pids_under(tmp_path / "runtimes"):
        if pid != os.getpid():
            os.kill(pid, signal.SIGKILL)


def _start_node(
    url: str, tmp_path: Path, backend: str, network: str, command: str, records: str
) -> subprocess.Popen[str]:
    script = tmp_path / "node_main.py"
    script.write_text(_NODE)
    argv = [sys.executable, str(script), url, str(tmp_path), backend, network, command, records, SERVED_MODEL]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "submitted"
    return proc


def _sleepers(runtimes: Path) -> list[int]:
    return pids_under(runtimes, "sleep", "3601") + pids_under(runtimes, "sleep", "3602")


@pytest.mark.usefixtures("cleanup")
@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_node_killed_with_sigkill_leaves_no_harness_process(tmp_path: Path, backend: str) -> None:
    runtimes = tmp_path / "runtimes"
    # a background child, a daemon that left the process group, and the harness's own shell
    command = "sleep 3601 & setsid sleep 3602 & wait"
    with fake_policy() as (url, _):
        node = _start_node(url, tmp_path, backend, "gateway", command, "")
        try:
            await until(lambda: len(_sleepers(runtimes)) == 2, "the run", 60)
        finally:
            node.kill()
            node.wait()
    await until(lambda: not pids_under(runtimes), "every process of the session to die", 60)


@pytest.mark.usefixtures("cleanup")
async def test_without_namespaces_the_next_node_start_reaps_what_a_killed_node_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from polar.runtime import leftovers

    runtimes, records = tmp_path / "runtimes", tmp_path / "records"
    monkeypatch.setattr(leftovers, "records_dir", lambda: records)
    with fake_policy() as (url, _):
        node = _start_node(url, tmp_path, "local", "host", "(sleep 3603 & wait) & wait", str(records))
        try:
            await until(lambda: bool(pids_under(runtimes, "sleep", "3603")), "the harness to run", 60)
        finally:
            node.kill()
            node.wait()
        orphans = pids_under(runtimes, "sleep", "3603")
        assert orphans, "without a PID namespace the grandchild outlives its node"
        assert list(records.iterdir())  # its process group was recorded by the dead node
        async with running_node(url, tmp_path) as again:  # the node restarts: same store, same runtime root
            await until(
                lambda: not pids_under(runtimes, "sleep", "3603"), "the next node start to reap it", 60
            )
            await again.submit(spec(shell_task("true", runtime={"network": "host"}), "after"))
            assert (await again.wait("after")).status == SessionStatus.COMPLETED
    assert not list(records.iterdir())


def test_a_restarted_node_removes_the_bridge_sockets_a_killed_one_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node.start removes gateway-bridge directories nobody serves any more (old enough that none is
    being set up right now); a live bridge stays."""
    monkeypatch.setattr(bridge, "_DIR", str(tmp_path))
    live = bridge.UnixBridge("127.0.0.1", 9)
    live.start()
    dead, young = tmp_path / "polar-gw-dead", tmp_path / "polar-gw-young"
    for folder in (dead, young):
        folder.mkdir()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.bind(str(folder / "gw.sock"))  # left behind: the file stays, nothing listens
    for folder in (dead, live.socket_path.parent):
        os.utime(folder, (0, 0))
    try:
        assert bridge.remove_stale_bridges(min_age_s=60) == 1
        assert not dead.exists() and young.exists() and live.socket_path.exists()
    finally:
        live.close()
