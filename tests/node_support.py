"""Helpers for the node tests: a real node (gateway + pools) on the test's loop in front of the fake vLLM,
tasks for the shell harness and the built-in agent, and a script that calls the gateway like a harness."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from polar.gateway.backends.base import BackendOptions
from polar.gateway.config import GatewayConfig
from polar.netguard import OutboundPolicy
from polar.rollout.node import Node, NodeConfig
from polar.rollout.protocol import SessionSpec
from polar.task import Task
from tests.conftest import SERVED_MODEL
from tests.fakes.fake_vllm import FakeInferenceServer, Script, make_fake_backend
from tests.fakes.server import serve
from tests.server_support import TOKEN

PY = sys.executable

# One chat call through the official openai SDK, configured only by the environment the harness contract
# injects (OPENAI_BASE_URL, OPENAI_API_KEY = session id, OPENAI_MODEL): what any harness does.
CALL_GATEWAY = """
import os, sys, openai
client = openai.OpenAI(max_retries=0)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 1
messages = [{"role": "user", "content": "say something"}]
for _ in range(n):
    r = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=messages)
    messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "more"}]
print(r.choices[0].message.content)
"""


@contextlib.contextmanager
def fake_policy(script: Script = None) -> Iterator[tuple[str, FakeInferenceServer]]:
    """A fake vLLM serving SERVED_MODEL only, as a real one serves (and lists) the model it loaded: `polar
    run` checks the --model it is given against the list before it starts."""
    app = make_fake_backend("vllm", script, model=SERVED_MODEL)
    with serve(app) as srv:
        yield srv.url, app


@contextlib.asynccontextmanager
async def running_node(
    backend_url: str,
    tmp_path: Path,
    *,
    wrap_model_api: Any = None,
    wrap_control: Any = None,
    seen: list[Node] | None = None,
    **overrides: Any,
) -> AsyncIterator[Node]:
    """A started node; `wrap_model_api(app)` wraps the ASGI app of its model API listener (a recorder),
    `wrap_control(app)` that of its control listener (a fault); `seen` gets the node before it starts (for
    a test of a start that fails)."""
    gateway = GatewayConfig(
        backend_url=backend_url,
        served_model=overrides.pop("served_model", SERVED_MODEL),
        store_path=tmp_path / "node.db",
        backend=overrides.pop("backend", BackendOptions(retries=0, timeout_s=30.0)),
        port=overrides.pop("port", 0),
        control_port=overrides.pop("control_port", 0),
        control_token=overrides.pop("control_token", TOKEN),  # the test servers' token: nodes register
        # Frozen side-call models in tests listen on loopback, which an operator must allow.
        outbound=overrides.pop("outbound", OutboundPolicy(allow=("127.0.0.1",))),
        render=overrides.pop("render", "server"),
        tokenizer=overrides.pop("tokenizer", None),
    )
    defaults: dict[str, Any] = {
        "runtime_root": tmp_path / "runtimes",
        "node_id": "node-test",
        "sandbox_paths": (PROGRAMS,),
    }
    node = Node(NodeConfig(gateway=gateway, **(defaults | overrides)))
    if wrap_model_api is not None:
        assert node.servers.data is not None, "the model API is served by the gateway's workers"
        node.servers.data.app = wrap_model_api(node.servers.data.app)
    if wrap_control is not None:
        node.servers.control.app = wrap_control(node.servers.control.app)
    if seen is not None:
        seen.append(node)
    await node.start()
    try:
        yield node
    finally:
        await node.stop()


# Programs the tests' sessions run: one folder, which every test node shows (read-only) to its sandboxes, as
# an operator shares a toolchain (`polar node --sandbox-path`). A session sees nothing of the test's own
# tmp_path (a sandbox shows only what the node and the task name).
PROGRAMS = Path(tempfile.mkdtemp(prefix="pt-programs-"))
PROGRAMS.chmod(0o755)


def program(name: str, text: str) -> Path:
    """`text` saved as PROGRAMS/<hash>-<name>, a path every test session can run."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    path = PROGRAMS / f"{digest}-{name}"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.chmod(0o644)
        tmp.replace(path)
    return path


def run_taskfile(tmp_path: Path, *tasks: dict[str, Any]) -> Path:
    """`tmp_path/tasks.yaml` holding `tasks` for `polar run`, with CALL_GATEWAY beside it as call_gateway.py
    (what `caller_task`s upload: the node may read the task file's folder)."""
    (tmp_path / "call_gateway.py").write_text(CALL_GATEWAY)
    path = tmp_path / "tasks.yaml"
    path.write_text(yaml.safe_dump({"tasks": list(tasks)}))
    return path


