"""Docker (and podman, which takes the same command lines): one detached container per runtime
(`sleep infinity`), commands through `exec`.

Networks: `none` is `--network none`; `host` is `--network host` (the gateway on the node's loopback answers
at the same URL, and so does every other address); `gateway` is `--network none` plus a listener on the
container's own 127.0.0.1 at the gateway's port, made from the host side and relayed to the gateway
(`polar.runtime.netns`): only the gateway is reachable, and the harness is given `http://127.0.0.1:PORT`.

Every container carries the labels `polar.owner` (the node's host, pid, start time and boot id) and
`polar.session`, so a node started after another died (SIGKILL) removes what the dead one left
(`reap_containers`). `cpus`, `memory_mb` and `pids_limit` become `--cpus`, `--memory`, `--pids-limit`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from pathlib import Path

from polar.runtime.base import RuntimeEntry, RuntimeFailure, RuntimeSpec
from polar.runtime.container import INSIDE, ContainerRuntime
from polar.runtime.leftovers import owner_dead, owner_label

log = logging.getLogger("polar.runtime")

OWNER_LABEL = "polar.owner"
SESSION_LABEL = "polar.session"


class DockerRuntime(ContainerRuntime):
    backend = "docker"
    default_binary = "docker"
    bridged = True  # `network: gateway` through a listener in the container's network namespace
    copies_to_host = True

    def start_argv(self) -> list[str]:
        session = str(self.session_dir)
        network = "host" if self.spec.network == "host" else "none"
        # --init: an init as PID 1 that reaps the orphans agents leave (`sleep infinity` would not, and their
        # zombies count against --pids-limit). docker ships docker-init; podman needs catatonit.
        argv = [self.binary, "run", "-d", "--init", "--name", self.name, "--network", network]
        # No setuid binary or file capability in the image raises the agent above what it starts with.
        argv += ["--security-opt", "no-new-privileges"]
        argv += ["--label", f"{OWNER_LABEL}={owner_label()}", "--label", f"{SESSION_LABEL}={self.session_id}"]
        argv += ["-v", f"{session}:{INSIDE}"]
        for path in self.spec.read_only_paths:
            argv += ["-v", f"{path}:{path}:ro"]
        argv += self.limit_args()
        # No `-w`: podman refuses a workdir the image lacks (docker makes it); `start` makes it for both.
        return [*argv, self.image, "sleep", "infinity"]

    def limit_args(self) -> list[str]:
        spec, out = self.spec, []
        if spec.cpus is not None:
            out += ["--cpus", f"{spec.cpus:g}"]
        if spec.memory_mb is not None:
            out += ["--memory", f"{spec.memory_mb}m"]
        if spec.pids_limit is not None:
            out += ["--pids-limit", str(spec.pids_limit)]
        return out

    def pid_argv(self) -> list[str]:
        return [self.binary, "inspect", "--format", "{{.State.Pid}}", self.name]

    def exec_argv(self, argv: list[str], cwd: Path, env: dict[str, str]) -> list[str]:
        cmd = [self.binary, "exec", "-i", "-w", str(cwd)]
        for key in env:  # `-e NAME` takes the value from the client's environment
            cmd += ["-e", key]
        return [*cmd, self.name, *argv]

    def client_env(self, env: dict[str, str]) -> dict[str, str]:
        return dict(env)

    def kill_argv(self) -> list[str]:
        return [self.binary, "kill", self.name]

    def remove_argv(self) -> list[str]:
        return [self.binary, "rm", "-f", self.name]

    def diff_argv(self) -> list[str]:
        return [self.binary, "diff", self.name]

    def copy_argv(self, src: str, dst: str) -> list[str]:
        return [self.binary, "cp", src, dst]

    async def copy_in(self, src: Path, dst: Path) -> None:
        await self.engine(self.exec_argv(["mkdir", "-p", str(dst.parent)], Path("/"), {}))
        # `SRC/.` copies a directory's contents into DST (created if missing), as upload promises
        source = f"{src}/." if src.is_dir() else str(src)
        await self.engine(self.copy_argv(source, f"{self.name}:{dst}"))

    async def copy_out(self, src: Path, dst: Path) -> None:
        await self.engine(self.copy_argv(f"{self.name}:{src}", str(dst)))


class PodmanRuntime(DockerRuntime):
    """Podman takes docker's command lines. On hosts where its default OCI runtime (crun) cannot start
    containers, its own `containers.conf` chooses runc (docs/runtimes.md)."""

    backend = "podman"
    default_binary = "podman"

    def remove_argv(self) -> list[str]:
        # Podman's `rm -f` first waits 10 s for a SIGTERM that `sleep infinity` as PID 1 never heeds.
        return [self.binary, "rm", "-f", "--time", "0", self.name]


async def _engine_out(argv: list[str], timeout_s: float = 60.0) -> str | None:
    """stdout of an engine command, None when it failed or the engine is not there."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=dict(os.environ)
        )
    except OSError:
        return None
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return None
    return out.decode(errors="replace") if proc.returncode == 0 else None


async def container_owners(binary: str, names: list[str]) -> list[tuple[str, str]]:
    """(name, owner label) of each of `names` that still exists. One `inspect` for all (docker's and
    podman's `ps` templates differ; `inspect`'s agree), or one each when that fails: a container removed
    between the listing and the inspect (its own node stopping it) fails the whole command, which had left
    every dead node's containers in place (seen in CI with tests running beside the reap)."""
    fmt = f'{{{{index .Config.Labels "{OWNER_LABEL}"}}}}'
    owners = await _engine_out([binary, "inspect", "--format", fmt, *names])
    if owners is not None and len(lines := owners.splitlines()) == len(names):
        return [(n, o.strip()) for n, o in zip(names, lines, strict=True)]
    found = []
    for name in names:
        one = await _engine_out([binary, "inspect", "--format", fmt, name])
        if one is not None:
            found.append((name, one.strip()))
    return found


async def reap_containers(binary: str) -> list[str]:
    """Remove the containers of `binary` (docker or podman) whose owning node is dead; their names."""
    if shutil.which(binary) is None:
        return []
    listed = await _engine_out(
        [binary, "ps", "-a", "--filter", f"label={OWNER_LABEL}", "--format", "{{.Names}}"]
    )
    names = [n.strip() for n in (listed or "").splitlines() if n.strip()]
    if not names:
        return []
    dead = [n for n, owner in await container_owners(binary, names) if owner_dead(owner)]
    if dead:
        now = ["--time", "0"] if binary == "podman" else []  # see PodmanRuntime.remove_argv
        await _engine_out([binary, "rm", "-f", *now, *dead], timeout_s=120)
        log.warning("removed %d %s container(s) left by a node that died: %s", len(dead), binary, dead)
    return dead


def check_engine(spec: RuntimeSpec) -> None:
    """The engine's CLI (`docker` or `podman`, the backend's name) is on PATH."""
    if shutil.which(spec.backend) is None:
        raise RuntimeFailure(
            f"runtime {spec.backend!r} needs the {spec.backend} CLI, but no `{spec.backend}` is on PATH"
        )


RUNTIME = RuntimeEntry(DockerRuntime, check_engine, image=True, limits=True)
