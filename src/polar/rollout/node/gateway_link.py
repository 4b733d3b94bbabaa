"""The node's gateway as its stages use it: a session opened, known and closed, and where its harness calls.

One gateway process (the default) runs inside the node, on the node's own event loop (`InProcess`). With
`gateway_workers` > 1 it is `polar gateway --workers N` (`polar.cli.workers`) in a process tree of its own
(`GatewayChild`: the node already has threads and a loop, so it cannot fork the workers itself), reached over
its control listener (`Workers`): each session is created on its owner (the workers' control router), and
its runtime is pointed at its owner's own model API, so a harness's calls pay no hop between workers.
docs/gateway-workers.md has the design.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pickle
import re
import signal
import subprocess
import sys
from dataclasses import replace
from typing import Any, Protocol

import httpx

from polar.gateway.config import GatewayConfig
from polar.gateway.forward import owner
from polar.gateway.proxy import Proxy
from polar.logs import JsonFormatter
from polar.rollout.protocol import error_message
from polar.store.sqlite import SQLiteStore

START_TIMEOUT_S = 120.0  # the workers' start-up: the store, the backend's first answers
STOP_GRACE_S = 40.0  # the supervisor gives its workers 30 s to drain


class GatewayStartError(RuntimeError):
    """The gateway's workers could not start; the message is their one line (a port in use, a store or
    backend that cannot be used)."""


class NodeGateway(Protocol):
    """What the node's stages and admission ask of its gateway."""

    @property
    def served_model(self) -> str:
        """The model the gateway serves (what a task that names none is given)."""

    async def open(self, metadata: dict[str, Any], session_id: str) -> None:
        """Create the session (its id is its API key). KeyError: the id was used before; ValueError: the
        metadata's side-call route cannot be built (its message names the field)."""

    def known(self, session_id: str) -> bool:
        """Whether the gateway (or its store) holds the id."""

    async def close(self, session_id: str) -> None:
        """Refuse the session's key from now on."""

    def url_for(self, session_id: str) -> str:
        """The model API serving this session, as this machine reaches it (a runtime is given it unless the
        node names another address for runtimes, `runtime_gateway_url`)."""


class InProcess:
    """The gateway served by the node itself (`NodeApp.gateway`)."""

    def __init__(self, proxy: Proxy, url: str) -> None:
        self.proxy, self.url = proxy, url

    @property
    def served_model(self) -> str:
        return self.proxy.served_model

    async def open(self, metadata: dict[str, Any], session_id: str) -> None:
        await self.proxy.sessions.create(metadata, session_id)

    def known(self, session_id: str) -> bool:
        return self.proxy.sessions.get(session_id) is not None

    async def close(self, session_id: str) -> None:
        await self.proxy.close_session(session_id)

    def url_for(self, session_id: str) -> str:
        return self.url


class Workers:
    """The gateway's workers in `GatewayChild`, over their shared control listener (the token the node's
    own control listener takes), each session's runtime pointed at its owner."""

    def __init__(self, child: GatewayChild) -> None:
        self.child = child
        self._http = httpx.AsyncClient(
            base_url=child.control_url,
            headers={"authorization": f"Bearer {child.config.control_token}"},
            timeout=httpx.Timeout(60.0, connect=10.0),
        )
        self._store = SQLiteStore(child.config.store_path, child.config.durability)

    @property
    def served_model(self) -> str:
        return self.child.served_model

    async def open(self, metadata: dict[str, Any], session_id: str) -> None:
        r = await self._http.post("/sessions", json={"session_id": session_id, "metadata": metadata})
        if r.status_code == 409:
            raise KeyError(session_id)
        if r.status_code == 400:
            raise ValueError(_message(r).removeprefix("metadata."))
        if r.status_code != 201:
            raise RuntimeError(f"the gateway's workers answered {r.status_code}: {_message(r)}")

    def known(self, session_id: str) -> bool:
        # The store says it for every worker: a session is in it from its creation on.
        return self._store.session(session_id) is not None

    async def close(self, session_id: str) -> None:
        r = await self._http.delete(f"/sessions/{session_id}")
        if r.status_code not in (200, 404):
            raise RuntimeError(f"the gateway's workers answered {r.status_code}: {_message(r)}")

    def url_for(self, session_id: str) -> str:
        urls = self.child.worker_urls
        return urls[owner(session_id, len(urls))]

    async def metrics(self) -> bytes:
        """The workers' `/metrics`, summed over them (Prometheus text); a comment line when unanswered."""
        try:
            r = await self._http.get("/metrics", headers={"accept": "text/plain"})
        except httpx.HTTPError as exc:
            return f"# the gateway's workers did not answer: {exc}\n".encode()
        if r.status_code != 200:
            return f"# the gateway's workers answered {r.status_code}\n".encode()
        return r.content

    async def aclose(self) -> None:
        await self._http.aclose()
        self._store.close()


