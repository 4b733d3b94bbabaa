"""LocalRuntime with real processes and files: env/cwd/stdin, exit codes, timeouts that kill whole
trees, cancellation during a running exec, uploads/downloads, output caps and cleanup."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from polar.runtime import LocalRuntime, RuntimeFailure, RuntimeSpec, make_runtime
from polar.runtime.procs import group_alive


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


@pytest.fixture
async def rt(tmp_path: Path) -> AsyncIterator[LocalRuntime]:
    runtime = LocalRuntime(
        RuntimeSpec(root=tmp_path, env={"SPEC_VAR": "from-spec"}), "sess/1", term_grace_s=0.3
    )
    await runtime.start()
    yield runtime
    await runtime.stop()


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
    r = await rt.exec(
        "sleep 100 & echo $!; sh -c 'sleep 100 & echo $!; sleep 100' & echo $!; wait", timeout_s=0.5
    )
    assert r.exit_code == 124 and r.timed_out
    pids = [int(x) for x in r.stdout.split()]
    assert len(pids) == 3
    assert await _wait_gone(pids) == []


async def test_timeout_escalates_to_sigkill(rt: LocalRuntime) -> None:
    r = await rt.exec("trap '' TERM; echo $$; sleep 100 & wait; sleep 100", timeout_s=0.3)
    assert r.timed_out and r.exit_code == 124
    assert await _wait_gone([int(r.stdout.split()[0])]) == []


async def test_background_child_holding_stdout_counts_as_running(rt: LocalRuntime) -> None:
    r = await rt.exec("sleep 100 & echo started", timeout_s=0.5)
    assert r.timed_out and r.stdout == "started\n"


async def test_cancel_during_exec_kills_everything(rt: LocalRuntime) -> None:
    pidfile = rt.workdir / "pids"
    task = asyncio.create_task(rt.exec(f"sleep 100 & echo $! > {pidfile}; echo $$ >> {pidfile}; wait"))
    for _ in range(100):
        if pidfile.exists() and len(pidfile.read_text().split()) == 2:
            break
        await asyncio.sleep(0.05)
    await rt.cancel()
    result = await asyncio.wait_for(task, 10)
    assert result.exit_code < 0 and not result.timed_out
    assert await _wait_gone([int(x) for x in pidfile.read_text().split()]) == []
    with pytest.raises(RuntimeFailure, match="cancelled"):
        await rt.exec(["true"])
    await rt.cancel()  # idempotent


async def test_cancel_reaches_leftover_background_processes(rt: LocalRuntime) -> None:
    r = await rt.exec("nohup sleep 100 >/dev/null 2>&1 & echo $!")
    pid = int(r.stdout)
    assert r.exit_code == 0 and _alive(pid)
    await rt.cancel()
    assert await _wait_gone([pid]) == []


async def test_cancelling_the_calling_task_kills_the_tree(rt: LocalRuntime) -> None:
    pidfile = rt.workdir / "pid"
    task = asyncio.create_task(rt.exec(f"echo $$ > {pidfile}; sleep 100"))
    while not (pidfile.exists() and pidfile.read_text().strip()):
        await asyncio.sleep(0.05)
    pid = int(pidfile.read_text())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await _wait_gone([pid]) == []
    assert not group_alive(pid)


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


async def test_stop_cleans_up_and_keeps_artifacts_when_asked(tmp_path: Path) -> None:
    rt = LocalRuntime(RuntimeSpec(root=tmp_path), "s")
    await rt.start()
    r = await rt.exec("nohup sleep 100 >/dev/null 2>&1 & echo $!")
    await rt.stop()
    assert not rt.session_dir.exists()
    assert await _wait_gone([int(r.stdout)]) == []
    await rt.stop()  # idempotent
    with pytest.raises(RuntimeFailure, match="stopped"):
        await rt.exec(["true"])

    rt = LocalRuntime(RuntimeSpec(root=tmp_path), "s", keep="artifacts")
    await rt.start()
    await rt.exec("echo t > ../artifacts/t && echo w > w")
    await rt.stop()
    assert sorted(p.name for p in rt.session_dir.iterdir()) == ["artifacts"]
    assert (rt.artifacts / "t").read_text() == "t\n"


async def test_two_runtimes_for_one_session_get_separate_dirs(tmp_path: Path) -> None:
    a = make_runtime(RuntimeSpec(root=tmp_path), "same")
    b = make_runtime(RuntimeSpec(root=tmp_path), "same")
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
    with pytest.raises(RuntimeFailure, match="unknown runtime backend 'podman'; known: local, bwrap"):
        make_runtime(RuntimeSpec(backend="podman"), "x")  # type: ignore[arg-type]


async def test_cancel_returns_even_when_an_escaped_process_holds_the_pipe(rt: LocalRuntime) -> None:
    """`setsid` leaves the process group (only bwrap's PID namespace would catch it); cancel still ends
    the exec instead of waiting for that process to close stdout."""
    task = asyncio.create_task(rt.exec("setsid sleep 100 & echo $!; wait"))
    pid = None
    for _ in range(100):
        pids = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _is_setsid_sleep(p, rt)]
        if pids:
            pid = int(pids[0].name)
            break
        await asyncio.sleep(0.05)
    assert pid is not None
    try:
        await rt.cancel()
        result = await asyncio.wait_for(task, 10)
        assert result.exit_code < 0 and not result.timed_out
        assert result.stdout == f"{pid}\n"  # what was read before the cancel is kept
    finally:
        os.kill(pid, 9)


def _is_setsid_sleep(proc: Path, rt: LocalRuntime) -> bool:
    try:
        return (proc / "cmdline").read_bytes() == b"sleep\x00100\x00" and (
            proc / "cwd"
        ).resolve() == rt.workdir
    except OSError:
        return False
