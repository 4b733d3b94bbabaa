"""Stores readable by their owner only: SQLite files 0600 and the directories polar makes for them 0700.

A store holds every prompt, answer and reward, and the rollout server's holds each dispatch's credential.
SQLite creates a database with the process's umask (0644 under the usual 022) and gives its `-wal`, `-shm`
and `-journal` files the database's own permission bits (os_unix.c, `findCreateFileMode`; it `fchmod`s
them when the umask stripped some): creating the database 0600 before SQLite opens it is enough for all.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

SIDE_FILES = ("-wal", "-shm", "-journal")


def private_dirs(path: Path) -> None:
    """Create `path` and its missing parents with mode 0700; directories that exist are left as they are
    (they are the operator's)."""
    missing: list[Path] = []
    here = path
    while not here.exists() and here != here.parent:
        missing.append(here)
        here = here.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another process
            folder.mkdir(mode=0o700)
        with contextlib.suppress(OSError):
            folder.chmod(0o700)  # mkdir's mode passes through the umask; 0700 survives any, but be exact


def private_database(path: str | Path) -> None:
    """Make the SQLite database at `path` 0600 before SQLite opens it: created so when missing, tightened
    (with its side files) when an earlier version left it readable to others. A directory that does not
    exist is not created, nor is any other problem raised here: SQLite's own error names the path.

    An existing database is never opened here, only changed by path: closing any descriptor of a file drops
    every POSIX lock this process holds on it, SQLite's included, and a process whose connections hold no
    lock lets the next reader elsewhere think it is the last user and delete the WAL still being written
    (tests/test_gateway_durability.py)."""
    name = str(path)
    if name in ("", ":memory:") or name.startswith("file:"):
        return
    try:
        mode = os.stat(name).st_mode
    except FileNotFoundError:
        try:  # a new file: no connection of this process can hold a lock on it yet
            os.close(os.open(name, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        except OSError:
            return
    except OSError:
        return
    else:
        if mode & 0o077:
            with contextlib.suppress(OSError):  # not ours (a store shared on purpose): left as it is
                os.chmod(name, 0o600)
    for suffix in SIDE_FILES:
        with contextlib.suppress(OSError):
            side = name + suffix
            if os.stat(side).st_mode & 0o077:
                os.chmod(side, 0o600)
