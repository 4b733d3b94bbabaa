"""Docker, podman and apptainer without an engine: the exact command lines, that values of variables never
reach a command line, that the in-container wrapper really reports its process group, and that the factory
refuses clearly when an engine or an image is missing. Docker and podman themselves run in
tests/test_runtime_engines.py; apptainer is in neither Debian's packages nor the index."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from polar.runtime import RuntimeFailure, RuntimeSpec, make_runtime
from polar.runtime.apptainer import ApptainerRuntime
from polar.runtime.container import ListingTruncated, parse_changes
from polar.runtime.docker import DockerRuntime, PodmanRuntime
from polar.runtime.leftovers import owner_label


def _spec(tmp_path: Path, backend: str, **kw: object) -> RuntimeSpec:
    return RuntimeSpec(backend=backend, image="python:3.12-slim", root=tmp_path, **kw)  # type: ignore[arg-type]


def test_docker_command_lines(tmp_path: Path) -> None:
    rt = DockerRuntime(
        _spec(tmp_path, "docker", read_only_paths=("/opt/cli",)), "s/1", gateway_url="http://127.0.0.1:9"
    )
    s = str(rt.session_dir)
    assert rt.name == rt.session_dir.name and rt.name.startswith("polar-s_1-")
    assert rt.start_argv() == [
        "docker", "run", "-d", "--init", "--name", rt.name, "--network", "none",
        "--security-opt", "no-new-privileges", "--label", f"polar.owner={owner_label()}", "--label", "polar.session=s/1",
        "-v", f"{s}:/polar", "-v", "/opt/cli:/opt/cli:ro", "python:3.12-slim", "sleep", "infinity",
    ]  # fmt: skip
    # network gateway: no network, and a listener on the container's loopback at the gateway's port
    assert rt.gateway_url == "http://127.0.0.1:9" and rt._gateway == ("127.0.0.1", 9)
    assert rt.pid_argv() == ["docker", "inspect", "--format", "{{.State.Pid}}", rt.name]
    host = DockerRuntime(
        _spec(tmp_path, "docker", network="host", cpus=1.5, memory_mb=512, pids_limit=100),
        "s/2",
        gateway_url="http://127.0.0.1:9/v1",
    )
    argv = host.start_argv()
    assert argv[argv.index("--network") + 1] == "host" and host.gateway_url == "http://127.0.0.1:9/v1"
    assert argv[argv.index("--cpus") :][:6] == ["--cpus", "1.5", "--memory", "512m", "--pids-limit", "100"]
    assert host._gateway is None  # the host's network: the same URL answers, nothing to bridge
    env = {"HOME": f"{s}/home", "OPENAI_API_KEY": "secret-session-key"}
    argv = rt.exec_argv(["python", "-V"], Path("/w"), env)
    assert argv == [
        "docker",
        "exec",
        "-i",
        "-w",
        "/w",
        "-e",
        "HOME",
        "-e",
        "OPENAI_API_KEY",
        rt.name,
        "python",
        "-V",
    ]
    assert "secret-session-key" not in " ".join(argv)
    assert rt.client_env(env) == env
    assert rt.kill_argv() == ["docker", "kill", rt.name]
    assert rt.remove_argv() == ["docker", "rm", "-f", rt.name]
    assert rt.copy_argv("/a/.", f"{rt.name}:/b") == ["docker", "cp", "/a/.", f"{rt.name}:/b"]
    assert rt.diff_argv() == ["docker", "diff", rt.name]


def test_a_change_listing_joins_names_that_hold_newlines_and_refuses_a_cut_one() -> None:
    text = "C /app\nA /app/two\nlines\nA /app/x\nD /usr/bin/dash\n"
    assert parse_changes(text) == [
        ("C", "/app"), ("A", "/app/two\nlines"), ("A", "/app/x"), ("D", "/usr/bin/dash")
    ]  # fmt: skip
    # A crafted name can add an entry of its own, never hide the next one.
    assert parse_changes("A /app/a\nC /usr/bin/bash\nA /app/b\n")[1:] == [
        ("C", "/usr/bin/bash"),
        ("A", "/app/b"),
    ]
    with pytest.raises(ListingTruncated):
        parse_changes("A /a\n[polar: output truncated at 10 bytes, 5 more bytes dropped]\n")


def test_docker_network_none_and_absolute_workdir(tmp_path: Path) -> None:
    rt = DockerRuntime(
        _spec(tmp_path, "docker", network="none", workdir="/testbed"), "s", gateway_url="http://127.0.0.1:9"
    )
    argv = rt.start_argv()
    assert argv[argv.index("--network") + 1] == "none"
    assert "-w" not in argv and rt.workdir == Path(
        "/testbed"
    )  # made by `start` (podman refuses a missing -w)
    assert rt.gateway_url is None
    # str commands run in a login shell inside images (their profile sets PATH)
    assert rt._command("make test") == ["bash", "-lc", "make test"]
    assert rt._env({"X": "1"}) == {"HOME": "/polar/home", "X": "1"}  # nothing from the host


def test_every_container_sees_its_session_at_the_same_place(tmp_path: Path) -> None:
    """Two runtimes (two samples of a task) give their harness the same paths: what a CLI writes into its
    prompt (its home, its cwd) is the same, so the group shares a prefix cache and a recording replays."""
    one, two = (DockerRuntime(_spec(tmp_path, "docker"), sid) for sid in ("s1", "s2"))
    assert one.session_dir != two.session_dir
    for rt in (one, two):
        assert (
            rt.runtime_path(rt.home) == "/polar/home" and rt.runtime_path(rt.artifacts) == "/polar/artifacts"
        )
        assert rt.runtime_path(rt.workdir) == "/polar/workspace" and rt._cwd("sub") == Path(
            "/polar/workspace/sub"
        )
        assert rt.runtime_path(Path("/opt/cli")) == "/opt/cli"  # not in the session directory: as it is
        assert rt.wrapped(["id"], rt.control / "exec-0.pid")[5] == "/polar/.polar/exec-0.pid"


def test_apptainer_command_lines(tmp_path: Path) -> None:
    rt = ApptainerRuntime(_spec(tmp_path, "apptainer", network="none"), "a", binary="/usr/bin/singularity")
    s = str(rt.session_dir)
    assert rt.start_argv() == [
        "/usr/bin/singularity", "instance", "start", "--containall", "--writable-tmpfs",
        "--bind", f"{s}:/polar", "--net", "--network", "none", "python:3.12-slim", rt.name,
    ]  # fmt: skip
    argv = rt.exec_argv(["id"], Path("/w"), {"K": "secret"})
    assert argv == [
        "/usr/bin/singularity",
        "exec",
        "--cleanenv",
        "--pwd",
        "/w",
        f"instance://{rt.name}",
        "id",
    ]
    assert rt.client_env({"K": "secret"}) == {"APPTAINERENV_K": "secret"}
    assert rt.kill_argv() == ["/usr/bin/singularity", "instance", "stop", "--signal", "SIGKILL", rt.name]
    assert rt.remove_argv() == ["/usr/bin/singularity", "instance", "stop", "--force", rt.name]


async def test_in_container_wrapper_reports_its_process_group(tmp_path: Path) -> None:
    """The wrapper runs unchanged inside the container; here it runs on the host to prove what it does."""
    rt = DockerRuntime(_spec(tmp_path, "docker"), "w")
    pidfile = tmp_path / "pid"
    argv = rt.wrapped(["sh", "-c", 'echo "$$ $(ps -o pgid= -p $$)"; exit 3'], pidfile)
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    pid, pgid = out.decode().split()
    assert proc.returncode == 3  # setsid -w hands the exit status through
    assert pid == pgid == pidfile.read_text().strip()


async def test_stop_before_start_needs_no_engine(tmp_path: Path) -> None:
    rt = DockerRuntime(_spec(tmp_path, "docker"), "never")
    await rt.stop()
    with pytest.raises(RuntimeFailure, match="stopped"):
        await rt.exec(["true"])


def _fake_path(tmp_path: Path, *names: str) -> str:
    """A PATH holding executables with these names (only their presence is looked up)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name in names:
        (bindir / name).symlink_to("/bin/false")
    return str(bindir)


