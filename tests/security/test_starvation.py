"""No session starves the others (issue #24, point 5), each finding reproduced as it was measured on main.

An attacker's bwrap agent opened 587 half-open connections to its model API: every one held descriptors
in the node (the bridge's two, the gateway's one) until the node's 1,024 ran out, the other session's
calls timed out, and asyncio's accept loop logged 141 MB in 30 s. Now a session's bridge relays at most
64 connections at once (the rest wait in the kernel's backlog), every listener polar starts closes a
connection whose request headers do not arrive in time, servers raise their open-files limit at start, and
accept errors are logged once per interval. Every server here is real, on loopback or a unix socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from polar.auth import new_token
from polar.runtime.bridge import DEFAULT_MAX_CONNECTIONS, UnixBridge
from tests.conftest import SERVED_MODEL, start_gateway
from tests.fakes.server import free_port
from tests.node_support import PROGRAMS, fake_policy, program, running_node, until
from tests.server_support import start_server

# A request that never finishes its headers: what each of the attacker's connections sent.
PARTIAL = b"POST /v1/chat/completions HTTP/1.1\r\nHost: polar\r\nContent-Type: appl"
CHAT = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}

# The node's side in a process of its own, with few descriptors (soft = hard: raising cannot help): a
# gateway and two sessions' bridges. Prints the sessions and the bridges' sockets, serves until stdin ends.
_NODE_SIDE = """
import json, resource, sys
from pathlib import Path
limit = int(sys.argv[4])
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
import httpx
from polar.gateway.app import create_app
from polar.gateway.config import GatewayConfig
from polar.harness.registry import classifier
from polar.runtime.bridge import UnixBridge
from polar.serving import ServerThread

config = GatewayConfig(backend_url=sys.argv[1], served_model=sys.argv[2], store_path=Path(sys.argv[3]))
app = create_app(config, classifier)
server = ServerThread(app.data, also=[app.control]).start()
auth = {"authorization": "Bearer " + config.control_token}
sessions = [httpx.post(server.urls[1] + "/sessions", headers=auth).json()["session_id"] for _ in range(2)]
bridges = [UnixBridge("127.0.0.1", server.port) for _ in sessions]
for bridge in bridges:
    bridge.start()
print(json.dumps({"sessions": sessions, "sockets": [str(b.socket_path) for b in bridges]}), flush=True)
sys.stdin.read()
for bridge in bridges:
    bridge.close()
