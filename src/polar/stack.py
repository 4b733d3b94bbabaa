"""The whole rollout service on one machine, in this process: what `polar run`, `polar generate` and
`polar train` start. It puts the parts together (server, dashboard, node, embedded engine), so it sits
above all of them.

    with embedded_engine(None) as (engine, engine_server):          # optional: or any inference server
        policy = PolicyServer((engine_server.url,), model=engine.name)
        async with local_stack(out, policy, capacity=4) as stack:
            async with RolloutClient(stack.server_url, token=stack.token) as client: ...
            stack.control_url                                  # the node's gateway control (pause/resume)

The rollout server runs in a thread (its own loop); the node, with its gateway, runs on the caller's loop.
One control token is made per run and known only to this process: nothing else, in particular no session's
agent, can steer the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polar.rollout.rundir import locked

if TYPE_CHECKING:
    from polar.dashboard.app import DashboardOptions
    from polar.engine.engine import Engine
    from polar.netguard import OutboundPolicy
    from polar.rollout.node.config import NodeConfig
    from polar.rollout.node.node import Node
    from polar.rollout.ray.cluster import RayNodes
    from polar.rollout.ray.spec import RayPlacement
    from polar.serving import ServerThread

log = logging.getLogger("polar.run")


@dataclass(frozen=True)
class PolicyServer:
    """The policy's inference server(s), as the run's gateways reach them: one server or several of one
    `kind` serving `model` (None: the first model they list), and who renders prompts (`render`: the
    server, or the gateway with each session's token chain; `tokenizer` is then the model's, default what
    the server says it loaded: `polar.gateway.render`). Empty `urls`: the embedded engine, not started yet."""

    urls: tuple[str, ...] = ()
    kind: str = "vllm"
    model: str | None = None
    render: str = "server"
    tokenizer: str | None = None

    def gateway_fields(self) -> dict[str, Any]:
        """These settings as `GatewayConfig` fields."""
        return {
            "backend_urls": self.urls,
            "backend_kind": self.kind,
            "served_model": self.model,
            "render": self.render,
            "tokenizer": self.tokenizer,
        }


@dataclass(frozen=True)
class LocalStack:
    server: ServerThread  # running the rollout server
    node: Node | None  # gateway + session pools; None when the nodes are Ray actors
    token: str  # this run's control token
    ray: RayNodes | None = None  # with `--ray`

    @property
    def server_url(self) -> str:
        return str(self.server.url)

    @property
    def gateway_url(self) -> str:
        """The gateway's model API (what harnesses call)."""
        return str(self._node().url)

    @property
    def dashboard_url(self) -> str:
        """The dashboard, with this run's token in the URL fragment (`polar.dashboard.auth`)."""
        from polar.dashboard import dashboard_url

        return dashboard_url(self.server_url, self.token)

    @property
    def control_url(self) -> str:
        """The node's control listener: its gateway's sessions, records and pause/resume (token required)."""
        return str(self._node().control_url)

    def by_stage(self) -> dict[str, int]:
        """Sessions per stage, over every node (Ray: as of the driver's last poll)."""
        if self.ray is not None:
            stages: dict[str, int] = self.ray.by_stage()
            return stages
        return dict(self._node().status().by_stage)

    def _node(self) -> Node:
        if self.node is None:
            raise RuntimeError("this run's gateway nodes are Ray actors: each has its own gateway")
        return self.node


