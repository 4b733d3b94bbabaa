"""BwrapRuntime with the real bubblewrap: read-only host, writable session dir, whole-tree kills through
the PID namespace, and a network where only the gateway answers (checked with the official openai SDK
against a real gateway)."""

from __future__ import annotations

import asyncio
import shutil
import socket
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import polar
from polar.rollout.node.lifecycle import runtime_spec
from polar.rollout.taskfile import TaskFileError, parse_tasks
from polar.runtime import RuntimeFailure, RuntimeSpec, make_runtime
from polar.runtime.bwrap import BwrapRuntime
from tests.conftest import Gateway
from tests.node_support import pids_under
from tests.test_runtime_local import _wait_gone

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap not installed (scripts/test installs it)"
)


@pytest.fixture
async def rt(tmp_path: Path) -> AsyncIterator[BwrapRuntime]:
    runtime = BwrapRuntime(RuntimeSpec(backend="bwrap", root=tmp_path), "b1", term_grace_s=0.3)
    await runtime.start()
    yield runtime
    await runtime.stop()


@pytest.fixture
def other_server() -> Iterator[int]:
    """A TCP server on the host's loopback that answers 'hello' (what the sandbox must not reach)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.sendall(b"hello")
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    yield port
    listener.close()


_CONNECT = (
    "import socket,sys\n"
    "try:\n"
    "    print(socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=3).recv(5).decode())\n"
    "except OSError as e:\n"
    "    print('refused', type(e).__name__)\n"
)


async def test_host_is_read_only_and_session_dir_writable(rt: BwrapRuntime, tmp_path: Path) -> None:
    host_tmp = Path("/tmp") / f"polar-host-only-{rt.session_dir.name}"
    host_tmp.write_text("x")
    r = await rt.exec(f"echo ok > here && cat here && test ! -e {host_tmp}")
    host_tmp.unlink()
    assert (r.exit_code, r.stdout) == (0, "ok\n"), r.stderr
    # polar's own sources are visible (the builtin harness runs from them), read-only
    host_dir = Path(polar.__file__).parent
    escape = host_dir / f"polar-escape-{rt.session_dir.name}"
    r = await rt.exec(f"test -f {host_dir}/__init__.py && echo x > {escape}")
    assert r.exit_code != 0 and "Read-only file system" in r.stderr
    assert not escape.exists()
    # the rest of the checkout (where a run's stores may live) is not visible at all
    r = await rt.exec(f"ls {Path(__file__).parent}")
    assert r.exit_code != 0 and "No such file or directory" in r.stderr
    r = await rt.exec(f"echo x > {tmp_path}/outside")  # lands in the sandbox's private /tmp
    assert not (tmp_path / "outside").exists()
    r = await rt.exec("touch /etc/polar-escape || mount -o remount,rw / ; touch /usr/polar-escape")
    assert r.exit_code != 0 and not Path("/etc/polar-escape").exists()
    assert not Path("/usr/polar-escape").exists()


async def test_env_cwd_stdin_exit_codes(rt: BwrapRuntime) -> None:
    (rt.workdir / "sub").mkdir()
    r = await rt.exec(
        ["sh", "-c", 'echo "$A $HOME $PWD"; cat; exit 5'], env={"A": "a"}, cwd="sub", stdin=b"in"
    )
    assert r.exit_code == 5
    # Every session's home and cwd are the same paths in the sandbox.
    assert r.stdout == "a /tmp/polar-session/home /tmp/polar-session/workspace/sub\nin"
    assert rt.runtime_path(rt.workdir / "sub") == "/tmp/polar-session/workspace/sub"


async def test_timeout_kills_the_sandbox_including_setsid_daemons(rt: BwrapRuntime) -> None:
    # setsid escapes a process group; it cannot escape the PID namespace
    r = await rt.exec("setsid sleep 100 & sleep 100 & echo ready; wait", timeout_s=0.5)
    assert r.timed_out and r.exit_code == 124 and r.stdout == "ready\n"
    await asyncio.sleep(0.2)
    assert await _wait_gone(_sleepers(rt)) == []


def _sleepers(rt: BwrapRuntime) -> list[int]:
    """Host pids of `sleep 100` processes working in this runtime's workdir (found by inode: inside the
    sandbox the directory has another path)."""
    return pids_under(rt.workdir, "sleep", "100")


async def test_cancel_during_exec(rt: BwrapRuntime) -> None:
    task = asyncio.create_task(rt.exec("setsid sleep 100 & sleep 100"))
    for _ in range(100):
        if len(_sleepers(rt)) == 2:
            break
        await asyncio.sleep(0.05)
    pids = _sleepers(rt)
    assert len(pids) == 2
    await rt.cancel()
    result = await asyncio.wait_for(task, 10)
    assert result.exit_code != 0
    assert await _wait_gone(pids) == []


async def test_read_only_paths_and_missing_ones(tmp_path: Path) -> None:
    shared = tmp_path / "shared"  # under /tmp, which the sandbox otherwise replaces with a tmpfs
    shared.mkdir()
    (shared / "tool").write_text("T")
    rt = BwrapRuntime(RuntimeSpec(backend="bwrap", root=tmp_path / "r", read_only_paths=(str(shared),)), "ro")
    await rt.start()
    r = await rt.exec(f"cat {shared}/tool; echo x > {shared}/new")
    assert r.stdout == "T" and "Read-only" in r.stderr
    await rt.stop()
    bad = BwrapRuntime(RuntimeSpec(backend="bwrap", root=tmp_path, read_only_paths=("/no/such",)), "ro")
    with pytest.raises(RuntimeFailure, match="read_only_paths"):
        await bad.start()


async def test_network_none_and_host(tmp_path: Path, other_server: int) -> None:
    for network, expected in (("none", "refused"), ("host", "hello")):
        rt = BwrapRuntime(RuntimeSpec(backend="bwrap", root=tmp_path, network=network), network)  # type: ignore[arg-type]
        await rt.start()
        r = await rt.exec([sys.executable, "-c", _CONNECT, str(other_server)])
        assert r.stdout.startswith(expected), (network, r.stdout, r.stderr)
        await rt.stop()


async def test_only_the_gateway_is_reachable(tmp_path: Path, gateway: Gateway, other_server: int) -> None:
    session = gateway.new_session()
    rt = make_runtime(RuntimeSpec(backend="bwrap", root=tmp_path), session, gateway_url=gateway.url)
    assert isinstance(rt, BwrapRuntime)
    gw_port = int(gateway.url.rsplit(":", 1)[1])
    assert rt.gateway_url == f"http://127.0.0.1:{gw_port}"
    await rt.start()
    client = (
        "import os, openai\n"
        "c = openai.OpenAI()\n"
        "r = c.chat.completions.create(model='fake-policy', messages=[{'role': 'user', 'content': 'hi'}])\n"
        "print('answered', r.choices[0].finish_reason)\n"
    )
    env = {"OPENAI_BASE_URL": f"{rt.gateway_url}/v1", "OPENAI_API_KEY": session}
    r = await rt.exec([sys.executable, "-c", client], env=env, timeout_s=60)
    assert r.exit_code == 0 and r.stdout.startswith("answered"), r.stderr
    assert len(gateway.completions(session)) == 1
    # the other host server on loopback, and the gateway's port anywhere but 127.0.0.1, do not answer
    r = await rt.exec([sys.executable, "-c", _CONNECT, str(other_server)])
    assert r.stdout.startswith("refused"), r.stdout
    r = await rt.exec(["curl", "-s", "-m", "3", "http://example.com/"])
    assert r.exit_code != 0
    await rt.stop()
    assert rt._bridge is None


async def test_gateway_network_without_gateway_is_loopback_only(tmp_path: Path, other_server: int) -> None:
    rt = BwrapRuntime(RuntimeSpec(backend="bwrap", root=tmp_path), "nogw")
    await rt.start()
    r = await rt.exec([sys.executable, "-c", _CONNECT, str(other_server)])
    assert r.stdout.startswith("refused")
    await rt.stop()


def test_bad_gateway_url() -> None:
    with pytest.raises(RuntimeFailure, match="not an http"):
        BwrapRuntime(RuntimeSpec(backend="bwrap"), "x", gateway_url="unix:///sock")


def test_factory_refuses_when_bwrap_is_missing(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeFailure, match="apt-get install bubblewrap"):
        make_runtime(RuntimeSpec(backend="bwrap"), "x")


def test_a_task_naming_no_runtime_gets_bwrap_or_a_clear_error_at_its_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default is the strongest sandbox; where it cannot run, a local run stops before anything starts
    with the task's line and what to install (it never falls back to `local`)."""
    text = "tasks:\n  - task_id: a\n    instruction: hi\n"
    (task,) = parse_tasks(text, "t.yaml", tmp_path, resolve_imports=True)
    assert task.runtime.backend is None and runtime_spec(task, None).backend == "bwrap"
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(TaskFileError) as refused:
        parse_tasks(text, "t.yaml", tmp_path, resolve_imports=True)
    assert str(refused.value).startswith("t.yaml:2: tasks[0].runtime.backend: the task names no runtime")
    assert "apt-get install bubblewrap" in str(refused.value) and "'local'" in str(refused.value)


async def test_an_environment_under_tmp_stays_visible(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A virtualenv or checkout made under /tmp (CI's fresh clones, pytest's tmp dirs) is hidden by the
    sandbox's private /tmp unless it is bound back: the sandbox could not even find its python."""
    prefix = tmp_path / "venv"
    (prefix / "bin").mkdir(parents=True)
    tool = prefix / "bin" / "tool"
    tool.write_text("#!/bin/sh\necho from-the-prefix\n")
    tool.chmod(0o755)
    monkeypatch.setattr(sys, "prefix", str(prefix))
    spec = RuntimeSpec(backend="bwrap", network="none", root=tmp_path / "runtimes")
    runtime = make_runtime(spec, "under-tmp")
    await runtime.start()
    try:
        ok = await runtime.exec([str(tool)])
        assert (ok.exit_code, ok.stdout.strip()) == (0, "from-the-prefix"), ok.stderr
        denied = await runtime.exec(f"echo x > {prefix}/bin/written")  # bound back read-only
        assert denied.exit_code != 0 and "Read-only file system" in denied.stderr
    finally:
        await runtime.stop()
