"""The whole rollout service on one machine, in this process: what `polar run`, `polar generate` and
`polar train` start.

    with embedded_engine(None) as (engine, engine_server):          # optional: or any inference server
        async with local_stack(out, engine_server.url, "vllm", engine.name, capacity=4) as stack:
            async with RolloutClient(stack.server_url, token=stack.token) as client: ...
            stack.control_url                                  # the node's gateway control (pause/resume)

The rollout server runs in a thread (its own loop); the node, with its gateway, runs on the caller's loop.
One control token is made per run and known only to this process: nothing else, in particular no session's
agent, can steer the run.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class LocalStack:
    server: Any  # polar.serving.ServerThread running the rollout server
    node: Any  # polar.rollout.node.Node (gateway + session pools)
    token: str  # this run's control token

    @property
    def server_url(self) -> str:
        return str(self.server.url)

    @property
    def gateway_url(self) -> str:
        """The gateway's model API (what harnesses call)."""
        return str(self.node.url)

    @property
    def control_url(self) -> str:
        """The node's control listener: its gateway's sessions, records and pause/resume (token required)."""
        return str(self.node.control_url)


@contextlib.asynccontextmanager
async def local_stack(
    out: Path,
    backend_url: str,
    backend_kind: str,
    model: str | None,
    capacity: int,
    *,
    stop_reason: str = "the local run finished",
    allow_callback: tuple[str, ...] = (),
    upload_roots: Sequence[Path] = (),
) -> AsyncIterator[LocalStack]:
    """Start the rollout server (state in `out/server.db`) and one node (records in `out/gateway.db`).
    `allow_callback`: the outbound allowlist (`polar.netguard`) both use for task-given URLs; the node reads
    upload sources only inside `upload_roots` (the task files' directories)."""
    from polar.auth import new_token
    from polar.gateway.config import GatewayConfig
    from polar.netguard import OutboundPolicy
    from polar.rollout.node import Node, NodeConfig
    from polar.rollout.server.app import create_app as create_server
    from polar.rollout.server.config import ServerConfig
    from polar.serving import ServerThread, free_port

    out.mkdir(parents=True, exist_ok=True)
    token = new_token()
    outbound = OutboundPolicy(allow=allow_callback)
    server_config = ServerConfig(db_path=out / "server.db", token=token, outbound=outbound)
    server = ServerThread(create_server(server_config)).start()
    node = Node(
        NodeConfig(
            gateway=GatewayConfig(
                backend_url=backend_url,
                backend_kind=backend_kind,  # type: ignore[arg-type]
                served_model=model,
                store_path=out / "gateway.db",
                port=free_port(),
                control_token=token,
                outbound=outbound,
            ),
            capacity=capacity,
            run_workers=capacity,
            server_url=server.url,
            heartbeat_s=1.0,
            upload_roots=tuple(upload_roots),
        )
    )
    try:
        await node.start()
        yield LocalStack(server, node, token)
    finally:
        await node.stop(stop_reason)
        server.stop()


@contextlib.contextmanager
def embedded_engine(policy: str | None, **load: Any) -> Iterator[tuple[Any, Any]]:
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
