"""What the driver asks of each Ray node (resources) and what it hands each gateway actor (its config).
Plain data: nothing here imports Ray."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polar.rollout.node.config import NodeConfig
from polar.task import Task

MIB = 1 << 20


@dataclass(frozen=True)
class NodeRequest:
    """The Ray resources one gateway node takes on its Ray node. A Ray node is eligible when its total
    resources cover them; the actor reserves them, so Ray never places two gateway nodes where only one
    fits. `resource`: a custom resource (one unit) only the Ray nodes meant for rollouts declare
    (`ray start --resources '{"polar": 1}'`)."""

    resource: str | None = None
    cpus: float = 1.0
    memory_mb: int = 0

    def __post_init__(self) -> None:
        if self.cpus < 0:
            raise ValueError(f"cpus must not be negative, not {self.cpus}")
        if self.memory_mb < 0:
            raise ValueError(f"memory_mb must not be negative, not {self.memory_mb}")
        if self.resource is not None and not self.resource.strip():
            raise ValueError("resource must name a Ray resource")

    @classmethod
    def for_tasks(
        cls,
        tasks: Iterable[Task],
        capacity: int,
        *,
        resource: str | None = None,
        cpus: float | None = None,
        memory_mb: int | None = None,
        gateway_workers: int = 1,
    ) -> NodeRequest:
        """What a node running `capacity` of these tasks' sessions at once needs: `capacity` times the
        largest `runtime.cpus` and `runtime.memory_mb` any task asks for (at least one CPU for the node
        itself, or one for each of its `gateway_workers`), unless given."""
        tasks = list(tasks)
        if cpus is None:
            per = max((t.runtime.cpus or 0.0 for t in tasks), default=0.0)
            cpus = max(float(gateway_workers), capacity * per)
        if memory_mb is None:
            memory_mb = capacity * max((t.runtime.memory_mb or 0 for t in tasks), default=0)
        return cls(resource=resource, cpus=cpus, memory_mb=memory_mb)

    def wants(self) -> dict[str, float]:
        """In Ray's units (memory in bytes), as `ray.nodes()` reports a node's resources."""
        out: dict[str, float] = {"CPU": self.cpus}
        if self.memory_mb:
            out["memory"] = float(self.memory_mb * MIB)
        if self.resource is not None:
            out[self.resource] = 1.0
        return {k: v for k, v in out.items() if v > 0}

    def fits(self, total: Mapping[str, float]) -> bool:
        return all(total.get(k, 0.0) >= v for k, v in self.wants().items())

    def actor_options(self) -> dict[str, Any]:
        """Options for `ActorClass.options(...)`."""
        opts: dict[str, Any] = {"num_cpus": self.cpus}
        if self.memory_mb:
            opts["memory"] = self.memory_mb * MIB
        if self.resource is not None:
            opts["resources"] = {self.resource: 1}
        return opts

    def describe(self) -> str:
        parts = [f"{self.cpus:g} CPU"]
        if self.memory_mb:
            parts.append(f"{self.memory_mb} MiB memory")
        if self.resource is not None:
            parts.append(f"resource {self.resource!r}")
        return ", ".join(parts)


@dataclass(frozen=True)
class RayNodeSpec:
    """Everything a gateway actor gets from the driver (pickled into the actor; never from a request).

    `config` is the node's settings less what depends on where it lands: its node id, its store
    (`store_dir/<node id>/gateway.db` on that Ray node's disk) and its control address (that Ray node's IP,
    a free port) are set by the actor. `plugins` are the modules `--plugin` allowed; `trusted_imports`
    (import path, task file directory) the code a local task file named (`polar run`), trusted there as it
    is in the driver."""

    config: NodeConfig
    store_dir: Path
    log_level: str = "warning"
    plugins: tuple[str, ...] = ()
    trusted_imports: tuple[tuple[str, Path], ...] = ()


def node_id_for(ray_node_id: str) -> str:
    """The gateway node's id on a Ray node: stable for that Ray node's life (a restarted actor keeps it)."""
    return f"ray-{ray_node_id[:12]}"


def trusted_imports(tasks: Iterable[Task], base: Path) -> tuple[tuple[str, Path], ...]:
    """The import paths local task files name (harness, evaluator, builder), with the directory they are
    resolved against: what a `polar run` driver vouched for."""
    from polar.plugins import is_import_path
    from polar.rollout.taskfile import CODE_FIELDS

    seen: dict[str, Path] = {}
    for task in tasks:
        for _, get in CODE_FIELDS:
            name = get(task)
            if isinstance(name, str) and is_import_path(name):
                seen.setdefault(name, base.resolve())
    return tuple(seen.items())


@dataclass(frozen=True)
class RayPlacement:
    """`--ray [ADDRESS]`: the gateway nodes of a run go to Ray (`polar.stack.local_stack`).
    `address` None: RAY_ADDRESS, the cluster last started on this machine, else a new local one."""

    address: str | None
    request: NodeRequest
    log_level: str = "warning"
    trusted_imports: tuple[tuple[str, Path], ...] = ()
