"""Bubblewrap: the local runtime's session directory, inside a sandbox.

Each command runs as `bwrap ... -- ARGV` with the host mounted read-only, a private /tmp, the session
directory writable at `/tmp/polar-session` (the same path in every session, so what a CLI writes into its
prompt does not differ between the samples of a task; `runtime_path()` maps host paths), its own PID namespace
(killing bwrap kills everything in it, daemons included: the kernel tears a PID namespace down with its
init; `--die-with-parent` makes the node's death, SIGKILL included, kill bwrap), no capabilities, and,
unless `network="host"`, its own network namespace where only a private loopback exists.

`network="gateway"`: the gateway must stay reachable while nothing else is. As with `local`, the node
serves a unix socket (`UnixBridge`) that splices to the gateway; bwrap binds it into the sandbox, and each
command starts under `fwd_inside.py`, which listens on the sandbox's 127.0.0.1 at the gateway's port and
splices to that socket. The harness is given `runtime.gateway_url` (`http://127.0.0.1:<gateway port>`),
which only answers the gateway.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Unpack

from polar.runtime.base import RuntimeSpec
from polar.runtime.local import LocalRuntime, RuntimeOptions
from polar.runtime.namespaces import FWD

# Where the sandbox sees its session directory: under its private /tmp (the host's root is read-only, so no
# new top-level directory can be made), the same for every session.
SANDBOX_SESSION = Path("/tmp/polar-session")


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

    async def _isolate(self) -> None:
        # bwrap makes its own namespaces (and brings the loopback up itself)
        self._check_read_only_paths()

    def runtime_path(self, path: Path) -> str:
        path = Path(path)
        if path.is_relative_to(self.session_dir):
            return str(SANDBOX_SESSION / path.relative_to(self.session_dir))
        return str(path)

    def bwrap_argv(self, argv: list[str], cwd: Path) -> list[str]:
        """The full bwrap command line for `argv` run in `cwd` (a host path, as the sandbox sees it)."""
        session = str(self.session_dir)
        cmd = [
            self.bwrap,
            "--ro-bind", "/", "/",
            "--dev", "/dev",
            "--proc", "/proc",
            "--tmpfs", "/tmp",
        ]  # fmt: skip
        for path in _needed_under_tmp():  # before the session bind, which may lie inside one of them
            cmd += ["--ro-bind", path, path]
        cmd += ["--bind", session, str(SANDBOX_SESSION)]
        for path in self.spec.read_only_paths:
            cmd += ["--ro-bind", path, path]
        cmd += ["--unshare-pid", "--unshare-ipc", "--unshare-uts"]
        if self.spec.network != "host":
            cmd.append("--unshare-net")
        # --cap-drop ALL: as root, bwrap keeps capabilities, which would allow remounting / read-write
        chdir = self.runtime_path(cwd)
        cmd += ["--die-with-parent", "--new-session", "--cap-drop", "ALL", "--chdir", chdir]
        if self._bridge is not None and self._gateway is not None:
            sock = str(self._bridge.socket_path)
            cmd += ["--bind", str(self._bridge.socket_path.parent), str(self._bridge.socket_path.parent)]
            cmd += ["--", sys.executable, "-I", "-S", str(FWD), "--forward", "127.0.0.1", str(self._gateway[1]), sock]  # fmt: skip
        return [*cmd, "--", *argv]

    def _wrap(
        self, argv: list[str], cwd: Path, env: dict[str, str], status_fd: int | None
    ) -> tuple[list[str], str | None]:
        return self.bwrap_argv(argv, cwd), None


def _needed_under_tmp() -> list[str]:
    """Host paths under /tmp that sandboxed programs need and `--tmpfs /tmp` would hide: the Python
    environment and the polar checkout, when a virtualenv or a fresh clone was made under /tmp (as CI's and
    many test runners' are). Bound read-only; nested paths are covered by their outermost one."""
    import polar

    candidates = {
        sys.prefix,
        sys.base_prefix,
        os.path.dirname(os.path.realpath(sys.executable)),
        str(Path(polar.__file__).resolve().parents[2]),  # src/polar/__init__.py -> the checkout
        os.environ.get("POLAR_HOME", ""),  # the harness tools cache, when a node keeps it under /tmp
    }
    under = sorted(p for p in candidates if p.startswith("/tmp/") and os.path.isdir(p))
    return [p for p in under if not any(p.startswith(q + "/") for q in under if q != p)]
