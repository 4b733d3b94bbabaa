"""Running one command as its own process group: capped capture, timeout, and killing the whole tree.

Every runtime that spawns host processes (local, bwrap, the docker/apptainer clients) goes through
`run_process`, so timeouts and cancellation behave the same everywhere: the command gets a fresh session
(`setsid`), hence a process group of its own that also holds the children it forks; killing the group
takes the grandchildren with it, which killing only the direct child would not (an agent's `bash` tool
commonly leaves `sleep`/servers behind).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polar.runtime.base import ExecResult

if TYPE_CHECKING:
    from polar.runtime.leftovers import GroupRecords

OUTPUT_CAP = 10 * 1024 * 1024  # per stream; an agent that cats a binary must not exhaust the node
TERM_GRACE_S = 2.0  # SIGTERM first so tools can flush logs, then SIGKILL
_PIPE_DRAIN_S = 2.0  # after a kill, how long to wait for pipes held by processes that escaped the group
TIMEOUT_EXIT = 124  # like coreutils `timeout`


def _group_members(pgid: int) -> bool | None:
    """Whether a live (non-zombie) process is in the group; None when /proc cannot tell."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # comm may contain spaces and parentheses: fields start after the last ')'
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    members = _group_members(pgid)
    return True if members is None else members


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def kill_group(pgid: int, grace_s: float = TERM_GRACE_S) -> None:
    """SIGTERM the group, give it `grace_s` to exit, then SIGKILL whatever is left."""
    signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and group_alive(pgid):
        await asyncio.sleep(0.05)
    signal_group(pgid, signal.SIGKILL)


class GroupTracker:
    """The process groups one runtime started, so `cancel` can reach all of them, finished execs'
    leftover background processes included; with `records`, also on disk for a node that restarts."""

    def __init__(self, records: GroupRecords | None = None) -> None:
        self._groups: set[int] = set()
        self._cancelled = asyncio.Event()
        self._records = records

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def mark_cancelled(self) -> None:
        self._cancelled.set()

    async def wait_cancelled(self) -> None:
        await self._cancelled.wait()

    def add(self, pgid: int) -> None:
        self._groups.add(pgid)
        if self._records is not None:
            self._records.add(pgid)

    def _forget(self, pgid: int) -> None:
        self._groups.discard(pgid)
        if self._records is not None:
            self._records.discard(pgid)

    def forget_if_dead(self, pgid: int) -> None:
        if not group_alive(pgid):
            self._forget(pgid)

    async def kill_all(self, grace_s: float) -> None:
        groups = list(self._groups)
        await asyncio.gather(*(kill_group(g, grace_s) for g in groups))
        for pgid in groups:  # SIGKILLed: gone as soon as the kernel delivers it
            self._forget(pgid)


class _Capture:
    """The first `cap` bytes of a stream; what was read survives the reader being cancelled."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.data = bytearray()
        self.dropped = 0

    async def drain(self, stream: asyncio.StreamReader | None) -> None:
        """Read to EOF; bytes past the cap are counted and dropped so the child never blocks."""
        if stream is None:
            return
        while chunk := await stream.read(1 << 16):
            room = self.cap - len(self.data)
            if room > 0:
                self.data += chunk[:room]
            self.dropped += max(0, len(chunk) - max(room, 0))

    def text(self) -> str:
        text = self.data.decode("utf-8", errors="replace")
        if self.dropped:
            text += f"\n[polar: output truncated at {self.cap} bytes, {self.dropped} more bytes dropped]\n"
        return text


async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        proc.stdin.write(data)
        await proc.stdin.drain()
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        proc.stdin.close()


KillFn = Callable[[int, float], Awaitable[None]]


async def _spawn(
    argv: list[str], *, env: dict[str, str], cwd: str | None, stdin: bool, pass_fds: tuple[int, ...]
) -> asyncio.subprocess.Process:
    """Start `argv` as the leader of a new session. A cancel that lands while asyncio is still connecting
    the pipes (the child already runs) must not leave it running: asyncio's own clean-up then kills only
    the direct child and waits for the pipes, which a grandchild (`sh -c 'sleep 100; true'`) holds until
    it ends, so the cancel would wait the command out and its tree would outlive the caller (seen in CI:
    a cancelled `sleep 100` took 100 s). The spawn finishes shielded; on a cancel its whole group dies."""
    spawn = asyncio.ensure_future(
        asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            cwd=cwd,
            start_new_session=True,
            pass_fds=pass_fds,
        )
    )
    try:
        return await asyncio.shield(spawn)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            proc = await spawn  # a few turns of the loop: the pipes are being connected
            signal_group(proc.pid, signal.SIGKILL)
            await proc.wait()
        raise


async def run_process(
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: str | None,
    stdin: bytes | None,
    timeout_s: float | None,
    tracker: GroupTracker,
    grace_s: float = TERM_GRACE_S,
    output_cap: int = OUTPUT_CAP,
    kill: KillFn = kill_group,
    pass_fds: tuple[int, ...] = (),
) -> ExecResult:
    """Run `argv` in a new session; on timeout `kill(pgid, grace_s)` and report exit code 124.

    `kill` lets container runtimes also stop what the client started inside the engine; `pass_fds` stay
    open in the child (the local runtime's status pipe)."""
    started = time.monotonic()
    try:
        proc = await _spawn(argv, env=env, cwd=cwd, stdin=stdin is not None, pass_fds=pass_fds)
    except FileNotFoundError:
        return ExecResult(127, "", f"polar: command not found: {argv[0]}\n")
    except PermissionError as exc:
        return ExecResult(126, "", f"polar: cannot execute {argv[0]}: {exc}\n")
    pgid = proc.pid  # start_new_session: the child is its session's and group's leader
    tracker.add(pgid)
    finished = False
    try:
        if tracker.cancelled:  # cancel() ran while we were spawning
            await kill(pgid, 0.0)
        waiter = asyncio.ensure_future(proc.wait())
        out, err = _Capture(output_cap), _Capture(output_cap)
        tasks: list[asyncio.Future[Any]] = [
            waiter,
            asyncio.ensure_future(out.drain(proc.stdout)),
            asyncio.ensure_future(err.drain(proc.stderr)),
        ]
        feeder = asyncio.ensure_future(_feed(proc, stdin)) if stdin is not None else None
        # Waiting on the pipes too: a background child still holding stdout is part of the command.
        # Until the command ends, it times out, or the runtime is cancelled (which kills it).
        everything = asyncio.ensure_future(asyncio.wait(tasks))
        cancelled = asyncio.ensure_future(tracker.wait_cancelled())
        await asyncio.wait([everything, cancelled], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        cancelled.cancel()
        everything.cancel()  # only the wrapper: the tasks themselves keep running
        running = not all(task.done() for task in tasks)
        timed_out = running and not tracker.cancelled
        if running:
            if timed_out:
                await kill(pgid, grace_s)
            _, pending = await asyncio.wait(tasks, timeout=grace_s + _PIPE_DRAIN_S)
            for task in pending:  # a process that left our group (setsid) still holds a pipe
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await proc.wait()
        if feeder is not None:
            feeder.cancel()
        finished = True
        code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
        return ExecResult(
            exit_code=TIMEOUT_EXIT if timed_out else code,
            stdout=out.text(),
            stderr=err.text(),
            timed_out=timed_out,
            duration_s=time.monotonic() - started,
        )
    finally:
        if not finished:  # the caller's task was cancelled: nothing of this command may outlive it
            signal_group(pgid, signal.SIGKILL)
        tracker.forget_if_dead(pgid)
