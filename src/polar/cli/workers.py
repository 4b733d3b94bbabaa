"""`polar gateway --workers N`: N serving processes over one store, each session served by one of them.

One interpreter serves a gateway's calls one at a time, so a single process tops out at what one core does
(docs/benchmarks.md). Here a supervisor binds every listener, then forks N workers; each runs the whole
gateway (`create_app` with its `WorkerSet`) over its own SQLite connection to the one WAL store:

- the shared model API port and control port are accepted on by every worker (one listening socket,
  inherited), and each worker also has a model API of its own, the `base_url` a new session is given, and a
  loopback control listener;
- a session belongs to worker `owner(session_id, N)` (`polar.gateway.forward`): its calls, numbering,
  chains and records are made there only; a call that reaches another worker is passed on to the owner,
  control requests go to the owner or to every worker (`polar.gateway.workers_control`);
- each worker commits its records (group commit on its writer thread) before answering, as one gateway
  does, so kill -9 of any process loses no answered call; SQLite's WAL lets one writer commit at a time and
  the others wait for its lock (docs/gateway-workers.md has what that costs, measured);
- a worker that dies is started again with the same sockets; its sessions are loaded back from the store
  by the new process as after a restart.

The supervisor forks before any thread or event loop exists in it, and stays single-threaded: a loop of
`os.wait`.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import signal
import socket
import sqlite3
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn

from polar.gateway.config import GatewayConfig
from polar.gateway.forward import WorkerSet
from polar.gateway.routing import Classifiers

log = logging.getLogger("polar.gateway")

RESTART_WINDOW_S = 10.0  # a worker that dies this soon after starting, RESTART_LIMIT times running, stops all
RESTART_LIMIT = 3
STOP_GRACE_S = 30.0


@dataclass
class Sockets:
    """Every listener of the gateway, bound by the supervisor before any worker starts."""

    data: socket.socket  # the shared model API (--host/--port)
    control: socket.socket  # the shared control listener (--control-host/--control-port)
    own_data: list[socket.socket]  # worker k's own model API (--host, any free port)
    own_control: list[socket.socket]  # worker k's own control listener (loopback, any free port)


@dataclass
class Worker:
    index: int
    pid: int = 0
    started: float = 0.0
    quick_deaths: int = 0
    ready: int = -1  # the read end of its start-up pipe, until it reported


@dataclass
class Supervisor:
    config: GatewayConfig
    classifiers: Classifiers | None
    sockets: Sockets
    workers: WorkerSet
    options: dict[str, Any]
    on_worker_start: Callable[[], None] | None = None
    procs: list[Worker] = field(default_factory=list)
    stopping: bool = False
    hurry: bool = False  # a second signal while stopping: the workers left are killed now

    def spawn(self, k: int) -> Worker:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker: never returns
            os.close(read)
            _worker_main(self, k, write)
        os.close(write)
        return Worker(k, pid, time.monotonic(), ready=read)

    def start(self) -> None:
        """Fork every worker and wait until each serves; a worker that cannot start stops them all and its
        one-line reason is raised (`CannotStart`, exit status 2)."""
        from polar.cli.common import CannotStart, cannot_start

        self.procs = [self.spawn(k) for k in range(self.workers.n)]
        waiting = {w.ready: w for w in self.procs}
        while waiting:
            readable, _, _ = select.select(list(waiting), [], [])
            for fd in readable:
                w = waiting.pop(fd)
                said = os.read(fd, 65536)
                os.close(fd)
                w.ready = -1
                if said != b"ok":
                    self.stop()
                    if said.startswith(b"E"):  # its own line, already "polar gateway: ..."
                        raise CannotStart(said[1:].decode(errors="replace"))
                    raise cannot_start(f"gateway worker {w.index} exited while starting (see its log above)")

    def supervise(self) -> None:
        """Until SIGINT/SIGTERM: start again any worker that exits. A second signal while the workers drain
        (Ctrl-C twice, or a terminal's Ctrl-C followed by a service manager's SIGTERM) ends their grace:
        the ones left are killed at once, as a single gateway exits at once on a second signal."""

        def stop(signum: int, frame: Any) -> None:
            if self.stopping:
                self.hurry = True  # raising here would abandon `stop()` half way, with a traceback
                return
            self.stopping = True  # before the raise: a signal right behind this one only hurries
            raise _Stop

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, stop)
        try:
            while True:
                pid, status = os.wait()
                w = next((w for w in self.procs if w.pid == pid), None)
                if w is None:
                    continue
                code = os.waitstatus_to_exitcode(status)
                quick = time.monotonic() - w.started < RESTART_WINDOW_S
                w.quick_deaths = w.quick_deaths + 1 if quick else 0
                if w.quick_deaths >= RESTART_LIMIT:
                    log.error(
                        "gateway worker %d exited (%s) %d times right after starting",
                        w.index,
                        code,
                        RESTART_LIMIT,
                    )
                    self.stop()
                    raise SystemExit(1)
                log.warning("gateway worker %d (pid %d) exited (%s); starting it again", w.index, pid, code)
                fresh = self.spawn(w.index)
                os.close(fresh.ready)  # nobody waits for it: calls for its sessions get 503 until it serves
                w.pid, w.started, w.ready = fresh.pid, fresh.started, -1
        except _Stop:
            self.stop()

    def stop(self) -> None:
        """SIGTERM to every worker (each drains like a single gateway), SIGKILL after `STOP_GRACE_S`."""
        self.stopping = True
        live = [w.pid for w in self.procs if w.pid]
        for pid in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while live and time.monotonic() < deadline and not self.hurry:
            for pid in list(live):
                with contextlib.suppress(ChildProcessError):
                    done, _ = os.waitpid(pid, os.WNOHANG)
                    if not done:
                        continue
                live.remove(pid)
            time.sleep(0.05)
        for pid in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


class _Stop(Exception):
    pass


def serve_workers(
    config: GatewayConfig,
    n: int,
    classifiers: Classifiers | None,
    options: dict[str, Any],
    on_worker_start: Callable[[], None] | None = None,
    on_ready: Callable[[str, str, WorkerSet], None] | None = None,
) -> None:
    """Bind the gateway's listeners, fork `n` workers and supervise them until SIGINT/SIGTERM. Problems
    of the machine or configuration (a port in use, a store or backend that cannot be used) are
    `CannotStart` (one line, exit status 2), as for one process. `on_ready(model API URL, control URL,
    workers)` runs in the supervisor once every worker serves (a node's gateway child reports them)."""
    from polar.cli.common import cannot_start, one_line, start_failure
    from polar.gateway.app import _reasoning_key
    from polar.serving import BindError, EmbeddedServer
    from polar.store.sqlite import SQLiteStore

    # One reasoning-signature key for all: made here, so no two workers make one each.
    try:
        with SQLiteStore(config.store_path, config.durability) as store:
            config = replace(config, reasoning_key=_reasoning_key(config, store))
    except (sqlite3.Error, OSError) as exc:
        raise cannot_start(f"{config.store_path}: {one_line(exc)}") from None
    listeners = [
        EmbeddedServer(None, config.host, config.port),
        EmbeddedServer(None, config.control_host, config.control_port, label="control port"),
        *(EmbeddedServer(None, config.host, 0, label=f"worker {k} port") for k in range(n)),
        *(EmbeddedServer(None, "127.0.0.1", 0, label=f"worker {k} control port") for k in range(n)),
    ]
    try:
        for server in listeners:
            server.bind()
    except BindError as exc:
        for server in listeners:
            server._release()
        failure = start_failure(exc, "polar gateway")
        raise (failure or exc) from None
    socks = [s.sock for s in listeners]
    assert all(s is not None for s in socks)
    own_data, own_control = listeners[2 : 2 + n], listeners[2 + n :]
    sockets = Sockets(socks[0], socks[1], socks[2 : 2 + n], socks[2 + n :])  # type: ignore[arg-type]
    workers = WorkerSet(
        index=-1,
        data_urls=tuple(s.url for s in own_data),
        public_urls=tuple(s.public_url for s in own_data),
        control_urls=tuple(s.url for s in own_control),
    )
    supervisor = Supervisor(config, classifiers, sockets, workers, options, on_worker_start)
    try:
        supervisor.start()
        log.info(
            "model API at %s (and per worker %s), control at %s (bearer token required); %d workers",
            listeners[0].url,
            ", ".join(workers.public_urls),
            listeners[1].url,
            n,
        )
        if on_ready is not None:
            on_ready(listeners[0].url, listeners[1].url, workers)
        supervisor.supervise()
    finally:
        for server in listeners:
            server._release()


def _worker_main(sup: Supervisor, k: int, ready: int) -> NoReturn:
    """A forked worker: serve the gateway on its sockets until SIGTERM (or the supervisor's death)."""
    code = 1
    try:
        _die_with_parent()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        code = _serve_worker(sup, k, ready)
    except BaseException:  # a bug: its traceback, and the supervisor sees the exit
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _serve_worker(sup: Supervisor, k: int, ready: int) -> int:
    from polar.cli.common import CannotStart, serve_until_stopped
    from polar.gateway.app import create_app
    from polar.serving import EmbeddedServer

    config, s = sup.config, sup.sockets
    for j in range(sup.workers.n):  # the other workers' own listeners are theirs to accept on
        if j != k:
            s.own_data[j].close()
            s.own_control[j].close()
    workers = replace(sup.workers, index=k)
    app = create_app(config, sup.classifiers, workers)
    o = sup.options
    servers = [
        EmbeddedServer(app.data, config.host, 0, sock=s.own_data[k], label=f"worker {k} port", **o),
        EmbeddedServer(app.data, config.host, config.port, sock=s.data, lifespan="off", **o),
        EmbeddedServer(
            app.control, "127.0.0.1", 0, sock=s.own_control[k], lifespan="off", label="control port", **o
        ),
        EmbeddedServer(
            app.control, config.control_host, 0, sock=s.control, lifespan="off", label="control port", **o
        ),
    ]

    def started() -> None:
        if sup.on_worker_start is not None:
            sup.on_worker_start()
        with contextlib.suppress(OSError):
            os.write(ready, b"ok")
            os.close(ready)

    try:
        serve_until_stopped(servers, started=started, database=config.store_path)
    except CannotStart as exc:
        with contextlib.suppress(OSError):
            os.write(ready, b"E" + exc.format_message().encode())
        return 2
    return 0


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when the supervisor dies (even by kill -9), so no worker serves on
    with nobody to restart or stop it."""
    parent = os.getppid()
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the call above
        os._exit(1)