def caller_task(task_id: str, command: str, **fields: Any) -> dict[str, Any]:
    """A task-file entry whose shell harness runs `command` with the gateway caller uploaded as call.py
    (`run_taskfile` puts it beside the task file); `fields` add or replace entries."""
    return {
        "task_id": task_id,
        "instruction": "say something",
        "num_samples": 2,
        "timeout_seconds": 60,
        "runtime": {"prepare": [{"type": "upload", "src": "call_gateway.py", "dst": "call.py"}]},
        "agent": {"harness": "shell", "settings": {"command": command}},
        "evaluator": {"strategy": "session_completed"},
    } | fields


def write_caller(tmp_path: Path) -> Path:
    return program("call_gateway.py", CALL_GATEWAY)


# For sessions that coordinate with their test through host files (gates, pid files, run logs): a trusted
# program on the host's files, which only `local` gives (a sandbox sees none of the test's tmp_path).
ON_HOST: dict[str, Any] = {"backend": "local"}


def sandboxed_caller_task(tmp_path: Path) -> Task:
    """Two calls from inside a bubblewrap sandbox (network=gateway), the caller arriving by an upload (the
    host's /tmp is hidden there): the second answer, which the test's fake scripts as "sandboxed", is written
    to answer.txt and is what the evaluator passes on."""
    caller = tmp_path / "call_gateway.py"
    caller.write_bytes(write_caller(tmp_path).read_bytes())
    return shell_task(
        f"{PY} call_gateway.py 2 > answer.txt",
        runtime={
            "backend": "bwrap",
            "prepare": [{"type": "upload", "src": str(caller), "dst": "call_gateway.py"}],
        },
        evaluator={
            "strategy": "test_on_output",
            "config": {"command": "cat answer.txt", "expect": "sandboxed", "match": "contains"},
        },
    )


def shell_task(command: str, task_id: str = "t1", **fields: Any) -> Task:
    """A task running `command` with the shell harness; `fields` override Task fields (dicts merge)."""
    data: dict[str, Any] = {
        "task_id": task_id,
        "instruction": "do it",
        "timeout_seconds": 60,
        "agent": {"harness": "shell", "settings": {"command": command}},
    }
    for key, value in fields.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return Task.model_validate(data)


def spec(task: Task, session_id: str, **kw: Any) -> SessionSpec:
    return SessionSpec(session_id=session_id, task=task, **kw)


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    """Wait for `cond` (a correctness wait with a generous bound, not a timing assertion)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie (a container's PID 1 may not reap orphans)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def pids_under(root: Path, *argv: str) -> list[int]:
    """Host pids of live processes whose cwd lies under `root` (a node's runtime root) and, given `argv`,
    that run exactly that. A session's `$$` and `$!` are its own PID namespace's, not the host's, so tests
    find its processes from the host side; a sandbox shows its session directory at another path
    (bwrap: /tmp/polar-session), so directories are compared by device and inode."""
    want = b"".join(a.encode() + b"\0" for a in argv)
    dirs = set()
    for here, _, _ in os.walk(root):
        with contextlib.suppress(OSError):
            st = os.stat(here)
            dirs.add((st.st_dev, st.st_ino))
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or not alive(int(proc.name)):
            continue
        try:
            cwd = os.stat(proc / "cwd")  # follows the link into the process's own mount namespace
            cmdline = (proc / "cmdline").read_bytes() if argv else b""
        except OSError:
            continue
        if (cwd.st_dev, cwd.st_ino) in dirs and cmdline == want:
            found.append(int(proc.name))
    return found


async def eventually(check: Callable[[], Awaitable[Any]], what: str, timeout_s: float = 30.0) -> Any:
    """Poll an async `check` until it returns something truthy, and return that."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while True:
        value = await check()
        if value:
            return value
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.03)


def control_client(node: Node, **kwargs: Any) -> Any:
    """An httpx.AsyncClient for the node's control listener, with its token (as the rollout server has)."""
    import httpx

    from polar.auth import bearer

    headers = {**bearer(node.config.gateway.control_token), **kwargs.pop("headers", {})}
    return httpx.AsyncClient(base_url=node.control_url, headers=headers, **kwargs)
