"""The runtime table: each backend's name, what it needs on this machine, and how it is built.

Every place that knows runtime names reads them here (`RUNTIMES`), so a new runtime is one module plus one
row. `check_runtime` refuses early (at node admission and before `polar run` starts anything) a backend
that cannot run on this machine or cannot confine the network it asks for; `default_backend` is what a
task that names no runtime gets: the strongest isolation this machine has.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args

from polar.plugins import import_path
from polar.runtime import namespaces
from polar.runtime.base import Runtime, RuntimeBackend, RuntimeFailure, RuntimeSpec
from polar.runtime.local import Keep


def _apptainer_binary() -> str | None:
    # SingularityCE still ships as `singularity` and takes the same instance/exec command lines
    return shutil.which("apptainer") or shutil.which("singularity")


def _check_local(spec: RuntimeSpec) -> None:
    namespaces.for_network(spec.network)  # gateway/none: refused where namespaces cannot be made


def _check_bwrap(spec: RuntimeSpec) -> None:
    from polar.runtime.bwrap import probe

    why = probe()
    if why is not None:
        raise RuntimeFailure(f"runtime 'bwrap' cannot run here: {why}")


def _check_engine(spec: RuntimeSpec) -> None:
    if shutil.which(spec.backend) is None:
        raise RuntimeFailure(
            f"runtime {spec.backend!r} needs the {spec.backend} CLI, but no `{spec.backend}` is on PATH"
        )


def _check_apptainer(spec: RuntimeSpec) -> None:
    if _apptainer_binary() is None:
        raise RuntimeFailure("runtime 'apptainer' needs apptainer (or singularity), but neither is on PATH")
    if spec.network == "gateway":
        raise RuntimeFailure(
            "runtime 'apptainer' cannot confine network 'gateway': its instances share the host's network, "
            "where every address is reachable; use runtime 'docker', 'podman' or 'bwrap', network 'none', "
            "or network 'host' to give the agent the host's network"
        )


@dataclass(frozen=True)
class RuntimeEntry:
    """One backend: where its class lives (imported on use), what it checks, what it needs."""

    cls: str  # "module:Class"
    check: Callable[[RuntimeSpec], None]
    image: bool = False  # runs a container image (`runtime.image` required)
    limits: bool = False  # enforces cpus, memory_mb, pids_limit
    trusted_only: bool = False  # no file-system boundary: for policies one trusts (docs/security.md)
    extra: Callable[[], dict[str, Any]] = dict  # constructor keywords decided on this machine


RUNTIMES: dict[str, RuntimeEntry] = {
    "bwrap": RuntimeEntry("polar.runtime.bwrap:BwrapRuntime", _check_bwrap),
    "docker": RuntimeEntry("polar.runtime.docker:DockerRuntime", _check_engine, image=True, limits=True),
    "podman": RuntimeEntry("polar.runtime.docker:PodmanRuntime", _check_engine, image=True, limits=True),
    "apptainer": RuntimeEntry(
        "polar.runtime.apptainer:ApptainerRuntime",
        _check_apptainer,
        image=True,
        extra=lambda: {"binary": _apptainer_binary()},
    ),
    "local": RuntimeEntry("polar.runtime.local:LocalRuntime", _check_local, trusted_only=True),
}
assert set(RUNTIMES) == set(get_args(RuntimeBackend)), "RUNTIMES and RuntimeBackend name the same backends"
BACKENDS = tuple(RUNTIMES)
IMAGE_BACKENDS = tuple(name for name, entry in RUNTIMES.items() if entry.image)
CONTAINER_BACKENDS = IMAGE_BACKENDS  # kept for callers that say "container"


def default_backend() -> RuntimeBackend:
    """What a task that names no runtime gets: bwrap, the strongest isolation that needs no image; a clear
    error where it cannot run (nothing weaker is chosen silently)."""
    from polar.runtime.bwrap import probe

    why = probe()
    if why is not None:
        raise RuntimeFailure(
            f"the task names no runtime and the default sandbox, bwrap, cannot run here: {why}. Install "
            "bubblewrap, or name one in the task: runtime.backend 'docker' or 'podman' with an image, or "
            "'local' for a policy you trust with this machine's files (docs/security.md)"
        )
    return "bwrap"


def check_runtime(spec: RuntimeSpec) -> None:
    """Raise `RuntimeFailure` saying what is missing when `spec` cannot run here; None when it can."""
    entry = RUNTIMES.get(spec.backend)
    if entry is None:
        raise RuntimeFailure(f"unknown runtime backend {spec.backend!r}; known: {', '.join(BACKENDS)}")
    if entry.image and not spec.image:
        raise RuntimeFailure(f"runtime {spec.backend!r} needs runtime.image")
    entry.check(spec)
    for name, value in (("cpus", spec.cpus), ("memory_mb", spec.memory_mb), ("pids_limit", spec.pids_limit)):
        if value is not None and not entry.limits:
            limited = " and ".join(n for n, e in RUNTIMES.items() if e.limits)
            raise RuntimeFailure(f"runtime.{name} is enforced by {limited} only, not {spec.backend!r}")


def make_runtime(
    spec: RuntimeSpec,
    session_id: str,
    *,
    gateway_url: str | None = None,
    keep: Keep = "nothing",
) -> Runtime:
    """A new, not yet started runtime for one session (or one evaluation).

    `gateway_url` is the gateway as the host reaches it; sandboxes that isolate the network make it
    reachable inside and publish the URL to hand the harness as `runtime.gateway_url`.
    """
    check_runtime(spec)
    entry = RUNTIMES[spec.backend]
    cls = import_path(entry.cls)
    runtime: Runtime = cls(spec, session_id, gateway_url=gateway_url, keep=keep, **entry.extra())
    return runtime
