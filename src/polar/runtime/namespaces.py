"""Namespaces for the local runtime, through util-linux: `unshare` for them, `setpriv` for the rest.

Each command of a local runtime runs as

    setpriv --pdeathsig KILL -- unshare [--user --map-current-user --keep-caps] [--net] --mount --pid
        --fork --kill-child --mount-proc -- python -I -S fwd_inside.py [--lo] [--forward ...] --setpriv ...

`--pdeathsig KILL` on the node's direct child and `--kill-child` on the namespace's first process make a
node killed with SIGKILL take every command with it (the PID namespace dies with its PID 1); the private
/proc hides the host's processes; `--net` leaves only the namespace's own loopback, where `fwd_inside.py`
forwards the gateway's port. As root no user namespace is needed; otherwise one mapping the node's user
(util-linux 2.38's `--map-current-user`, with `--keep-caps` so that the forwarder may bring `lo` up).
Whether this works here (a container may forbid namespaces) is probed once per process.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from polar.runtime.base import RuntimeFailure

FWD = Path(__file__).with_name("fwd_inside.py")


@dataclass(frozen=True)
class Namespaces:
    unshare: str
    setpriv: str
    user: bool  # not root: a user namespace owns the others

    def argv(
        self,
        argv: list[str],
        *,
        network: bool,
        forward: tuple[int, str] | None = None,
        status_fd: int | None = None,
    ) -> list[str]:
        """`argv` in fresh mount and PID namespaces, and a network namespace when `network`; `forward`
        (port, unix socket) makes the sandbox's 127.0.0.1:port reach that socket."""
        cmd = [self.setpriv, "--pdeathsig", "KILL", "--", self.unshare]
        if self.user:
            cmd += ["--user", "--map-current-user", "--keep-caps"]
        if network:
            cmd.append("--net")
        cmd += ["--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "--"]
        cmd += [sys.executable, "-I", "-S", str(FWD)]
        if network:
            cmd.append("--lo")
        if forward is not None:
            cmd += ["--forward", "127.0.0.1", str(forward[0]), forward[1]]
        cmd += ["--setpriv", self.setpriv]
        if status_fd is not None:
            cmd += ["--status-fd", str(status_fd)]
        return [*cmd, "--", *argv]


def pdeathsig(argv: list[str], path: str | None) -> list[str]:
    """`argv` killed when the node dies (only the direct child: its descendants are reaped at the next
    node start), where setpriv exists. A command not found on `path` is left unwrapped, so that it fails
    as one (polar's exit 127), not as a setpriv error."""
    setpriv = shutil.which("setpriv")
    if setpriv is None or ("/" not in argv[0] and shutil.which(argv[0], path=path) is None):
        return argv
    return [setpriv, "--pdeathsig", "KILL", "--", *argv]


@functools.cache
def probe() -> Namespaces | str:
    """The namespaces this process can make, or why it cannot (checked by running the real command line
    once: a container or a sysctl may forbid user namespaces or mounting /proc)."""
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    if unshare is None or setpriv is None:
        return "util-linux's `unshare` and `setpriv` are not both on PATH"
    ns = Namespaces(unshare, setpriv, user=os.geteuid() != 0)
    try:
        done = subprocess.run(
            ns.argv(["true"], network=True), capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run unshare: {exc}"
    if done.returncode != 0:
        return f"unshare failed (exit {done.returncode}): {done.stderr.strip()[-300:]}"
    return ns


def for_network(network: str) -> Namespaces | None:
    """The namespaces a local runtime runs its commands in, None where there are none (then only
    `network: host` is possible); raises `RuntimeFailure` for a network it cannot confine here."""
    support = probe()
    if isinstance(support, Namespaces):
        return support
    if network != "host":
        raise RuntimeFailure(
            f"runtime 'local' cannot confine network {network!r} on this machine: it needs Linux "
            f"namespaces ({support}); use runtime 'bwrap', or network 'host' to give the agent the "
            "host's network"
        )
    return None