@contextlib.asynccontextmanager
async def local_stack(
    out: Path,
    policy: PolicyServer,
    capacity: int,
    *,
    gateway_workers: int = 1,
    stop_reason: str = "the local run finished",
    allow_callback: tuple[str, ...] = (),
    upload_roots: Sequence[Path] = (),
    dashboard: DashboardOptions | None = None,
    ray: RayPlacement | None = None,
) -> AsyncIterator[LocalStack]:
    """Start the rollout server (state in `out/server.db`) and one node (records in `out/gateway.db`)
    whose gateway sends calls to the `policy` server (several URLs: spread over those servers), served by
    `gateway_workers` processes (`NodeConfig.gateway_workers`).
    `allow_callback`: the outbound allowlist (`polar.netguard`) both use for task-given URLs; the node reads
    upload sources only inside `upload_roots` (the task files' directories). `dashboard`: the dashboard's
    `DashboardOptions` (tokenizer, training folder), served by the server under /ui.

    `ray` (a `polar.rollout.ray.RayPlacement`): instead of the one node, a gateway node as a Ray actor on
    each eligible Ray node (records in `out/nodes/<node id>/gateway.db` on that Ray node's disk), its
    gateway on `gateway_workers` processes beside the actor's; the server then listens on this machine's
    Ray address, so they reach it (the token guards it).

    `out` is held by this process meanwhile (`rundir.locked`). State an earlier run left there is resumed:
    finished sessions stay, sessions it left on its node are requeued (`requeue_orphans`)."""
    from polar.auth import new_token
    from polar.dashboard import server_app
    from polar.netguard import OutboundPolicy
    from polar.rollout.server.config import ServerConfig
    from polar.serving import ServerThread

    with locked(out), contextlib.ExitStack() as cleanup:
        requeue_orphans(out / "server.db")
        token = new_token()
        outbound = OutboundPolicy(allow=allow_callback)
        server_config = ServerConfig(db_path=out / "server.db", token=token, outbound=outbound)
        host = "127.0.0.1"
        if ray is not None:
            from polar.rollout.ray.cluster import connect, disconnect, driver_ip

            if connect(ray.address):
                cleanup.callback(disconnect)
            host = driver_ip()
        # An open dashboard tab holds an event stream: it must not hold the run's end.
        app = server_app(server_config, dashboard)
        server = ServerThread(app, timeout_graceful_shutdown=2, host=host).start()
        try:
            config = _node_config(out, policy, capacity, server.url, token, outbound, upload_roots)
            config = dataclasses.replace(config, gateway_workers=gateway_workers)
        except BaseException:
            server.stop()
            raise
        if ray is not None:
            async with _ray_nodes(ray, config, out, server, token, stop_reason) as stack:
                yield stack
            return
        from polar.rollout.node import Node

        node = Node(config)
        try:
            await node.start()
            yield LocalStack(server, node, token)
        except BaseException:
            # Interrupted (Ctrl-C) or failed: what still runs is cancelled but not reported, so the server
            # keeps those sessions open and a run resumed into `out` runs them again under new ids.
            await node.stop(f"{stop_reason} (interrupted)", report=False)
            server.stop()
            raise
        await node.stop(stop_reason)
        server.stop()


@contextlib.asynccontextmanager
async def _ray_nodes(
    ray: RayPlacement, config: NodeConfig, out: Path, server: ServerThread, token: str, stop_reason: str
) -> AsyncIterator[LocalStack]:
    """`local_stack`'s nodes as Ray actors; the same interrupted/finished rules as its one node."""
    from polar.rollout.ray.cluster import RayNodes
    from polar.rollout.ray.spec import RayNodeSpec

    spec = RayNodeSpec(
        config=dataclasses.replace(config, report_images=True),  # several nodes: place by image
        store_dir=(out / "nodes").resolve(),
        log_level=ray.log_level,
        trusted_imports=ray.trusted_imports,
    )
    gateways = RayNodes(spec, ray.request, server.url, token)
    try:
        await gateways.start(wait_for_one=True)
        yield LocalStack(server, None, token, gateways)
    except BaseException:
        await gateways.stop(f"{stop_reason} (interrupted)", report=False)
        server.stop()
        raise
    await gateways.stop(stop_reason)
    server.stop()


def requeue_orphans(db: Path) -> int:
    """Sessions an earlier local run left on its node (it was interrupted or killed): back to the queue,
    under new ids. A local stack's node lives and dies with its process, so none of them still runs."""
    if not db.is_file():
        return 0
    from polar.rollout.server.service import new_session_id
    from polar.rollout.server.store import ServerStore

    store = ServerStore(db)
    try:
        n = store.requeue_orphans(new_session_id)
    finally:
        store.close()
    if n:
        log.info("%d session(s) interrupted in an earlier run will run again under new ids", n)
    return n


def _node_config(
    out: Path,
    policy: PolicyServer,
    capacity: int,
    server_url: str,
    token: str,
    outbound: OutboundPolicy,
    upload_roots: Sequence[Path],
) -> NodeConfig:
    from polar.gateway.config import GatewayConfig
    from polar.rollout.node import NodeConfig
    from polar.serving import free_port

    return NodeConfig(
        gateway=GatewayConfig(
            **policy.gateway_fields(),
            store_path=out / "gateway.db",
            port=free_port(),
            control_token=token,
            outbound=outbound,
        ),
        capacity=capacity,
        run_workers=capacity,
        server_url=server_url,
        heartbeat_s=1.0,
        upload_roots=tuple(upload_roots),
    )


@contextlib.contextmanager
def embedded_engine(policy: str | None, **load: Any) -> Iterator[tuple[Engine, ServerThread]]:
    """The embedded engine serving `policy` (None: the offline tiny model) on a loopback port:
    yields `(engine, server_thread)`; the engine's scheduler lives as long as the server."""
    from polar.engine import Engine, create_engine_app
    from polar.serving import ServerThread

    engine = Engine.load(policy, start=False, **load)
    server = ServerThread(create_engine_app(engine, manage_engine=True)).start()
    try:
        yield engine, server
    finally:
        server.stop()
