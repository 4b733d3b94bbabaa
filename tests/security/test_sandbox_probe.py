"""From inside real sessions, as the agent under training: no host socket, no host secret, no other session.

Reproduces issue #24's first finding: from a `bwrap` session (`network: gateway`) the agent, still uid 0
under a read-only `/`, drove the host's docker socket into a root container on the host, read /etc/shadow,
and opened the run's stores. Here a probe runs as the session's harness: it walks every path it can see for
unix sockets and tries each, lists abstract sockets, tries to read the host's secrets (given their paths,
as if it knew them: /etc/shadow, the token file, the stores, a world-readable file under /root), lists the
folder where the node keeps every session's directory (the evaluator's fresh runtime among them, prepared
while the agent runs), and reports its uid and capabilities through the only channel out: a model call.

`local` is the runtime for policies one trusts (docs/security.md): its probe pins that documented
difference, and a node that does not allow it refuses it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from polar.auth import default_token_file, load_token
from polar.rollout.node import AdmissionError
from polar.store.sqlite import SQLiteStore
from tests.container_support import IMAGE
from tests.node_support import fake_policy, running_node, shell_task, spec
from tests.server_support import start_server

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the uid boundary is made by a root node")

# Stdlib only, in any Python 3 (the image's, too).
PROBE = r"""
import hashlib, json, os, socket, stat, urllib.request

def err(e):
    return type(e).__name__

found = {"uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()), "read": {}, "list": {},
         "named_sockets": {}, "sockets": {}, "abstract": {}}
with open("/proc/self/status") as f:
    status = dict(line.split(":", 1) for line in f if ":" in line)
found["cap_eff"], found["no_new_privs"] = status["CapEff"].strip(), status["NoNewPrivs"].strip()
for name, path in json.loads(os.environ["SECRETS"]).items():
    try:
        with open(path, "rb") as f:
            found["read"][name] = hashlib.sha256(f.read()).hexdigest()
    except OSError as e:
        found["read"][name] = err(e)
for name, path in json.loads(os.environ["FOLDERS"]).items():
    try:
        found["list"][name] = sorted(os.listdir(path))
    except OSError as e:
        found["list"][name] = err(e)

def try_unix(address):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(3)
    try:
        s.connect(address)
        return "open"
    except OSError as e:
        return err(e)
    finally:
        s.close()

for name, path in json.loads(os.environ["SOCKETS"]).items():
    found["named_sockets"][name] = try_unix(path)
own = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # so the walk has one socket to find: its own
found["own"] = "/tmp/polar-probe-own-" + os.urandom(4).hex() + ".sock"
own.bind(found["own"])
own.listen(4)
if os.environ.get("WALK") == "1":
    for root, dirs, files in os.walk("/"):
        if root == "/":
            dirs[:] = [d for d in dirs if d not in ("proc", "sys")]
        for entry in files + dirs:
            path = os.path.join(root, entry)
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    found["sockets"][path] = try_unix(path)
            except OSError:
                pass
try:
    with open("/proc/net/unix") as f:
        names = {line.split()[-1] for line in list(f)[1:] if line.split()[-1].startswith("@")}
except OSError:
    names = set()
for name in sorted(names):
    found["abstract"][name] = try_unix("\0" + name[1:])

