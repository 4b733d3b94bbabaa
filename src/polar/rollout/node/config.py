"""Node settings, validated once at start-up."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from polar.gateway.config import GatewayConfig


@dataclass(frozen=True)
class NodeConfig:
    """A gateway node: the gateway (`gateway`) plus the pools that run sessions through their stages.

    `capacity` is the admission limit (sessions accepted and not finished). INIT, RUNNING and POSTRUN each
    have their own worker count, so slow sandbox starts and long evaluations never hold an agent's run
    slot; `ready_buffer` bounds how many prepared runtimes may wait for a run slot.
    """

    gateway: GatewayConfig
    capacity: int = 8
    init_workers: int = 4
    run_workers: int = 8
    post_workers: int = 4
    ready_buffer: int = 4
    node_id: str = field(default_factory=lambda: f"node-{socket.gethostname()}")
    server_url: str | None = None  # the rollout server to register with (None: standalone)
    advertise_url: str | None = None  # the URL the server reaches this node at (default: host:port)
    runtime_gateway_url: str | None = None  # the gateway as seen from inside runtimes (default: url)
    runtime_root: Path | None = None  # where runtimes make session directories (default: a temp dir)
    keep: Literal["nothing", "artifacts", "all"] = "nothing"  # of an agent's session dir after teardown
    heartbeat_s: float = 5.0
    report_attempts: int = 8  # POSTs of a SessionResult before giving up (it stays on the node)
    report_backoff_s: float = 0.5  # first retry delay; doubles, capped at 30 s
    post_run_timeout_s: float = 120.0  # the harness's post-run hook (log collection)
    keep_results: int = 10_000  # finished results kept whole; older ones keep status and reason only
    # How long the journal keeps a tombstone (an acknowledged outcome, a refused dispatch), so a dispatch
    # resent after a lost reply is recognised; unacknowledged outcomes are kept until the server has them.
    tombstone_ttl_s: float = 7 * 24 * 3600.0
    # Host directories upload prepare actions may copy from (empty: none, so a remote submitter cannot make
    # the node copy its files into a sandbox); `polar run` gives the task file's directory.
    upload_roots: tuple[Path, ...] = ()
    # What tasks may ask of this node (None: anything this machine can run): an operator serving untrusted
    # submitters refuses `local` (no file-system boundary) and `host` (the host's network).
    allowed_runtimes: tuple[str, ...] | None = None
    allowed_networks: tuple[str, ...] | None = None
    # Host paths every sandbox of this node sees read-only, besides what its task names (a shared
    # toolchain, datasets): `polar node --sandbox-path`.
    sandbox_paths: tuple[Path, ...] = ()
    # Processes serving the gateway (`polar gateway --workers N` in a process tree of the node's: each
    # session is served by one of them, its runtime pointed at that one; docs/gateway-workers.md). 1: the
    # gateway runs inside the node's own process.
    gateway_workers: int = 1
    # Report the container images this node holds and pull those the server asks for (docker and podman,
    # where installed and allowed), so the server places sessions where their image is: on for nodes of a
    # fleet (`polar node`, Ray), off for the one node of a local run (placement has no choice there).
    report_images: bool = False

    def __post_init__(self) -> None:
        for name in (
            "capacity",
            "init_workers",
            "run_workers",
            "post_workers",
            "ready_buffer",
            "gateway_workers",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.keep not in ("nothing", "artifacts", "all"):
            raise ValueError(f"keep must be nothing, artifacts or all, not {self.keep!r}")
        if self.heartbeat_s <= 0:
            raise ValueError("heartbeat_s must be positive")
        if self.tombstone_ttl_s <= 0:
            raise ValueError("tombstone_ttl_s must be positive")
        if self.report_attempts < 1:
            raise ValueError("report_attempts must be at least 1")
        from polar.runtime.factory import BACKENDS

        for name, value, known in (
            ("allowed_runtimes", self.allowed_runtimes, BACKENDS),
            ("allowed_networks", self.allowed_networks, ("gateway", "none", "host")),
        ):
            unknown = sorted(set(value or ()) - set(known))
            if unknown or value == ():
                raise ValueError(f"{name} must name some of {', '.join(known)}, not {list(value or ())}")
        if any(not Path(p).is_absolute() or not Path(p).exists() for p in self.sandbox_paths):
            raise ValueError(
                f"sandbox_paths must be existing absolute paths, not {list(map(str, self.sandbox_paths))}"
            )
        if any(not Path(root).is_absolute() for root in self.upload_roots):
            raise ValueError(f"upload_roots must be absolute paths, not {list(map(str, self.upload_roots))}")
        for name in ("server_url", "advertise_url", "runtime_gateway_url"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("http://", "https://")):
                raise ValueError(f"{name} must be an http(s) URL, not {value!r}")
