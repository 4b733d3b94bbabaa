"""Process groups recorded on disk, so that a node restarted after a SIGKILL kills what the dead one left.

Where runtimes get a PID namespace (bwrap, local with `unshare`), a node's death kills its commands at
once. Without one (a local runtime where namespaces are forbidden), `PR_SET_PDEATHSIG` only reaches the
node's direct child; its descendants are orphaned. So every process group a runtime starts is recorded as
a file `<pgid>` holding `owner-pid owner-start leader-start boot-id`, removed when the group is gone, and
`reap_leftovers` (run at node start) kills the groups whose owner is dead. Start times (clock ticks since
boot, from /proc) tell a recorded process from a later one that reuses its pid, the boot id tells records
of an earlier boot; a group id whose leader is gone cannot be reused while members of the group live.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import stat
import tempfile
from pathlib import Path

from polar.runtime.procs import group_alive

log = logging.getLogger("polar.runtime")


def records_dir() -> Path:
    """One directory per user, shared by every node of that user on this machine (records name their
    owner, so a node never reaps a live one's groups)."""
    return Path(tempfile.gettempdir()) / f"polar-groups-{os.geteuid()}"


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # comm may hold spaces and parentheses
    return int(fields[19]) if len(fields) > 19 else None


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def _private(directory: Path) -> bool:
    """Create `directory` if needed; True only if it is a real directory of ours that nobody else can
    write (another user's planted directory or symlink would let them choose what we kill)."""
    with contextlib.suppress(FileExistsError, OSError):
        directory.mkdir(mode=0o700, parents=True)
    try:
        st = directory.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


class GroupRecords:
    """The records of one process (a node, a `polar run`): add when a group starts, discard when gone."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or records_dir()

    def add(self, pgid: int) -> None:
        if not _private(self.directory):
            return
        owner = os.getpid()
        line = f"{owner} {start_time(owner) or 0} {start_time(pgid) or 0} {_boot_id()}\n"
        with contextlib.suppress(OSError):  # best effort: a full disk must not fail the command
            (self.directory / str(pgid)).write_text(line)

    def discard(self, pgid: int) -> None:
        with contextlib.suppress(OSError):
            (self.directory / str(pgid)).unlink()


def reap_leftovers(directory: Path | None = None) -> list[int]:
    """SIGKILL every recorded group whose owner process is dead; returns their ids."""
    directory = directory or records_dir()
    if not directory.is_dir() or not _private(directory):
        return []
    boot, killed = _boot_id(), []
    for record in directory.iterdir():
        try:
            pgid = int(record.name)
            owner, owner_start, leader_start, record_boot = record.read_text().split()
        except (OSError, ValueError):
            record.unlink(missing_ok=True)
            continue
        if record_boot == boot and start_time(int(owner)) == int(owner_start):
            continue  # its node is alive and looks after it
        leader_now = start_time(pgid)
        # A leader with another start time is a new process reusing the id: the recorded group is gone.
        ours = leader_now is None or leader_now == int(leader_start)
        if record_boot == boot and ours and group_alive(pgid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
                killed.append(pgid)
        record.unlink(missing_ok=True)
    if killed:
        log.warning("killed %d process group(s) left by a node that died: %s", len(killed), killed)
    return killed


def owner_label() -> str:
    """This process as a container label names it: `host:pid:start-ticks:boot-id`."""
    pid = os.getpid()
    return f"{socket.gethostname()}:{pid}:{start_time(pid) or 0}:{_boot_id()}"


def owner_dead(label: str) -> bool:
    """Whether an `owner_label` names a process of this host that no longer runs (it has exited, or the
    host rebooted since). Another host's label, or one that does not parse, is not ours to judge: an engine
    can be shared between machines (a remote DOCKER_HOST), and their nodes look after their own."""
    try:
        host, pid, start, boot = label.rsplit(":", 3)
        pid_n, start_n = int(pid), int(start)
    except ValueError:
        return False
    if host != socket.gethostname():
        return False
    return boot != _boot_id() or start_time(pid_n) != start_n


# -- session directories ------------------------------------------------------------------------------------
# A session directory (`<root>/polar-<session>-<random>`) is removed when its runtime stops; a node killed
# with SIGKILL removes none. So the node records its claim beside each one it would remove, in a file
# `<directory>.owner` holding its `owner_label` (outside the directory: no sandbox sees or writes it), and
# the next node start on the same root removes the directories whose owner is dead. A live node's, another
# host's (a shared root), a kept one's (`keep` other than nothing: never claimed) stay.
OWNER_SUFFIX = ".owner"


def _marker(session_dir: Path) -> Path:
    return session_dir.with_name(session_dir.name + OWNER_SUFFIX)


def claim_session_dir(session_dir: Path) -> None:
    """Record that this process owns `session_dir` (best effort: a claim that cannot be written only
    leaves the directory behind if the node is killed)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(_marker(session_dir), flags, 0o600)
    except OSError as exc:
        log.debug("cannot record the owner of %s: %s", session_dir, exc)
        return
    with os.fdopen(fd, "w") as f:
        f.write(owner_label() + "\n")


def release_session_dir(session_dir: Path) -> None:
    """The directory was removed (or is kept on purpose): forget the claim."""
    with contextlib.suppress(OSError):
        _marker(session_dir).unlink()


def remove_dead_session_dirs(root: Path | None = None) -> list[Path]:
    """Remove the session directories under `root` (default: the temp dir, where runtimes make them)
    claimed by a process of this host that is dead; returns them."""
    root = root if root is not None else Path(tempfile.gettempdir())
    removed: list[Path] = []
    try:
        markers = list(root.glob(f"polar-*{OWNER_SUFFIX}"))
    except OSError:
        return removed
    for marker in markers:
        try:
            st = marker.lstat()
            # Ours and a plain file: in a shared /tmp another user's planted claim must not pick what we delete
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue
            label = marker.read_text().strip()
        except OSError:
            continue
        if not owner_dead(label):
            continue
        session_dir = marker.with_name(marker.name.removesuffix(OWNER_SUFFIX))
        with contextlib.suppress(OSError):
            if stat.S_ISDIR(session_dir.lstat().st_mode):  # never through a symlink
                shutil.rmtree(session_dir, ignore_errors=True)
        if not os.path.lexists(session_dir):
            marker.unlink(missing_ok=True)
            removed.append(session_dir)
    if removed:
        log.warning("removed %d session directory(ies) left by a node that died", len(removed))
    return removed
