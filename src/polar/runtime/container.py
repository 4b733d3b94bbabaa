"""What docker, podman and apptainer share: a long-lived container per runtime, commands run inside it by
the engine's client, and the session directory bind-mounted at `/polar` in every container.

The mount point is the same for every session, so what a harness sees (its home, its working directory,
the paths a CLI writes into its system prompt: Claude Code's memory folder, Codex's skills) is the same in
every sample of a task: the policy server's prefix cache is shared across a GRPO group, and a recorded
session replays (`polar replay`). `runtime_path()` turns a host path in the session directory into its path in
the container.

Killing the engine's client does not kill what it started inside the container, so every command is
wrapped as `setsid -w sh -c 'echo $$ > PIDFILE; exec "$@"'`: it runs as the leader of its own process
group, whose id lands in the (shared) session directory, and a timeout signals that group through the
engine (`kill -TERM -- -PGID`, then `-KILL`). `cancel` kills the whole container at once.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import signal
import tempfile
import time
from abc import abstractmethod
from dataclasses import replace
from pathlib import Path
from typing import Unpack

from polar.runtime.base import ExecResult, RuntimeFailure, RuntimeSpec
from polar.runtime.bridge import UnixBridge
from polar.runtime.local import Keep, LocalRuntime, RuntimeOptions, _copy
from polar.runtime.netns import listen_in_netns
from polar.runtime.procs import GroupTracker, group_alive, run_process, signal_group

ENGINE_TIMEOUT_S = 600.0  # `docker run` may pull an image first
INSIDE = Path("/polar")  # where every container sees its session directory
# The image's own dotfiles (of its user's home: /root) copied into the session home, which is HOME for every
# command: SWE-bench images activate their conda environment in /root/.bashrc (sourced by /root/.profile),
# and a harness's `bash -lc` with HOME elsewhere would run the tests with the wrong Python. Files only, never
# over one the session has.
SEED_HOME = (
    'for f in "$HOME"/.[!.]*; do [ -f "$f" ] && [ ! -e "$1/${f##*/}" ] && cp -p "$f" "$1/"; done; exit 0'
)


def _copy_link_or_tree(src: Path, dst: Path) -> None:
    if src.is_symlink():
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.readlink(src), dst)
    else:
        _copy(src, dst)


class ListingTruncated(RuntimeFailure):
    """`changed_paths` listed more than the output cap holds."""


def parse_changes(text: str) -> list[tuple[str, str]]:
    """`docker diff` / `podman diff` lines (`A /path`) as (kind, path). A name holding a newline goes on
    over the next lines, which do not start with a kind and a `/`: they are joined back (a crafted name can
    add a line of its own, never hide another entry). Bytes that are not UTF-8 come as U+FFFD."""
    if "\n[polar: output truncated at " in text:
        raise ListingTruncated("the container's list of changed paths is longer than the output cap")
    lines = text.split("\n")
    if lines and lines[-1] == "":  # the listing's last newline
        lines.pop()
    out: list[tuple[str, str]] = []
    for line in lines:
        if line[:1] in ("A", "C", "D") and line[1:3] == " /":
            out.append((line[0], line[2:]))
        elif out:
            out[-1] = (out[-1][0], f"{out[-1][1]}\n{line}")
    return out


class ContainerRuntime(LocalRuntime):
    """Subclasses build the engine's command lines; this class runs them."""

    default_binary = ""
    bridged = False  # `network: host`/`none` only: check_runtime refuses `gateway`
    copies_to_host = False  # copy_out writes to any host path (else only into the session directory)

    def __init__(
        self,
        spec: RuntimeSpec,
        session_id: str,
        *,
        binary: str | None = None,
        **options: Unpack[RuntimeOptions],
    ) -> None:
        super().__init__(spec, session_id, **options)
        if not spec.image:
            raise RuntimeFailure(f"runtime {spec.backend!r} needs runtime.image")
        self.image = spec.image
        self.binary = binary or self.default_binary
        self.name = self.session_dir.name  # polar-<session>-<random>: unique per runtime
        self.control = self.session_dir / ".polar"
        if Path(spec.workdir).is_absolute():  # a path inside the image, e.g. /testbed
            self.workdir = Path(spec.workdir)
        self._counter = itertools.count()

    # -- the engine's command lines (pure; tested without an engine) --------------------------------

    @abstractmethod
    def start_argv(self) -> list[str]: ...

    @abstractmethod
    def exec_argv(self, argv: list[str], cwd: Path, env: dict[str, str]) -> list[str]: ...

    @abstractmethod
    def client_env(self, env: dict[str, str]) -> dict[str, str]:
        """Variables for the client process that carry `env` into the container (values never appear
        on a command line, where `ps` would show the session key)."""

    def pid_argv(self) -> list[str] | None:
        """The engine command that prints the container's first process's host pid (None: not known)."""
        return None

    def diff_argv(self) -> list[str] | None:
        """The engine command that lists what changed in the container against its image (None: none)."""
        return None

    @abstractmethod
    def kill_argv(self) -> list[str]: ...

    @abstractmethod
    def remove_argv(self) -> list[str]: ...

    @abstractmethod
    async def copy_in(self, src: Path, dst: Path) -> None: ...

    @abstractmethod
    async def copy_out(self, src: Path, dst: Path) -> None:
        """Copy `src` inside the container to `dst` in the shared session directory (not existing)."""

    def runtime_path(self, path: Path) -> str:
        """`path` (a host path) as the container sees it: under `/polar` when in the session directory."""
        path = Path(path)
        if path.is_relative_to(self.session_dir):
            return str(INSIDE / path.relative_to(self.session_dir))
        return str(path)

    def wrapped(self, argv: list[str], pidfile: Path) -> list[str]:
        return ["setsid", "-w", "sh", "-c", 'echo $$ > "$0" && exec "$@"', self.runtime_path(pidfile), *argv]

    # -- running the engine ------------------------------------------------------------------------

    async def engine(self, argv: list[str], *, check: bool = True) -> ExecResult:
        result = await run_process(
            argv,
            env=dict(os.environ),
            cwd=None,
            stdin=None,
            timeout_s=ENGINE_TIMEOUT_S,
            tracker=GroupTracker(),
            grace_s=self.term_grace_s,
        )
        if check and result.exit_code != 0:
            raise RuntimeFailure(
                f"{' '.join(argv[:3])} failed (exit {result.exit_code}): {result.stderr.strip()[-2000:]}"
            )
        return result

    async def start(self) -> None:
        if self._state != "new":
            return
        # An absolute workdir lives in the image, not in the session directory
        shared = (self.workdir,) if self.workdir.is_relative_to(self.session_dir) else ()
        self._check_read_only_paths()
        self._make_dirs(self.home, self.artifacts, self.control, *shared, exist_ok=True)
        try:
            await self.engine(self.start_argv())
        except RuntimeFailure:
            # Podman creates the container before it fails to start it (a missing workdir, a bad mount).
            await self.engine(self.remove_argv(), check=False)
            self._remove("nothing")
            raise
        self._state = "started"
        try:
            if not shared:  # a workdir inside the image, e.g. /testbed: there before the first command
                await self.engine(self.exec_argv(["mkdir", "-p", str(self.workdir)], Path("/"), {}))
            await self.engine(
                self.exec_argv(["sh", "-c", SEED_HOME, "sh", self.runtime_path(self.home)], Path("/"), {})
            )
            if self._gateway is not None:
                await self._bridge_gateway()
        except RuntimeFailure:
            await self.stop()
            raise

    async def _bridge_gateway(self) -> None:
        """`network: gateway`: a listener on the container's 127.0.0.1 at the gateway's port, relayed to
        the gateway (`polar.runtime.netns`); the container itself has no network."""
        assert self._gateway is not None
        argv = self.pid_argv()
        if argv is None:
            raise RuntimeFailure(f"runtime {self.backend!r} cannot bridge the gateway into its container")
        out = (await self.engine(argv)).stdout.strip()
        if not out.isdigit() or int(out) <= 0:
            raise RuntimeFailure(f"{' '.join(argv[:2])} gave no pid for container {self.name}: {out!r}")
        self._bridge = UnixBridge(*self._gateway, unix=False)
        self._bridge.start()
        sock = await asyncio.to_thread(listen_in_netns, int(out), "127.0.0.1", self._gateway[1])
        self._bridge.serve_socket(sock)

    async def cancel(self) -> None:
        self._tracker.mark_cancelled()
        if self._state == "started":
            await self.engine(self.kill_argv(), check=False)
        await self._tracker.kill_all(0.0)

    async def stop(self, *, keep: Keep | None = None) -> None:
        if self._state == "stopped":
            return
        was_started = self._state == "started"
        await self.cancel()
        if was_started:
            await self.engine(self.remove_argv(), check=False)
        self._state = "stopped"
        if self._bridge is not None:
            self._bridge.close()
            self._bridge = None
        await asyncio.to_thread(self._remove, keep or self.keep)

    # -- commands ----------------------------------------------------------------------------------

    def _env(self, env: dict[str, str] | None) -> dict[str, str]:
        # No host variables: the image's own PATH and locale apply
        return {"HOME": self.runtime_path(self.home)} | self.spec.env | (env or {})

    def _cwd(self, cwd: str | None) -> Path:
        return Path(self.runtime_path(self.workdir if cwd is None else self.workdir / cwd))

    def _command(self, argv: list[str] | str) -> list[str]:
        # A login shell here: images set PATH and friends in their profile (conda, nvm)
        return ["bash", "-lc", argv] if isinstance(argv, str) else list(argv)

    async def _kill_inside(self, pidfile: Path, client_pgid: int, grace_s: float) -> None:
        """SIGTERM the command's group inside the container, wait for the client to notice, SIGKILL."""
        try:
            pgid = int(pidfile.read_text().strip())
        except (OSError, ValueError):
            pgid = None  # not started yet inside: killing the client is all there is
        if pgid is not None:
            await self.engine(self.exec_argv(["kill", "-TERM", "--", f"-{pgid}"], Path("/"), {}), check=False)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and group_alive(client_pgid):
                await asyncio.sleep(0.05)
            await self.engine(self.exec_argv(["kill", "-KILL", "--", f"-{pgid}"], Path("/"), {}), check=False)
        signal_group(client_pgid, signal.SIGKILL)

    async def _run(
        self,
        command: list[str],
        env: dict[str, str],
        cwd: str | None,
        *,
        stdin: bytes | None,
        timeout_s: float | None,
    ) -> ExecResult:
        pidfile = self.control / f"exec-{next(self._counter)}.pid"

        async def kill(pgid: int, grace_s: float) -> None:
            await self._kill_inside(pidfile, pgid, grace_s)

        try:
            result = await run_process(
                self.exec_argv(self.wrapped(command, pidfile), self._cwd(cwd), env),
                env=dict(os.environ) | self.client_env(env),
                cwd=None,
                stdin=stdin,
                timeout_s=timeout_s,
                tracker=self._tracker,
                grace_s=self.term_grace_s,
                output_cap=self.output_cap,
                kill=kill,
            )
            if self._tracker.cancelled and result.exit_code == 0 and not result.timed_out:
                # `cancel` killed the container under the command; podman's exec client can then exit 0
                # (measured: podman 4.3 with catatonit). The command did not succeed: it was killed.
                result = replace(result, exit_code=-signal.SIGKILL)
            return result
        finally:
            pidfile.unlink(missing_ok=True)

    async def changed_paths(self) -> list[tuple[str, str]]:
        """What changed in the container's own filesystem against its image, as (kind, absolute path): "A"
        added, "C" changed (a directory is "C" when anything under it changed), "D" deleted. The engine
        reads it from the host, so nothing in the container (a replaced command, a stopped init) changes
        the listing; bind mounts (the session directory at /polar) are not in it. A listing past the output
        cap raises `ListingTruncated` (what was cut off could be anything)."""
        argv = self.diff_argv()
        if argv is None:
            raise RuntimeFailure(f"runtime {self.backend!r} cannot list what changed in its container")
        if self._state != "started":
            raise RuntimeFailure(f"runtime for session {self.session_id} is not running")
        res = await run_process(
            argv,
            env=dict(os.environ),
            cwd=None,
            stdin=None,
            timeout_s=ENGINE_TIMEOUT_S,
            tracker=GroupTracker(),
            grace_s=self.term_grace_s,
            output_cap=self.output_cap,
        )
        if res.exit_code != 0:
            raise RuntimeFailure(
                f"{' '.join(argv[:2])} failed (exit {res.exit_code}): {res.stderr.strip()[-2000:]}"
            )
        return parse_changes(res.stdout)

    # -- files -------------------------------------------------------------------------------------

    def _target(self, path: str) -> Path:
        return Path(os.path.normpath(self.workdir / path))

    async def upload(self, src: Path, dst: str) -> None:
        self._check_running()
        target = self._target(dst)
        if target.is_relative_to(self.session_dir):  # shared with the host: a plain copy
            await super().upload(src, dst)
        elif not Path(src).exists():
            raise RuntimeFailure(f"cannot copy {src}: no such file or directory")
        else:
            await self.copy_in(Path(src), target)

    async def download(self, src: str, dst: Path) -> None:
        self._check_running()
        source = self._target(src)
        if source.is_relative_to(self.session_dir):
            await super().download(src, dst)
            return
        # Through a staging place, so trees merge into `dst` as with local: the node's own where the engine
        # copies to the host (the session directory is the container's to write to), else the shared one.
        # A symlink arrives as a symlink (the engine copies the link, not its target) and stays one:
        # following it here would read a host file.
        if self.copies_to_host:
            staging = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="polar-out-"))
        else:
            staging = self.control / f"out-{next(self._counter)}"
            staging.mkdir()
        try:
            await self.copy_out(source, staging / "x")
            await asyncio.to_thread(_copy_link_or_tree, staging / "x", Path(dst))
        except OSError as exc:
            raise RuntimeFailure(f"download {src} -> {dst} failed: {exc}") from exc
        finally:
            await asyncio.to_thread(shutil.rmtree, staging, True)