server.stop()
"""


def _flood(path: str, most: int = 1000) -> list[socket.socket]:
    """Half-open connections to the unix socket at `path`, each with a partial request, until the listener
    stops taking them (its backlog stays full for a second) or `most` are open."""
    held: list[socket.socket] = []
    while len(held) < most:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        for _ in range(50):
            try:
                sock.connect(path)
                break
            except BlockingIOError:  # the backlog is full: nothing is accepting right now
                time.sleep(0.02)
        else:
            sock.close()
            return held
        sock.setblocking(True)
        sock.sendall(PARTIAL)
        held.append(sock)
    return held


def _open(sock: socket.socket) -> bool:
    """Still connected, nothing received (not refused or closed by the other side)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def test_half_open_connections_of_one_session_leave_another_sessions_calls_working(tmp_path: Path) -> None:
    """Through the real bridge of each of two sessions, in a node process with 512 descriptors: one session
    holds as many half-open connections as its bridge takes; the other's model call still succeeds. The
    connections past the cap are held back (still open, waiting), not refused."""
    log = tmp_path / "node.log"
    env = {**os.environ, "POLAR_HEADER_TIMEOUT_S": "600"}  # nothing here may be closed for being slow
    with fake_policy() as (url, _), log.open("w") as err:
        argv = [sys.executable, "-c", _NODE_SIDE, url, SERVED_MODEL, str(tmp_path / "gateway.db"), "512"]
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env
        )
        held: list[socket.socket] = []
        try:
            assert proc.stdout is not None and proc.stdin is not None
            line = proc.stdout.readline()
            assert line, f"the node side did not start: {log.read_text()[-2000:]}"
            info = json.loads(line)
            victim, (attacker_sock, victim_sock) = info["sessions"][1], info["sockets"]
            held = _flood(attacker_sock)
            assert (
                len(held) > DEFAULT_MAX_CONNECTIONS
            )  # more than the bridge relays: some wait in its backlog
            transport = httpx.HTTPTransport(uds=victim_sock)
            with httpx.Client(transport=transport, timeout=60) as client:
                r = client.post(
                    "http://gateway/v1/chat/completions",
                    json=CHAT,
                    headers={"authorization": f"Bearer {victim}"},
                )
            assert r.status_code == 200, r.text
            assert all(_open(s) for s in held), "the attacker's connections were refused instead of held back"
            assert "Too many open files" not in log.read_text()
        finally:
            for sock in held:
                sock.close()
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# A node in its own process, its sandboxes' programs in PROGRAMS: the attacker's session floods its model
# API once it finds `go` in its workdir, the victim's then calls the model once (on its own `go`). Both
# sessions start under the node's own limits; then, told so on stdin, the node keeps 512 descriptors (soft =
# hard, raising cannot help): the attacker's sandbox can open far more connections than the node can hold,
# as a sandbox that raised its soft limit to a hard one of 1,048,576 did against a node's 1,024. Prints
# "ready" when both run, "lowered", then the victim's result (status, reward), and stops.
_NODE = """
import asyncio, json, resource, sys
from pathlib import Path
from polar.gateway.config import GatewayConfig
from polar.rollout.node import Node, NodeConfig
from polar.rollout.protocol import SessionSpec
from polar.task import Task

backend_url, model, root, programs, flood, call = sys.argv[1:7]

def task(command: str) -> Task:
    wait = "touch ready; while [ ! -e go ]; do sleep 0.05; done"
    return Task.model_validate({"task_id": "t", "instruction": "x", "timeout_seconds": 600,
                                "agent": {"harness": "shell", "settings": {"command": f"{wait}; {command}"}}})

async def main() -> None:
    gateway = GatewayConfig(backend_url=backend_url, served_model=model, store_path=Path(root) / "node.db", port=0)
    node = Node(NodeConfig(gateway=gateway, runtime_root=Path(root) / "runtimes", sandbox_paths=(Path(programs),)))
    await node.start()
    await node.submit(SessionSpec(session_id="attacker", task=task(f"{sys.executable} {flood}")))
    await node.submit(SessionSpec(session_id="victim", task=task(f"{sys.executable} {call}")))
    await asyncio.to_thread(sys.stdin.readline)
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512))
    print("lowered", flush=True)
    result = await node.wait("victim")
    await node.cancel("attacker")
    await node.wait("attacker")  # its runtime (and bridge) torn down
    await node.stop()
    print(json.dumps({"status": result.status, "reward": result.reward, "reason": result.reason}), flush=True)

asyncio.run(main())
"""

# Inside the attacker's sandbox: connections to its model API, each with half a request, until no more are
# taken; then it says how many and holds them.
_FLOOD = f"""
import os, socket, time
from urllib.parse import urlsplit
url = urlsplit(os.environ["OPENAI_BASE_URL"])
held = []
while len(held) < 2000:
    try:
        sock = socket.create_connection((url.hostname, url.port), timeout=2)
        sock.sendall({PARTIAL!r})
    except OSError:
        break
    held.append(sock)
with open("flooded.tmp", "w") as f:
    f.write(str(len(held)))
os.rename("flooded.tmp", "flooded")
time.sleep(3600)
"""

