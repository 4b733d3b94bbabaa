"""Apptainer (or SingularityCE): one instance per runtime, commands through `exec instance://`.

The instance is contained (`--containall`: own PID/IPC namespaces, no host home, clean environment) with
a writable tmpfs over the image and the session directory bound at `/polar` (as docker's). `network="none"` is
`--net --network none` (which needs root or a site configuration that allows it); `host` shares the host
network, and `gateway` is refused as with docker (other addresses would not be fenced off). Variables travel as
`APPTAINERENV_<NAME>` in the client's environment, which apptainer injects into the container.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from polar.runtime.base import RuntimeEntry, RuntimeFailure, RuntimeSpec
from polar.runtime.container import INSIDE, ContainerRuntime
from polar.runtime.local import _copy


class ApptainerRuntime(ContainerRuntime):
    backend = "apptainer"
    default_binary = "apptainer"

    def start_argv(self) -> list[str]:
        session = str(self.session_dir)
        argv = [self.binary, "instance", "start", "--containall", "--writable-tmpfs"]
        argv += ["--bind", f"{session}:{INSIDE}"]
        for path in self.spec.read_only_paths:
            argv += ["--bind", f"{path}:{path}:ro"]
        if self.spec.network == "none":
            argv += ["--net", "--network", "none"]
        return [*argv, self.image, self.name]

    def exec_argv(self, argv: list[str], cwd: Path, env: dict[str, str]) -> list[str]:
        return [self.binary, "exec", "--cleanenv", "--pwd", str(cwd), f"instance://{self.name}", *argv]

    def client_env(self, env: dict[str, str]) -> dict[str, str]:
        return {f"APPTAINERENV_{key}": value for key, value in env.items()}

    def kill_argv(self) -> list[str]:
        return [self.binary, "instance", "stop", "--signal", "SIGKILL", self.name]

    def remove_argv(self) -> list[str]:
        # cancel() already stopped it; --force covers an instance that ignored the signal
        return [self.binary, "instance", "stop", "--force", self.name]

    # apptainer has no `cp`: files go through the shared session directory and a `cp` inside

    async def copy_in(self, src: Path, dst: Path) -> None:
        staging = self.control / f"in-{next(self._counter)}"
        await asyncio.to_thread(_copy, src, staging)
        if src.is_dir():  # merge the tree's contents into dst, as upload promises
            inner = 'mkdir -p "$1" && cp -a "$0/." "$1"'
        else:
            inner = 'mkdir -p "$(dirname "$1")" && cp -a "$0" "$1"'
        try:
            argv = ["sh", "-c", inner, self.runtime_path(staging), str(dst)]
            await self.engine(self.exec_argv(argv, Path("/"), {}))
        finally:
            await asyncio.to_thread(_remove_path, staging)

    async def copy_out(self, src: Path, dst: Path) -> None:
        await self.engine(self.exec_argv(["cp", "-a", str(src), self.runtime_path(dst)], Path("/"), {}))


def _remove_path(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def binary() -> str | None:
    # SingularityCE still ships as `singularity` and takes the same instance/exec command lines
    return shutil.which("apptainer") or shutil.which("singularity")


def check(spec: RuntimeSpec) -> None:
    if binary() is None:
        raise RuntimeFailure("runtime 'apptainer' needs apptainer (or singularity), but neither is on PATH")
    if spec.network == "gateway":
        raise RuntimeFailure(
            "runtime 'apptainer' cannot confine network 'gateway': its instances share the host's network, "
            "where every address is reachable; use runtime 'docker', 'podman' or 'bwrap', network 'none', "
            "or network 'host' to give the agent the host's network"
        )


RUNTIME = RuntimeEntry(ApptainerRuntime, check, image=True, extra=lambda: {"binary": binary()})
