"""The default runtime: a private session directory on the host, each command in its own namespaces.

What `local` isolates is the network and the processes. Each command runs under `unshare`
(`namespaces.py`): a network namespace of its own (`network: gateway`: only the gateway answers, at
`http://127.0.0.1:<port>` through the bridge that bwrap uses too; `none`: nothing outside the sandbox;
`host`: the host's network), a PID namespace with a private /proc (it sees and signals only its own
processes, and all of them die when it exits, is killed, or the node dies), and, as root, only docker's
default capabilities. What it does NOT isolate is the file system: commands run as the node's user on
the host's files, so they read and write whatever that user can (its start-up files and the polar
installation included) and reach host services through their unix sockets. Use `bwrap` (read-only host)
or a container for that.

Where namespaces cannot be made (a container that forbids them), `gateway` and `none` are refused and
`host` runs without them: each command is its own process group, killed whole by timeouts and `cancel`
(a process that leaves its group with `setsid` escapes that); the node's death kills its direct child
(PR_SET_PDEATHSIG) and the next node start kills the rest (`leftovers.py`).
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Literal, TypedDict

from polar.runtime import namespaces
from polar.runtime.base import ExecResult, RuntimeEntry, RuntimeFailure, RuntimeSpec
from polar.runtime.bridge import UnixBridge, gateway_address
from polar.runtime.leftovers import GroupRecords
from polar.runtime.procs import OUTPUT_CAP, TERM_GRACE_S, GroupTracker, run_process

Keep = Literal["nothing", "artifacts", "all"]


class RuntimeOptions(TypedDict, total=False):
    """`LocalRuntime`'s keyword options, which the sandboxes built on it take as `**options`, so an
    option added here reaches every backend."""

    gateway_url: str | None
    keep: Keep
    term_grace_s: float
    output_cap: int


# Variables inherited from the node's environment; everything else comes from the spec and the call, so
# a harness never sees the node's credentials by accident.
_INHERITED = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TERM")


def _safe_name(session_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", session_id)[:64] or "session"


def _relative(path: str, what: str) -> Path:
    """`path` made relative (a leading / is dropped) and refused if it climbs out with `..`."""
    rel = Path(path.lstrip("/"))
    if ".." in rel.parts:
        raise RuntimeFailure(f"{what} {path!r} must not contain '..'")
    return rel


def _copy(src: Path, dst: Path) -> None:
    """Copy a file or a tree; a tree is merged into an existing directory, a file into a directory
    goes inside it (as `cp` does)."""
    if src.is_dir():
        shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
    elif src.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    else:
        raise RuntimeFailure(f"cannot copy {src}: no such file or directory")


def _read_status(fd: int) -> int | None:
    """The signal number fwd_inside.py wrote, if it wrote one (the write end is still open here)."""
    os.set_blocking(fd, False)
    try:
        data = os.read(fd, 16)
    except BlockingIOError:
        return None
    return int(data) if data.strip().isdigit() else None


class LocalRuntime:
    """A session directory (`home/`, the workdir, `artifacts/`) and the processes started in it."""

    backend = "local"
    bridged = True  # `network: gateway` reaches the gateway through a bridge (containers share the host's)

    def __init__(
        self,
        spec: RuntimeSpec,
        session_id: str,
        *,
        gateway_url: str | None = None,
        keep: Keep = "nothing",
        term_grace_s: float = TERM_GRACE_S,
        output_cap: int = OUTPUT_CAP,
    ) -> None:
        self.spec = spec
        self.session_id = session_id
        root = Path(spec.root) if spec.root is not None else Path(tempfile.gettempdir())
        # A random suffix: the evaluator's fresh runtime shares the session id with the agent's
        self.session_dir = root.absolute() / f"polar-{_safe_name(session_id)}-{secrets.token_hex(4)}"
        self.home = self.session_dir / "home"
        self.artifacts = self.session_dir / "artifacts"
        self.workdir = self.session_dir / _relative(spec.workdir, "workdir")
        # The URL the harness should use for the gateway: the host's, or its port on the sandbox's loopback
        self.gateway_url = gateway_url
        self._gateway: tuple[str, int] | None = None  # the gateway as the host reaches it, when bridged
        if spec.network == "gateway" and gateway_url is not None and self.bridged:
            host, port, self.gateway_url = gateway_address(gateway_url)
            self._gateway = (host, port)
        elif spec.network == "none":
            self.gateway_url = None  # nothing answers inside
        self._bridge: UnixBridge | None = None
        self._ns: namespaces.Namespaces | None = None
        self.keep: Keep = keep
        self.term_grace_s = term_grace_s
        self.output_cap = output_cap
        self._tracker = GroupTracker(GroupRecords())
        self._state: Literal["new", "started", "stopped"] = "new"

    # -- lifecycle -------------------------------------------------------------------------------

    def _make_dirs(self, *paths: Path, exist_ok: bool) -> None:
        """Create the session directory (refused if it exists, unless `exist_ok`) and `paths` in it."""
        try:
            self.session_dir.mkdir(parents=True, exist_ok=exist_ok)
            for path in paths:
                path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RuntimeFailure(f"cannot create session directory {self.session_dir}: {exc}") from exc

    def runtime_path(self, path: Path) -> str:
        """`path` as commands in the runtime see it: the host's own (containers mount it elsewhere)."""
        return str(path)

    def _check_read_only_paths(self) -> None:
        """What a sandbox mounts read-only must exist (bwrap refuses a missing one; docker's `-v` would create
        it as an empty root-owned directory): refused before anything starts."""
        for path in self.spec.read_only_paths:
            if not Path(path).is_absolute() or not Path(path).exists():
                raise RuntimeFailure(f"read_only_paths: {path!r} is not an existing absolute path")

    async def _isolate(self) -> None:
        """Decide the namespaces (refusing a network it cannot confine); bwrap makes its own."""
        self._ns = await asyncio.to_thread(namespaces.for_network, self.spec.network)

    async def start(self) -> None:
        if self._state != "new":
            return
        await self._isolate()
        self._make_dirs(self.home, self.artifacts, self.workdir, exist_ok=False)
        self._state = "started"
        if self._gateway is not None:
            self._bridge = UnixBridge(*self._gateway)
            self._bridge.start()

    async def cancel(self) -> None:
        self._tracker.mark_cancelled()
        await self._tracker.kill_all(self.term_grace_s)

    async def stop(self, *, keep: Keep | None = None) -> None:
        """Cancel, then remove the session directory except what `keep` (default: the constructor's)
        asks to keep."""
        if self._state == "stopped":
            return
        await self.cancel()
        self._state = "stopped"
        await asyncio.to_thread(self._remove, keep or self.keep)
        if self._bridge is not None:
            self._bridge.close()
            self._bridge = None

    def _remove(self, keep: Keep) -> None:
        if keep == "all" or not self.session_dir.exists():
            return
        if keep == "nothing":
            shutil.rmtree(self.session_dir, ignore_errors=True)
            return
        for entry in self.session_dir.iterdir():
            if entry == self.artifacts:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

    def _check_running(self) -> None:
        if self._state == "new":
            raise RuntimeFailure(f"runtime for session {self.session_id} is not started")
        if self._state == "stopped":
            raise RuntimeFailure(f"runtime for session {self.session_id} is stopped")
        if self._tracker.cancelled:
            raise RuntimeFailure(f"runtime for session {self.session_id} was cancelled")

    # -- commands --------------------------------------------------------------------------------

    def _env(self, env: dict[str, str] | None) -> dict[str, str]:
        base = {k: os.environ[k] for k in _INHERITED if k in os.environ}
        base["HOME"] = self.runtime_path(self.home)
        return base | self.spec.env | (env or {})

    def _cwd(self, cwd: str | None) -> Path:
        path = self.workdir if cwd is None else self.workdir / cwd  # an absolute cwd replaces workdir
        if not path.is_dir():
            raise RuntimeFailure(f"working directory {path} does not exist")
        return path

    def _command(self, argv: list[str] | str) -> list[str]:
        # Not `bash -l`: Debian's /etc/profile resets PATH, which would hide the PATH the spec and
        # the harness set (a venv, an npm prefix)
        return ["bash", "-c", argv] if isinstance(argv, str) else list(argv)

    def _reports_signals(self) -> bool:
        """Whether `fwd_inside.py` stands between the node and the command (and so must report on a pipe
        the signal that killed it, which its own exit status cannot carry)."""
        return self._ns is not None

    def _wrap(
        self, argv: list[str], cwd: Path, env: dict[str, str], status_fd: int | None
    ) -> tuple[list[str], str | None]:
        """The host command line and host cwd that run `argv`; sandboxes override this. `status_fd`
        receives the signal that killed the command, when a PID namespace's init stands in between."""
        if self._ns is None:
            return namespaces.pdeathsig(argv, env.get("PATH")), str(cwd)
        forward = None
        if self._bridge is not None and self._gateway is not None:
            forward = (self._gateway[1], str(self._bridge.socket_path))
        network = self.spec.network != "host"
        return self._ns.argv(argv, network=network, forward=forward, status_fd=status_fd), str(cwd)

    async def exec(
        self,
        argv: list[str] | str,
        *,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        self._check_running()
        command = self._command(argv)
        if not command:
            raise RuntimeFailure("empty command")
        return await self._run(command, self._env(env), cwd, stdin=stdin, timeout_s=timeout_s)

    async def _run(
        self,
        command: list[str],
        env: dict[str, str],
        cwd: str | None,
        *,
        stdin: bytes | None,
        timeout_s: float | None,
    ) -> ExecResult:
        """Run a checked command with its full environment; container runtimes override this."""
        status = os.pipe() if self._reports_signals() else None
        try:
            host_argv, host_cwd = self._wrap(command, self._cwd(cwd), env, status[1] if status else None)
            result = await run_process(
                host_argv,
                env=env,
                cwd=host_cwd,
                stdin=stdin,
                timeout_s=timeout_s,
                tracker=self._tracker,
                grace_s=self.term_grace_s,
                output_cap=self.output_cap,
                pass_fds=status[1:] if status else (),
            )
            signum = _read_status(status[0]) if status else None
        finally:
            for fd in status or ():
                os.close(fd)
        # Killed by a signal inside the namespace: reported as such (-N), as without one
        if signum is not None and not result.timed_out:
            result = replace(result, exit_code=-signum)
        return result

    # -- files -----------------------------------------------------------------------------------

    def _host_path(self, path: str) -> str:
        """A path as the runtime's commands name it, as the host names it (the inverse of `runtime_path`)."""
        return path

    def _inside(self, path: str) -> Path:
        """A runtime path (relative to workdir, or absolute) as a host path inside the session dir, also
        once symlinks are followed: the node copies as root, and a link the agent planted (`tests ->
        /etc`) must not make it read or write a host file."""
        host = Path(os.path.normpath(self.workdir / self._host_path(path)))
        real = Path(os.path.realpath(host))
        if not host.is_relative_to(self.session_dir) or not real.is_relative_to(
            os.path.realpath(self.session_dir)
        ):
            raise RuntimeFailure(f"path {path!r} is outside the session directory {self.session_dir}")
        return host

    async def upload(self, src: Path, dst: str) -> None:
        self._check_running()
        target = self._inside(dst)
        try:
            await asyncio.to_thread(_copy, Path(src), target)
        except OSError as exc:
            raise RuntimeFailure(f"upload {src} -> {dst} failed: {exc}") from exc

    async def download(self, src: str, dst: Path) -> None:
        if self._state == "new":
            raise RuntimeFailure(f"runtime for session {self.session_id} is not started")
        source = self._inside(src)
        try:
            await asyncio.to_thread(_copy, source, Path(dst))
        except OSError as exc:
            raise RuntimeFailure(f"download {src} -> {dst} failed: {exc}") from exc


def check(spec: RuntimeSpec) -> None:
    namespaces.for_network(spec.network)  # gateway/none: refused where namespaces cannot be made


RUNTIME = RuntimeEntry(LocalRuntime, check, trusted_only=True)
