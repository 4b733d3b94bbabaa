"""LocalRuntime with real processes and files: env/cwd/stdin, exit codes, timeouts that kill whole
trees, cancellation during a running exec, uploads/downloads, output caps and cleanup.

Process tests run twice: in the runtime's namespaces (the default where `unshare` works) and without them
(`network: host` where namespaces are forbidden, simulated by a failing probe). A PID namespace hides the
host pids from the command itself (`$$` is its own namespace's), so the tests find processes from the
host side by their command line and their cwd in the session directory."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from polar.runtime import LocalRuntime, RuntimeFailure, RuntimeSpec, make_runtime, namespaces
from polar.runtime.procs import group_alive

MODES = ["namespaced", "plain"]


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (an unreaped zombie cannot do anything)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


async def _wait_gone(pids: list[int]) -> list[int]:
    for _ in range(100):
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        await asyncio.sleep(0.05)
    return alive


def without_namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a machine that forbids namespaces (a locked-down container) looks like to the runtime."""
    monkeypatch.setattr(namespaces, "probe", lambda: "namespaces disabled by the test")


def _procs(rt: LocalRuntime, *argv: str) -> list[int]:
    """Host pids of live processes running exactly `argv` with their cwd in the runtime's session dir."""
    want = b"".join(a.encode() + b"\0" for a in argv)
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or not _alive(int(proc.name)):
            continue
        try:
            if (proc / "cmdline").read_bytes() == want and Path(os.readlink(proc / "cwd")).is_relative_to(
                rt.session_dir
            ):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


async def _appear(rt: LocalRuntime, n: int, *argv: str) -> list[int]:
    for _ in range(200):
        pids = _procs(rt, *argv)
        if len(pids) >= n:
            return pids
        await asyncio.sleep(0.05)
    raise AssertionError(f"{n} x {argv} never ran")