# Inside the victim's sandbox: one model call, given a minute at most.
_CALL = """
import os, openai
client = openai.OpenAI(max_retries=0, timeout=60)
r = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=[{"role": "user", "content": "hi"}])
print(r.choices[0].message.content)
"""


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="no bubblewrap")
async def test_a_sandboxed_agent_flooding_its_model_api_leaves_another_sessions_calls_working(
    tmp_path: Path,
) -> None:
    """The measured attack, from inside real bwrap sessions of one node: the attacker opens connections to
    its model API until none is taken any more; the other session's model call then still succeeds."""
    runtimes = tmp_path / "runtimes"
    runtimes.mkdir()
    env = {**os.environ, "POLAR_HEADER_TIMEOUT_S": "600"}  # the cap alone holds the attacker here
    flood, call = program("flood.py", _FLOOD), program("call.py", _CALL)

    def workdir(session: str, file: str) -> Path | None:
        found = [d for d in runtimes.glob(f"polar-{session}-*/workspace") if (d / file).exists()]
        return found[0] if found else None

    with fake_policy() as (url, _):
        argv = [
            sys.executable,
            "-c",
            _NODE,
            url,
            SERVED_MODEL,
            str(tmp_path),
            str(PROGRAMS),
            str(flood),
            str(call),
        ]
        log = (tmp_path / "node.log").open("w")
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env
        )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            await until(
                lambda: workdir("attacker", "ready") and workdir("victim", "ready"), "both sessions", 120
            )
            proc.stdin.write("lower\n")
            proc.stdin.flush()
            assert await asyncio.to_thread(proc.stdout.readline) == "lowered\n"
            attacker, victim = workdir("attacker", "ready"), workdir("victim", "ready")
            assert attacker is not None and victim is not None
            (attacker / "go").touch()
            await until(lambda: (attacker / "flooded").exists(), "the flood", 120)
            assert (
                int((attacker / "flooded").read_text()) > DEFAULT_MAX_CONNECTIONS
            )  # more than the bridge relays
            (victim / "go").touch()
            line = await asyncio.to_thread(proc.stdout.readline)
            await asyncio.to_thread(proc.wait, 60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    result = json.loads(line)
    assert (result["status"], result["reward"]) == ("COMPLETED", 1.0), result
    errors = [x for x in (tmp_path / "node.log").read_text().splitlines() if "Traceback" in x or "ERROR" in x]
    assert errors == []


def _closed_without_answer(connect: Callable[[], socket.socket], first: bytes = b"") -> bytes:
    """Connect, optionally complete one request (`first`, whose answer is read), then send a request whose
    headers never finish; returns what came back after it before the other side closed (60 s at most)."""
    with contextlib.closing(connect()) as sock:
        sock.settimeout(60)
        if first:
            sock.sendall(first)
            answer = b""
            while b"\r\n\r\n" not in answer:
                answer += sock.recv(4096)
            head, _, body = answer.partition(b"\r\n\r\n")
            length = next(
                int(h.split(b":")[1]) for h in head.lower().split(b"\r\n") if h.startswith(b"content-length:")
            )
            while len(body) < length:
                body += sock.recv(4096)
            assert head.startswith(b"HTTP/1.1 200") and b"connection: close" not in head.lower()
        sock.sendall(PARTIAL)
        got = b""
        try:
            while chunk := sock.recv(4096):
                got += chunk
        except TimeoutError:
            raise AssertionError("still open after 60 s") from None
        return got


def _tcp(url: str) -> Callable[[], socket.socket]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return lambda: socket.create_connection((host, int(port)), timeout=10)


def _unix(path: Path) -> Callable[[], socket.socket]:
    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(path))
        return sock

    return connect


@pytest.fixture
def short_header_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLAR_HEADER_TIMEOUT_S", "1")


@pytest.mark.usefixtures("short_header_timeout")
async def test_every_listener_closes_a_connection_whose_headers_never_finish(tmp_path: Path) -> None:
    """The gateway's model API and control listener, a node's (model API and control), the rollout server,
    and a session's bridge in front of a gateway: each closes a connection that sent half a request."""
    for folder in ("gw", "node"):
        (tmp_path / folder).mkdir()
    with fake_policy() as (url, _):
        gateway = start_gateway(url, tmp_path / "gw")
        server = start_server(tmp_path / "server.db")
        bridge = UnixBridge("127.0.0.1", gateway.server.port)
        bridge.start()
        try:
            async with running_node(url, tmp_path / "node") as node:
                listeners = {
                    "gateway model API": _tcp(gateway.url),
                    "gateway control": _tcp(gateway.control_url),
                    "node model API": _tcp(node.url),
                    "node control": _tcp(node.control_url),
                    "rollout server": _tcp(server.url),
                    "session bridge": _unix(bridge.socket_path),
                }

                async def check(connect: Callable[[], socket.socket]) -> BaseException | bytes:
                    try:
                        return await asyncio.to_thread(_closed_without_answer, connect)
                    except (AssertionError, OSError) as exc:
                        return exc

                outcomes = await asyncio.gather(*(check(c) for c in listeners.values()))
        finally:
            bridge.close()
            server.stop()
            gateway.server.stop()
    failed = {name: repr(o) for name, o in zip(listeners, outcomes, strict=True) if not isinstance(o, bytes)}
    assert failed == {}
    assert set(outcomes) == {b""}  # closed, nothing answered: the client never finished asking


