"""The dashboard's door, over real HTTP against a real rollout server: nothing under /ui answers without a
login or the bearer token, the login cookie is not the token, forged and expired cookies are refused,
and a change (cancel) needs the page's CSRF header as well."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from polar.dashboard import DashboardOptions, server_app
from polar.rollout.server import ServerConfig
from polar.serving import ServerThread
from tests.server_support import AUTH, FAST, TOKEN, StandInNode, task, wait_until

PAGES = [
    "/ui",
    "/ui/",
    "/ui/frag/overview",
    "/ui/tasks/secret-task",
    "/ui/frag/tasks/secret-task",
    "/ui/sessions/polar-0123456789",
    "/ui/compare?s=polar-0123456789&s=polar-9876543210",
    "/ui/training",
    "/ui/search?q=polar",
    "/ui/events",
    "/ui/static/dashboard.js",
    "/ui/static/vendor/htmx.min.js",
    "/ui/nothing-here",
]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    config = ServerConfig(db_path=tmp_path / "server.db", token=TOKEN, **FAST)
    srv = ServerThread(server_app(config, DashboardOptions(login_ttl_s=3600))).start()
    try:
        yield srv.url
    finally:
        srv.stop()


def login(client: httpx.Client, url: str) -> str:
    """Log in as the page's script does; the CSRF value the pages carry for this login."""
    r = client.post(f"{url}/ui/login", headers=AUTH)
    assert r.status_code == 200, r.text
    page = client.get(f"{url}/ui/", headers={"accept": "text/html"})
    assert page.status_code == 200
    match = re.search(r'"X-Polar-CSRF": "([^"]+)"', page.text)
    assert match is not None
    return match.group(1)


def submit(client: httpx.Client, url: str, task_id: str) -> None:
    r = client.post(f"{url}/rollout/task/submit", json=task(task_id, num_samples=2), headers=AUTH)
    assert r.status_code == 201, r.text


def test_no_page_or_api_answers_without_a_login(server: str) -> None:
    with httpx.Client() as client:
        submit(client, server, "secret-task")
        for path in PAGES:
            for accept in ("text/html", "application/json", "text/event-stream"):
                r = client.get(f"{server}{path}", headers={"accept": accept})
                assert r.status_code == 401, (path, accept, r.status_code)
                assert "secret-task" not in r.text
        page = client.get(f"{server}/ui/tasks/secret-task", headers={"accept": "text/html"})
        assert "control token" in page.text and "<form" in page.text  # a browser gets the login page
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        r = client.post(f"{server}/ui/tasks/secret-task/cancel", headers={"x-polar-csrf": "x"})
        assert r.status_code == 401
        wrong = client.get(f"{server}/ui/", headers={"authorization": "Bearer " + "x" * 43})
        assert wrong.status_code == 401
        refused = client.get(f"{server}/rollout/status", headers=AUTH).json()["security"]["auth_refused"]
        assert refused >= len(PAGES) * 3  # counted where `polar status` shows refusals


def test_the_login_cookie_is_not_the_token_and_stays_on_the_dashboard(server: str) -> None:
    with httpx.Client() as client:
        assert client.post(f"{server}/ui/login", headers={"authorization": "Bearer wrong"}).status_code == 401
        assert client.post(f"{server}/ui/login").status_code == 401
        r = client.post(f"{server}/ui/login", headers=AUTH)
        assert r.status_code == 200
        cookie = r.headers["set-cookie"]
        assert TOKEN not in cookie
        for attr in ("HttpOnly", "SameSite=Strict", "Path=/ui", "Max-Age=3600"):
            assert attr in cookie
        submit(client, server, "t1")
        assert "t1" in client.get(f"{server}/ui/", headers={"accept": "text/html"}).text
        # The cookie opens the dashboard only: the control routes still need the bearer token.
        sid = cookie.split(";")[0].split("=", 1)[1]
        r = httpx.get(f"{server}/rollout/status", headers={"cookie": f"polar_ui={sid}"})
        assert r.status_code == 401
        # Logging out forgets the id.
        csrf = login(client, server)
        assert client.post(f"{server}/ui/logout", headers={"x-polar-csrf": csrf}).status_code == 200
        old = client.cookies.get("polar_ui")
        assert old in (None, "")


def test_a_forged_cookie_is_refused(server: str) -> None:
    for value in ("", "forged", TOKEN, "A" * 43):
        r = httpx.get(f"{server}/ui/", headers={"cookie": f"polar_ui={value}", "accept": "text/html"})
        assert r.status_code == 401, value


def test_an_expired_login_is_refused(tmp_path: Path) -> None:
    config = ServerConfig(db_path=tmp_path / "server.db", token=TOKEN, **FAST)
    srv = ServerThread(server_app(config, DashboardOptions(login_ttl_s=0.5))).start()
    try:
        with httpx.Client() as client:
            r = client.post(f"{srv.url}/ui/login", headers=AUTH)
            assert r.status_code == 200
            sid = r.headers["set-cookie"].split(";")[0].split("=", 1)[1]
            # The browser would drop it at Max-Age; the server refuses it on its own once it expired.
            wait_until(
                lambda: httpx.get(f"{srv.url}/ui/", headers={"cookie": f"polar_ui={sid}"}).status_code == 401,
                what="the login to expire",
            )
    finally:
        srv.stop()


def test_cancel_needs_the_csrf_header_of_this_login(server: str) -> None:
    with httpx.Client() as client:
        node = StandInNode().register(client, server)
        try:
            submit(client, server, "t1")
            csrf = login(client, server)
            url = f"{server}/ui/tasks/t1/cancel"
            assert client.post(url).status_code == 403
            assert client.post(url, headers={"x-polar-csrf": "not-it"}).status_code == 403
            other = httpx.Client()
            other_csrf = login(other, server)
            assert client.post(url, headers={"x-polar-csrf": other_csrf}).status_code == 403
            other.close()
            state = client.get(f"{server}/rollout/task/t1", headers=AUTH).json()["state"]
            assert state == "ACTIVE"
            r = client.post(url, headers={"x-polar-csrf": csrf})
            assert r.status_code == 200 and "cancelled" in r.text
            view = client.get(f"{server}/rollout/task/t1", headers=AUTH).json()
            assert view["state"] == "CANCELLED"
            assert {s["status"] for s in view["sessions"]} == {"CANCELLED"}
        finally:
            node.server.stop()


def test_a_script_may_use_the_bearer_token_instead(server: str) -> None:
    with httpx.Client() as client:
        submit(client, server, "t1")
        assert "t1" in client.get(f"{server}/ui/frag/overview", headers=AUTH).text
        r = client.post(f"{server}/ui/tasks/t1/cancel", headers=AUTH)  # no cookie: nothing to forge
        assert r.status_code == 200
