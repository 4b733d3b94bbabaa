"""From inside a real session sandbox, as the agent under training: the model API answers, nothing else does.

Reproduces issue #10's first finding: from a bwrap sandbox with `network: gateway`, `POST /node/sessions` on
the gateway's own port started a host session as root, and the sandbox listed sessions, created sessions,
paused the gateway and read other sessions' prompts. Here a probe runs as the session's harness inside the
sandbox, with the control token in hand (as if it had leaked), tries every control route on the port it was
given and every other listener of the deployment, then reports what it saw through the only channel out:
a chat call to the model API. The test reads that report from the gateway's records.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar.store.sqlite import SQLiteStore
from tests.container_support import IMAGE
from tests.node_support import eventually, fake_policy, running_node
from tests.server_support import AUTH, TOKEN, start_server

# Stdlib only; runs as the harness, configured by the environment the harness contract injects.
PROBE = r"""
import json, os, socket, sys, urllib.error, urllib.request

base = os.environ["OPENAI_BASE_URL"]          # http://127.0.0.1:PORT/v1, the model API
gateway = base[: -len("/v1")]
sid, token = os.environ["OPENAI_API_KEY"], os.environ["LEAKED_TOKEN"]
targets = json.loads(os.environ["TARGETS"])    # other listeners of the deployment: {name: [host, port]}
other = os.environ["OTHER_SESSION"]
found = {"routes": {}, "connect": {}}

