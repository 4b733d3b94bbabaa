"""Several inference servers behind one gateway (`polar.gateway.backends.pool`), against fake vLLM servers
on loopback: calls spread by least outstanding requests, a session stays on its server, a dead or failing
server is drained and its sessions move without a failed call, a server that recovers comes back,
mismatched served models refuse to start, the per-server state is on the control listener only.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar.gateway.backends.base import BackendOptions
from polar.gateway.config import GatewayConfig
from polar.serving import StartupError
from tests.conftest import SERVED_MODEL, Gateway, serve_gateway
from tests.fakes.fake_vllm import FakeInferenceServer, make_fake_backend
from tests.fakes.server import ServerThread, serve

Fake = tuple[FakeInferenceServer, ServerThread]


@contextlib.contextmanager
def fakes(n: int, **faults: Any) -> Iterator[list[Fake]]:
    with contextlib.ExitStack() as stack:
        out = []
        for _ in range(n):
            app = make_fake_backend("vllm", **faults)
            out.append((app, stack.enter_context(serve(app))))
        yield out


@contextlib.contextmanager
def pooled_gateway(servers: list[Fake], tmp_path: Path, **config: Any) -> Iterator[Gateway]:
    settings: dict[str, Any] = {
        "served_model": SERVED_MODEL,
        "backend": BackendOptions(retries=0, timeout_s=30.0),
        "health_interval_s": 0.1,
        **config,
    }
    gw = serve_gateway(
        GatewayConfig(
            backend_urls=tuple(srv.url for _, srv in servers), store_path=tmp_path / "gw.db", **settings
        )
    )
    try:
        yield gw
    finally:
        gw.server.stop()


async def chat(client: httpx.AsyncClient, gw: Gateway, sid: str, text: str) -> httpx.Response:
    return await client.post(
        f"{gw.url}/v1/chat/completions",
        headers={"authorization": f"Bearer {sid}"},
        json={"model": SERVED_MODEL, "messages": [{"role": "user", "content": text}]},
    )


def sessions_seen(app: FakeInferenceServer) -> list[str]:
    """The session of every chat call `app` served, in order (each prompt starts with its session id)."""
    return [r["messages"][-1]["content"].split()[0] for r in app.requests]


def backends(gw: Gateway) -> dict[str, dict[str, Any]]:
    r = gw.control("GET", "/backends")
    assert r.status_code == 200, r.text
    return {b["url"]: b for b in r.json()["backends"]}


async def until(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Wait for `check` (a condition, not a timing claim: the deadline only ends a test that would hang)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.02)


async def test_calls_go_to_the_server_with_fewest_in_flight(tmp_path: Path) -> None:
    """While one server holds a call (paused, as vLLM holds calls during a weight sync), every new call
    goes to the other: round robin would send every other call to the held server and hang."""
    with fakes(2) as servers, pooled_gateway(servers, tmp_path, backend_affinity=False) as gw:
        (held_app, held_srv), (free_app, free_srv) = servers
        httpx.post(f"{held_srv.url}/pause", params={"mode": "abort"}).raise_for_status()
        async with httpx.AsyncClient(timeout=60) as client:
            first = None
            for i in range(2):  # until one call is held (the first or second, whatever the tie-break)
                task = asyncio.create_task(chat(client, gw, gw.new_session(), f"s{i} held?"))

                def answered_or_held(t: asyncio.Task[httpx.Response] = task) -> bool:
                    return t.done() or backends(gw)[held_srv.url]["outstanding"] == 1

                await until(answered_or_held, "the call is answered or held")
                if not task.done():
                    first = task
                    break
                assert task.result().status_code == 200
            assert first is not None, "no call went to the paused server"
            for i in range(8):  # these would hang on the held server
                r = await chat(client, gw, gw.new_session(), f"n{i} hello")
                assert r.status_code == 200, r.text
            state = backends(gw)
            assert state[held_srv.url]["outstanding"] == 1 and state[free_srv.url]["outstanding"] == 0
            assert len(free_app.requests) >= 8 and held_app.requests == []
            httpx.post(f"{held_srv.url}/resume").raise_for_status()
            assert (await first).status_code == 200
        assert len(held_app.requests) == 1


async def test_slow_servers_share_concurrent_calls_evenly(tmp_path: Path) -> None:
    with fakes(2, delay_s=0.3) as servers, pooled_gateway(servers, tmp_path) as gw:
        sids = [gw.new_session() for _ in range(8)]
        async with httpx.AsyncClient(timeout=60) as client:
            answers = await asyncio.gather(*(chat(client, gw, sid, f"{sid} go") for sid in sids))
        assert all(r.status_code == 200 for r in answers)
        assert sorted(len(app.requests) for app, _ in servers) == [4, 4]


async def test_a_session_stays_on_its_server(tmp_path: Path) -> None:
    with fakes(2) as servers, pooled_gateway(servers, tmp_path) as gw:
        sids = [gw.new_session() for _ in range(6)]
        async with httpx.AsyncClient(timeout=60) as client:
            for turn in range(4):  # the sessions' calls interleave, concurrently
                answers = await asyncio.gather(*(chat(client, gw, s, f"{s} turn {turn}") for s in sids))
                assert all(r.status_code == 200 for r in answers)
        on = [set(sessions_seen(app)) for app, _ in servers]
        assert on[0] and on[1], "both servers hold sessions"
        assert not on[0] & on[1], "a session was served by both servers"
        assert on[0] | on[1] == set(sids)
        state = backends(gw)
        assert sorted(b["sessions"] for b in state.values()) == [3, 3]


async def test_without_affinity_a_session_moves_between_servers(tmp_path: Path) -> None:
    """The control for the test above: with affinity off the same calls do land on both servers."""
    with fakes(2) as servers, pooled_gateway(servers, tmp_path, backend_affinity=False) as gw:
        sid = gw.new_session()
        async with httpx.AsyncClient(timeout=60) as client:
            for turn in range(4):
                assert (await chat(client, gw, sid, f"{sid} turn {turn}")).status_code == 200
        assert all(sid in sessions_seen(app) for app, _ in servers)


async def test_a_killed_server_is_drained_and_its_sessions_move(tmp_path: Path) -> None:
    with fakes(2) as servers, pooled_gateway(servers, tmp_path, health_interval_s=60) as gw:
        (app_a, srv_a), (app_b, srv_b) = servers
        sids = [gw.new_session() for _ in range(4)]
        async with httpx.AsyncClient(timeout=60) as client:
            for s in sids:
                assert (await chat(client, gw, s, f"{s} first")).status_code == 200
            moved = set(sessions_seen(app_b))
            assert moved, "the server to kill holds sessions"
            srv_b.stop()
            for s in sids:  # no probe runs (60 s): the failed connection itself drains the server
                r = await chat(client, gw, s, f"{s} second")
                assert r.status_code == 200, r.text
        assert set(sessions_seen(app_a)) == set(sids)  # every session now on the live server
        for s in sids:
            assert gw.control("GET", f"/sessions/{s}/failures").json()["failures"] == []
            assert len(gw.completions(s)) == 2
        state = backends(gw)
        assert state[srv_b.url]["healthy"] is False and "unreachable" in state[srv_b.url]["last_error"]
        assert state[srv_b.url]["sessions"] == 0 and state[srv_a.url]["sessions"] == 4


async def test_a_failing_server_is_left_out_until_its_health_check_passes(tmp_path: Path) -> None:
    with fakes(2) as servers, pooled_gateway(servers, tmp_path) as gw:
        (app_a, _), (app_b, srv_b) = servers
        app_b.set(status=503)  # calls and the health probe answer 503
        async with httpx.AsyncClient(timeout=60) as client:
            sids = [gw.new_session() for _ in range(4)]
            for s in sids:
                assert (await chat(client, gw, s, f"{s} hi")).status_code == 200
            assert set(sessions_seen(app_a)) == set(sids)
            await until(lambda: backends(gw)[srv_b.url]["healthy"] is False, "the 503 server is unhealthy")
            calls_b = app_b.calls
            for s in sids:
                assert (await chat(client, gw, s, f"{s} again")).status_code == 200
            assert app_b.calls == calls_b  # an unhealthy server gets no new calls
            app_b.set(status=None)
            await until(lambda: backends(gw)[srv_b.url]["healthy"] is True, "the server recovers")
            fresh = [gw.new_session() for _ in range(4)]
            for s in fresh:  # new sessions go to the recovered server (fewest pinned sessions)
                assert (await chat(client, gw, s, f"{s} hi")).status_code == 200
        assert set(sessions_seen(app_b)) == set(fresh)
        for s in sids + fresh:
            assert gw.control("GET", f"/sessions/{s}/failures").json()["failures"] == []


async def test_with_every_server_down_the_call_fails_once_and_is_recorded(tmp_path: Path) -> None:
    with fakes(2) as servers, pooled_gateway(servers, tmp_path) as gw:
        for _, srv in servers:
            srv.stop()
        sid = gw.new_session()
        async with httpx.AsyncClient(timeout=60) as client:
            r = await chat(client, gw, sid, f"{sid} anyone?")
        assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]
        assert len(gw.control("GET", f"/sessions/{sid}/failures").json()["failures"]) == 1


def test_a_disabled_server_gets_no_calls_until_enabled(tmp_path: Path) -> None:
    with fakes(2) as servers, pooled_gateway(servers, tmp_path) as gw:
        (app_a, _), (app_b, srv_b) = servers
        r = gw.control("POST", "/admin/backends", json={"url": srv_b.url + "/", "enabled": False})
        assert r.status_code == 200, r.text
        assert backends(gw)[srv_b.url]["enabled"] is False
        for _ in range(4):
            sid = gw.new_session()
            r = httpx.post(
                f"{gw.url}/v1/chat/completions",
                headers={"authorization": f"Bearer {sid}"},
                json={"model": SERVED_MODEL, "messages": [{"role": "user", "content": f"{sid} hi"}]},
            )
            assert r.status_code == 200
        assert app_b.requests == [] and len(app_a.requests) == 4
        assert (
            gw.control("POST", "/admin/backends", json={"url": srv_b.url, "enabled": True}).status_code == 200
        )
        assert backends(gw)[srv_b.url]["enabled"] is True
        unknown = gw.control("POST", "/admin/backends", json={"url": "http://127.0.0.1:9", "enabled": False})
        assert unknown.status_code == 404
        assert gw.control("POST", "/admin/backends", json={"url": srv_b.url}).status_code == 400


def test_backend_state_is_on_the_control_listener_only(tmp_path: Path) -> None:
    with fakes(2) as servers, pooled_gateway(servers, tmp_path) as gw:
        state = gw.control("GET", "/backends").json()
        assert state["kind"] == "vllm" and state["affinity"] is True
        assert [b["url"] for b in state["backends"]] == [srv.url for _, srv in servers]
        keys = {"url", "healthy", "enabled", "outstanding", "calls", "failures", "sessions", "last_error"}
        assert all(set(b) == keys for b in state["backends"])
        assert httpx.get(f"{gw.control_url}/backends").status_code == 401  # the token is required
        sid = gw.new_session()
        for path in ("/backends", "/health", "/v1/models", "/"):  # the model API: no server addresses
            r = httpx.get(f"{gw.url}{path}", headers={"authorization": f"Bearer {sid}"})
            assert all(srv.url.split("//")[1] not in r.text for _, srv in servers), (path, r.text)
        assert httpx.get(f"{gw.url}/backends").status_code == 404
        post = httpx.post(f"{gw.url}/admin/backends", json={"url": servers[0][1].url, "enabled": False})
        assert post.status_code == 404


def test_one_server_has_a_state_without_a_rotation(gateway: Gateway) -> None:
    state = gateway.control("GET", "/backends").json()
    assert state["affinity"] is None and len(state["backends"]) == 1
    r = gateway.control(
        "POST", "/admin/backends", json={"url": state["backends"][0]["url"], "enabled": False}
    )
    assert r.status_code == 409


def test_start_up_refuses_servers_that_serve_different_models(tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        urls = []
        for model in ("policy-a", "policy-a", "policy-b"):
            urls.append(stack.enter_context(serve(make_fake_backend("vllm", model=model))).url)
        config = GatewayConfig(backend_urls=tuple(urls), store_path=tmp_path / "gw.db")
        with pytest.raises(StartupError) as info:
            serve_gateway(config)
        message = str(info.value.error)
        assert "do not serve the same model" in message
        assert f"{urls[2]} serves ['policy-b']" in message and f"{urls[0]} serves ['policy-a']" in message
        # The same servers with --model: still refused (the servers disagree whatever the gateway asks for).
        with pytest.raises(StartupError):
            serve_gateway(
                GatewayConfig(
                    backend_urls=tuple(urls), served_model="policy-a", store_path=tmp_path / "g2.db"
                )
            )


def test_start_up_takes_the_model_every_server_serves_and_starts_with_one_down(tmp_path: Path) -> None:
    from polar.serving import free_port

    down = f"http://127.0.0.1:{free_port()}"
    with serve(make_fake_backend("vllm", model="policy-a")) as up:
        gw = serve_gateway(GatewayConfig(backend_urls=(up.url, down), store_path=tmp_path / "gw.db"))
        try:
            assert gw.control("GET", "/health").json()["model"] == "policy-a"
            state = backends(gw)
            assert state[down]["healthy"] is False and state[up.url]["healthy"] is True
        finally:
            gw.server.stop()


def test_config_takes_one_url_or_several() -> None:
    one = GatewayConfig(backend_url="http://a:8000/")
    assert one.backend_urls == ("http://a:8000",) and one.backend_url == "http://a:8000"
    many = GatewayConfig(backend_urls=("http://a:8000", "http://b:8000"))
    assert many.backend_url == "http://a:8000"
    with pytest.raises(ValueError, match="twice"):
        GatewayConfig(backend_urls=("http://a:8000", "http://a:8000/"))
    with pytest.raises(ValueError, match="http"):
        GatewayConfig(backend_urls=("http://a:8000", "b:8000"))
    with pytest.raises(ValueError, match="inference server"):
        GatewayConfig()