def _message(r: httpx.Response) -> str:
    return error_message(r.content) or r.text[:200]


class GatewayChild:
    """`polar gateway --workers N` for a node, in a process of its own: it binds the model API on the
    node's host and port and a control listener on loopback, forks the workers, and reports where they
    serve on a pipe (`polar.cli.node_gateway`). It gets SIGTERM when the node dies."""

    def __init__(self, config: GatewayConfig, workers: int) -> None:
        # Its control listener is the node's to reach (on loopback, any free port): the node's own control
        # listener takes the node's --control-port and passes the gateway's routes on.
        self.config = replace(config, control_host="127.0.0.1", control_port=0)
        self.workers = workers
        self.proc: subprocess.Popen[bytes] | None = None
        self.data_url = self.control_url = self.served_model = ""
        self.worker_urls: tuple[str, ...] = ()

    async def start(self) -> None:
        """Start it and wait until every worker serves; `GatewayStartError` with the child's one line when
        it cannot (a port in use, a store or backend that cannot be used)."""
        read, write = os.pipe()
        try:
            # A session of its own: a terminal's Ctrl-C reaches the node alone, which stops it (one SIGTERM:
            # the workers drain) once its sessions ended and closed through it. In the node's group the
            # Ctrl-C began their drain at once and the node's SIGTERM came as a second signal, which ends
            # the drain (`Supervisor.supervise`).
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "polar.cli.node_gateway", str(write)],
                stdin=subprocess.PIPE,
                pass_fds=(write,),
                start_new_session=True,
            )
        finally:
            os.close(write)
        assert self.proc.stdin is not None
        # The config holds the control token: it goes over a pipe, never in argv or the environment.
        self.proc.stdin.write(pickle.dumps((self.config, self.workers, *_logging())))
        self.proc.stdin.close()
        try:
            said = await asyncio.wait_for(asyncio.to_thread(_read_all, read), START_TIMEOUT_S)
        except TimeoutError:
            await self.stop()
            raise GatewayStartError(
                f"the gateway's workers did not start within {START_TIMEOUT_S:g} s"
            ) from None
        finally:
            os.close(read)
        if not said.startswith(b"ok"):
            await self.stop()
            # Its one line without the child's own "polar ...: " (the node's command names it).
            reason = (
                re.sub(r"^polar[\w ]*: ", "", said[1:].decode(errors="replace"))
                if said.startswith(b"E")
                else ""
            )
            raise GatewayStartError(
                reason or f"the gateway's workers exited while starting ({self.proc.returncode})"
            )
        ready = json.loads(said[2:])
        self.data_url, self.control_url = ready["data"], ready["control"]
        self.worker_urls = tuple(ready["workers"])
        async with httpx.AsyncClient(timeout=30.0) as http:  # the model the workers resolved at start
            self.served_model = str((await http.get(self.data_url + "/health")).json()["model"])

    async def stop(self) -> None:
        """SIGTERM (the supervisor drains its workers), SIGKILL after `STOP_GRACE_S`."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.to_thread(proc.wait), STOP_GRACE_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await asyncio.to_thread(proc.wait)

    async def wait(self) -> int:
        """Until it exits (its supervisor stopped or was killed); its exit status."""
        assert self.proc is not None
        return await asyncio.to_thread(self.proc.wait)


def _logging() -> tuple[str, bool]:
    """This process's log level and whether it logs JSON (`polar.logs.setup_logging`), for the child."""
    root = logging.getLogger()
    json_lines = any(isinstance(h.formatter, JsonFormatter) for h in root.handlers)
    return logging.getLevelName(root.getEffectiveLevel()).lower(), json_lines


def _read_all(fd: int) -> bytes:
    """What the child wrote on its start-up pipe, until it closed it (or exited)."""
    out = b""
    while chunk := os.read(fd, 65536):
        out += chunk
    return out
