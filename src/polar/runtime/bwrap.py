"""Bubblewrap: the default runtime. A session directory on the host, seen by an unprivileged agent in a
sandbox that shows it only what it needs.

Each command runs as `bwrap ... -- ARGV` with:
- **its own uid** (`polar.runtime.sandbox`): a root node hands each sandbox an unprivileged uid of its own,
  which owns the session directory (mode 0700); a non-root node's sandboxes run as the node's uid in a user
  namespace;
- **a curated view**: the system directories, the Python running polar and its sources, the harness tool
  cache and the task's `read_only_paths`, read-only; a private /tmp with the session directory writable at
  `/tmp/polar-session` (the same path in every session, so what a CLI writes into its prompt does not
  differ between the samples of a task; `runtime_path()` maps host paths); empty /run, /var and home
  directories. No host socket, store, token file or other session is in it;
- its own PID, IPC and UTS namespaces (killing bwrap kills everything in it, daemons included: the kernel
  tears a PID namespace down with its init; `--die-with-parent` makes the node's death, SIGKILL included,
  kill bwrap), no capabilities, and unless `network="host"` its own network namespace.

`network="gateway"`: the node serves a unix socket (`UnixBridge`) that splices to the gateway; bwrap binds
its directory into the sandbox, and each command starts under `fwd_inside.py`, which listens on the
sandbox's 127.0.0.1 at the gateway's port, then drops to the sandbox uid and runs the command. The harness
is given `runtime.gateway_url` (`http://127.0.0.1:<gateway port>`), which only answers the gateway.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Unpack

from polar.runtime.base import RuntimeEntry, RuntimeFailure, RuntimeSpec
from polar.runtime.local import Keep, LocalRuntime, RuntimeOptions
from polar.runtime.namespaces import FWD
from polar.runtime.sandbox import MASKED, SYSTEM, SandboxUser, allocate_user, chown_tree, visible_paths

# Where the sandbox sees its session directory: under its private /tmp, the same for every session.
SANDBOX_SESSION = Path("/tmp/polar-session")


def probe(bwrap: str = "bwrap") -> str | None:
    """Why bwrap cannot make a sandbox on this machine (no binary, user namespaces forbidden), or None."""
    path = shutil.which(bwrap)
    if path is None:
        return "no `bwrap` is on PATH (Debian/Ubuntu: apt-get install bubblewrap)"
    return _runs(path)


@functools.cache
def _runs(path: str) -> str | None:
    """Run once per process: a container or a sysctl may forbid the namespaces bwrap makes."""
    argv = [path, "--ro-bind", "/", "/", "--unshare-pid", "--unshare-net", "--", "true"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap cannot run: {exc}"
    if done.returncode != 0:
        return f"bwrap cannot make a sandbox here (exit {done.returncode}): {done.stderr.strip()[-300:]}"
    return None


def view_args(extra: tuple[str, ...] = ()) -> list[str]:
    """bwrap arguments for the curated read-only view (without the session directory)."""
    cmd: list[str] = []
    for path in SYSTEM:
        if os.path.islink(path):
            cmd += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            cmd += ["--ro-bind", path, path]
    cmd += ["--dev", "/dev", "--proc", "/proc"]
    for path in MASKED:  # /tmp is everyone's, as on a host (sticky)
        cmd += ["--perms", "1777" if path == "/tmp" else "0755", "--tmpfs", path]
    cmd += ["--perms", "1777", "--dir", "/var/tmp"]
    for path in visible_paths(extra):
        # The folders above a bound path are made readable and traversable (bwrap would copy the host's
        # modes, and /root's 0700 would hide the Python installed under it from the sandbox uid).
        for parent in reversed(Path(path).parents[:-1]):
            cmd += ["--perms", "0755", "--dir", str(parent)]
        cmd += ["--ro-bind", path, path]
    return cmd


class BwrapRuntime(LocalRuntime):
    backend = "bwrap"

    def __init__(
        self,
        spec: RuntimeSpec,
        session_id: str,
        *,
        bwrap: str = "bwrap",
        **options: Unpack[RuntimeOptions],
    ) -> None:
        super().__init__(spec, session_id, **options)
        self.bwrap = bwrap
        self.user: SandboxUser | None = None

    async def _isolate(self) -> None:
        # bwrap makes its own namespaces (and brings the loopback up itself)
        self._check_read_only_paths()
        try:
            self.user = allocate_user()
        except OSError as exc:
            raise RuntimeFailure(f"cannot allocate a sandbox uid: {exc}") from exc

    async def start(self) -> None:
        if self._state != "new":
            return
        await super().start()
        if self.user is None:
            return
        try:
            await asyncio.to_thread(self._give_to_user, self.user)
        except OSError as exc:
            await self.stop()
            raise RuntimeFailure(f"cannot hand the session directory to the sandbox uid: {exc}") from exc

    def _give_to_user(self, user: SandboxUser) -> None:
        # The bridge's folder stays root's (0700): only the forwarder, which keeps uid 0, connects to it.
        chown_tree(self.session_dir, user)
        self.session_dir.chmod(0o700)

    async def stop(self, *, keep: Keep | None = None) -> None:
        await super().stop(keep=keep)
        if self.user is not None:
            self.user.release()

    async def upload(self, src: Path, dst: str) -> None:
        await super().upload(src, dst)
        if self.user is not None:  # copied by the node (root): the sandbox uid must own what it works on
            await asyncio.to_thread(chown_tree, self._inside(dst), self.user)

    def runtime_path(self, path: Path) -> str:
        path = Path(path)
        if path.is_relative_to(self.session_dir):
            return str(SANDBOX_SESSION / path.relative_to(self.session_dir))
        return str(path)

    def _host_path(self, path: str) -> str:
        if Path(path).is_relative_to(SANDBOX_SESSION):
            return str(self.session_dir / Path(path).relative_to(SANDBOX_SESSION))
        return path

    def _reports_signals(self) -> bool:
        return self.user is not None or self._bridge is not None  # fwd_inside runs the command

    def bwrap_argv(self, argv: list[str], cwd: Path, status_fd: int | None = None) -> list[str]:
        """The full bwrap command line for `argv` run in `cwd` (a host path, as the sandbox sees it);
        `status_fd` (inherited through bwrap) receives the signal that killed the command."""
        cmd = [self.bwrap, *view_args(self.spec.read_only_paths)]
        cmd += ["--bind", str(self.session_dir), str(SANDBOX_SESSION)]
        cmd += ["--unshare-pid", "--unshare-ipc", "--unshare-uts"]
        if self.spec.network != "host":
            cmd.append("--unshare-net")
        chdir = self.runtime_path(cwd)
        cmd += ["--die-with-parent", "--new-session", "--cap-drop", "ALL"]
        inner = [sys.executable, "-I", "-S", str(FWD)]
        if status_fd is not None:
            inner += ["--status-fd", str(status_fd)]
        if self._bridge is not None and self._gateway is not None:
            sock = str(self._bridge.socket_path)
            cmd += ["--bind", str(self._bridge.socket_path.parent), str(self._bridge.socket_path.parent)]
            inner += ["--forward", "127.0.0.1", str(self._gateway[1]), sock]
        if self.user is not None:
            # Root inside until fwd_inside has bound its listener, with just what dropping to the sandbox uid
            # takes (and binding a gateway port below 1024); the session directory (0700, the sandbox
            # uid's) is entered after the drop.
            for cap in ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE"):
                cmd += ["--cap-add", cap]
            cmd += ["--chdir", "/"]
            inner += ["--user", str(self.user.uid), str(self.user.gid), "--chdir", chdir]
        else:
            cmd += ["--chdir", chdir]
            if self._bridge is None:
                return [*cmd, "--", *argv]
        return [*cmd, "--", *inner, "--", *argv]

    def _wrap(
        self, argv: list[str], cwd: Path, env: dict[str, str], status_fd: int | None
    ) -> tuple[list[str], str | None]:
        return self.bwrap_argv(argv, cwd, status_fd), None


def check(spec: RuntimeSpec) -> None:
    why = probe()
    if why is not None:
        raise RuntimeFailure(f"runtime 'bwrap' cannot run here: {why}")


RUNTIME = RuntimeEntry(BwrapRuntime, check)
