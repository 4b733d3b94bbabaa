"""Build the runtime a `RuntimeSpec` names, refusing early (at node admission and before `polar run`
starts anything) when the backend cannot run on this machine or cannot confine the network it asks for."""

from __future__ import annotations

import shutil

from polar.runtime import namespaces
from polar.runtime.base import Runtime, RuntimeFailure, RuntimeSpec
from polar.runtime.local import Keep, LocalRuntime

BACKENDS = ("local", "bwrap", "docker", "podman", "apptainer")
CONTAINER_BACKENDS = ("docker", "podman", "apptainer")


def _apptainer_binary() -> str | None:
    # SingularityCE still ships as `singularity` and takes the same instance/exec command lines
    return shutil.which("apptainer") or shutil.which("singularity")


def check_runtime(spec: RuntimeSpec) -> None:
    """Raise `RuntimeFailure` saying what is missing when `spec` cannot run here; None when it can."""
    backend = spec.backend
    if backend not in BACKENDS:
        raise RuntimeFailure(f"unknown runtime backend {backend!r}; known: {', '.join(BACKENDS)}")
    if backend == "bwrap" and shutil.which("bwrap") is None:
        raise RuntimeFailure(
            "runtime 'bwrap' needs bubblewrap, but no `bwrap` is on PATH "
            "(Debian/Ubuntu: apt-get install bubblewrap)"
        )
    if backend == "local":
        namespaces.for_network(spec.network)  # gateway/none: refused where namespaces cannot be made
    if backend in CONTAINER_BACKENDS and not spec.image:
        raise RuntimeFailure(f"runtime {backend!r} needs runtime.image")
    if backend in ("docker", "podman") and shutil.which(backend) is None:
        raise RuntimeFailure(f"runtime {backend!r} needs the {backend} CLI, but no `{backend}` is on PATH")
    if backend == "apptainer" and _apptainer_binary() is None:
        raise RuntimeFailure("runtime 'apptainer' needs apptainer (or singularity), but neither is on PATH")
    if backend == "apptainer" and spec.network == "gateway":
        raise RuntimeFailure(
            "runtime 'apptainer' cannot confine network 'gateway': its instances share the host's network, "
            "where every address is reachable; use runtime 'docker', 'podman', 'bwrap' or 'local', network "
            "'none', or network 'host' to give the agent the host's network"
        )
    for name, value in (("cpus", spec.cpus), ("memory_mb", spec.memory_mb), ("pids_limit", spec.pids_limit)):
        if value is not None and backend not in ("docker", "podman"):
            raise RuntimeFailure(f"runtime.{name} is enforced by docker and podman only, not {backend!r}")


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
    if spec.backend == "bwrap":
        from polar.runtime.bwrap import BwrapRuntime

        return BwrapRuntime(spec, session_id, gateway_url=gateway_url, keep=keep)
    if spec.backend == "docker":
        from polar.runtime.docker import DockerRuntime

        return DockerRuntime(spec, session_id, gateway_url=gateway_url, keep=keep)
    if spec.backend == "podman":
        from polar.runtime.docker import PodmanRuntime

        return PodmanRuntime(spec, session_id, gateway_url=gateway_url, keep=keep)
    if spec.backend == "apptainer":
        from polar.runtime.apptainer import ApptainerRuntime

        binary = _apptainer_binary()
        assert binary is not None  # check_runtime made sure
        return ApptainerRuntime(spec, session_id, gateway_url=gateway_url, keep=keep, binary=binary)
    return LocalRuntime(spec, session_id, gateway_url=gateway_url, keep=keep)