def status(method, path, headers):
    body = b"{}" if method in ("POST", "PUT") else None
    req = urllib.request.Request(gateway + path, data=body, method=method,
                                 headers={"content-type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception as e:
        return type(e).__name__

routes = [("POST", "/node/sessions"), ("GET", "/node/sessions"), ("GET", "/node/status"), ("POST", "/node/drain"),
          ("POST", "/nodes/n1/drain"), ("POST", "/nodes/n1/leave"),
          ("DELETE", "/node/sessions/" + other), ("POST", "/sessions"), ("GET", "/sessions/" + other),
          ("GET", "/sessions/" + other + "/completions"), ("GET", "/sessions/" + other + "/trajectory"),
          ("POST", "/admin/pause"), ("POST", "/admin/resume"), ("POST", "/admin/resume?policy_version=7"),
          ("GET", "/backends"), ("POST", "/admin/backends"), ("GET", "/sessions/" + other + "/failures"),
          ("POST", "/rollout/task/submit"), ("POST", "/callbacks/session_result"), ("GET", "/events"),
          ("GET", "/metrics"),
          ("GET", "/ui/"), ("GET", "/ui/events"), ("POST", "/ui/login"), ("GET", "/ui/sessions/" + other),
          ("POST", "/ui/tasks/victim/cancel")]  # the dashboard lives on the rollout server only
for method, path in routes:
    for who, headers in (("none", {}), ("session", {"authorization": "Bearer " + sid}),
                         ("token", {"authorization": "Bearer " + token})):
        found["routes"][f"{method} {path} {who}"] = status(method, path, headers)

own = int(gateway.rsplit(":", 1)[1])
for name, (host, port) in targets.items():
    if port == own:  # its own model API (with gateway workers, one of theirs): the forwarder inside answers
        continue
    try:
        socket.create_connection((host, port), timeout=3).close()
        found["connect"][name] = "open"
    except OSError as e:
        found["connect"][name] = type(e).__name__

report = {"model": os.environ["OPENAI_MODEL"], "max_tokens": 4,
          "messages": [{"role": "user", "content": "REPORT " + json.dumps(found)}]}
req = urllib.request.Request(base + "/chat/completions", data=json.dumps(report).encode(),
                             headers={"content-type": "application/json", "authorization": "Bearer " + sid})
urllib.request.urlopen(req, timeout=30).read()
"""


def _report(store: Path, session_id: str) -> dict[str, Any]:
    with SQLiteStore(store) as s:
        records = s.completions(session_id)
    (record,) = records
    content = record.request["messages"][0]["content"]
    assert content.startswith("REPORT ")
    found: dict[str, Any] = json.loads(content.removeprefix("REPORT "))
    return found


@pytest.mark.parametrize(
    ("backend", "workers"),
    [("bwrap", 1), ("local", 1), pytest.param("docker", 1, marks=pytest.mark.containers),
     pytest.param("podman", 1, marks=pytest.mark.containers),
     pytest.param("bwrap", 2, id="bwrap-gateway-workers")],
)  # fmt: skip
async def test_a_sandbox_reaches_the_model_api_and_nothing_else(
    tmp_path: Path, backend: str, workers: int, request: pytest.FixtureRequest
) -> None:
    """With `--gateway-workers` the session's runtime is given its owner's model API: the other workers'
    model APIs, the shared one and the workers' control listener are as far out of reach as the rest."""
    if backend == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("needs bubblewrap (scripts/test installs it)")
    runtime: dict[str, Any] = {"backend": backend, "network": "gateway"}
    python = sys.executable
    if backend in ("docker", "podman"):
        request.getfixturevalue(f"{backend}_engine")  # started, with polar's base image
        runtime["image"], python = IMAGE, "python3"
    server = start_server(tmp_path / "server.db")
    try:
        with fake_policy() as (policy_url, _):
            async with (
                running_node(
                    policy_url, tmp_path, server_url=server.url, heartbeat_s=0.05, gateway_workers=workers
                ) as node,
                httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=30) as http,
            ):

                async def registered() -> bool:
                    nodes = (await http.get("/nodes")).json()["nodes"]
                    return bool(nodes) and bool(nodes[0]["healthy"])

                await eventually(registered, "the node to register")
                # Another session on the same node, whose records the probe must not read.
                assert node.gateway is not None
                other = "victim-session-1"
                await node.gateway.open({"task_id": "victim"}, other)
                host = httpx.URL(node.control_url)
                targets = {
                    "node control listener": ["127.0.0.1", host.port],
                    "rollout server and its dashboard": ["127.0.0.1", httpx.URL(server.url).port],
                    "policy server": ["127.0.0.1", httpx.URL(policy_url).port],
                }
                if node.servers.child is not None:  # the probe skips its own model API among them
                    child = node.servers.child
                    targets["gateway workers' control listener"] = [
                        "127.0.0.1",
                        httpx.URL(child.control_url).port,
                    ]
                    targets["shared model API"] = ["127.0.0.1", httpx.URL(child.data_url).port]
                    for k, url in enumerate(child.worker_urls):
                        targets[f"worker {k} model API"] = ["127.0.0.1", httpx.URL(url).port]
                task = {
                    "task_id": f"probe-{backend}",
                    "instruction": "probe",
                    "timeout_seconds": 120,
                    "runtime": runtime,
                    "agent": {
                        "harness": "shell",
                        "settings": {"command": f'{python} -I -c "$PROBE"'},
                        "env": {
                            "PROBE": PROBE,
                            "LEAKED_TOKEN": TOKEN,
                            "TARGETS": json.dumps(targets),
                            "OTHER_SESSION": other,
                        },
                    },
                }
                r = await http.post("/rollout/task/submit", json=task)
                assert r.status_code == 201, r.text
                (sid,) = r.json()["tasks"][0]["session_ids"]

                async def finished() -> dict[str, Any] | None:
                    view: dict[str, Any] = (await http.get(f"/rollout/task/probe-{backend}")).json()
                    return view if view["state"] == "DONE" else None

                view = await eventually(finished, "the probe session", timeout_s=120)
                assert view["results"][0]["status"] == "COMPLETED", view["results"][0]["reason"]
                status = (await http.get("/rollout/status")).json()
        found = _report(tmp_path / "node.db", sid)
    finally:
        server.stop()
    # No control route exists on the port a sandbox is given, whatever credential it presents.
    assert found["routes"], found
    for route, answer in found["routes"].items():
        assert answer in (404, 405), (route, answer)
    # No other listener of the deployment is reachable from inside.
    assert len(found["connect"]) == (3 if workers == 1 else 3 + 2 + workers - 1), found["connect"]
    for name, answer in found["connect"].items():
        assert answer != "open", (name, found["connect"])
    # Nothing ran beyond the probe: one task, one session, and the victim session kept its records private.
    assert status["sessions"] == {"COMPLETED": 1}
