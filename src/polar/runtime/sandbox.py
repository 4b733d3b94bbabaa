"""What a sandboxed agent is and what it sees: an unprivileged uid of its own, and a curated read-only view.

An agent under RL training is untrusted: it will try whatever pays. Read-only mounts alone do not make a
boundary, because `connect()` on a unix socket needs no write access to the file system: an agent running
as root under `--ro-bind / /` drove the host's docker socket into a root container on the host, read
/etc/shadow and opened the run's stores. Two layers close that, each enough for the findings alone:

- **An unprivileged uid per sandbox** (when the node is root). Host permissions then hold against the
  agent: root-only files (/etc/shadow, the stores, which polar creates 0600, the token file) and sockets
  (docker's is root:docker 0660) refuse it, and another session's directory (0700, another uid) is closed.
  Uids come from a range no account uses, one per live sandbox on the machine (a lock file per uid, held
  while the sandbox lives, so two nodes on one machine never hand out the same uid).
- **A curated view** (`visible_paths`): system directories, the Python that runs polar and its sources, the
  harness tool cache and what the task names, all read-only; a private /tmp, empty /run, /var and home
  directories. Host sockets, stores, token files and other sessions' directories are not in it at all.

A non-root node cannot switch uids: its sandboxes run as its own uid in a user namespace, and the curated
view is the boundary.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# Sandbox uids and gids: far above the ranges distributions give to accounts (1000-60000) and the subuid
# ranges rootless containers take (100000-165535 per user, usually), so a file a sandbox leaves behind can
# never be mistaken for a person's. Overridable for hosts that use this range.
UID_BASE = int(os.environ.get("POLAR_SANDBOX_UID_BASE", "2000000000"))
UID_COUNT = 1 << 16
_LOCKS = Path("/run/polar/sandbox-uids") if Path("/run").is_dir() else Path("/tmp/polar-sandbox-uids")

# System directories every sandbox sees read-only (those the host has). /bin, /lib and friends are
# symlinks into /usr on merged-/usr systems; they are recreated as the same symlinks.
SYSTEM = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# Empty and private in every sandbox: where host services keep their sockets (/run, /var/run), state
# (/var/lib: docker's containers, databases) and users their secrets (home directories).
MASKED = ("/tmp", "/run", "/var", "/home", "/root", "/mnt", "/media", "/srv", "/opt")


@dataclass
class SandboxUser:
    """A uid/gid pair held for one sandbox; `release` (or the process's death) frees it."""

    uid: int
    gid: int
    _lock: int | None = None

    def release(self) -> None:
        if self._lock is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock)
            self._lock = None


def allocate_user() -> SandboxUser | None:
    """A free sandbox uid (gid alike) for this machine, or None when this process cannot switch uids
    (not root): then the sandbox runs as the node's own uid."""
    if os.geteuid() != 0:
        return None
    _LOCKS.mkdir(mode=0o700, parents=True, exist_ok=True)
    for _ in range(64):
        uid = UID_BASE + secrets.randbelow(UID_COUNT)
        fd = os.open(_LOCKS / str(uid), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return SandboxUser(uid, uid, fd)
    raise OSError(f"no free sandbox uid after 64 tries in {UID_BASE}+{UID_COUNT}")


def chown_tree(path: Path, user: SandboxUser) -> None:
    """Give `path` and everything under it to `user`, never following a symlink (a link the tree holds
    must not hand a host file to the sandbox)."""
    os.chown(path, user.uid, user.gid, follow_symlinks=False)
    if path.is_symlink() or not path.is_dir():
        return
    for root, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            os.chown(os.path.join(root, name), user.uid, user.gid, follow_symlinks=False)


def python_paths() -> list[str]:
    """The Python that runs polar (and the builtin harness, and the forwarder) and polar's own sources."""
    import polar

    return [
        sys.base_prefix,
        sys.prefix,
        os.path.dirname(sys.executable),  # a venv's bin/ (its python links to the base one)
        str(Path(polar.__file__).resolve().parents[1]),  # the directory holding the polar package
    ]


def tools_home() -> Path:
    """Where harness CLIs are installed, pinned (`polar.harness.install`): every sandbox sees it read-only."""
    home = os.environ.get("POLAR_HOME")
    base = Path(home) if home else Path.home() / ".cache" / "polar"
    return base / "tools"


def visible_paths(extra: Iterable[str] = ()) -> list[str]:
    """Host paths bound read-only (at the same path) into a sandbox, besides the system directories: the
    Python, polar's sources, the harness tool cache and `extra`; nested ones are covered by their outermost
    one, and paths that do not exist are left out (a missing tool cache before the first install). A symlink
    is bound both where it is and where it points, so either name works inside."""
    named = [*python_paths(), str(tools_home()), *extra]
    candidates = {os.path.normpath(p) for p in named if p} | {os.path.realpath(p) for p in named if p}
    existing = sorted(p for p in candidates if os.path.exists(p) and p != "/")
    system = tuple(s + "/" for s in SYSTEM)
    outer = [p for p in existing if not any(p.startswith(q + "/") for q in existing if q != p)]
    return [p for p in outer if not p.startswith(system)]
