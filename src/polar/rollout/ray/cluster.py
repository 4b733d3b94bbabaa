"""The driver's side: connect to Ray, place one gateway actor per eligible Ray node, keep them.

    nodes = RayNodes(spec, request, server_url, token)
    await nodes.start(wait_for_one=True)   # actors placed and started on every eligible Ray node
    ...                                    # the rollout server schedules sessions on them (HTTP, as ever)
    await nodes.stop("run finished")

A watch loop (every `poll_s`) asks Ray for its nodes. A Ray node that died: its actor is killed for good
(pinned to a dead node, Ray would try to restart it forever) and the rollout server is told the gateway
node is lost, so its open sessions end ERROR with Ray's reason at once instead of after the server's
`node_lost_after_s`; if the driver cannot tell it, the heartbeat bound still ends them. A new eligible Ray
node gets an actor. An actor whose process died while its Ray node lives is restarted by Ray; the driver
starts its node again (same id and store). A node that failed to start is logged and left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from polar.extras import RAY, require
from polar.rollout.ray.spec import NodeRequest, RayNodeSpec, node_id_for

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorClass

    from polar.rollout.ray.actor import GatewayActor

T = TypeVar("T")

log = logging.getLogger("polar.ray")


class RayError(RuntimeError):
    """Ray cannot be reached, or no Ray node can host a gateway node: one line for the CLI."""


def connect(address: str | None, *, log_to_driver: bool = False) -> bool:
    """`ray.init` (address None: RAY_ADDRESS, else the cluster last started on this machine, else a new
    local Ray instance; "auto": an existing cluster only). False if this process was already connected."""
    require(RAY)
    import ray

    if ray.is_initialized():
        return False
    _reachable(address)
    # `ray.init` makes SIGTERM `sys.exit(15)` in the driver (ray/_private/worker.py, "terminate any signal
    # before connecting driver") and its core worker then dumps a stack on it: `polar serve --ray` under a
    # SIGTERM (systemd, Kubernetes) died with status 15 and "*** SIGTERM received" instead of stopping its
    # gateway nodes and exiting 0. A handler the command installed (serve's on its event loop, `polar run`'s
    # `interrupt.guard`) is put back once connected; a caller without one keeps Ray's.
    main = threading.current_thread() is threading.main_thread()
    ours = signal.getsignal(signal.SIGTERM) if main else None
    try:
        ray.init(address=address, log_to_driver=log_to_driver, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = address or "the local Ray cluster"
        raise RayError(f"cannot connect to Ray at {where}: {str(exc).splitlines()[0]}") from None
    finally:
        if callable(ours):
            signal.signal(signal.SIGTERM, ours)
    return True


def _reachable(address: str | None) -> None:
    """A HOST:PORT that nothing answers is one line at once; `ray.init` would retry for minutes."""
    import socket

    if address is None or address in ("auto", "local") or "://" in address:
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except (OSError, ValueError) as exc:
        raise RayError(f"cannot connect to Ray at {address}: {exc}") from None


def disconnect() -> None:
    import ray

    ray.shutdown()


def driver_ip() -> str:
    """This machine's address in the Ray cluster (where gateway actors reach the rollout server)."""
    import ray

    ip: str = ray.util.get_node_ip_address()
    return ip


def _loopback(url: str) -> bool:
    from urllib.parse import urlsplit

    host = (urlsplit(url).hostname or "").lower()
    return host == "localhost" or host.startswith("127.") or host == "::1"


def check_reachable(urls: tuple[str, ...], nodes: list[dict[str, Any]], request: NodeRequest) -> None:
    """A loopback URL (an embedded engine, `--backend http://127.0.0.1:...`, a server bound to loopback)
    reaches only this machine: refuse it when an eligible Ray node lives on another one, rather than
    failing every session there."""
    loop = [u for u in urls if _loopback(u)]
    here = driver_ip()
    elsewhere = sorted(
        {n["NodeManagerAddress"] for n in nodes if n["Alive"] and request.fits(n["Resources"])} - {here}
    )
    if loop and elsewhere:
        raise RayError(
            f"{loop[0]} is this machine's loopback, which gateway nodes on Ray nodes at "
            f"{', '.join(elsewhere)} cannot reach: give URLs every Ray node reaches (--backend; for "
            "polar serve also --host and --public-url)"
        )


def actor_class() -> ActorClass[GatewayActor]:
    import ray

    from polar.rollout.ray.actor import GatewayActor

    return ray.remote(GatewayActor)


@dataclass
class _Placed:
    ray_node: str  # Ray's node id (hex)
    node_id: str  # the gateway node's id at the rollout server
    handle: Any
    keeper: asyncio.Task[None] | None = None
    started: bool = False
    failed: str | None = None
    gone: bool = False
    status: dict[str, Any] = field(default_factory=dict)


