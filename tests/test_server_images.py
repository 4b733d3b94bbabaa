"""The server's side of image-aware placement, over HTTP as nodes speak it: the image list a heartbeat
carries is kept (and not asked for again while its digest holds), a session goes to the node that holds its
image, a group stays together, the images of queued sessions no node holds are asked of one node in its
heartbeat's answer, and `POST /images/where` tells a submitter which live nodes hold what."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar.serving import ServerThread
from tests.server_support import AUTH, StandInNode, start_server, task, wait_until

PY = "python:3.11"
GO = "golang:1.22"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    s = start_server(tmp_path / "server.db")
    yield s
    s.stop()


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10, headers=AUTH) as c:
        yield c


def beat(
    http: httpx.Client, url: str, node: str, images: list[str] | None, digest: str | None, **kw: Any
) -> Any:
    body: dict[str, Any] = {"node_id": node, "capacity": 4, "engines": ["docker"], "images_digest": digest}
    if images is not None:
        body["images"] = {"docker": images}
    r = http.post(f"{url}/nodes/{node}/heartbeat", json={**body, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def docker_task(task_id: str, image: str, n: int) -> dict[str, Any]:
    return task(task_id, num_samples=n, runtime={"backend": "docker", "image": image})


def submit(http: httpx.Client, url: str, body: dict[str, Any]) -> None:
    r = http.post(f"{url}/rollout/task/submit", json=body)
    assert r.status_code == 201, r.text


def placed(node: StandInNode, task_id: str) -> int:
    return sum(1 for spec in node.specs.values() if spec.task.task_id == task_id)


def test_sessions_go_where_their_image_is_and_missing_images_are_prefetched(
    server: ServerThread, http: httpx.Client
) -> None:
    a, b = StandInNode("a"), StandInNode("b")
    try:
        a.register(http, server.url, capacity=4)
        b.register(http, server.url, capacity=4)
        # b holds the image under podman's spelling of Docker Hub: the same image.
        assert beat(http, server.url, "a", [GO], "da")["images_digest"] == "da"
        assert beat(http, server.url, "b", [f"docker.io/library/{PY}"], "db")["images_digest"] == "db"
        # Later heartbeats leave the list out: the server keeps what it holds for that digest.
        reply = beat(http, server.url, "b", None, "db")
        assert reply == {"ok": True, "images_digest": "db", "prefetch": []}

        assert (
            http.post(f"{server.url}/rollout/task/submit", json=docker_task("py", PY, 3)).status_code == 201
        )
        wait_until(lambda: placed(b, "py") == 3, what="the python sessions on b")
        assert placed(a, "py") == 0  # a was less loaded, but b holds the image

        # Ten sessions of an image nobody holds: the group fills the free node, which fetches it as its
        # sessions start; the rest wait for slots there (b's one free slot is passed over: the image is
        # coming to a), and since more wait than a has slots, b is asked to fetch it ahead.
        submit(http, server.url, docker_task("rs", "rust:1", 10))
        wait_until(lambda: placed(a, "rs") == 4, what="four rust sessions on a")

        def asked() -> dict[str, list[Any]]:
            return {n: beat(http, server.url, n, None, d)["prefetch"] for n, d in (("a", "da"), ("b", "db"))}

        plan = wait_until(lambda: (p := asked()) and any(p.values()) and p, what="a prefetch request")
        assert plan == {"a": [], "b": [{"engine": "docker", "image": "rust:1"}]}
        assert placed(b, "rs") == 0

        nodes = {n["node_id"]: n for n in http.get(f"{server.url}/nodes").json()["nodes"]}
        assert (nodes["a"]["images"], nodes["b"]["images"]) == (1, 1)
        assert "images" not in nodes["a"]["status"]  # kept in memory, not written at every heartbeat

        where = http.post(
            f"{server.url}/images/where",
            json={"images": [{"engine": "docker", "image": PY}, {"engine": "docker", "image": "x:2"}]},
        ).json()
        assert [(i["held_by"], i["fetching_on"]) for i in where["images"]] == [(["b"], []), ([], [])]
        assert where["reporting"] == {"docker": ["a", "b"]}
    finally:
        a.stop()
        b.stop()


def test_a_node_that_reports_no_images_is_placed_by_load_as_before(
    server: ServerThread, http: httpx.Client
) -> None:
    a, b = StandInNode("a"), StandInNode("b")
    try:
        a.register(http, server.url, capacity=2)
        b.register(http, server.url, capacity=2)
        for n in ("a", "b"):
            r = http.post(f"{server.url}/nodes/{n}/heartbeat", json={"node_id": n, "capacity": 2})
            assert r.json() == {"ok": True, "images_digest": None, "prefetch": []}
        submit(http, server.url, docker_task("t", PY, 4))
        wait_until(lambda: len(a.specs) + len(b.specs) == 4, what="four sessions placed")
        assert Counter((len(a.specs), len(b.specs))) == Counter((2, 2))
        bad = http.post(f"{server.url}/images/where", json={"images": [{"engine": "docker"}]})
        assert bad.status_code == 400 and "images[0].image" in bad.text
    finally:
        a.stop()
        b.stop()


def test_polar_submit_names_images_no_node_holds_before_submitting(
    server: ServerThread, http: httpx.Client, tmp_path: Path
) -> None:
    """Was: the sessions of an image no node holds each failed late on the engine's registry error. Now
    `polar submit` asks the server first: one line per missing image with the commands that make it, exit
    2, nothing submitted; `--images pull` submits (the nodes pull while earlier sessions run)."""
    from click.testing import CliRunner

    from polar.cli import main

    a = StandInNode("a")
    try:
        a.register(http, server.url, capacity=4)
        beat(http, server.url, "a", [PY], "da")
        taskfile = tmp_path / "tasks.yaml"
        taskfile.write_text(
            "tasks:\n"
            f"  - {{task_id: held, instruction: x, runtime: {{backend: docker, image: '{PY}'}}}}\n"
            f"  - {{task_id: go1, instruction: x, runtime: {{backend: docker, image: '{GO}'}}}}\n"
            f"  - {{task_id: go2, instruction: x, runtime: {{backend: docker, image: '{GO}'}}}}\n"
            "  - {task_id: pod, instruction: x, runtime: {backend: podman, image: 'x:1'}}\n"
        )
        env = {"POLAR_TOKEN": AUTH["authorization"].removeprefix("Bearer ")}
        args = ["submit", str(taskfile), "--server", server.url]
        refused = CliRunner().invoke(main, args, env=env)
        assert refused.exit_code == 2, refused.output
        assert refused.output.splitlines() == [
            "polar submit: no live node reports its podman images: those were not checked",
            f"polar submit: tasks go1 and 1 more: docker image {GO}: on none of the 1 live node(s) that report "
            f"their docker images; build it on the nodes (polar images build {taskfile} --engine docker) or "
            f"have them pull it (polar submit {taskfile} --images pull)",
        ]
        assert http.get(f"{server.url}/rollout/status").json()["tasks"] == {}

        accepted = CliRunner().invoke(main, [*args, "--images", "pull"], env=env)
        assert accepted.exit_code == 0, accepted.output
        assert "submitted go1: 1 session(s)" in accepted.output
    finally:
        a.stop()
