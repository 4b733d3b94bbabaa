"""A `max_tokens` beyond what the server's context holds is cut to what fits at the gateway (polar.gateway.fit).

The fake vLLM refuses like the real one: vLLM 0.32's checks (`context_checks="0.32"`: a `max_tokens` above
`max_model_len` is a 400 without the prompt's length, which the gateway then counts with `/tokenize`) and
vLLM 0.11's and SGLang's (a prompt plus `max_tokens` over the context is a 400 stating both). Each dialect,
streamed and not, through raw HTTP: the harness gets an answer, the record says it was cut and from what, and
the server sampled with exactly the room left. When the prompt alone fills the context the server's error
stands, as the dialect's context-length error.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar.gateway.fit import requested_flag
from polar.store.records import FLAG_MAX_TOKENS_CLAMPED
from tests.conftest import Gateway, start_gateway
from tests.fakes.fake_vllm import FakeInferenceServer, make_fake_backend
from tests.fakes.server import serve
from tests.test_gateway_faults import CLAUDE_MODEL, DIALECTS, GEMINI_MODEL, HTTP, failures, raw_call

ASKED = 64  # what every call here asks for (Anthropic's `max_tokens`, the others' equivalent)


# The servers' checks: (fake kind, its `context_checks`).
SERVERS = {"vllm-0.32": ("vllm", "0.32"), "vllm-0.11": ("vllm", "0.11"), "sglang": ("sglang", "0.11")}


@pytest.fixture(scope="module", params=list(SERVERS))
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    kind, checks = SERVERS[request.param]
    app = make_fake_backend(kind, context_checks=checks)
    with serve(app) as srv:
        gw = start_gateway(srv.url, tmp_path_factory.mktemp("gw"), backend_kind=kind)
        try:
            yield app, gw
        finally:
            gw.server.stop()


def call(gw: Gateway, dialect: str, sid: str, stream: bool, max_tokens: int) -> httpx.Response:
    """ "hello" in `dialect`, with its own output-budget field set to `max_tokens`."""
    headers = {"authorization": f"Bearer {sid}"}
    hello = [{"role": "user", "content": "hello"}]
    body: dict[str, Any]
    if dialect == "chat":
        path, body = (
            "/v1/chat/completions",
            {"model": "m", "messages": hello, "max_completion_tokens": max_tokens},
        )
    elif dialect == "responses":
        path, body = "/v1/responses", {"model": "m", "input": "hello", "max_output_tokens": max_tokens}
    elif dialect == "anthropic":
        headers["anthropic-version"] = "2023-06-01"
        path, body = "/v1/messages", {"model": CLAUDE_MODEL, "max_tokens": max_tokens, "messages": hello}
    else:
        method = "streamGenerateContent?alt=sse" if stream else "generateContent"
        path = f"/v1beta/models/{GEMINI_MODEL}:{method}"
        body = {
            "contents": [{"role": "user", "parts": [{"text": "hello"}]}],
            "generationConfig": {"maxOutputTokens": max_tokens},
        }
    if stream and dialect != "gemini":
        body["stream"] = True
    return HTTP.post(gw.url + path, json=body, headers=headers)


def prompt_len(fake: FakeInferenceServer, body: dict[str, Any]) -> int:
    return len(fake._prompt_ids(body))


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_max_tokens_over_the_context_is_cut_to_what_fits(stack: Any, dialect: str, stream: bool) -> None:
    fake, gw = stack
    checks = fake.context_checks
    fake.reset(context_checks=checks)
    sid = gw.new_session(task_id="fit")
    assert call(gw, dialect, sid, stream, ASKED).status_code == 200  # learn the prompt's length
    n = prompt_len(fake, fake.requests[-1])
    # 0.32 refuses a max_tokens above the whole context; 0.11 and SGLang any prompt + max_tokens over it.
    limit = ASKED - 1 if checks == "0.32" else n + ASKED - 1
    fake.reset(max_model_len=limit, context_checks=checks)
    r = call(gw, dialect, sid, stream, ASKED)
    assert r.status_code == 200, r.text
    refused, sent = fake.requests
    assert refused["max_tokens"] == ASKED and sent["max_tokens"] == limit - n
    assert {k: v for k, v in refused.items() if k != "max_tokens"} == {
        k: v for k, v in sent.items() if k != "max_tokens"
    }
    counted = fake.tokenize_requests
    assert len(counted) == (1 if checks == "0.32" else 0)  # the 400 said no length
    first, record = gw.completions(sid)
    assert FLAG_MAX_TOKENS_CLAMPED not in first.flags
    assert FLAG_MAX_TOKENS_CLAMPED in record.flags and requested_flag(ASKED) in record.flags
    assert record.upstream_request["max_tokens"] == limit - n and record.trainable
    assert record.seq == 1 and failures(gw, sid) == []


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_prompt_that_fills_the_context_is_still_refused(stack: Any, dialect: str, stream: bool) -> None:
    fake, gw = stack
    checks = fake.context_checks
    fake.reset(context_checks=checks)
    sid = gw.new_session(task_id="fit")
    assert call(gw, dialect, sid, stream, ASKED).status_code == 200
    n = prompt_len(fake, fake.requests[-1])
    fake.reset(max_model_len=n, context_checks=checks)  # no room left for even one token
    r = call(gw, dialect, sid, stream, ASKED)
    assert r.status_code == 400 or (stream and r.status_code == 200), r.text
    assert len(fake.requests) == 1  # nothing was resent
    (failure,) = failures(gw, sid)
    assert failure["kind"] == "context_length"
    assert len(gw.completions(sid)) == 1


def test_no_max_tokens_asked_is_left_to_the_server(tmp_path: Path) -> None:
    """A call without an output budget is never refused for it: vLLM uses the room left itself."""
    fake = make_fake_backend("vllm", max_model_len=10_000, context_checks="0.32")
    with serve(fake) as srv:
        gw = start_gateway(srv.url, tmp_path)
        try:
            sid = gw.new_session(task_id="fit")
            assert raw_call(gw.url, "chat", sid, False).status_code == 200
            (record,) = gw.completions(sid)
            assert "max_tokens" not in record.upstream_request and FLAG_MAX_TOKENS_CLAMPED not in record.flags
            assert fake.tokenize_requests == []
        finally:
            gw.server.stop()
