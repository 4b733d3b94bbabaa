"""Bubblewrap: the local runtime's session directory, inside a sandbox.

Each command runs as `bwrap ... -- ARGV` with the host mounted read-only, a private /tmp, the session
directory writable at its host path (so host and sandbox agree on every path), its own PID namespace
(killing bwrap kills everything in it, daemons included: the kernel tears a PID namespace down with its
init) and, unless `network="host"`, its own network namespace where only a private loopback exists.

`network="gateway"`: the gateway must stay reachable while nothing else is. A fresh network namespace
has its own loopback, not the host's, so the node serves a unix socket (`UnixBridge`) that splices to the
gateway, binds it into the sandbox, and each command starts under `fwd_inside.py`, which listens on the
sandbox's 127.0.0.1 at the gateway's port and splices to that socket. The harness is given
`runtime.gateway_url` (`http://127.0.0.1:<gateway port>`), which only answers the gateway.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Unpack
from urllib.parse import urlsplit

from polar.runtime.base import RuntimeFailure, RuntimeSpec
from polar.runtime.bridge import UnixBridge
from polar.runtime.local import Keep, LocalRuntime, RuntimeOptions

_FWD = Path(__file__).with_name("fwd_inside.py")


def _gateway_address(url: str) -> tuple[str, int, str]:
    """(host, port, url as seen inside) of the gateway URL the host uses."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RuntimeFailure(f"gateway URL {url!r} is not an http(s) URL")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.hostname, port, f"{parts.scheme}://127.0.0.1:{port}{parts.path.rstrip('/')}"


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
        self._bridge: UnixBridge | None = None
        self._target: tuple[str, int] | None = None
        if spec.network == "gateway" and self.gateway_url is not None:
            host, port, self.gateway_url = _gateway_address(self.gateway_url)
            self._target = (host, port)
        elif spec.network == "none":
            self.gateway_url = None  # nothing answers inside

    async def start(self) -> None:
        if self._state != "new":
            return
        for path in self.spec.read_only_paths:
            if not Path(path).is_absolute() or not Path(path).exists():
                raise RuntimeFailure(f"read_only_paths: {path!r} is not an existing absolute path")
        await super().start()
        if self._target is not None:
            # Short and outside the session dir: a unix socket path must fit in 108 bytes
            sock_dir = Path(tempfile.mkdtemp(prefix="polar-gw-", dir="/tmp"))
            self._bridge = UnixBridge(sock_dir / "gw.sock", *self._target)
            try:
                self._bridge.start()
            except OSError as exc:
                raise RuntimeFailure(f"cannot start the gateway bridge: {exc}") from exc

    async def stop(self, *, keep: Keep | None = None) -> None:
        await super().stop(keep=keep)
        if self._bridge is not None:
            self._bridge.close()
            self._bridge.socket_path.parent.rmdir()
            self._bridge = None

    def bwrap_argv(self, argv: list[str], cwd: Path) -> list[str]:
        """The full bwrap command line for `argv` run in `cwd` (host path = sandbox path)."""
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
        cmd += ["--bind", session, session]
        for path in self.spec.read_only_paths:
            cmd += ["--ro-bind", path, path]
        cmd += ["--unshare-pid", "--unshare-ipc", "--unshare-uts"]
        if self.spec.network != "host":
            cmd.append("--unshare-net")
        # --cap-drop ALL: as root, bwrap keeps capabilities, which would allow remounting / read-write
        cmd += ["--die-with-parent", "--new-session", "--cap-drop", "ALL", "--chdir", str(cwd)]
        if self._bridge is not None and self._target is not None:
            sock = str(self._bridge.socket_path)
            cmd += ["--bind", str(self._bridge.socket_path.parent), str(self._bridge.socket_path.parent)]
            cmd += ["--", sys.executable, "-I", "-S", str(_FWD), "127.0.0.1", str(self._target[1]), sock]
        return [*cmd, "--", *argv]

    def _wrap(self, argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[list[str], str | None]:
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
