"""The node's listeners: the model API harnesses call and the control port.

The model API is the gateway served in the node's own process (`EmbeddedServer` on the node's loop), or, with
`gateway_workers` > 1, by the gateway's workers in a process tree of their own (`GatewayChild`). Either way
the stages reach the gateway through one `NodeGateway` (`gateway_link`), and the control port serves the
`/node` routes and the gateway's control routes (`app.NodeApp`)."""

from __future__ import annotations

import asyncio

from polar.gateway.config import GatewayConfig
from polar.rollout.node.app import NodeApp
from polar.rollout.node.gateway_link import GatewayChild, InProcess, Workers
from polar.serving import EmbeddedServer, start_all, stop_all


class NodeServers:
    def __init__(self, asgi: NodeApp, config: GatewayConfig, workers: int) -> None:
        self._asgi = asgi
        self.child = GatewayChild(config, workers) if workers > 1 else None
        self.data = EmbeddedServer(asgi.data, config.host, config.port) if self.child is None else None
        self.control = EmbeddedServer(
            asgi.control, config.control_host, config.control_port, lifespan="off", label="control port"
        )
        self.gateway: InProcess | Workers | None = None  # while started
        self.url = ""  # the gateway's model API (what runtimes are pointed at)
        self.control_url = ""  # /node/... and the gateway's control routes, token required

    async def start(self) -> InProcess | Workers:
        """Serve both listeners; the gateway as the stages reach it."""
        if self.child is not None:
            await self.child.start()
            try:
                await start_all([self.control])
            except BaseException:  # the node does not start: neither do its gateway's workers stay
                await self.child.stop()
                raise
            self.url = self.child.data_url
            self.gateway = Workers(self.child)
        else:
            assert self.data is not None and self._asgi.gateway is not None
            await start_all([self.data, self.control])
            self.url = self.data.url
            self.gateway = InProcess(self._asgi.gateway.state.proxy, self.url)
        self.control_url = self.control.url
        return self.gateway

    async def wait(self) -> str | None:
        """Until a listener stops serving: None when a server ended (`stop`, a signal), or how the gateway's
        workers exited when they went first (their supervisor was killed)."""
        if self.child is None:
            assert self.data is not None
            await self.data.wait()
            return None
        served = asyncio.create_task(self.control.wait())
        child = asyncio.create_task(self.child.wait())
        try:
            await asyncio.wait((served, child), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (served, child):
                task.cancel()
        return f"exit status {child.result()}" if child.done() and not child.cancelled() else None

    async def metrics(self) -> bytes:
        """The gateway workers' `/metrics` (Prometheus text), or a comment saying why there are none."""
        if not isinstance(self.gateway, Workers):  # in this process (its metrics are the node's), or stopped
            return b"# the gateway's workers are not running\n"
        return await self.gateway.metrics()

    async def stop(self) -> None:
        await stop_all([s for s in (self.data, self.control) if s is not None])
        if isinstance(self.gateway, Workers):
            await self.gateway.aclose()
        if self.child is not None:
            await self.child.stop()
        self.gateway = None  # its store is closed with the node's app