@pytest.fixture(params=MODES)
async def rt(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[LocalRuntime]:
    network = "gateway"
    if request.param == "plain":
        without_namespaces(monkeypatch)
        network = "host"
    spec = RuntimeSpec(root=tmp_path, env={"SPEC_VAR": "from-spec"}, network=network)  # type: ignore[arg-type]
    runtime = LocalRuntime(spec, "sess/1", term_grace_s=0.3)
    await runtime.start()
    yield runtime
    await runtime.stop()


def _namespaced(rt: LocalRuntime) -> bool:
    return rt._ns is not None


async def test_layout_and_env(rt: LocalRuntime, tmp_path: Path) -> None:
    assert rt.session_dir.parent == tmp_path and "/" not in rt.session_dir.name
    for d in (rt.home, rt.workdir, rt.artifacts):
        assert d.is_dir() and d.is_relative_to(rt.session_dir)
    r = await rt.exec(
        'echo "$SPEC_VAR $CALL_VAR $HOME $PWD"; test -z "$POLAR_SECRET_FROM_NODE"',
        env={"CALL_VAR": "from-call"},
    )
    assert r.exit_code == 0, r.stderr
    assert r.stdout.split() == ["from-spec", "from-call", str(rt.home), str(rt.workdir)]


async def test_node_environment_does_not_leak(rt: LocalRuntime, monkeypatch) -> None:
    monkeypatch.setenv("POLAR_SECRET_FROM_NODE", "x")
    r = await rt.exec(["sh", "-c", 'echo "[${POLAR_SECRET_FROM_NODE}]"; echo "$PATH"'])
    assert r.stdout.splitlines() == ["[]", os.environ["PATH"]]


async def test_call_env_overrides_spec_env(rt: LocalRuntime) -> None:
    r = await rt.exec("echo $SPEC_VAR", env={"SPEC_VAR": "override"})
    assert r.stdout == "override\n"


async def test_cwd_stdin_and_exit_codes(rt: LocalRuntime) -> None:
    (rt.workdir / "sub").mkdir()
    r = await rt.exec(["pwd"], cwd="sub")
    assert r.stdout.strip() == str(rt.workdir / "sub")
    r = await rt.exec(["cat"], stdin=b"hello\x00world")
    assert r.stdout == "hello\x00world"
    r = await rt.exec("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, "out\n", "err\n", False)
    r = await rt.exec("kill -9 $$")
    assert r.exit_code == -9
    r = await rt.exec(["definitely-not-a-command-xyz"])
    assert r.exit_code == 127 and "not found" in r.stderr


async def test_stdin_is_not_inherited(rt: LocalRuntime) -> None:
    r = await rt.exec(["cat"], timeout_s=5)
    assert (r.exit_code, r.stdout, r.timed_out) == (0, "", False)


async def test_missing_cwd_is_a_runtime_failure(rt: LocalRuntime) -> None:
    with pytest.raises(RuntimeFailure, match="does not exist"):
        await rt.exec(["true"], cwd="nope")


async def test_timeout_kills_grandchildren(rt: LocalRuntime) -> None:
    task = asyncio.create_task(rt.exec("sleep 100 & sh -c 'sleep 100 & sleep 100' & wait", timeout_s=3))
    pids = await _appear(rt, 3, "sleep", "100")
    r = await task
    assert r.exit_code == 124 and r.timed_out
    assert await _wait_gone(pids) == []


async def test_timeout_escalates_to_sigkill(rt: LocalRuntime) -> None:
    script = "trap '' TERM; sleep 100 & wait; sleep 100"
    task = asyncio.create_task(rt.exec(["bash", "-c", script], timeout_s=2))
    pids = await _appear(rt, 1, "bash", "-c", script)
    r = await task
    assert r.timed_out and r.exit_code == 124
    assert await _wait_gone(pids) == []


async def test_background_child_holding_stdout(rt: LocalRuntime) -> None:
    """Without namespaces a background child holding stdout keeps the exec running (until its timeout);
    in a PID namespace it dies when the command exits (the namespace's init exits), as under bwrap."""
    r = await rt.exec("sleep 100 & echo started", timeout_s=2)
    assert r.stdout == "started\n"
    assert r.timed_out is not _namespaced(rt)
    assert await _wait_gone(_procs(rt, "sleep", "100")) == []


async def test_cancel_during_exec_kills_everything(rt: LocalRuntime) -> None:
    script = "sleep 100 & wait"
    task = asyncio.create_task(rt.exec(["bash", "-c", script]))
    pids = await _appear(rt, 1, "sleep", "100") + await _appear(rt, 1, "bash", "-c", script)
    await rt.cancel()
    result = await asyncio.wait_for(task, 10)
    assert result.exit_code < 0 and not result.timed_out
    assert await _wait_gone(pids) == []
    with pytest.raises(RuntimeFailure, match="cancelled"):
        await rt.exec(["true"])
    await rt.cancel()  # idempotent


async def test_cancel_reaches_leftover_background_processes(rt: LocalRuntime) -> None:
    """A detached leftover outlives its exec only without namespaces, and then `cancel` reaches it."""
    r = await rt.exec("nohup sleep 100 >/dev/null 2>&1 &")
    assert r.exit_code == 0
    if _namespaced(rt):
        assert await _wait_gone(_procs(rt, "sleep", "100")) == []
        return
    pids = await _appear(rt, 1, "sleep", "100")
    await rt.cancel()
    assert await _wait_gone(pids) == []


async def test_a_cancel_while_the_command_is_being_spawned_kills_it_at_once(rt: LocalRuntime) -> None:
    """asyncio connects a child's pipes a few turns of the loop after forking it; a cancel landing then
    used to wait for `sleep 100` to end (seen in CI: this file's cancel test took 100 s) and leave it
    running. Each turn of that window is tried; every cancel ends at once, and nothing survives."""
    for turns in range(30):
        task = asyncio.create_task(rt.exec("sleep 100; true"))
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), 30)  # bound: a missed window waits out the 100 s
        assert await _wait_gone(_procs(rt, "sleep", "100")) == [], turns


def _pgid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rfind(")") + 2 :].split()[2])


async def test_cancelling_the_calling_task_kills_the_tree(rt: LocalRuntime) -> None:
    task = asyncio.create_task(rt.exec("sleep 100; true"))
    pids = await _appear(rt, 1, "sleep", "100")
    group = _pgid(pids[0])
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await _wait_gone(pids) == []
    for _ in range(100):  # the group's other members (unshare, the namespace's init) die with it
        if not group_alive(group):
            break
        await asyncio.sleep(0.05)
    assert not group_alive(group)


async def test_output_is_capped_and_says_so(tmp_path: Path) -> None:
    rt = LocalRuntime(RuntimeSpec(root=tmp_path), "cap", output_cap=1000)
    await rt.start()
    r = await rt.exec("head -c 5000 /dev/zero | tr '\\0' a; echo err >&2")
    assert r.exit_code == 0
    assert r.stdout.startswith("a" * 1000) and "truncated at 1000 bytes, 4000 more bytes dropped" in r.stdout
    assert r.stderr == "err\n"
    await rt.stop()


