"""The upstream clients against the fake inference server on real loopback ports: data, flags, errors."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest

from polar.gateway.backends import BackendOptions, OpenAIBackend, SGLangBackend, VLLMBackend, make_backend
from polar.gateway.backends.base import Backend, float_list, int_list
from polar.gateway.backends.http import context_numbers, error_detail, is_context_overflow, map_status
from polar.gateway.canonical import CanonicalRequest
from polar.gateway.errors import GatewayError
from polar.store.records import (
    FLAG_LOGPROB_MISMATCH,
    FLAG_NO_LOGPROBS,
    FLAG_NO_PROMPT_IDS,
    FLAG_NO_RESPONSE_IDS,
    FLAG_NOT_TRAINABLE,
    FLAG_TOOL_PARSE_ERROR,
)
from tests.fakes.chatml import IM_END, FakeTokenizer, assistant_text, logprob
from tests.fakes.fake_vllm import FakeInferenceServer, Reply, make_fake_backend
from tests.fakes.server import ServerThread, free_port
from tests.fakes.tcp_proxy import DroppingProxy

TOK = FakeTokenizer()
KINDS = ("vllm", "sglang", "openai")
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
FAST = BackendOptions(retries=2, retry_backoff_s=0.01, timeout_s=10.0)
MISSING_ALL = (FLAG_NO_PROMPT_IDS, FLAG_NO_RESPONSE_IDS, FLAG_NO_LOGPROBS, FLAG_NOT_TRAINABLE)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, tuple[FakeInferenceServer, str]]]:
    apps = {kind: make_fake_backend(kind) for kind in KINDS}
    threads = [ServerThread(app).start() for app in apps.values()]
    try:
        yield {kind: (app, t.url) for (kind, app), t in zip(apps.items(), threads, strict=True)}
    finally:
        for t in threads:
            t.stop()


def fake(
    servers: dict[str, Any], kind: str, script: Any = None, **faults: Any
) -> tuple[FakeInferenceServer, str]:
    app, url = servers[kind]
    app.reset(script, **faults)
    return app, url


@asynccontextmanager
async def client(kind: str, url: str, options: BackendOptions = FAST) -> AsyncIterator[Backend]:
    backend = make_backend(kind, url, options)
    await backend.start()
    try:
        yield backend
    finally:
        await backend.aclose()


def request(content: str = "hello", **params: Any) -> CanonicalRequest:
    return CanonicalRequest(
        model="harness-model", messages=[{"role": "user", "content": content}], tools=TOOLS, params=params
    )


async def call(
    kind: str, url: str, req: CanonicalRequest | None = None, options: BackendOptions = FAST
) -> Any:
    async with client(kind, url, options) as b:
        return await b.complete(b.build_body(req or request(), "served"))


async def failure(
    kind: str, url: str, req: CanonicalRequest | None = None, options: BackendOptions = FAST
) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        await call(kind, url, req, options)
    return info.value


# ---- bodies ----


def test_build_body_per_kind() -> None:
    req = CanonicalRequest(
        model="harness-model",
        messages=[{"role": "user", "content": "x"}],
        tools=TOOLS,
        tool_choice="auto",
        params={
            "temperature": 0.7,
            "max_tokens": 64,
            "logprobs": False,
            "stream_options": {"include_usage": True},
        },
        stream=True,
        render={"never": "upstream"},
    )
    common = {
        "model": "served",
        "messages": req.messages,
        "tools": TOOLS,
        "tool_choice": "auto",
        "temperature": 0.7,
        "max_tokens": 64,
        "stream": False,
    }
    # A streamed request is streamed upstream, with the usage chunk asked for (the harness's own
    # stream_options are not forwarded); SGLang refuses its training fields on streams, so it is not.
    streamed = {**common, "stream": True, "stream_options": {"include_usage": True}}
    assert make_backend("openai", "http://h/v1").build_body(req, "served") == {**streamed, "logprobs": False}
    assert make_backend("vllm", "http://h").build_body(req, "served") == {
        **streamed,
        "return_token_ids": True,
        "logprobs": True,
        "top_logprobs": 0,
    }
    assert make_backend("sglang", "http://h").build_body(req, "served") == {
        **common,
        "return_prompt_token_ids": True,
        "return_meta_info": True,
        "logprobs": True,
        "top_logprobs": 0,
    }
    bare = make_backend("vllm", "http://h").build_body(CanonicalRequest(model="m", messages=[]), "s")
    assert "tools" not in bare and "tool_choice" not in bare


def test_make_backend_kinds_and_urls() -> None:
    def base(kind: str, url: str) -> str:
        backend = make_backend(kind, url)
        assert isinstance(backend, OpenAIBackend)
        return backend.http.base_url

    assert isinstance(make_backend("vllm", "http://h:1"), VLLMBackend)
    assert isinstance(make_backend("sglang", "http://h:1"), SGLangBackend)
    assert base("vllm", "http://h:1/v1/") == "http://h:1"  # /tokenize lives at the root
    assert base("sglang", "http://h:1") == "http://h:1"
    assert base("openai", "http://h:1") == "http://h:1/v1"
    assert base("openai", "https://api.x/v1beta/openai") == "https://api.x/v1beta/openai"
    with pytest.raises(ValueError, match="unknown backend kind 'tgi'"):
        make_backend("tgi", "http://h")


def test_id_and_logprob_lists_are_checked_whole() -> None:
    assert int_list([1, 151645]) == [1, 151645] and int_list([]) == []
    for bad in ([1, 2.0], [1, "2"], [1, None], [[1]], "123", None, {"a": 1}):
        assert int_list(bad) is None
    assert float_list([-0.5, 0, -9999.0]) == [-0.5, 0, -9999.0]
    for bad_lp in ([-0.5, None], ["-0.5"], [[-0.5]]):
        assert float_list(bad_lp) is None


async def test_unencodable_request_is_the_callers_fault(servers: Any) -> None:
    app, url = fake(servers, "vllm")
    err = await failure("vllm", url, request(seed=2**70))
    assert err.kind == "invalid_request" and "cannot be sent upstream as JSON" in err.message
    assert app.calls == 0


# ---- token data read exactly ----


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_ids_and_logprobs_read_exactly(servers: Any, kind: str) -> None:
    reply = Reply(content="let me look", reasoning="plan: ls", tool_calls=[("bash", '{"cmd": "ls"}')])
    app, url = fake(servers, kind, [reply])
    req = request("list the files", max_tokens=500, temperature=0.0)
    async with client(kind, url) as b:
        body = b.build_body(req, "served")
        comp = await b.complete(body)
    assert app.requests == [body]  # the stored body is exactly what went upstream
    sampled = [*TOK.encode(assistant_text(reply.content, reply.reasoning, reply.tool_calls)), IM_END]
    assert comp.prompt_ids == TOK.encode(TOK.render(req.messages, TOOLS))
    assert comp.response_ids == sampled
    assert comp.response_logprobs == [logprob(i, t) for i, t in enumerate(sampled)]
    assert comp.flags == ()
    assert comp.content == "let me look" and comp.reasoning == "plan: ls"
    assert [(c.name, c.arguments) for c in comp.tool_calls] == [("bash", '{"cmd": "ls"}')]
    assert comp.tool_calls[0].id == "call_1_0"
    assert comp.finish_reason == "tool_calls"
    assert (comp.prompt_tokens, comp.completion_tokens) == (len(comp.prompt_ids), len(sampled))
    assert comp.id == "chatcmpl-fake-1" and comp.model == "served" and comp.created == 1_700_000_001


async def test_openai_kind_has_no_token_data_and_says_so(servers: Any) -> None:
    app, url = fake(servers, "openai", [Reply(content="fine", reasoning="hmm")])
    comp = await call("openai", url)
    assert comp.content == "fine" and comp.reasoning == "hmm" and comp.finish_reason == "stop"
    assert comp.prompt_ids is None and comp.response_ids is None and comp.response_logprobs is None
    assert comp.flags == MISSING_ALL
    assert "return_token_ids" not in app.requests[0] and "logprobs" not in app.requests[0]


async def test_api_key_is_sent_as_bearer(servers: Any) -> None:
    app, url = fake(servers, "openai")
    await call("openai", url, options=BackendOptions(api_key="sk-test"))
    assert app.last_headers["authorization"] == "Bearer sk-test"
    assert app.last_headers["content-type"] == "application/json"


async def test_length_finish_keeps_the_truncated_ids(servers: Any) -> None:
    _, url = fake(servers, "vllm", [Reply(content="a long answer")])
    comp = await call("vllm", url, request(max_tokens=4))
    assert comp.finish_reason == "length"
    assert comp.response_ids == TOK.encode("a lo") and len(comp.response_logprobs) == 4
    assert comp.content == "a lo" and comp.flags == ()


async def test_vllm_engine_extras(servers: Any) -> None:
    _, url = fake(
        servers, "vllm", [Reply(content="x", flags=["tool_call_parse_error", "custom"])], policy_version=12
    )
    comp = await call("vllm", url)
    assert comp.policy_version == 12
    assert comp.flags == (FLAG_TOOL_PARSE_ERROR, "custom")


async def test_sglang_weight_version_and_empty_content(servers: Any) -> None:
    _, url = fake(servers, "sglang", [Reply(tool_calls=[("bash", "{}")])], policy_version=4)
    comp = await call("sglang", url)
    assert comp.policy_version == 4 and comp.content is None and comp.finish_reason == "tool_calls"
    _, url = fake(servers, "sglang")
    assert (await call("sglang", url)).policy_version is None  # weight_version "default"


async def test_vllm_older_reasoning_content_field(servers: Any) -> None:
    def rename(body: dict[str, Any]) -> dict[str, Any]:
        msg = body["choices"][0]["message"]
        msg["reasoning_content"] = msg.pop("reasoning")
        return body

    _, url = fake(servers, "vllm", [Reply(content="a", reasoning="why")], transform=rename)
    assert (await call("vllm", url)).reasoning == "why"


# ---- flags ----


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_missing_token_data_is_flagged_not_repaired(servers: Any, kind: str) -> None:
    _, url = fake(servers, kind, no_token_ids=True)
    comp = await call(kind, url)
    assert comp.content == "You said: hello"
    assert comp.prompt_ids is None and comp.response_ids is None and comp.response_logprobs is None
    assert comp.flags == MISSING_ALL
    assert comp.prompt_tokens > 0  # usage still read


def _drop_last_logprob(body: dict[str, Any]) -> dict[str, Any]:
    body["choices"][0]["logprobs"]["content"].pop()
    return body


def _string_ids(body: dict[str, Any]) -> dict[str, Any]:
    body["prompt_token_ids"] = [str(i) for i in body["prompt_token_ids"]]
    return body


def _null_logprob(body: dict[str, Any]) -> dict[str, Any]:
    body["choices"][0]["logprobs"]["content"][0]["logprob"] = None
    return body


def _no_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    body["choices"][0]["logprobs"] = None
    return body


@pytest.mark.parametrize(
    ("transform", "expected"),
    [
        (_drop_last_logprob, (FLAG_LOGPROB_MISMATCH, FLAG_NOT_TRAINABLE)),
        (_string_ids, (FLAG_NO_PROMPT_IDS, FLAG_NOT_TRAINABLE)),
        (_null_logprob, (FLAG_NO_LOGPROBS, FLAG_NOT_TRAINABLE)),
        (_no_logprobs, (FLAG_NO_LOGPROBS, FLAG_NOT_TRAINABLE)),
    ],
)
async def test_inconsistent_vllm_token_data_is_flagged(
    servers: Any, transform: Any, expected: tuple[str, ...]
) -> None:
    _, url = fake(servers, "vllm", transform=transform)
    assert (await call("vllm", url)).flags == expected


def _sglang_bad_entry(body: dict[str, Any]) -> dict[str, Any]:
    body["choices"][0]["meta_info"]["output_token_logprobs"][0] = [-0.5]
    return body


def _sglang_null_logprob(body: dict[str, Any]) -> dict[str, Any]:
    body["choices"][0]["meta_info"]["output_token_logprobs"][0][0] = None
    return body


@pytest.mark.parametrize(
    ("transform", "expected"),
    [
        (_sglang_bad_entry, (FLAG_NO_RESPONSE_IDS, FLAG_NO_LOGPROBS, FLAG_NOT_TRAINABLE)),
        (_sglang_null_logprob, (FLAG_NO_LOGPROBS, FLAG_NOT_TRAINABLE)),
    ],
)
async def test_inconsistent_sglang_token_data_is_flagged(
    servers: Any, transform: Any, expected: tuple[str, ...]
) -> None:
    _, url = fake(servers, "sglang", transform=transform)
    assert (await call("sglang", url)).flags == expected


@pytest.mark.parametrize("kind", KINDS)
async def test_tool_arguments_that_are_not_json_are_flagged_and_kept(servers: Any, kind: str) -> None:
    _, url = fake(servers, kind, [Reply(tool_calls=[("bash", '{"cmd": "ls"'), ("bash", "{}")])])
    comp = await call(kind, url)
    assert [c.arguments for c in comp.tool_calls] == ['{"cmd": "ls"', "{}"]
    assert FLAG_TOOL_PARSE_ERROR in comp.flags
    if kind != "openai":
        assert comp.flags == (FLAG_TOOL_PARSE_ERROR,)  # still trainable: the model did sample these tokens


async def test_tool_arguments_sent_as_an_object_become_json_text(servers: Any) -> None:
    def as_object(body: dict[str, Any]) -> dict[str, Any]:
        body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] = {"cmd": "ls"}
        return body

    _, url = fake(servers, "vllm", [Reply(tool_calls=[("bash", "{}")])], transform=as_object)
    comp = await call("vllm", url)
    assert comp.tool_calls[0].arguments == '{"cmd":"ls"}' and FLAG_TOOL_PARSE_ERROR not in comp.flags


async def test_stop_with_tool_calls_reads_as_tool_calls(servers: Any) -> None:
    # vLLM answers a named tool_choice with finish_reason "stop" although it called the tool.
    _, url = fake(servers, "vllm", [Reply(tool_calls=[("bash", "{}")], finish_reason="stop")])
    assert (await call("vllm", url)).finish_reason == "tool_calls"


# ---- shape-less answers ----


@pytest.mark.parametrize(
    ("transform", "message"),
    [
        (lambda b: [b], "not an object (list)"),
        (lambda b: {**b, "choices": []}, "no `choices`"),
        (lambda b: {**b, "choices": ["x"]}, "`choices[0]` is not an object"),
        (lambda b: {**b, "choices": [{"index": 0}]}, "no `choices[0].message`"),
        (lambda b: {**b, "choices": [{"message": {"content": 5}}]}, "`message.content` is not a string"),
        (lambda b: {**b, "choices": [{"message": {"tool_calls": {}}}]}, "`message.tool_calls` is not a list"),
        (
            lambda b: {**b, "choices": [{"message": {"tool_calls": [{"function": {}}]}}]},
            "`message.tool_calls[0].function.name`",
        ),
        (
            lambda b: {**b, "choices": [{"message": {}, "finish_reason": "weird"}]},
            "unknown finish_reason 'weird'",
        ),
        (lambda b: {**b, "choices": [{"message": {}, "finish_reason": "abort"}]}, "aborted the generation"),
    ],
)
async def test_shapeless_answers_are_upstream_errors_naming_the_field(
    servers: Any, transform: Any, message: str
) -> None:
    _, url = fake(servers, "vllm", transform=transform)
    err = await failure("vllm", url)
    assert err.kind == "upstream_error" and err.status == 502
    assert message in err.message


async def test_non_json_answer(servers: Any) -> None:
    _, url = fake(servers, "vllm", garbage=True)
    err = await failure("vllm", url)
    assert err.kind == "upstream_error" and "HTTP 200 with a body that is not JSON" in err.message
    assert "this is not JSON" in err.message


# ---- error mapping ----


async def test_context_overflow_vllm_prompt_too_long(servers: Any) -> None:
    _, url = fake(servers, "vllm", max_model_len=50)
    req = request("x" * 100)
    n = len(TOK.encode(TOK.render(req.messages, TOOLS)))
    err = await failure("vllm", url, req)
    assert err.kind == "context_length" and err.status == 400
    assert (err.prompt_tokens, err.max_tokens) == (n, 50)
    assert err.message.startswith("This model's maximum context length is 50 tokens.")


async def test_context_overflow_vllm_max_tokens_too_large(servers: Any) -> None:
    req = request("x", max_tokens=10_000)
    n = len(TOK.encode(TOK.render(req.messages, TOOLS)))
    _, url = fake(servers, "vllm", max_model_len=n + 100)
    err = await failure("vllm", url, req)
    assert err.kind == "context_length" and (err.prompt_tokens, err.max_tokens) == (n, n + 100)


async def test_context_overflow_sglang(servers: Any) -> None:
    _, url = fake(servers, "sglang", max_model_len=10)
    err = await failure("sglang", url)
    assert err.kind == "context_length" and err.max_tokens == 10 and err.prompt_tokens is not None


async def test_context_overflow_openai(servers: Any) -> None:
    _, url = fake(servers, "openai", max_model_len=10)
    err = await failure("openai", url)
    assert err.kind == "context_length" and err.max_tokens == 10 and err.prompt_tokens is None


@pytest.mark.parametrize(
    ("message", "prompt", "maximum"),
    [
        (
            "This model's maximum context length is 8192 tokens. However, you requested 9064 tokens (9000 in the "
            "messages, 64 in the completion). Please reduce the length of the messages or completion.",
            9000,
            8192,
        ),
        (
            "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens in the messages, "
            "Please reduce the length of the messages.",
            5000,
            4096,
        ),
        (
            "This model's maximum context length is 32768 tokens. However, your request has 40000 input tokens. "
            "Please reduce the length of the input messages. None",
            40000,
            32768,
        ),
        (
            "'max_tokens' or 'max_completion_tokens' is too large: 64. This model's maximum context length is 8192 "
            "tokens and your request has 8150 input tokens (64 > 8192 - 8150).",
            8150,
            8192,
        ),
        (
            "This model's maximum context length is 32768 tokens. However, you requested 32000 output tokens and your "
            "prompt contains at least 769 input tokens, for a total of at least 32769 tokens. Please reduce the length "
            "of the input prompt or the number of requested output tokens. (parameter=input_tokens, value=769)",
            769,
            32768,
        ),
        (
            "You passed 9000 input tokens and requested 100 output tokens. However, the model's context length is only "
            "8192 tokens, resulting in a maximum input length of 8092 tokens. Please reduce the length of the input "
            "prompt.",
            9000,
            8192,
        ),
        (
            "You passed 90000 input characters and requested 100 output tokens. However, the model's context length is "
            "only 8192 tokens, resulting in a maximum input length of 8092 tokens (at most 40000 characters).",
            None,
            8192,
        ),
        (
            "The decoder prompt (length 12324) is longer than the maximum model length of 8192. Make sure that "
            "`max_model_len` is no smaller than the number of text tokens.",
            12324,
            8192,
        ),
        (
            "The input (204281 tokens) is longer than the model's context length (202752 tokens).",
            204281,
            202752,
        ),
        (
            "Requested token count exceeds the model's maximum context length of 4096 tokens. You requested a total of "
            "5000 tokens: 4000 tokens from the input messages and 1000 tokens for the completion.",
            4000,
            4096,
        ),
        (  # vLLM 0.32 and the polar engine: an output budget above the whole context
            "max_tokens=64000 cannot be greater than max_model_len=32768. Please request fewer output tokens. "
            "(parameter=max_tokens, value=64000)",
            None,
            32768,
        ),
    ],
)
def test_context_overflow_wordings(message: str, prompt: int | None, maximum: int) -> None:
    assert is_context_overflow(message)
    assert context_numbers(message) == (prompt, maximum)
    err = map_status(
        400, orjson.dumps({"error": {"message": message, "type": "BadRequestError", "code": 400}})
    )
    assert err.kind == "context_length" and (err.prompt_tokens, err.max_tokens) == (prompt, maximum)


def test_error_body_shapes() -> None:
    assert error_detail(b'{"error": {"message": "bad temp", "param": "temperature"}}') == (
        "bad temp",
        "temperature",
    )
    assert error_detail(
        b'{"object": "error", "message": "flat", "type": "BadRequestError", "code": 400}'
    ) == ("flat", None)
    assert error_detail(b'{"detail": "Not Found"}') == ("Not Found", None)
    assert error_detail(b'{"detail": [{"loc": ["body"], "msg": "x"}]}') == (
        '[{"loc":["body"],"msg":"x"}]',
        None,
    )
    assert error_detail(b'{"error": "plain"}') == ("plain", None)
    assert error_detail(b"<html>oops</html>") == ("'<html>oops</html>'", None)
    assert error_detail(b"") == ("(empty body)", None)


@pytest.mark.parametrize(
    ("status", "kind", "gateway_status"),
    [
        (400, "invalid_request", 400),
        (422, "invalid_request", 400),
        (404, "not_found", 404),
        (429, "rate_limit", 429),
        (413, "request_too_large", 413),
        (401, "upstream_error", 502),
        (409, "upstream_error", 502),  # a replay without the call: not the request's fault
        (500, "upstream_error", 502),
    ],
)
async def test_status_mapping_and_no_retry(servers: Any, status: int, kind: str, gateway_status: int) -> None:
    app, url = fake(servers, "vllm", status=status, error_message=f"upstream says {status}")
    err = await failure("vllm", url)
    assert (err.kind, err.status) == (kind, gateway_status)
    assert f"upstream says {status}" in err.message
    assert app.calls == 1  # 4xx and 500 are never retried


async def test_unknown_model_is_not_found(servers: Any) -> None:
    _, url = fake(servers, "vllm", model="the-real-model")
    err = await failure("vllm", url)
    assert err.kind == "not_found" and err.message == "The model `served` does not exist."


@pytest.mark.parametrize("status", [502, 503, 504])
async def test_gateway_statuses_are_retried_then_fail(servers: Any, status: int) -> None:
    app, url = fake(servers, "vllm", status=status)
    err = await failure("vllm", url)
    assert err.kind == "upstream_error" and f"HTTP {status}" in err.message
    assert app.calls == FAST.retries + 1


async def test_retries_succeed_after_fail_first_n(servers: Any) -> None:
    app, url = fake(servers, "sglang", fail_first_n=2)
    comp = await call("sglang", url)
    assert comp.content == "You said: hello" and app.calls == 3 and comp.flags == ()


async def test_retries_are_bounded(servers: Any) -> None:
    app, url = fake(servers, "vllm", fail_first_n=3)
    err = await failure("vllm", url)
    assert err.kind == "upstream_error" and "HTTP 502" in err.message and app.calls == 3
    app.reset(fail_first_n=1)
    await failure("vllm", url, options=BackendOptions(retries=0))
    assert app.calls == 1


async def test_timeout(servers: Any) -> None:
    _, url = fake(servers, "vllm", delay_s=1.0)
    err = await failure("vllm", url, options=BackendOptions(timeout_s=0.1, retries=2))
    assert err.kind == "timeout" and err.status == 504 and "within 0.1 s" in err.message


async def test_refused_connection() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    err = await failure("vllm", url)
    assert err.kind == "upstream_error" and err.message == f"inference server unreachable at {url}"


async def test_dropped_connections_are_retried_on_a_new_one(servers: Any) -> None:
    app, url = fake(servers, "vllm")
    port = int(url.rsplit(":", 1)[1])
    async with DroppingProxy(port, drop_first=2) as proxy:
        comp = await call("vllm", proxy.url)
        assert comp.content == "You said: hello" and proxy.connections == 3 and app.calls == 1
    async with DroppingProxy(port, drop_first=5) as proxy:
        err = await failure("vllm", proxy.url)
        assert err.kind == "upstream_error" and "dropped the connection" in err.message
        assert proxy.connections == 3


# ---- token counts, models, lifecycle ----


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_count_tokens_asks_the_server(servers: Any, kind: str) -> None:
    app, url = fake(servers, kind)
    req = request("count me", chat_template_kwargs={"enable_thinking": False})
    async with client(kind, url) as b:
        n = await b.count_tokens(req, "served")
        comp = await b.complete(b.build_body(req, "served"))
    assert n == len(comp.prompt_ids or []) == comp.prompt_tokens
    assert app.tokenize_requests == [
        {
            "model": "served",
            "messages": req.messages,
            "add_generation_prompt": True,
            "tools": TOOLS,
            "chat_template_kwargs": {"enable_thinking": False},
        }
    ]


async def test_count_tokens_openai_is_a_byte_estimate(servers: Any) -> None:
    _, url = fake(servers, "openai")
    req = request("count me")
    size = len(orjson.dumps(req.messages)) + len(orjson.dumps(TOOLS))
    async with client("openai", url) as b:
        assert await b.count_tokens(req, "served") == math.ceil(size / 4)


async def test_count_tokens_errors_map_too(servers: Any) -> None:
    _, url = fake(servers, "vllm", status=404)
    async with client("vllm", url) as b:
        with pytest.raises(GatewayError) as info:
            await b.count_tokens(request(), "served")
    assert info.value.kind == "not_found"
    _, url = fake(servers, "vllm", garbage=True)
    async with client("vllm", url) as b:
        with pytest.raises(GatewayError, match="not JSON"):
            await b.count_tokens(request(), "served")


@pytest.mark.parametrize("kind", KINDS)
async def test_list_models(servers: Any, kind: str) -> None:
    _, url = fake(servers, kind, model="policy-7b")
    async with client(kind, url) as b:
        assert await b.list_models() == ["policy-7b"]


async def test_client_starts_lazily_and_closes_cleanly(servers: Any) -> None:
    _, url = fake(servers, "vllm")
    b = make_backend("vllm", url, FAST)
    comp = await b.complete(b.build_body(request(), "served"))  # no start(): the pool opens on first use
    assert comp.content == "You said: hello"
    await b.aclose()
    await b.aclose()  # idempotent
    await b.start()
    await b.start()  # idempotent
    assert (await b.complete(b.build_body(request(), "served"))).flags == ()
    await b.aclose()


# ---- against our embedded engine (a real model behind vLLM's API) ----


@pytest.mark.slow
async def test_vllm_backend_reads_the_embedded_engine() -> None:
    from tests.engine_support import TEST_CONTEXT, tiny_server

    with tiny_server() as (engine, srv):
        async with client("vllm", srv.url) as b:
            req = CanonicalRequest(
                model="h", messages=[{"role": "user", "content": "Say hi."}], params={"max_tokens": 6}
            )
            comp = await b.complete(b.build_body(req, engine.name))
            assert comp.flags == () and comp.finish_reason == "length"
            assert comp.prompt_ids is not None and len(comp.prompt_ids) == comp.prompt_tokens
            assert comp.response_ids is not None and len(comp.response_ids) == 6 == comp.completion_tokens
            assert comp.response_logprobs is not None and len(comp.response_logprobs) == 6
            assert all(lp <= 0 for lp in comp.response_logprobs)
            assert comp.policy_version == engine.policy_version
            assert await b.count_tokens(req, engine.name) == comp.prompt_tokens
            assert await b.list_models() == [engine.name]
            long = CanonicalRequest(
                model="h", messages=[{"role": "user", "content": "word " * (TEST_CONTEXT + 10)}]
            )
            with pytest.raises(GatewayError) as info:
                await b.complete(b.build_body(long, engine.name))
            err = info.value
            assert err.kind == "context_length" and err.max_tokens == TEST_CONTEXT
            assert err.prompt_tokens is not None and err.prompt_tokens > TEST_CONTEXT


@pytest.mark.parametrize(
    ("content", "text"),
    [
        ([{"token": "<tool", "logprob": -0.1}, {"token": "_call>", "logprob": -0.2}], "<tool_call>"),
        ([], ""),
        ([{"token": "a"}, {"token": None}], None),
        ([{"token": "a"}, {"logprob": -1.0}], None),
        ([{"token": "a"}, "b"], None),
        ([{"token": "a"}, ["token"]], None),
        ([{"token": 7}], None),
        (None, None),
    ],
)
def test_vllm_sampled_text_is_the_tokens_joined_or_nothing(content: Any, text: str | None) -> None:
    """The sampled text (what tool-call checks read) is `logprobs.content[].token` joined, and nothing at all
    when any entry is not an object with a string token: never the pieces that happened to be readable."""
    backend = make_backend("vllm", "http://h")
    assert isinstance(backend, VLLMBackend)
    choice = {"token_ids": [1, 2], "logprobs": {"content": content}}
    assert backend.read_tokens({"prompt_token_ids": [3]}, choice).text == text
