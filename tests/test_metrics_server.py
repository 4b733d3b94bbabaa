"""The rollout server's Prometheus metrics over real HTTP: a real server, a stand-in node that reports results
with their dispatch credential, a trainer callback URL that is down; then `GET /metrics`, parsed with
prometheus_client's own parser."""

from __future__ import annotations

from pathlib import Path

import httpx

from polar.auth import bearer
from polar.serving import free_port
from tests.server_support import AUTH, StandInNode, post_result, result, start_server, task, wait_until
from tests.test_metrics_gateway import Samples, parse, value


def scrape(http: httpx.Client, url: str) -> Samples:
    r = http.get(f"{url}/metrics", headers=AUTH)
    assert r.status_code == 200, r.text
    return parse(r.text)


def test_tasks_sessions_queue_nodes_callbacks_and_refusals(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server.db")
    down = f"http://127.0.0.1:{free_port()}/cb"
    try:
        with httpx.Client(timeout=30) as http:
            empty = scrape(http, server.url)
            assert value(empty, "polar_server_tasks", state="ACTIVE") == 0
            assert value(empty, "polar_server_queue_depth") == 0

            node = StandInNode().register(http, server.url, capacity=1)
            r = http.post(
                f"{server.url}/rollout/task/submit",
                json=task("t1", num_samples=3, callback_url=down),
                headers=AUTH,
            )
            assert r.status_code == 201
            sids = r.json()["tasks"][0]["session_ids"]
            wait_until(lambda: len(node.specs) == 1, what="one dispatch (capacity 1)")
            queued = scrape(http, server.url)
            assert value(queued, "polar_server_tasks", state="ACTIVE") == 1
            assert value(queued, "polar_server_queue_depth") == 2
            assert value(queued, "polar_server_node_load", node="n1") == 1
            assert value(queued, "polar_server_node_capacity", node="n1") == 1
            assert value(queued, "polar_server_node_up", node="n1") == 1
            assert value(queued, "polar_server_nodes", state="healthy") == 1
            assert (
                sum(value(queued, "polar_server_sessions", status=s) for s in ("REGISTERED", "DISPATCHED"))
                == 3
            )

            # A result without its dispatch credential is refused and counted; so is a request without the token.
            forged = post_result(http, server.url, result(sids[0], "t1", node_id="n1"))
            assert forged.status_code == 403
            assert http.get(f"{server.url}/metrics").status_code == 401
            assert (
                http.get(f"{server.url}/metrics", headers=bearer("wrong-wrong-wrong-wrong")).status_code
                == 401
            )

            for sid in sids:  # each reported as its dispatch comes (one at a time: capacity 1)
                assert node.report(http, server.url, result(sid, "t1", reward=1.0)).status_code == 200
            # Four callbacks (three results, task_done) to a URL that is down: each tried 4 times, then failed.
            wait_until(
                lambda: value(scrape(http, server.url), "polar_server_callbacks", state="failed") == 4,
                what="the callbacks to give up",
            )
            after = scrape(http, server.url)
            node.stop()
    finally:
        server.stop()

    assert value(after, "polar_server_tasks", state="DONE") == 1
    assert value(after, "polar_server_tasks", state="ACTIVE") == 0
    assert value(after, "polar_server_sessions", status="COMPLETED") == 3
    assert value(after, "polar_server_queue_depth") == 0
    assert value(after, "polar_server_node_load", node="n1") == 0
    assert value(after, "polar_server_callbacks", state="pending") == 0
    assert value(after, "polar_server_callback_attempts_total", outcome="failed") == 4
    assert value(after, "polar_server_callback_attempts_total", outcome="retried") == 4 * 3
    assert value(after, "polar_server_callback_attempts_total", outcome="delivered") == 0
    assert value(after, "polar_server_results_refused_total") == 1
    assert value(after, "polar_server_auth_refused_total") == 2
