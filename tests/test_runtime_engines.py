"""The docker and podman runtimes against the real engines (tests.container_support starts them).

Each behaviour the local and bwrap runtimes are held to, in a container of polar's base image: environment,
cwd, stdin and exit codes; timeouts and cancellation that kill what the command started inside the
container; uploads and downloads to the shared session directory and to paths inside the image; cleanup
(no container left, also after the node is killed with SIGKILL); resource limits; and the three networks,
`none`, `gateway` (only the gateway, at a plain 127.0.0.1 URL) and `host`.
"""

from __future__ import annotations

import asyncio
import http.server
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from polar.runtime import RuntimeFailure, RuntimeSpec, make_runtime
from polar.runtime.docker import (
    OWNER_LABEL,
    SESSION_LABEL,
    DockerRuntime,
    container_owners,
    reap_containers,
)
from polar.runtime.leftovers import owner_label
from tests.container_support import IMAGE, containers_of

pytestmark = pytest.mark.containers


def runtime(engine: str, tmp_path: Path, **spec: object) -> DockerRuntime:
    fields: dict[str, object] = {"backend": engine, "image": IMAGE, "root": tmp_path, "network": "none"}
    fields.update(spec)
    gateway = fields.pop("gateway_url", None)
    rt = make_runtime(RuntimeSpec(**fields), "sess/1", gateway_url=gateway)  # type: ignore[arg-type]
    assert isinstance(rt, DockerRuntime)
    rt.term_grace_s = 0.5
    return rt


@pytest.fixture
async def rt(engine: str, tmp_path: Path) -> AsyncIterator[DockerRuntime]:
    r = runtime(engine, tmp_path, env={"SPEC_VAR": "from-spec"})
    await r.start()
    yield r
    await r.stop()


