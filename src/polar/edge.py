"""What keeps one client from starving a polar process's others: open files, and logs of failed accepts.

A process that runs out of file descriptors stops accepting connections, for every session at once. Two
things make that less likely and less costly:

- `raise_open_files_limit`: the soft `RLIMIT_NOFILE` is often 1,024 while the hard limit allows far more
  (systemd and most container runtimes); every polar server raises soft to hard at start.
- `limit_accept_errors`: when accepting fails anyway, CPython's event loop logs it with a traceback, and
  (3.11, `BaseSelectorEventLoop._accept_connection`) does not stop at the first failure: it goes on trying
  up to `backlog` times in the same tick (uvicorn passes 2,048), logging each, and schedules as many retries
  a second later. One agent holding a node's descriptors grew its log by 141 MB in 30 s. The filter lets one
  such record through per `ACCEPT_LOG_INTERVAL_S`, on one line, saying how many it held back.
"""

from __future__ import annotations

import logging
import resource
import threading
import time
from pathlib import Path

ACCEPT_LOG_INTERVAL_S = 10.0
# asyncio's message when accept() fails for want of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM)
ACCEPT_ERROR = "socket.accept() out of system resource"
_HINT = "raise the open-files limit (ulimit -n) or find what holds the connections"


class Throttle:
    """At most one log line per `interval_s`; `allow` says whether this one goes out and how many were
    held back since the last one that did (thread-safe: the bridge logs from its own thread)."""

    def __init__(self, interval_s: float = ACCEPT_LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last: float | None = None
        self._held = 0

    def allow(self) -> tuple[bool, int]:
        now = time.monotonic()
        with self._lock:
            if self._last is not None and now - self._last < self.interval_s:
                self._held += 1
                return False, 0
            held, self._held, self._last = self._held, 0, now
            return True, held


def _held_note(held: int) -> str:
    return f" ({held} more since the last line, not logged)" if held else ""


class AcceptErrorFilter(logging.Filter):
    """On the `asyncio` logger: asyncio's accept failures, one line per interval with the count held back
    and the error, without the traceback (it is always the same frame of the event loop)."""

    def __init__(self, interval_s: float = ACCEPT_LOG_INTERVAL_S) -> None:
        super().__init__()
        self.throttle = Throttle(interval_s)

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith(ACCEPT_ERROR)):
            return True
        allowed, held = self.throttle.allow()
        if not allowed:
            return False
        error = record.exc_info[1] if record.exc_info else None
        record.msg = f"{ACCEPT_ERROR}: {error or 'unknown error'}; {_HINT}{_held_note(held)}"
        record.args = None
        record.exc_info = record.exc_text = None
        return True


_installed: AcceptErrorFilter | None = None
_install_lock = threading.Lock()


def limit_accept_errors() -> AcceptErrorFilter:
    """Install the `AcceptErrorFilter` on the `asyncio` logger, once per process."""
    global _installed
    with _install_lock:
        if _installed is None:
            _installed = AcceptErrorFilter()
            logging.getLogger("asyncio").addFilter(_installed)
        return _installed


def log_accept_error(log: logging.Logger, throttle: Throttle, where: str, exc: OSError) -> None:
    """One line for an accept() that failed, at most once per the throttle's interval (polar's own
    accept loops: the gateway bridge)."""
    allowed, held = throttle.allow()
    if allowed:
        log.error("%s: accept failed: %s; %s%s", where, exc, _HINT, _held_note(held))


def _nr_open() -> int:
    try:
        return int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        return 1 << 20


def raise_open_files_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (never lowers it); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An unlimited hard limit is not a valid soft one for NOFILE: Linux caps it at fs.nr_open.
    target = _nr_open() if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft
        return target
    return soft


def prepare_server_process() -> None:
    """What every process that serves does at start: the open-files limit raised, accept errors throttled
    (idempotent; the CLI calls it, and so does every listener polar starts)."""
    raise_open_files_limit()
    limit_accept_errors()
