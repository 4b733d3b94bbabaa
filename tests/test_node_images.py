"""A node's images, end to end on a real docker and a real registry (Debian's `docker-registry` on
loopback): the node reports what docker holds, the server asks it to fetch the image of a session queued
behind a busy slot, the node pulls it while the slot is busy, and the server then knows it is there. A pull
that fails (no such image) is remembered, not retried at every heartbeat."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar.rollout.protocol import ImageRef
from tests.container_support import local_registry
from tests.node_support import eventually, fake_policy, running_node, shell_task
from tests.server_support import AUTH, start_server

pytestmark = pytest.mark.containers


def _docker(*argv: str, stdin: str | None = None) -> None:
    done = subprocess.run(["docker", *argv], input=stdin, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def _pushed_away(registry: str, tmp_path: Path) -> str:
    """A one-file image (FROM scratch: nothing to pull to build it) in the registry and not in docker."""
    image = f"{registry}/polar-prefetch:1"
    context = tmp_path / "ctx"
    context.mkdir()
    (context / "hello").write_text("hi\n")
    _docker("build", "-q", "-t", image, "-f", "-", str(context), stdin="FROM scratch\nCOPY hello /hello\n")
    _docker("push", "-q", image)
    _docker("rmi", image)
    return image


class Server:
    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    async def holders(self, image: str) -> list[str] | None:
        r = await self.http.post("/images/where", json={"images": [{"engine": "docker", "image": image}]})
        return r.json()["images"][0]["held_by"] or None

    async def submit(self, body: dict[str, Any]) -> None:
        assert (await self.http.post("/rollout/task/submit", json=body)).status_code == 201


async def test_a_node_prefetches_the_image_of_a_queued_session_from_a_registry(
    docker_engine: str, tmp_path: Path
) -> None:
    gate = tmp_path / "go"
    busy = shell_task(f"while [ ! -f {gate} ]; do sleep 0.1; done", "busy", runtime={"backend": "local"})
    node_options: dict[str, Any] = {
        "capacity": 1,
        "heartbeat_s": 0.2,
        "report_images": True,
        "allowed_runtimes": ("local", "docker"),
    }
    server = start_server(tmp_path / "server.db")
    try:
        with local_registry(tmp_path) as registry, fake_policy() as (url, _):
            image = _pushed_away(registry, tmp_path)
            queued = {
                "task_id": "queued",
                "instruction": "x",
                "runtime": {"backend": "docker", "image": image},
            }
            async with (
                running_node(url, tmp_path, server_url=server.url, **node_options) as node,
                httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=10) as http,
            ):
                s = Server(http)
                held = await eventually(lambda: s.holders("polar-base:bookworm"), "the node's images")
                assert held == ["node-test"]
                assert await s.holders(image) is None

                await s.submit(busy.model_dump(mode="json"))
                await s.submit(queued)
                # The one slot is busy; the queued session's image is fetched meanwhile.
                assert await eventually(lambda: s.holders(image), "the prefetched image") == ["node-test"]
                assert node.images.pulled == 1
                view = (await http.get("/rollout/task/queued")).json()
                assert view["sessions"][0]["status"] == "REGISTERED"  # it never ran: fetched ahead
                await http.delete("/rollout/task/queued")
                gate.touch()

                # A pull that fails is remembered: asked again, the node does not pull again.
                missing = ImageRef(engine="docker", image=f"{registry}/polar-missing:1")
                node.images.want([missing])
                assert node.images.fetching["docker"] == {missing.image}

                async def failed() -> bool:
                    return bool(node.images.failed)

                await eventually(failed, "the failed pull")
                node.images.want([missing])
                assert not node.images.fetching["docker"]
    finally:
        server.stop()
