"""The gateway's Prometheus metrics over real HTTP: real traffic through the official openai SDK against the
fake vLLM, then `GET /metrics` on the control listener, parsed with prometheus_client's own parser.

`/metrics` is a control route: the control token or 401, and absent from the model API (the route-list
proofs in test_gateway_http.py and tests/security cover it with every other control route).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from polar.auth import bearer
from tests.conftest import FakeBackend, Gateway, start_gateway
from tests.fakes.fake_vllm import Reply, make_fake_backend
from tests.fakes.server import serve

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
DOC = (Path(__file__).parent.parent / "docs" / "prometheus.md").read_text()


def parse(text: str) -> Samples:
    """Every sample of an exposition, keyed by (sample name, labels); every family must have its row in
    docs/prometheus.md (the text format shows each counter's `_created` sample as a family of its own)."""
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        assert f"| `{name}` |" in DOC, f"{name} is not in the table of docs/prometheus.md"
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """A sample's value; 0 when the exposition has none (a labelled counter not moved yet)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def scrape(gw: Gateway) -> Samples:
    r = gw.control("GET", "/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse(r.text)


def test_calls_tokens_refusals_and_failures_are_counted(gateway: Gateway, fake_backend: FakeBackend) -> None:
    before = scrape(gateway)
    assert value(before, "polar_gateway_records_committed_total") == 0
    assert value(before, "polar_gateway_in_flight") == 0 and value(before, "polar_gateway_paused") == 0

    fake_backend.app.reset([Reply(content="one answer"), Reply(content="a streamed answer in pieces")])
    sid = gateway.new_session()
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=sid, max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    chunks = list(
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}], stream=True)
    )
    assert chunks
    stranger = openai.OpenAI(base_url=gateway.url + "/v1", api_key="not-a-session", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    bad = httpx.post(gateway.url + "/v1/messages", content=b"{nope", headers={"x-api-key": sid})
    assert bad.status_code == 400

    after = scrape(gateway)
    assert value(after, "polar_gateway_calls_total", dialect="chat", status="200") == 2
    assert value(after, "polar_gateway_calls_total", dialect="chat", status="401") == 1
    assert value(after, "polar_gateway_calls_total", dialect="anthropic", status="400") == 1
    assert value(after, "polar_gateway_refused_total", dialect="chat", reason="authentication") == 1
    assert value(after, "polar_gateway_refused_total", dialect="anthropic", reason="invalid_request") == 1
    # The unparseable call was recorded as a failure; the unauthenticated one belongs to no session.
    kinds = {"dialect": "anthropic", "kind": "invalid_request"}
    assert value(after, "polar_gateway_call_failures_total", **kinds) == 1

    records = gateway.completions(sid)
    assert len(records) == 2
    assert value(after, "polar_gateway_records_committed_total") == 2
    prompt = sum(r.usage["prompt_tokens"] for r in records)
    completion = sum(r.usage["completion_tokens"] for r in records)
    assert prompt > 0 and completion > 0
    assert value(after, "polar_gateway_prompt_tokens_total") == prompt
    assert value(after, "polar_gateway_completion_tokens_total") == completion
    for histogram in ("upstream", "record_commit", "overhead"):
        assert value(after, f"polar_gateway_{histogram}_seconds_count") == 2
        assert value(after, f"polar_gateway_{histogram}_seconds_bucket", le="+Inf") == 2
    # The records' own upstream latencies are what the histogram summed.
    upstream_s = sum(r.upstream_latency_ms or 0.0 for r in records) / 1000.0
    assert value(after, "polar_gateway_upstream_seconds_sum") == pytest.approx(upstream_s, abs=1e-5)

    # Live state, read at the scrape: one server, idle now, busy while the two calls ran.
    assert value(after, "polar_gateway_sessions_live") >= 1
    server = {"backend": fake_backend.url}
    assert value(after, "polar_gateway_backend_in_flight", **server) == 0
    assert value(after, "polar_gateway_backend_up", **server) == 1
    busy = value(after, "polar_gateway_backend_busy_seconds_total", **server)
    assert busy >= upstream_s > 0
    commits = value(after, "polar_gateway_store_commits_total")
    assert commits >= 3  # the session, two records, a failure
    assert value(after, "polar_gateway_store_writes_total") >= commits
    assert value(after, "polar_gateway_store_lock_retries_total") == 0  # one process: the lock is its own


def test_pause_shows_in_the_metrics(gateway: Gateway) -> None:
    assert gateway.control("POST", "/admin/pause").status_code == 200
    try:
        assert value(scrape(gateway), "polar_gateway_paused") == 1
    finally:
        gateway.control("POST", "/admin/resume")
    assert value(scrape(gateway), "polar_gateway_paused") == 0


def test_metrics_need_the_token_and_are_not_on_the_model_api(gateway: Gateway) -> None:
    sid = gateway.new_session()
    for headers in ({}, bearer("wrong-token-wrong-token"), bearer(sid)):
        r = httpx.get(f"{gateway.control_url}/metrics", headers=headers)
        assert r.status_code == 401, headers
        assert "polar_gateway" not in r.text
    for headers in ({}, bearer(gateway.control_token), bearer(sid)):
        r = httpx.get(f"{gateway.url}/metrics", headers=headers)
        assert r.status_code == 404, headers
        assert "polar_gateway" not in r.text


def test_openmetrics_is_served_to_a_scraper_that_asks(gateway: Gateway) -> None:
    accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    headers = {**bearer(gateway.control_token), "accept": accept}
    r = httpx.get(f"{gateway.control_url}/metrics", headers=headers)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.rstrip().endswith("# EOF")


@pytest.fixture
def two_servers() -> Iterator[list[str]]:
    apps = [make_fake_backend("vllm"), make_fake_backend("vllm")]
    with serve(apps[0]) as a, serve(apps[1]) as b:
        yield [a.url, b.url]


def test_a_pool_reports_each_server(two_servers: list[str], tmp_path: Path) -> None:
    gw = start_gateway(two_servers[0], tmp_path, backend_urls=tuple(two_servers), health_interval_s=60)
    try:
        for _ in range(2):
            sid = gw.new_session()
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        samples = scrape(gw)
    finally:
        gw.server.stop()
    calls = [value(samples, "polar_gateway_backend_calls_total", backend=url) for url in two_servers]
    assert sum(calls) == 2 and calls == [1, 1]  # two new sessions go to the two idle servers
    for url in two_servers:
        assert value(samples, "polar_gateway_backend_up", backend=url) == 1
        assert value(samples, "polar_gateway_backend_sessions", backend=url) == 1
        assert value(samples, "polar_gateway_backend_failures_total", backend=url) == 0
        assert value(samples, "polar_gateway_backend_busy_seconds_total", backend=url) > 0