def test_factory_builds_and_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeFailure, match="runtime 'docker' needs the docker CLI"):
        make_runtime(_spec(tmp_path, "docker"), "x")
    with pytest.raises(RuntimeFailure, match="needs apptainer \\(or singularity\\)"):
        make_runtime(_spec(tmp_path, "apptainer"), "x")
    with pytest.raises(RuntimeFailure, match=r"runtime 'docker' needs runtime\.image"):
        make_runtime(RuntimeSpec(backend="docker"), "x")
    with pytest.raises(RuntimeFailure, match="runtime 'podman' needs the podman CLI"):
        make_runtime(_spec(tmp_path, "podman"), "x")
    monkeypatch.setenv("PATH", _fake_path(tmp_path, "docker", "podman", "singularity"))
    # apptainer shares the host's network: `gateway` would not hold
    with pytest.raises(RuntimeFailure, match="runtime 'apptainer' cannot confine network 'gateway'"):
        make_runtime(_spec(tmp_path, "apptainer"), "x")
    with pytest.raises(RuntimeFailure, match=r"runtime\.memory_mb is enforced by docker and podman only"):
        make_runtime(_spec(tmp_path, "apptainer", network="none", memory_mb=64), "x")
    assert isinstance(make_runtime(_spec(tmp_path, "docker"), "x"), DockerRuntime)
    assert isinstance(make_runtime(_spec(tmp_path, "podman", network="host"), "x"), PodmanRuntime)
    rt = make_runtime(_spec(tmp_path, "apptainer", network="none"), "x")
    assert isinstance(rt, ApptainerRuntime) and os.path.basename(rt.binary) == "singularity"


