"""The one interface every runtime offers.

A runtime is created per session (or per evaluation) from a `RuntimeSpec`, started once, used through
`exec`/`upload`/`download`, and stopped. `cancel` kills everything it started (the whole process tree) and
must be safe to call at any time, from any task, even while an `exec` is running.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

# The runtimes, by name: each is a module `polar.runtime.<name>` declaring its `RUNTIME` entry
# (`polar.runtime.factory` reads them), so a new runtime is its module and its name here.
RuntimeBackend = Literal["bwrap", "docker", "podman", "apptainer", "local"]  # strongest isolation first


@dataclass(frozen=True)
class RuntimeSpec:
    backend: RuntimeBackend = "bwrap"
    image: str | None = None  # docker/podman/apptainer image; unused by local and bwrap
    workdir: str = "workspace"  # relative to the session directory (local/bwrap) or absolute in a container
    env: dict[str, str] = field(default_factory=dict)
    network: Literal["gateway", "host", "none"] = "gateway"  # gateway: only the gateway (local, bwrap)
    root: Path | None = None  # where session directories are made (default: a temp dir)
    read_only_paths: tuple[
        str, ...
    ] = ()  # extra host paths made visible read-only (bwrap, containers), e.g. a CLI prefix
    # Resource limits (docker, podman): CPUs (fractions allowed), memory in MiB, processes.
    cpus: float | None = None
    memory_mb: int | None = None
    pids_limit: int | None = None


@dataclass(frozen=True)
class ExecResult:
    exit_code: int  # -signal when killed; 124 on timeout (like coreutils timeout)
    stdout: str
    stderr: str
    timed_out: bool = False
    duration_s: float = 0.0


class RuntimeFailure(Exception):
    """A runtime could not start, or an operation on it failed for a reason other than the command."""


class Runtime(Protocol):
    spec: RuntimeSpec
    session_dir: Path  # host path of the session's private directory (home, workspace, artifacts)
    workdir: Path  # host path of the working directory the harness sees as its cwd
    home: Path  # host path of the harness's HOME (in the session directory)
    artifacts: Path  # host path where a harness leaves what outlives the session (logs, transcripts)
    gateway_url: str | None  # the gateway as the runtime's commands reach it (None: unreachable)

    async def start(self) -> None: ...

    def runtime_path(self, path: Path) -> str:
        """A host path in the session directory as the runtime's commands see it (a container mounts the
        session directory at one fixed place; local and bwrap see the host's path)."""
        ...

    async def exec(
        self,
        argv: list[str] | str,  # a str runs through `bash -lc`
        *,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,  # relative to workdir
        stdin: bytes | None = None,
    ) -> ExecResult: ...

    async def upload(self, src: Path, dst: str) -> None:
        """Copy a host file or directory into the runtime (dst relative to workdir, or absolute inside)."""
        ...

    async def download(self, src: str, dst: Path) -> None: ...

    async def stop(self) -> None:
        """Tear down and free everything (idempotent)."""
        ...

    async def cancel(self) -> None:
        """Kill every process the runtime started, now (idempotent); `stop` still frees the rest."""
        ...


@dataclass(frozen=True)
class RuntimeEntry:
    """What the runtime table (`polar.runtime.factory.RUNTIMES`) knows of one backend, declared by its module
    as `RUNTIME`: the class (called with the spec, the session id, `gateway_url`, `keep` and `extra()`),
    what this machine must have for it (`check` raises `RuntimeFailure` saying what is missing), and its
    traits."""

    cls: Callable[..., Runtime]
    check: Callable[[RuntimeSpec], None]
    image: bool = False  # runs a container image (`runtime.image` required)
    limits: bool = False  # enforces cpus, memory_mb, pids_limit
    trusted_only: bool = False  # no file-system boundary: for policies one trusts (docs/security.md)
    extra: Callable[[], dict[str, Any]] = dict  # constructor keywords decided on this machine
