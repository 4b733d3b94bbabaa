"""Real container engines for the tests: docker (a `dockerd` started here when none answers) and podman.

CI is a fresh Debian machine where we are root: `scripts/test` installs `docker.io`, `podman`, `runc`,
`fuse-overlayfs`, `slirp4netns`, `uidmap` and `mmdebstrap`; this module starts what is not running and
builds polar's base image once per engine (`polar.runtime.images`, cached). Measured on this kind of machine
(../shared/reference/runtime-facts.md): `dockerd` needs no systemd, only its own data and exec roots, and
is ready in ~1 s; podman's default OCI runtime (crun) fails here (`setrlimit RLIMIT_NOFILE`, "cgroups in
hybrid mode"), and a `containers.conf` choosing runc with explicit ulimits fixes it.

Where an engine cannot run (not root, packages missing) its tests skip and say why.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from polar.runtime.images import DEFAULT_INCLUDE, BaseImage, default_cache, ensure_base_image

CACHE = default_cache().parent  # ~/.cache/polar, as the product's image cache has it
IMAGE = BaseImage().tag
# The base plus Debian's Node.js (18): what the CLI presets whose launcher is a node script need in an image.
NODE_IMAGE = BaseImage(tag="polar-node-base:bookworm", include=(*DEFAULT_INCLUDE, "nodejs"))
PODMAN_CONF = """\
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
"""


def _answers(argv: list[str]) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=30, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@contextlib.contextmanager
def docker_daemon() -> Iterator[str | None]:
    """A docker that answers: the machine's, or a `dockerd` started here (stopped after). Yields None when
    ready, else why docker cannot run here. Sets DOCKER_HOST for this process and its children."""
    if shutil.which("docker") is None:
        yield "no docker CLI on PATH (scripts/test installs docker.io)"
        return
    if _answers(["docker", "info"]):
        yield None
        return
    if shutil.which("dockerd") is None or os.geteuid() != 0:
        yield "no docker daemon answers, and one cannot be started here (needs dockerd and root)"
        return
    run = Path("/tmp/polar-test-dockerd")
    run.mkdir(exist_ok=True)
    sock = run / "docker.sock"
    _stop_leftover_dockerd(run / "dockerd.pid")
    # Images live in the cache, so the base image is imported once per machine, not per run.
    argv = ["dockerd", "--data-root", str(CACHE / "docker-data"), "--exec-root", str(run / "exec")]
    argv += ["--pidfile", str(run / "dockerd.pid"), "-H", f"unix://{sock}"]
    log = (run / "dockerd.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    old = os.environ.get("DOCKER_HOST")
    os.environ["DOCKER_HOST"] = f"unix://{sock}"
    try:
        deadline = time.monotonic() + 60
        while not _answers(["docker", "info"]):
            if proc.poll() is not None or time.monotonic() > deadline:
                yield f"dockerd did not start (see {run / 'dockerd.log'})"
                return
            time.sleep(0.2)
        yield None
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        if old is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = old


def _stop_leftover_dockerd(pidfile: Path) -> None:
    """Stop the dockerd an earlier run left on our pidfile (a suite killed before its teardown): a second
    dockerd refuses to start while the pidfile names a live process, and it would hold the data root."""
    try:
        pid = int(pidfile.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return  # no pidfile, or its process is gone: dockerd replaces a stale pidfile itself
    if b"dockerd" not in cmdline or str(pidfile).encode() not in cmdline:
        return  # the pid was reused by another process: not ours to stop
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    if Path(f"/proc/{pid}").exists():
        os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def podman_config() -> Iterator[str | None]:
    """Podman with the configuration this kind of machine needs (CONTAINERS_CONF, for this process and
    its children); None when it runs, else why not."""
    if shutil.which("podman") is None:
        yield "no podman on PATH (scripts/test installs podman)"
        return
    conf = CACHE / "podman" / "containers.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text(PODMAN_CONF)
    old = os.environ.get("CONTAINERS_CONF")
    os.environ["CONTAINERS_CONF"] = str(conf)
    try:
        yield None if _answers(["podman", "info"]) else "podman is installed but `podman info` fails"
    finally:
        if old is None:
            os.environ.pop("CONTAINERS_CONF", None)
        else:
            os.environ["CONTAINERS_CONF"] = old


def base_image(engine: str) -> str:
    """polar's base image in `engine` (bootstrapped with mmdebstrap once, cached)."""
    return ensure_base_image(engine, cache=default_cache())


def node_image(engine: str) -> str:
    """polar's base image with Node.js in `engine` (built once, cached): for harness CLIs in containers."""
    return ensure_base_image(engine, NODE_IMAGE, cache=default_cache())


def containers_of(engine: str, label: str) -> list[str]:
    out = subprocess.run(
        [engine, "ps", "-a", "--filter", f"label={label}", "--format", "{{.Names}}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


REGISTRY_CONF = """\
version: 0.1
log: {level: error}
storage: {filesystem: {rootdirectory: %s}, delete: {enabled: true}}
http: {addr: "127.0.0.1:%d"}
"""


def _http_ok(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def local_registry(root: Path) -> Iterator[str]:
    """A real image registry (Debian's `docker-registry`, the CNCF distribution server) on loopback:
    yields its `host:port`, which docker pushes to and pulls from over plain HTTP (docker trusts
    127.0.0.0/8 registries without TLS). Images live under `root`."""
    import pytest

    from polar.serving import free_port

    if shutil.which("docker-registry") is None:
        pytest.skip("no docker-registry on PATH (scripts/test installs it)")
    port = free_port()
    conf = root / "registry.yml"
    conf.write_text(REGISTRY_CONF % (root / "data", port))
    log = (root / "registry.log").open("wb")
    proc = subprocess.Popen(["docker-registry", "serve", str(conf)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not _http_ok(f"http://127.0.0.1:{port}/v2/"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"docker-registry did not start (see {root / 'registry.log'})")
            time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