body = {"model": os.environ["OPENAI_MODEL"], "max_tokens": 4,
        "messages": [{"role": "user", "content": "REPORT " + json.dumps(found)}]}
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=json.dumps(body).encode(),
                             headers={"content-type": "application/json",
                                      "authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
urllib.request.urlopen(req, timeout=30).read()
"""


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def host_socket(path: Path) -> Iterator[Path]:
    """A host unix socket anyone may connect to (0666), standing for dbus, journald or a database."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    path.chmod(0o666)
    server.listen(16)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conn, _ = server.accept()
                conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        stop.set()
        server.close()
        path.unlink(missing_ok=True)


def _report(store: Path, session_id: str) -> dict[str, Any]:
    with SQLiteStore(store) as s:
        (record,) = s.completions(session_id)
    content = record.request["messages"][0]["content"]
    assert content.startswith("REPORT ")
    found: dict[str, Any] = json.loads(content.removeprefix("REPORT "))
    return found


async def _probe(tmp_path: Path, runtime: dict[str, Any], python: str, walk: bool) -> tuple[dict, dict]:
    """Run the probe as the agent of a two-sample task whose evaluator prepares a fresh runtime; return
    (the first sample's report, what the host holds: paths and digests)."""
    token_file = default_token_file()
    token = load_token(create=True)  # the deployment's token file, 0600, as `polar serve` writes it
    secret = Path("/root") / f"polar-probe-{secrets.token_hex(4)}"  # world-readable, in a home directory
    secret.write_text(secrets.token_hex(16))
    secret.chmod(0o644)
    server = start_server(tmp_path / "server.db")
    docker_sock = Path("/var/run/docker.sock")
    try:
        with (
            host_socket(Path("/run/polar-probe") / f"{secrets.token_hex(4)}.sock") as run_sock,
            host_socket(Path("/tmp") / f"polar-probe-{secrets.token_hex(4)}.sock") as tmp_sock,
            fake_policy() as (url, _),
        ):
            async with running_node(url, tmp_path) as node:
                host = {
                    "shadow": "/etc/shadow",
                    "token file": str(token_file),
                    "node store": str(tmp_path / "node.db"),
                    "server store": str(tmp_path / "server.db"),
                    "home secret": str(secret),
                }
                sockets = {"run": str(run_sock), "tmp": str(tmp_sock)}
                if docker_sock.exists():
                    sockets["docker"] = str(docker_sock)
                folders = {"session directories": str(tmp_path / "runtimes"), "root": "/root"}
                task = shell_task(
                    f'{python} -I -c "$PROBE"',
                    task_id="probe",
                    num_samples=2,
                    timeout_seconds=180,
                    runtime={
                        **runtime,
                        "prepare": [
                            {
                                "type": "exec",
                                "cmd": "git init -q && git -c user.email=p@l -c user.name=p "
                                "commit -q --allow-empty -m base",
                            }
                        ],
                    },
                    agent={
                        "harness": "shell",
                        "settings": {"command": f'{python} -I -c "$PROBE"'},
                        "env": {
                            "PROBE": PROBE,
                            "SECRETS": json.dumps(host),
                            "SOCKETS": json.dumps(sockets),
                            "FOLDERS": json.dumps(folders),
                            "WALK": "1" if walk else "0",
                        },
                    },
                    evaluator={
                        "strategy": "command",
                        "fresh_runtime": True,
                        "config": {"test_command": "true"},
                    },
                )
                for i in range(2):
                    await node.submit(spec(task, f"probe-{i}", sample_index=i))
                results = [await node.wait(f"probe-{i}") for i in range(2)]
                for result in results:
                    assert result.status.value == "COMPLETED", result.reason
                found = _report(tmp_path / "node.db", "probe-0")
                digests = {name: _digest(Path(p)) for name, p in host.items() if Path(p).exists()}
                return found, {"digests": digests, "token": token, "folders": folders}
    finally:
        server.stop()
        secret.unlink(missing_ok=True)


def _nothing_of_the_host(found: dict[str, Any], host: dict[str, Any]) -> None:
    """What the sandboxes promise: no host secret read, no host socket connected, no other session seen."""
    for name, answer in found["read"].items():
        assert answer != host["digests"].get(name), f"the sandbox read the host's {name}"
    for name, answer in found["named_sockets"].items():
        assert answer != "open", f"the sandbox connected to the host's {name} socket"
    assert found["sockets"].get(found["own"]) == "open", "the walk did not run"
    opened = [path for path, answer in found["sockets"].items() if answer == "open"]
    opened.remove(found["own"])
    assert not opened, f"sockets the sandbox could connect to: {opened}"
    assert all(answer != "open" for answer in found["abstract"].values()), found["abstract"]
    assert isinstance(found["list"]["session directories"], str), "the sandbox listed the session dirs"


async def test_bwrap_sessions_see_no_host_socket_secret_or_session(tmp_path: Path) -> None:
    found, host = await _probe(tmp_path, {"backend": "bwrap"}, sys.executable, walk=True)
    _nothing_of_the_host(found, host)
    assert found["uid"] != 0 and found["gid"] != 0 and found["groups"] in ([], [found["gid"]])
    assert int(found["cap_eff"], 16) == 0 and found["no_new_privs"] == "1"
    # /root holds only the folders above what the node binds (the Python, the tool cache), never its files
    assert all(not name.startswith("polar-probe-") for name in found["list"]["root"]), found["list"]


@pytest.mark.containers
@pytest.mark.parametrize("engine", ["docker", "podman"])
async def test_container_sessions_see_no_host_socket_secret_or_session(
    tmp_path: Path, engine: str, request: pytest.FixtureRequest
) -> None:
    request.getfixturevalue(f"{engine}_engine")  # started, with polar's base image
    runtime = {"backend": engine, "image": IMAGE}
    found, host = await _probe(tmp_path, runtime, "python3", walk=True)
    _nothing_of_the_host(found, host)
    # root of its own container only: none of the capabilities that reach past it
    assert found["no_new_privs"] == "1"  # a setuid binary in the image gives nothing more
    cap_eff = int(found["cap_eff"], 16)
    for cap in (21, 19, 12, 16):  # SYS_ADMIN, SYS_PTRACE, NET_ADMIN, SYS_MODULE
        assert not cap_eff & (1 << cap), (cap, found["cap_eff"])


async def test_local_is_the_trusted_runtime_and_a_node_can_refuse_it(tmp_path: Path) -> None:
    """`local` runs the agent as the node's user on the host's files: the probe pins that documented
    difference (it reads the token file and reaches a host socket), and an operator who does not trust
    the submitters refuses `local` (and the host network) at admission."""
    found, host = await _probe(tmp_path, {"backend": "local"}, sys.executable, walk=False)
    assert found["uid"] == os.geteuid()
    assert found["read"]["token file"] == host["digests"]["token file"]
    assert found["named_sockets"]["run"] == "open"
    (tmp_path / "strict").mkdir()
    with fake_policy() as (url, _):
        async with running_node(
            url, tmp_path / "strict", allowed_runtimes=("bwrap", "docker"), allowed_networks=("gateway",)
        ) as node:
            for runtime, field in (({"backend": "local"}, "backend"), ({"network": "host"}, "network")):
                task = shell_task("true", runtime=runtime)
                with pytest.raises(AdmissionError) as refused:
                    await node.submit(spec(task, f"refused-{field}"))
                assert refused.value.status == 422 and refused.value.field == f"task.runtime.{field}"
                assert "not allowed on this node" in refused.value.message
            ok = shell_task("true")  # the default: bwrap, network gateway
            await node.submit(spec(ok, "allowed"))
            assert (await node.wait("allowed")).status.value == "COMPLETED"