def running(engine: str, name: str) -> bool:
    out = subprocess.run(
        [engine, "inspect", "--format", "{{.State.Running}}", name],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.returncode == 0 and out.stdout.strip() == "true"


async def test_env_cwd_stdin_and_exit_codes(rt: DockerRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_SECRET", "must-not-leak")
    r = await rt.exec(
        'echo "$SPEC_VAR|$CALL_VAR|$HOME|${NODE_SECRET:-unset}"; pwd; cat; exit 3',
        env={"CALL_VAR": "from-call"},
        stdin=b"from stdin",
    )
    assert r.exit_code == 3
    first, cwd, rest = r.stdout.split("\n", 2)
    assert first == "from-spec|from-call|/polar/home|unset"  # the same in every container
    assert cwd == "/polar/workspace" == rt.runtime_path(rt.workdir) and rest == "from stdin"
    assert (await rt.exec(["sh", "-c", "echo err >&2; exit 0"])).stderr == "err\n"
    # The session directory is shared with the host (at /polar inside).
    (rt.workdir / "from-host.txt").write_text("host")
    assert (await rt.exec(["cat", "from-host.txt"])).stdout == "host"


async def test_a_timeout_kills_the_command_and_what_it_started_inside(rt: DockerRuntime) -> None:
    r = await rt.exec("sleep 301 & sleep 302", timeout_s=1)
    assert r.timed_out and r.exit_code == 124
    ps = await rt.exec(["ps", "-eo", "args"])
    assert "sleep 30" not in ps.stdout, ps.stdout
    assert (await rt.exec(["echo", "still usable"])).stdout == "still usable\n"


async def test_orphans_are_reaped(rt: DockerRuntime) -> None:
    """Background processes whose parent exited end as zombies unless PID 1 reaps them (`--init`)."""
    await rt.exec("for i in 1 2 3 4 5; do (sleep 0.1 &); done")
    await asyncio.sleep(1.0)
    ps = await rt.exec(["ps", "-eo", "stat=,args="])
    assert not [line for line in ps.stdout.splitlines() if line.startswith("Z")], ps.stdout


async def test_cancel_during_an_exec_kills_the_container(rt: DockerRuntime, engine: str) -> None:
    task = asyncio.create_task(rt.exec("sleep 303"))
    await asyncio.sleep(1.0)
    await rt.cancel()
    result = await asyncio.wait_for(task, 30)
    assert result.exit_code != 0
    assert not running(engine, rt.name)


async def test_uploads_and_downloads_inside_the_image_and_in_the_shared_dir(
    rt: DockerRuntime, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("x = 1\n")
    (src / "top.txt").write_text("top")
    one = tmp_path / "one.txt"
    one.write_text("single")
    await rt.upload(src, "/opt/tree")  # inside the image: through the engine
    await rt.upload(one, "/opt/deep/dir/one.txt")
    await rt.upload(src, "shared")  # relative: the workdir, in the shared session directory
    listing = await rt.exec("find /opt/tree /opt/deep -type f | sort; cat /opt/deep/dir/one.txt")
    assert listing.stdout == "/opt/deep/dir/one.txt\n/opt/tree/pkg/mod.py\n/opt/tree/top.txt\nsingle"
    assert (rt.workdir / "shared" / "pkg" / "mod.py").read_text() == "x = 1\n"
    await rt.exec("echo made-inside > /opt/tree/pkg/new.txt")
    out = tmp_path / "out"
    await rt.download("/opt/tree", out)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "pkg/mod.py",
        "pkg/new.txt",
        "top.txt",
    ]
    await rt.download("/opt/deep/dir/one.txt", tmp_path / "back.txt")
    assert (tmp_path / "back.txt").read_text() == "single"


async def test_a_symlink_downloads_as_a_symlink_never_as_the_host_file_it_names(
    rt: DockerRuntime, tmp_path: Path
) -> None:
    secret = tmp_path / "host-secret.txt"
    secret.write_text("the node's")
    await rt.exec(f"mkdir -p /opt/a && ln -s {secret} /opt/a/link && ln -s {secret} /opt/top")
    await rt.download("/opt/a", tmp_path / "a")
    try:  # docker copies the link itself; podman refuses a link that dangles in the container
        await rt.download("/opt/top", tmp_path / "top")
    except RuntimeFailure:
        assert not (tmp_path / "top").exists()
    for link in (tmp_path / "top", tmp_path / "a" / "link"):
        if link.exists() or link.is_symlink():
            assert link.is_symlink() and os.readlink(link) == str(secret)
    assert (tmp_path / "a" / "link").is_symlink()


async def test_changed_paths_lists_what_the_container_changed_against_its_image(rt: DockerRuntime) -> None:
    res = await rt.exec(
        "mkdir -p /opt/new/deep && echo x > /opt/new/deep/f && echo y >> /etc/issue && rm /usr/bin/dash"
        " && echo z > '/opt/new/two\nlines' && echo w > /polar/shared-not-listed"
    )
    assert res.exit_code == 0, res.stderr
    changes = await rt.changed_paths()
    assert {
        ("A", "/opt/new"),
        ("A", "/opt/new/deep"),
        ("A", "/opt/new/deep/f"),
        ("A", "/opt/new/two\nlines"),
        ("C", "/etc/issue"),
        ("D", "/usr/bin/dash"),
    } <= set(changes), changes
    assert not [p for _, p in changes if p.startswith("/polar/")]  # the session directory is a bind mount
    await rt.exec("kill -TERM 1")  # the agent can stop its own container; the listing still comes
    assert ("D", "/usr/bin/dash") in await rt.changed_paths()


async def test_stop_removes_the_container_and_keeps_artifacts_when_asked(engine: str, tmp_path: Path) -> None:
    rt = runtime(engine, tmp_path, workdir="/srv/app")
    await rt.start()
    label = f"{SESSION_LABEL}=sess/1"
    assert rt.name in containers_of(engine, label)
    (rt.artifacts / "result.json").write_text("{}")
    assert (await rt.exec(["pwd"])).stdout == "/srv/app\n"  # an absolute workdir lives in the image
    await rt.stop(keep="artifacts")
    assert rt.name not in containers_of(engine, label)
    assert (rt.artifacts / "result.json").read_text() == "{}"
    assert not rt.home.exists()


@pytest.fixture
def host_servers() -> Iterator[tuple[int, int]]:
    """Two HTTP servers on the host's loopback: (the gateway's port, another service's port)."""

    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(f"hello from {self.server.server_address[1]}".encode())

        def log_message(self, *args: object) -> None:
            pass

    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    try:
        yield servers[0].server_address[1], servers[1].server_address[1]
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


PROBE = textwrap.dedent(
    """
    import socket, sys, urllib.request
    for target in sys.argv[1:]:
        if target.startswith("http"):
            try:
                print(urllib.request.urlopen(target, timeout=5).read().decode())
            except Exception as e:
                print("fail", type(e).__name__)
        else:
            host, port = target.rsplit(":", 1)
            try:
                socket.create_connection((host, int(port)), timeout=3).close()
                print("open")
            except OSError as e:
                print("fail", type(e).__name__)
    """
)


async def probe(rt: DockerRuntime, *targets: str) -> list[str]:
    r = await rt.exec(["python3", "-c", PROBE, *targets], timeout_s=60)
    assert r.exit_code == 0, r.stderr
    return r.stdout.splitlines()


@pytest.mark.parametrize("network", ["none", "gateway", "host"])
async def test_networks(engine: str, tmp_path: Path, host_servers: tuple[int, int], network: str) -> None:
    gw_port, other_port = host_servers
    host_url = f"http://127.0.0.1:{gw_port}/v1"
    rt = runtime(engine, tmp_path, network=network, gateway_url=host_url)
    await rt.start()
    try:
        seen = await probe(
            rt, f"http://127.0.0.1:{gw_port}/", f"127.0.0.1:{other_port}", "1.1.1.1:80", "10.0.0.1:80"
        )
        if network == "none":
            assert rt.gateway_url is None
            assert all(line.startswith("fail") for line in seen), seen
        elif network == "gateway":
            # The harness is given a plain loopback URL; only the gateway's port answers there.
            assert rt.gateway_url == host_url
            assert seen[0] == f"hello from {gw_port}"
            assert all(line.startswith("fail") for line in seen[1:]), seen
        else:
            assert rt.gateway_url == host_url
            assert seen[0] == f"hello from {gw_port}" and seen[1] == "open"
    finally:
        await rt.stop()
    assert rt.name not in await asyncio.to_thread(containers_of, engine, f"{SESSION_LABEL}=sess/1")


async def test_gateway_network_serves_many_connections_and_closes_with_the_runtime(
    engine: str, tmp_path: Path, host_servers: tuple[int, int]
) -> None:
    gw_port, _ = host_servers
    rt = runtime(engine, tmp_path, network="gateway", gateway_url=f"http://127.0.0.1:{gw_port}")
    await rt.start()
    script = f"""
import concurrent.futures, urllib.request
def get(_): return urllib.request.urlopen("http://127.0.0.1:{gw_port}/", timeout=10).read()
with concurrent.futures.ThreadPoolExecutor(16) as pool:
    print(sum(r == b"hello from {gw_port}" for r in pool.map(get, range(64))))
"""
    try:
        assert (await rt.exec(["python3", "-c", script], timeout_s=120)).stdout == "64\n"
    finally:
        await rt.stop()
    assert rt._bridge is None


async def test_resource_limits_are_enforced(engine: str, tmp_path: Path) -> None:
    rt = runtime(engine, tmp_path, memory_mb=64, pids_limit=40, cpus=0.5)
    await rt.start()
    try:
        hog = await rt.exec(["python3", "-c", "x = bytearray(256 << 20); print('allocated')"], timeout_s=60)
        assert hog.exit_code != 0 and "allocated" not in hog.stdout
        spawn = (
            "import subprocess\n"
            "procs = []\n"
            "try:\n"
            "    for _ in range(80): procs.append(subprocess.Popen(['sleep', '30']))\n"
            "except OSError as e: print(len(procs), 'refused:', e)\n"
            "else: print(len(procs))\n"
            "for p in procs: p.kill()\n"
        )
        forks = await rt.exec(["python3", "-c", spawn], timeout_s=60)
        assert "refused" in forks.stdout and int(forks.stdout.split()[0]) < 40, forks
        quota = await rt.exec(
            "cat /sys/fs/cgroup/cpu.max 2>/dev/null || "
            "echo $(cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us) $(cat /sys/fs/cgroup/cpu/cpu.cfs_period_us)"
        )
        q, period = quota.stdout.split()
        assert int(q) / int(period) == pytest.approx(0.5)
    finally:
        await rt.stop()


NODE = """
import asyncio, sys, time
from pathlib import Path
from polar.runtime import RuntimeFailure, RuntimeSpec, make_runtime
spec = RuntimeSpec(backend=sys.argv[1], image=sys.argv[2], root=Path(sys.argv[3]), network="none")
rt = make_runtime(spec, "doomed")
asyncio.run(rt.start())
print(rt.name, flush=True)
time.sleep(600)
"""


async def test_containers_of_a_node_killed_with_sigkill_are_reaped(engine: str, tmp_path: Path) -> None:
    """A node that dies leaves its containers running; the next node start removes them (and only them)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", NODE, engine, IMAGE, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.stdout is not None
    name = (await asyncio.to_thread(proc.stdout.readline)).strip()
    ours = runtime(engine, tmp_path)  # a live owner's container: must survive the reap
    await ours.start()
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        assert running(engine, name)
        assert (
            owner_label()
            in subprocess.run(
                [engine, "inspect", "--format", f'{{{{index .Config.Labels "{OWNER_LABEL}"}}}}', ours.name],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        # A container gone between the listing and the inspect (its node removing it) costs nothing.
        owners = dict(await container_owners(engine, [name, "polar-gone-0000", ours.name]))
        assert set(owners) == {name, ours.name} and owners[ours.name] == owner_label()
        removed = await reap_containers(engine)
        assert name in removed and ours.name not in removed
        assert name not in containers_of(engine, OWNER_LABEL)
        assert running(engine, ours.name)
    finally:
        await ours.stop()
        subprocess.run([engine, "rm", "-f", name], capture_output=True, check=False)


def test_the_listener_lives_in_the_container_not_on_the_host(engine: str, tmp_path: Path) -> None:
    """The gateway's port inside the container is not a second listener on the host's loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main() -> None:
        rt = runtime(engine, tmp_path, network="gateway", gateway_url=f"http://127.0.0.1:{port}")
        await rt.start()
        try:
            with socket.socket() as s, pytest.raises(ConnectionRefusedError):
                s.connect(("127.0.0.1", port))  # nothing listens on the host at that port
        finally:
            await rt.stop()

    asyncio.run(main())


async def test_a_container_that_cannot_start_leaves_nothing(engine: str, tmp_path: Path) -> None:
    """An image that is not there (no registry answers here): a clear failure, no container, no directory."""
    rt = runtime(engine, tmp_path, image="polar-test-missing:1")
    with pytest.raises(RuntimeFailure, match="polar-test-missing"):
        await rt.start()
    assert not rt.session_dir.exists()
    assert rt.name not in await asyncio.to_thread(containers_of, engine, f"{SESSION_LABEL}=sess/1")


async def test_the_images_dotfiles_seed_the_session_home(engine: str, tmp_path: Path) -> None:
    """HOME is the session's home (/polar/home), not the image user's: the image's dotfiles are copied into
    it at start, so a login shell sets up what the image sets up (SWE-bench images activate their conda
    environment from /root's dotfiles). A dotfile the session already has is never overwritten."""
    from polar.runtime.images import build_image

    context = tmp_path / "ctx"
    context.mkdir()
    (context / "Dockerfile").write_text(
        f"FROM {IMAGE}\nRUN printf 'export POLAR_FROM_IMAGE=yes\\n' > /root/.profile\n"
    )
    tag = f"polar-test-dotfiles:{os.getpid()}"
    build_image(engine, tag, context)
    try:
        rt = runtime(engine, tmp_path / "rt", image=tag)
        rt.home.mkdir(parents=True)
        (rt.home / ".bashrc").write_text("# the session's own\n")
        await rt.start()
        try:
            r = await rt.exec("echo $HOME $POLAR_FROM_IMAGE")  # a string: `bash -lc`, a login shell
            assert r.stdout.split() == ["/polar/home", "yes"], (r.stdout, r.stderr)
            assert (rt.home / ".bashrc").read_text() == "# the session's own\n"
        finally:
            await rt.stop()
    finally:
        subprocess.run([engine, "rmi", "-f", tag], capture_output=True, timeout=120)