async def test_upload_download_files_and_trees(rt: LocalRuntime, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("A")
    (src / "top.txt").write_text("T")
    one = tmp_path / "one.txt"
    one.write_text("ONE")
    await rt.upload(src, "repo")
    await rt.upload(one, "deep/er/one.txt")
    r = await rt.exec("cat repo/pkg/a.py repo/top.txt deep/er/one.txt")
    assert r.stdout == "ATONE"
    await rt.exec("mkdir -p out/x && echo made > out/x/f && echo log > ../artifacts/log.txt")
    await rt.download("out", tmp_path / "back")
    await rt.download("../artifacts/log.txt", tmp_path / "log.txt")
    assert (tmp_path / "back" / "x" / "f").read_text() == "made\n"
    assert (tmp_path / "log.txt").read_text() == "log\n"
    await rt.upload(one, str(rt.home / ".config" / "one"))  # absolute inside the session dir
    assert (rt.home / ".config" / "one").read_text() == "ONE"


async def test_upload_refuses_paths_outside_and_missing_sources(rt: LocalRuntime, tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(RuntimeFailure, match="outside the session directory"):
        await rt.upload(f, "../../escape")
    with pytest.raises(RuntimeFailure, match="outside the session directory"):
        await rt.upload(f, "/etc/polar-escape")
    with pytest.raises(RuntimeFailure, match="no such file"):
        await rt.upload(tmp_path / "missing", "x")
    with pytest.raises(RuntimeFailure, match="no such file"):
        await rt.download("missing", tmp_path / "y")


@pytest.mark.parametrize("mode", MODES)
async def test_stop_cleans_up_and_keeps_artifacts_when_asked(
    tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if mode == "plain":
        without_namespaces(monkeypatch)
    rt = LocalRuntime(RuntimeSpec(root=tmp_path, network="host"), "s")
    await rt.start()
    task = asyncio.create_task(rt.exec("nohup sleep 100 >/dev/null 2>&1 & wait"))
    pids = await _appear(rt, 1, "sleep", "100")
    await rt.stop()
    await task
    assert not rt.session_dir.exists()
    assert await _wait_gone(pids) == []
    await rt.stop()  # idempotent
    with pytest.raises(RuntimeFailure, match="stopped"):
        await rt.exec(["true"])

    rt = LocalRuntime(RuntimeSpec(root=tmp_path, network="host"), "s", keep="artifacts")
    await rt.start()
    await rt.exec("echo t > ../artifacts/t && echo w > w")
    await rt.stop()
    assert sorted(p.name for p in rt.session_dir.iterdir()) == ["artifacts"]
    assert (rt.artifacts / "t").read_text() == "t\n"


async def test_two_runtimes_for_one_session_get_separate_dirs(tmp_path: Path) -> None:
    a = make_runtime(RuntimeSpec(backend="local", root=tmp_path), "same")
    b = make_runtime(RuntimeSpec(backend="local", root=tmp_path), "same")
    assert a.session_dir != b.session_dir


async def test_not_started_and_bad_workdir(tmp_path: Path) -> None:
    rt = LocalRuntime(RuntimeSpec(root=tmp_path), "n")
    with pytest.raises(RuntimeFailure, match="not started"):
        await rt.exec(["true"])
    with pytest.raises(RuntimeFailure, match="must not contain"):
        LocalRuntime(RuntimeSpec(root=tmp_path, workdir="../x"), "n")
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(RuntimeFailure, match="cannot create session directory"):
        await LocalRuntime(RuntimeSpec(root=blocked), "n").start()


async def test_absolute_workdir_lives_in_the_session_dir(tmp_path: Path) -> None:
    rt = LocalRuntime(RuntimeSpec(root=tmp_path, workdir="/testbed"), "abs")
    assert rt.workdir == rt.session_dir / "testbed"


def test_factory_refuses_unknown_backends() -> None:
    with pytest.raises(
        RuntimeFailure, match="unknown runtime backend 'lxc'; known: bwrap, docker, podman, apptainer, local"
    ):
        make_runtime(RuntimeSpec(backend="lxc"), "x")  # type: ignore[arg-type]


async def test_cancel_returns_even_when_an_escaped_process_holds_the_pipe(rt: LocalRuntime) -> None:
    """`setsid` leaves the process group; cancel still ends the exec instead of waiting for that process
    to close stdout. Without namespaces the escaped process survives; in a PID namespace it does not."""
    task = asyncio.create_task(rt.exec("setsid sleep 100 & echo started; wait"))
    pid = (await _appear(rt, 1, "sleep", "100"))[0]
    try:
        await rt.cancel()
        result = await asyncio.wait_for(task, 10)
        assert result.exit_code < 0 and not result.timed_out
        assert result.stdout == "started\n"  # what was read before the cancel is kept
        if _namespaced(rt):
            assert await _wait_gone([pid]) == []
    finally:
        if _alive(pid):
            os.kill(pid, 9)