async def test_engine_failure_is_a_runtime_failure(tmp_path: Path) -> None:
    """An engine that answers with an error (here: `false`) fails `start` clearly and leaves nothing."""
    rt = DockerRuntime(_spec(tmp_path, "docker"), "x", binary="/bin/false")
    with pytest.raises(RuntimeFailure, match="failed \\(exit 1\\)"):
        await rt.start()
    assert not rt.session_dir.exists()


def test_only_this_hosts_dead_owners_are_reaped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A container's `polar.owner` label says whose it is; only a dead process of this host gives it up."""
    import socket

    from polar.runtime import leftovers

    me = owner_label()
    host, pid, start, boot = me.rsplit(":", 3)
    assert host == socket.gethostname() and int(pid) == os.getpid()
    assert not leftovers.owner_dead(me)  # alive
    assert leftovers.owner_dead(f"{host}:{pid}:{int(start) + 1}:{boot}")  # the pid was reused since
    assert leftovers.owner_dead(f"{host}:{pid}:{start}:an-earlier-boot")  # this host rebooted
    assert not leftovers.owner_dead(f"other-machine:{pid}:1:{boot}")  # a shared engine: theirs to reap
    for garbage in ("", "x", "h:notapid:1:b", "1:2:3"):
        assert not leftovers.owner_dead(garbage)


async def test_a_missing_read_only_path_is_refused_before_the_engine_runs(tmp_path: Path) -> None:
    """docker's `-v` would create a missing host path as an empty root-owned directory and mount that."""
    missing = str(tmp_path / "no-such-cli")
    for backend, cls in (("docker", DockerRuntime), ("podman", PodmanRuntime)):
        rt = cls(_spec(tmp_path, backend, read_only_paths=(missing,)), "s", binary="/nonexistent/engine")
        with pytest.raises(RuntimeFailure, match=r"read_only_paths: .*no-such-cli.* not an existing"):
            await rt.start()
        assert not Path(missing).exists()


def test_cli_presets_in_a_container_get_the_tool_cache_read_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The presets install their pinned CLI during setup, after the container started: the node mounts the
    whole tool cache (made if missing) at its host path; other harnesses and non-container runtimes get
    nothing mounted."""
    from polar.rollout.node.lifecycle import runtime_spec
    from polar.task import Task

    monkeypatch.setenv("POLAR_HOME", str(tmp_path / "home"))

    def task(harness: str, backend: str) -> Task:
        return Task.model_validate(
            {
                "task_id": "t",
                "instruction": "x",
                "agent": {"harness": harness},
                "runtime": {"backend": backend, "image": "img:1" if backend != "local" else None},
            }
        )

    cache = tmp_path / "home" / "tools"
    for harness in ("codex", "claude_code", "mini_swe_agent"):
        for backend in ("docker", "podman"):
            assert runtime_spec(task(harness, backend), None).read_only_paths == (str(cache),)
    assert cache.is_dir()
    assert runtime_spec(task("shell", "docker"), None).read_only_paths == ()
    assert runtime_spec(task("codex", "local"), None).read_only_paths == ()
