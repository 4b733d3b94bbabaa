"""Docker: one detached container per runtime (`sleep infinity`), commands through `docker exec`.

`network="none"` is `--network none`; `host` is `--network host`, so the gateway on the node's loopback
answers at the same URL, and so does every other address. `gateway` (only the gateway reachable) is
refused by `check_runtime`: fencing off the rest needs a bridge network plus firewall rules, not done here.
"""

from __future__ import annotations

from pathlib import Path

from polar.runtime.container import ContainerRuntime


class DockerRuntime(ContainerRuntime):
    backend = "docker"
    default_binary = "docker"

    def start_argv(self) -> list[str]:
        session = str(self.session_dir)
        network = "none" if self.spec.network == "none" else "host"
        argv = [self.binary, "run", "-d", "--name", self.name, "--network", network]
        argv += ["-v", f"{session}:{session}"]
        for path in self.spec.read_only_paths:
            argv += ["-v", f"{path}:{path}:ro"]
        return [*argv, "-w", str(self.workdir), self.image, "sleep", "infinity"]

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

    def copy_argv(self, src: str, dst: str) -> list[str]:
        return [self.binary, "cp", src, dst]

    async def copy_in(self, src: Path, dst: Path) -> None:
        await self.engine(self.exec_argv(["mkdir", "-p", str(dst.parent)], Path("/"), {}))
        # `SRC/.` copies a directory's contents into DST (created if missing), as upload promises
        source = f"{src}/." if src.is_dir() else str(src)
        await self.engine(self.copy_argv(source, f"{self.name}:{dst}"))

    async def copy_out(self, src: Path, dst: Path) -> None:
        await self.engine(self.copy_argv(f"{self.name}:{src}", str(dst)))
