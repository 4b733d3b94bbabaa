"""Shared fixtures: a fake vLLM on loopback, and a real gateway in front of it."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar import plugins
from polar.gateway.app import create_app
from polar.gateway.backends.base import BackendOptions
from polar.gateway.config import GatewayConfig
from polar.harness.registry import classifier
from polar.store.records import CompletionRecord
from polar.store.sqlite import SQLiteStore
from tests.fakes.server import ServerThread, serve
from tests.vllm_support import VLLMServer

SERVED_MODEL = "fake-policy"
# The suite is the operator of the servers it starts: it allows its own helper modules (test harnesses and
# evaluators named `tests.module:Name` in tasks), as `polar serve --plugin tests` would. Anything else named
# by an import path over HTTP is refused (tests/security proves it).
plugins.allow_modules(["tests"])
# Servers the suite starts never write the user's own token file (~/.config/polar/token).
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="polar-test-config-")
os.environ.pop("POLAR_TOKEN", None)
# One client for the fixtures' control-plane calls: a new httpx.Client costs ~20 ms (certificate loading).
_HTTP = httpx.Client(timeout=60)


# scripts/test runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`, docs/testing.md). The
# tests of a marker here share one expensive thing started once per worker: the session's vLLM server (and
# the learning test's, which must not compete with it for the core vLLM binds), dockerd and the base images,
# a Ray cluster. Each marker's tests go to one worker, so each thing is started once, and never twice at
# once (two dockerds on one data root, two Ray clusters). So do the tests of a module that defines a
# module-scoped fixture (a loaded model, a corpus of sessions run once): it is built on one worker only.
XDIST_GROUPS = ("vllm", "containers", "ray")


def _module_fixture(item: pytest.Item) -> bool:
    """Whether `item` uses a module-scoped fixture defined in its own module."""
    info = getattr(item, "_fixtureinfo", None)
    module = item.nodeid.split("::")[0]
    return info is not None and any(
        defs[-1].scope == "module" and defs[-1].baseid == module for defs in info.name2fixturedefs.values()
    )


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        group = next((m for m in XDIST_GROUPS if item.get_closest_marker(m) is not None), None)
        if group is None and _module_fixture(item):
            group = item.nodeid.split("::")[0]
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


@dataclass
class FakeBackend:
    url: str
    app: Any  # the fake's ASGI app: `.requests`, fault attributes, script


@dataclass
class Gateway:
    url: str  # the model API (data plane): what harnesses call
    store_path: Path
    server: ServerThread
    control_token: str
    control_url: str  # sessions, records, trajectories, pause/resume: token required

    def _headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.control_token}"}

    def control(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """A request to the control listener, with the token."""
        return _HTTP.request(method, f"{self.control_url}{path}", headers=self._headers(), **kwargs)

    def new_session(self, **metadata: Any) -> str:
        r = self.control("POST", "/sessions", json=metadata)
        assert r.status_code == 201, r.text
        return str(r.json()["session_id"])

    def completions(self, session_id: str) -> list[CompletionRecord]:
        r = self.control("GET", f"/sessions/{session_id}/completions")
        assert r.status_code == 200, r.text
        return [CompletionRecord.from_json(d) for d in r.json()["completions"]]

    def stored(self, session_id: str) -> list[CompletionRecord]:
        with SQLiteStore(self.store_path) as store:
            return store.completions(session_id)


def start_gateway(backend_url: str, tmp_path: Path, **overrides: Any) -> Gateway:
    options = overrides.pop("backend", BackendOptions(retries=0, timeout_s=30.0))
    config = GatewayConfig(
        backend_url=backend_url,
        served_model=overrides.pop("served_model", SERVED_MODEL),
        store_path=overrides.pop("store_path", tmp_path / "gateway.db"),
        backend=options,
        **overrides,
    )
    return serve_gateway(config)


def serve_gateway(config: GatewayConfig) -> Gateway:
    """Both listeners of a gateway made from `config`, on one loop in a thread; `.server.stop()` ends it."""
    app = create_app(config, classifier)
    server = ServerThread(app.data, also=[app.control]).start()
    return Gateway(server.url, config.store_path, server, config.control_token, server.urls[1])


@pytest.fixture(scope="module")
def tiny() -> Iterator[tuple[Any, str]]:
    """The embedded engine with the offline tiny model (real Qwen3 tokenizer, random weights), served on
    loopback, for one module: (engine, url)."""
    from polar.engine import create_engine_app
    from tests.engine_support import load_tiny

    engine = load_tiny()
    with serve(create_engine_app(engine)) as srv:
        yield engine, srv.url
    engine.stop()


@pytest.fixture(scope="module")
def module_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeBackend, Gateway]]:
    """One fake backend and gateway shared by a module marked `shared_stack` (starting and stopping a pair
    for every test costs ~0.35 s; modules whose tests use fresh sessions can share one)."""
    from tests.sdk_support import serve_stack

    yield from serve_stack(tmp_path_factory.mktemp("stack"))


def _shared(request: pytest.FixtureRequest) -> tuple[FakeBackend, Gateway] | None:
    if request.node.get_closest_marker("shared_stack") is None:
        return None
    stack: tuple[FakeBackend, Gateway] = request.getfixturevalue("module_stack")
    return stack


@pytest.fixture
def fake_backend(request: pytest.FixtureRequest) -> Iterator[FakeBackend]:
    from tests.fakes.fake_vllm import make_fake_backend

    shared = _shared(request)
    if shared is not None:
        yield shared[0]
        return
    app = make_fake_backend("vllm")
    with serve(app) as srv:
        yield FakeBackend(srv.url, app)


@pytest.fixture
def gateway(request: pytest.FixtureRequest, fake_backend: FakeBackend, tmp_path: Path) -> Iterator[Gateway]:
    shared = _shared(request)
    if shared is not None:
        yield shared[1]
        return
    gw = start_gateway(fake_backend.url, tmp_path)
    try:
        yield gw
    finally:
        gw.server.stop()


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """One real `vllm serve` for the whole session (it starts in ~1 minute), of the offline default model
    taught to call a tool (`tests.vllm_support.tools_model_dir`).

    Tests that change its weights put the original ones back before they end. While working on these
    tests, `POLAR_TEST_VLLM_URL=http://127.0.0.1:PORT` reuses a server started by hand with
    `tests.vllm_support.TRAINING_FLAGS`, `tests.vllm_scripted.FORCING_FLAGS` (and `FORCING_ENV`),
    `tests.vllm_support.JUDGE_FLAGS` and `--served-model-name tiny` (the suite never sets it)."""
    from tests.vllm_support import attach_vllm, start_vllm, tools_model_dir

    reuse = os.environ.get("POLAR_TEST_VLLM_URL")
    if reuse:
        yield attach_vllm(reuse, tools_model_dir())
        return
    from tests.vllm_scripted import FORCING_ENV, FORCING_FLAGS
    from tests.vllm_support import JUDGE_FLAGS

    # With the forced-token processor of tests/vllm_scripted.py loaded, and structured outputs set up for a
    # judge: requests that ask for neither are served as without them.
    server = start_vllm(
        tools_model_dir(),
        tmp_path_factory.mktemp("vllm"),
        extra=(*FORCING_FLAGS, *JUDGE_FLAGS),
        env_extra=FORCING_ENV,
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[str]:
    """Docker with polar's base image (tests.container_support): "docker", or the test is skipped."""
    from tests.container_support import base_image, docker_daemon

    with docker_daemon() as why:
        if why is not None:
            pytest.skip(why)
        base_image("docker")
        yield "docker"


@pytest.fixture(scope="session")
def podman_engine() -> Iterator[str]:
    """Podman with polar's base image (tests.container_support): "podman", or the test is skipped."""
    from tests.container_support import base_image, podman_config

    with podman_config() as why:
        if why is not None:
            pytest.skip(why)
        base_image("podman")
        yield "podman"


@pytest.fixture(params=["docker", "podman"])
def engine(request: pytest.FixtureRequest) -> str:
    """Each container engine in turn (marker `containers`)."""
    return str(request.getfixturevalue(f"{request.param}_engine"))