class RayNodes:
    def __init__(
        self,
        spec: RayNodeSpec,
        request: NodeRequest,
        server_url: str,
        token: str,
        *,
        poll_s: float = 1.0,
        max_restarts: int = -1,
    ) -> None:
        self.spec, self.request = spec, request
        self.server_url, self.token = server_url, token
        self.poll_s = poll_s
        self.max_restarts = max_restarts
        self.placed: dict[str, _Placed] = {}  # by Ray node id
        self.lost: list[tuple[str, str]] = []  # (gateway node id, reason) of Ray nodes that died
        self._cls: Any = None  # actor_class() once started
        self._watch: asyncio.Task[None] | None = None
        self._stopping = False

    # -- life ---------------------------------------------------------------------------------------------
    async def start(self, *, wait_for_one: bool = False, timeout_s: float = 120.0) -> list[str]:
        """Place actors on the eligible Ray nodes and start watching. With `wait_for_one`, return once at
        least one node has started and every placed one has started or failed (RayError if none did);
        the gateway node ids started."""
        self._cls = actor_class()
        nodes = await asyncio.to_thread(_ray_nodes)
        check_reachable((*self.spec.config.gateway.backend_urls, self.server_url), nodes, self.request)
        if not any(self.request.fits(n["Resources"]) for n in nodes if n["Alive"]):
            message = f"no Ray node offers what a gateway node takes ({self.request.describe()}): " + (
                "; ".join(_describe(n) for n in nodes if n["Alive"]) or "the cluster has no live node"
            )
            if wait_for_one:
                raise RayError(message)
            log.warning("%s; waiting for one to join", message)
        self._place(nodes)
        self._watch = asyncio.create_task(self._watch_loop(), name="polar-ray-watch")
        if wait_for_one:
            end = time.monotonic() + timeout_s
            while any(not p.started and not p.failed and not p.gone for p in self.placed.values()):
                if time.monotonic() > end:
                    break
                await asyncio.sleep(0.1)
            started = [p.node_id for p in self.placed.values() if p.started]
            if not started:
                why = "; ".join(f"{p.node_id}: {p.failed}" for p in self.placed.values() if p.failed)
                raise RayError(f"no gateway node started on Ray: {why or 'timed out'}")
            await self._registered(set(started), end)
        return [p.node_id for p in self.placed.values() if p.started]

    async def _registered(self, node_ids: set[str], end: float) -> None:
        """Until the server lists every started node (each registers on its own, right after it started),
        so work submitted next is spread over all of them."""
        from polar.rollout.client import RolloutClient, RolloutError

        async with RolloutClient(self.server_url, token=self.token, retry_window_s=5) as client:
            while time.monotonic() < end:
                try:
                    known = {n["node_id"] for n in await client.nodes()}
                except RolloutError as exc:
                    log.warning("cannot list the server's nodes: %s", exc)
                    return
                if node_ids <= known:
                    return
                await asyncio.sleep(0.1)

    async def stop(
        self, reason: str = "node stopped", *, report: bool = True, timeout_s: float = 30.0
    ) -> None:
        """Stop every node (running sessions end CANCELLED with `reason`), then the actors."""
        import ray

        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        live = [p for p in self.placed.values() if not p.gone]
        refs = [p.handle.stop.remote(reason, report) for p in live if p.started]
        if refs:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.gather(*refs, return_exceptions=True), timeout_s)
        for p in self.placed.values():
            if p.keeper is not None:
                p.keeper.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await p.keeper
            with contextlib.suppress(Exception):
                ray.kill(p.handle, no_restart=True)

    # -- what the CLI shows ---------------------------------------------------------------------------------
    def by_stage(self) -> dict[str, int]:
        """Sessions per stage over every live node (as of the last poll)."""
        out: dict[str, int] = {}
        for p in self.placed.values():
            if p.gone:
                continue
            for stage, n in (p.status.get("by_stage") or {}).items():
                out[stage] = out.get(stage, 0) + int(n)
        return out

    def node_ids(self) -> Iterator[str]:
        return (p.node_id for p in self.placed.values() if p.started and not p.gone)

    # -- placement ----------------------------------------------------------------------------------------
    def _place(self, nodes: list[dict[str, Any]]) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        for n in nodes:
            ray_node = n["NodeID"]
            if not n["Alive"] or ray_node in self.placed or not self.request.fits(n["Resources"]):
                continue
            node_id = node_id_for(ray_node)
            handle = self._cls.options(
                name=f"polar-{node_id}-{time.time_ns()}",
                # Pinned: the node's store and its sessions' sandboxes live on that Ray node's disk.
                scheduling_strategy=NodeAffinitySchedulingStrategy(ray_node, soft=False),
                max_restarts=self.max_restarts,
                max_concurrency=1000,
                **self.request.actor_options(),
            ).remote(self.spec, node_id)
            placed = _Placed(ray_node, node_id, handle)
            placed.keeper = asyncio.create_task(self._keep(placed), name=f"polar-ray-{node_id}")
            self.placed[ray_node] = placed
            log.info("placing gateway node %s on Ray node %s (%s)", node_id, ray_node, _describe(n))

    async def _keep(self, p: _Placed) -> None:
        """Start the node, then wait on it; start it again each time Ray restarted its process."""
        from ray.exceptions import RayActorError, RayTaskError

        deaths = 0  # in a row, without a start between: a process that cannot even start is left out
        while not self._stopping:
            try:
                info = await p.handle.start.remote()
                deaths = 0
                if not p.started:
                    log.info("gateway node %s started: control %s", p.node_id, info["control_url"])
                p.started = True
                ended = await p.handle.serve.remote()
                if self._stopping:
                    return
                # Drained (`polar node drain`): it left the server. Its actor goes, and its resources with it;
                # that Ray node gets no new gateway node while this driver runs (there is no undrain).
                log.info("gateway node %s %s; its actor ends", p.node_id, ended)
                p.gone = True
                import ray

                ray.kill(p.handle, no_restart=True)
                return
            except RayTaskError as exc:  # the node itself failed to start (a port, the policy server)
                p.failed = str(exc.cause if exc.cause is not None else exc).splitlines()[0]
                log.error("gateway node %s failed on Ray: %s", p.node_id, p.failed)
                return
            except RayActorError as exc:
                if self._stopping or p.gone:
                    return
                deaths += 1
                if deaths >= 5:
                    p.failed = f"the actor died {deaths} times without starting: {_first_line(exc)}"
                    log.error("gateway node %s left out: %s", p.node_id, p.failed)
                    return
                log.warning("gateway actor %s died (%s); Ray restarts it", p.node_id, _first_line(exc))
                await asyncio.sleep(self.poll_s)

    # -- watching -----------------------------------------------------------------------------------------
    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                nodes = await asyncio.to_thread(_ray_nodes)
            except Exception as exc:
                log.warning("cannot list Ray nodes: %s", _first_line(exc))
                continue
            alive = {n["NodeID"]: n for n in nodes if n["Alive"]}
            for p in list(self.placed.values()):
                if not p.gone and p.ray_node not in alive:
                    dead = next((n for n in nodes if n["NodeID"] == p.ray_node), {})
                    await self._lost(p, _death(dead))
            self._place(nodes)
            await self._poll_status()

    async def _lost(self, p: _Placed, why: str) -> None:
        import ray

        p.gone = True
        if p.keeper is not None:
            p.keeper.cancel()
        with contextlib.suppress(Exception):
            ray.kill(p.handle, no_restart=True)
        reason = f"Ray node {p.ray_node[:12]} died ({why})"
        self.lost.append((p.node_id, reason))
        log.warning("gateway node %s: %s", p.node_id, reason)
        from polar.rollout.client import RolloutClient, RolloutError

        try:
            async with RolloutClient(self.server_url, token=self.token, retry_window_s=5) as client:
                answer = await client.node_lost(p.node_id, reason)
            log.warning("%s: %d open session(s) ended", p.node_id, answer.get("sessions_ended", 0))
        except RolloutError as exc:
            # Never registered (404), or the server is unreachable: the heartbeat bound ends its sessions.
            log.warning("could not report %s lost to the server: %s", p.node_id, exc)

    async def _poll_status(self) -> None:
        live = [p for p in self.placed.values() if p.started and not p.gone]
        if not live:
            return
        answers = await asyncio.gather(
            *(asyncio.wait_for(_await(p.handle.status.remote()), self.poll_s * 5) for p in live),
            return_exceptions=True,
        )
        for p, answer in zip(live, answers, strict=True):
            if isinstance(answer, dict):
                p.status = answer


async def _await(ref: ObjectRef[T]) -> T:
    return await ref


def _ray_nodes() -> list[dict[str, Any]]:
    import ray

    nodes: list[dict[str, Any]] = ray.nodes()
    return nodes


def _describe(n: dict[str, Any]) -> str:
    res = n.get("Resources") or {}
    shown = {k: v for k, v in res.items() if not k.startswith("node:") and k != "object_store_memory"}
    if "memory" in shown:
        shown["memory"] = f"{shown['memory'] / (1 << 20):.0f}MiB"
    return f"{n.get('NodeManagerAddress', '?')} {n.get('NodeID', '?')[:12]} {shown}"


def _death(n: dict[str, Any]) -> str:
    info = n.get("DeathReasonMessage") or n.get("DeathReason") or "no longer alive"
    return str(info)


def _first_line(exc: BaseException) -> str:
    """Ray's messages run to a traceback: its first line, and the exception's own line when it has one."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()] or [type(exc).__name__]
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
