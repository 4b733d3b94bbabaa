"""The gateway actor: one ordinary gateway node (`polar.rollout.node.Node`) in a Ray worker process.

It is an async actor: its methods and the node's servers (gateway, control listener), heartbeats and
session pools share the actor's event loop. Everything it runs comes from the driver (`RayNodeSpec`,
pickled into the actor at creation); the node's HTTP routes are the same as `polar node`'s, token
required, and run no code a request names.

When Ray restarts the actor after its process died (on the same Ray node: placement is pinned), `__init__`
runs again with the same spec and node id and the driver calls `start` again: the new node opens the same
store, so its journal reports what the dead process owed and ends what was running ERROR ("node
restarted"), never running it twice (docs/nodes.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Any

from polar.rollout.ray.spec import RayNodeSpec

log = logging.getLogger("polar.ray")


class GatewayActor:
    """Made a Ray actor class by `cluster.actor_class()` (so importing this module needs no Ray)."""

    def __init__(self, spec: RayNodeSpec, node_id: str) -> None:
        self.spec = spec
        self.node_id = node_id
        self.node: Any = None  # polar.rollout.node.Node once started
        self._starting: asyncio.Future[None] | None = None

    async def start(self) -> dict[str, str]:
        """Start the node (idempotent): {node_id, url (model API), control_url, store}."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)
        return {
            "node_id": self.node_id,
            "url": self.node.url,
            "control_url": self.node.control_url,
            "store": str(self.node.config.gateway.store_path),
        }

    async def _start(self) -> None:
        import ray

        from polar.logs import setup_logging
        from polar.plugins import allow_modules, trust_file_import
        from polar.rollout.node import Node
        from polar.store.files import private_dirs

        setup_logging(self.spec.log_level)
        allow_modules(self.spec.plugins)
        for path, base in self.spec.trusted_imports:
            trust_file_import(path, base)
        ip = ray.util.get_node_ip_address()
        store = self.spec.store_dir / self.node_id / "gateway.db"
        private_dirs(store.parent)  # 0700: it holds the node's stores
        config = self.spec.config
        gateway = dataclasses.replace(
            config.gateway, store_path=store, port=0, control_host=ip, control_port=0
        )
        node = Node(dataclasses.replace(config, gateway=gateway, node_id=self.node_id))
        await node.start()
        self.node = node
        from polar.memory import tune_gc

        tune_gc()  # the actor's process serves this node's gateway
        log.info(
            "gateway node %s on Ray node %s (%s)", self.node_id, ray.get_runtime_context().get_node_id(), ip
        )

    async def serve(self) -> str:
        """Returns once the node has stopped (drained, or `stop`): the driver's watch on this actor."""
        await self.start()
        await self.node.serve_forever()  # stops the node once its servers end
        return "stopped"

    async def status(self) -> dict[str, Any]:
        """The node's `NodeStatus`, with `started` and the worker process's `pid`."""
        if self.node is None:
            return {"node_id": self.node_id, "started": False, "pid": os.getpid()}
        status: dict[str, Any] = self.node.status().model_dump(mode="json")
        return {**status, "started": True, "pid": os.getpid()}

    async def stop(self, reason: str = "node stopped", report: bool = True) -> None:
        """Cancel what runs (CANCELLED with `reason`, reported unless `report` is False) and stop serving."""
        if self.node is not None:
            await self.node.stop(reason, report=report)