@pytest.mark.usefixtures("short_header_timeout")
def test_a_keep_alive_connection_whose_next_request_never_finishes_is_closed(tmp_path: Path) -> None:
    """uvicorn's keep-alive timer stops at the first byte of the next request: half a request after a
    complete one held the connection forever."""
    with fake_policy() as (url, _):
        gateway = start_gateway(url, tmp_path)
        try:
            first = b"GET /health HTTP/1.1\r\nHost: polar\r\n\r\n"
            assert _closed_without_answer(_tcp(gateway.url), first) == b""
        finally:
            gateway.server.stop()


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        assert proc.poll() is None and time.monotonic() < deadline, (
            f"did not start: {log.read_text()[-2000:]}"
        )
        time.sleep(0.1)


@contextlib.contextmanager
def _polar(args: list[str], ulimit: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`polar ARGS` under `ulimit ULIMIT`, its stderr in `log`; stopped (SIGTERM) at the end."""
    env = {**os.environ, "POLAR_TOKEN": new_token(), "PYTHONUNBUFFERED": "1"}
    script = f'ulimit {ulimit} && exec "$@"'
    with log.open("w") as err:
        proc = subprocess.Popen(
            ["bash", "-c", script, "polar", sys.executable, "-m", "polar", *args], stderr=err, env=env
        )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _open_files_limit(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open-files line in /proc/PID/limits")


@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_servers_raise_their_open_files_limit_to_the_hard_one(tmp_path: Path, command: str) -> None:
    """A soft limit of 256 under a higher hard one (systemd's 1,024 is the usual) is raised at start."""
    port = free_port()
    with fake_policy() as (url, _):
        args = {
            "serve": ["serve", "--port", str(port), "--db", str(tmp_path / "server.db")],
            "gateway": ["gateway", "--backend", url, "--model", SERVED_MODEL, "--port", str(port),
                        "--control-port", str(free_port()), "--store", str(tmp_path / "gateway.db")],
        }[command]  # fmt: skip
        log = tmp_path / "polar.log"
        with _polar(args, "-Sn 256", log) as proc:
            _wait_healthy(f"http://127.0.0.1:{port}", proc, log)
            soft, hard = _open_files_limit(proc.pid)
    assert hard > 256
    assert soft == hard


def test_accept_errors_are_logged_at_a_bounded_rate(tmp_path: Path) -> None:
    """A gateway out of descriptors (hard limit 64, so raising cannot help) with connections waiting: asyncio
    logged each failed accept with a traceback, up to 2,048 times a tick. Now: one line per interval."""
    port = free_port()
    log = tmp_path / "gateway.log"
    with fake_policy() as (url, _):
        args = ["gateway", "--backend", url, "--model", SERVED_MODEL, "--port", str(port),
                "--control-port", str(free_port()), "--store", str(tmp_path / "gateway.db")]  # fmt: skip
        held: list[socket.socket] = []
        try:
            with _polar(args, "-n 64", log) as proc:
                _wait_healthy(f"http://127.0.0.1:{port}", proc, log)
                for _ in range(200):  # accepted or waiting in the backlog: either way they are there
                    held.append(socket.create_connection(("127.0.0.1", port), timeout=10))
                deadline = time.monotonic() + 60
                while "out of system resource" not in log.read_text():
                    assert proc.poll() is None and time.monotonic() < deadline, "no accept ever failed"
                    time.sleep(0.1)
        finally:
            for sock in held:
                sock.close()
    lines = [line for line in log.read_text().splitlines() if "out of system resource" in line]
    assert 1 <= len(lines) <= 2, f"{len(lines)} lines, {log.stat().st_size} bytes of log"
    assert "Too many open files" in lines[0]
