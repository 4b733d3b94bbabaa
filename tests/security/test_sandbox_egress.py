"""What a session's command can reach on the network, probed from inside real sandboxes (a real node, the
shell harness, `local` and `bwrap`): with `network: gateway` the gateway answers at the 127.0.0.1 URL the
harness is given and nothing else does (a listener on the host's loopback, one on every host address, the
inference server behind the gateway); with `network: none` nothing does. A runtime that cannot hold the
network it is asked for is refused before anything runs, naming one that can."""

from __future__ import annotations

import json
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from polar.rollout.node.node import AdmissionError
from polar.rollout.protocol import SessionResult, SessionStatus
from polar.runtime import RuntimeFailure, RuntimeSpec, check_runtime
from tests.fakes.fake_vllm import Reply
from tests.node_support import ON_HOST, PY, fake_policy, running_node, shell_task, spec

BACKENDS = [
    "local",
    pytest.param("bwrap", marks=pytest.mark.skipif(shutil.which("bwrap") is None, reason="no bubblewrap")),
]

# Run inside the sandbox (stdlib only): one chat call through the URL the harness contract hands over,
# then a TCP connect to each target; writes {name: answer or "open" or the error's type} to probe.json.
_PROBE = """
import json, os, socket, urllib.request
out = {}
try:
    body = json.dumps({"model": os.environ["OPENAI_MODEL"], "messages": [{"role": "user", "content": "hi"}]})
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", body.encode(),
                                 {"authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                  "content-type": "application/json"})
    out["gateway"] = json.load(urllib.request.urlopen(req, timeout=30))["choices"][0]["message"]["content"]
except Exception as exc:
    out["gateway"] = type(exc).__name__
for name, (host, port) in json.loads(os.environ["PROBE_TARGETS"]).items():
    try:
        socket.create_connection((host, port), timeout=5).close()
        out[name] = "open"
    except OSError as exc:
        out[name] = type(exc).__name__
open("probe.json", "w").write(json.dumps(out))
"""


def _host_address() -> str | None:
    """A non-loopback address of this machine (the source address of a route out), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent, only a route is looked up
        except OSError:
            return None
        address = str(s.getsockname()[0])
    return None if address.startswith("127.") else address


@pytest.fixture
def host_listeners() -> Iterator[dict[str, tuple[str, int]]]:
    """Targets on the host that answer: a listener on 127.0.0.1, one on every address."""
    loopback = socket.create_server(("127.0.0.1", 0))
    anywhere = socket.create_server(("0.0.0.0", 0))
    targets = {"host_loopback": ("127.0.0.1", loopback.getsockname()[1])}
    address = _host_address()
    if address is not None:
        targets["host_address"] = (address, anywhere.getsockname()[1])
    for host, port in targets.values():  # the host itself does reach them
        socket.create_connection((host, port), timeout=5).close()
    yield targets
    loopback.close()
    anywhere.close()


async def _probe(
    tmp_path: Path, backend: str, network: str, targets: dict[str, tuple[str, int]]
) -> dict[str, Any]:
    with fake_policy([Reply("from the policy")]) as (url, _):
        targets = {**targets, "inference_server": ("127.0.0.1", int(url.rsplit(":", 1)[1]))}
        task = shell_task(
            f"{PY} {{instruction_file}}",
            instruction=_PROBE,
            runtime={"backend": backend, "network": network},
            agent={"env": {"PROBE_TARGETS": json.dumps(targets)}},
            evaluator={"strategy": "test_on_output", "config": {"command": "cat probe.json"}},
        )
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(task, f"egress-{backend}-{network}"))
            result: SessionResult = await node.wait(f"egress-{backend}-{network}")
    assert result.status == SessionStatus.COMPLETED, result.reason
    return dict(json.loads(result.metadata["evaluation"]["details"]["output"]))


@pytest.mark.parametrize("backend", BACKENDS)
async def test_gateway_network_reaches_only_the_gateway(
    tmp_path: Path, backend: str, host_listeners: dict[str, tuple[str, int]]
) -> None:
    seen = await _probe(tmp_path, backend, "gateway", host_listeners)
    assert seen.pop("gateway") == "from the policy"
    assert seen and all(answer != "open" for answer in seen.values()), seen


@pytest.mark.parametrize("backend", BACKENDS)
async def test_no_network_reaches_nothing(
    tmp_path: Path, backend: str, host_listeners: dict[str, tuple[str, int]]
) -> None:
    seen = await _probe(tmp_path, backend, "none", host_listeners)
    assert seen.pop("gateway") != "from the policy"
    assert seen and all(answer != "open" for answer in seen.values()), seen


async def test_local_without_namespaces_is_refused_naming_a_runtime_that_can(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where namespaces cannot be made (a locked-down container), `local` cannot hold `gateway`/`none`:
    refused by check_runtime and at node admission; `network: host` says the agent gets the host's."""
    from polar.runtime import namespaces

    monkeypatch.setattr(namespaces, "probe", lambda: "unshare: operation not permitted")
    for network in ("gateway", "none"):
        with pytest.raises(RuntimeFailure, match=r"cannot confine network .* use runtime 'bwrap'"):
            check_runtime(RuntimeSpec(backend="local", network=network))  # type: ignore[arg-type]
    check_runtime(RuntimeSpec(backend="local", network="host"))
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node:
            with pytest.raises(AdmissionError) as refused:
                await node.submit(spec(shell_task("true", runtime=ON_HOST), "refused"))
            assert refused.value.status == 422 and "bwrap" in refused.value.message
            await node.submit(spec(shell_task("echo ok", runtime={**ON_HOST, "network": "host"}), "host"))
            assert (await node.wait("host")).status == SessionStatus.COMPLETED


def test_apptainer_cannot_hold_the_gateway_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its instances share the host's network: `gateway` would leave every address reachable, so it is
    refused. (Docker and podman hold it: tests/security/test_sandbox_reach.py probes them from inside.)"""
    (tmp_path / "apptainer").symlink_to("/bin/true")  # the engine's CLI is there (only looked up)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeFailure, match="runtime 'apptainer' cannot confine network 'gateway'"):
        check_runtime(RuntimeSpec(backend="apptainer", image="img", network="gateway"))
    for engine in ("docker", "podman"):
        (tmp_path / engine).symlink_to("/bin/true")
        check_runtime(RuntimeSpec(backend=engine, image="img", network="gateway"))
