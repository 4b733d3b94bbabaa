"""The engine behind a real loopback server, driven by the official `openai` SDK (vLLM wire fields)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from polar.engine import Engine
from tests.engine_support import TEST_CONTEXT, reference_logprobs, tiny_server
from tests.fakes.server import ServerThread

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
VLLM = {"return_token_ids": True, "logprobs": True, "top_logprobs": 0}


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Engine, ServerThread]]:
    with tiny_server() as pair:
        yield pair


@pytest.fixture(scope="module")
def client(served: tuple[Engine, ServerThread]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key="unused", max_retries=0)


def _chat(client: openai.OpenAI, engine: Engine, **kw: Any) -> Any:
    extra = {**VLLM, **kw.pop("extra_body", {})}
    return client.chat.completions.create(
        model=engine.name, messages=kw.pop("messages", MESSAGES), extra_body=extra, **kw
    )


def _raw(resp: Any) -> dict[str, Any]:
    return resp.model_dump()


def test_chat_returns_vllm_token_fields(client: openai.OpenAI, served: tuple[Engine, ServerThread]) -> None:
    engine, srv = served
    resp = _chat(client, engine, max_tokens=12, seed=1, extra_body={"return_tokens_as_token_ids": True})
    body = _raw(resp)
    choice = body["choices"][0]
    prompt_ids = httpx.post(srv.url + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert body["prompt_token_ids"] == prompt_ids
    assert len(choice["token_ids"]) == 12 == body["usage"]["completion_tokens"]
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    entries = choice["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(e["top_logprobs"] == [] and e["logprob"] <= 0 for e in entries)
    assert choice["finish_reason"] == "length"
    assert body["policy_version"] == engine.policy_version
    assert body["polar_flags"] == []
    assert choice["message"]["content"]  # gibberish, but text


def test_logprobs_match_a_forward_pass_under_the_same_processing(
    client: openai.OpenAI, served: tuple[Engine, ServerThread]
) -> None:
    engine, _ = served
    for temperature, top_k, top_p in [
        (1.0, 0, 1.0),
        (0.7, 40, 1.0),
        (1.3, 0, 0.9),
        (0.8, 100, 0.95),
        (0.0, 0, 1.0),
    ]:
        body = _raw(
            _chat(
                client,
                engine,
                max_tokens=8,
                seed=7,
                temperature=temperature,
                top_p=top_p,
                extra_body={"top_k": top_k},
            )
        )
        choice = body["choices"][0]
        got = [e["logprob"] for e in choice["logprobs"]["content"]]
        want = reference_logprobs(
            engine.model,
            body["prompt_token_ids"],
            choice["token_ids"],
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
        )
        assert got == pytest.approx(want, abs=2e-3), (temperature, top_k, top_p)


def test_seeded_requests_reproduce_and_seeds_differ(
    client: openai.OpenAI, served: tuple[Engine, ServerThread]
) -> None:
    engine, _ = served
    a = _raw(_chat(client, engine, max_tokens=10, seed=123))["choices"][0]
    b = _raw(_chat(client, engine, max_tokens=10, seed=123))["choices"][0]
    c = _raw(_chat(client, engine, max_tokens=10, seed=124))["choices"][0]
    assert a["token_ids"] == b["token_ids"]
    assert a["message"]["content"] == b["message"]["content"]
    assert a["token_ids"] != c["token_ids"]


def test_n_choices_are_seed_plus_index(client: openai.OpenAI, served: tuple[Engine, ServerThread]) -> None:
    engine, _ = served
    body = _raw(_chat(client, engine, max_tokens=6, seed=40, n=3))
    ids = [c["token_ids"] for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert len({tuple(x) for x in ids}) == 3
    for i in range(3):
        single = _raw(_chat(client, engine, max_tokens=6, seed=40 + i))["choices"][0]
        assert single["token_ids"] == ids[i]
    assert body["usage"]["completion_tokens"] == 18


def test_stop_string_truncates_text_and_reports_it(
    client: openai.OpenAI, served: tuple[Engine, ServerThread]
) -> None:
    engine, _ = served
    full = _raw(_chat(client, engine, max_tokens=30, seed=5))["choices"][0]
    text = full["message"]["content"]
    stop = text[12:15]
    cut = text.index(stop)
    got = _raw(_chat(client, engine, max_tokens=30, seed=5, stop=[stop]))["choices"][0]
    assert got["finish_reason"] == "stop"
    assert got["stop_reason"] == stop
    assert got["message"]["content"] == text[:cut]
    assert got["token_ids"] == full["token_ids"][: len(got["token_ids"])]
    assert len(got["token_ids"]) < 30


def test_streaming_carries_the_same_tokens_as_a_whole_answer(
    client: openai.OpenAI, served: tuple[Engine, ServerThread]
) -> None:
    engine, _ = served
    whole = _raw(_chat(client, engine, max_tokens=15, seed=9))
    chunks = list(
        _chat(client, engine, max_tokens=15, seed=9, stream=True, stream_options={"include_usage": True})
    )
    raw = [c.model_dump() for c in chunks]
    assert raw[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    ids = [t for c in raw for ch in c["choices"] for t in (ch.get("token_ids") or [])]
    text = "".join(ch["delta"].get("content") or "" for c in raw for ch in c["choices"])
    lps = [
        e["logprob"] for c in raw for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]
    ]
    assert ids == whole["choices"][0]["token_ids"]
    assert text == whole["choices"][0]["message"]["content"]
    assert lps == pytest.approx([e["logprob"] for e in whole["choices"][0]["logprobs"]["content"]], abs=1e-5)
    assert raw[-1]["usage"]["completion_tokens"] == 15
    finals = [ch for c in raw for ch in c["choices"] if ch["finish_reason"]]
    assert [f["finish_reason"] for f in finals] == ["length"]
    assert all(c["policy_version"] == engine.policy_version for c in raw)


def test_open_thought_in_prompt_becomes_reasoning(
    client: openai.OpenAI, served: tuple[Engine, ServerThread]
) -> None:
    engine, _ = served
    messages = [*MESSAGES, {"role": "assistant", "content": "<think>\nLet me see"}]
    body = _raw(
        _chat(
            client,
            engine,
            messages=messages,
            max_tokens=6,
            seed=3,
            extra_body={"continue_final_message": True, "add_generation_prompt": False},
        )
    )
    msg = body["choices"][0]["message"]
    assert msg["content"] is None
    assert msg["reasoning_content"] and msg["reasoning"] == msg["reasoning_content"]
    assert engine.tokenizer.decode(body["choices"][0]["token_ids"]) == msg["reasoning_content"]


def test_thinking_disabled_is_all_content(client: openai.OpenAI, served: tuple[Engine, ServerThread]) -> None:
    engine, _ = served
    body = _raw(
        _chat(
            client,
            engine,
            max_tokens=6,
            seed=3,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
    )
    assert "<think>\n\n</think>" in engine.tokenizer.decode(body["prompt_token_ids"])
    assert body["choices"][0]["message"]["reasoning_content"] is None
    assert body["choices"][0]["message"]["content"]


def test_completions_with_token_prompt(client: openai.OpenAI, served: tuple[Engine, ServerThread]) -> None:
    engine, _ = served
    prompt = engine.tokenizer.encode("Once upon a time")
    resp = client.completions.create(
        model=engine.name,
        prompt=prompt,
        max_tokens=5,
        seed=2,
        logprobs=0,
        extra_body={"return_token_ids": True},
    )
    body = resp.model_dump()
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == prompt
    assert len(choice["token_ids"]) == 5
    want = reference_logprobs(engine.model, prompt, choice["token_ids"])
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(want, abs=2e-3)
    assert body["policy_version"] == engine.policy_version


def test_models_health_and_tokenize(served: tuple[Engine, ServerThread]) -> None:
    engine, srv = served
    models = httpx.get(srv.url + "/v1/models").json()
    assert models["data"][0]["id"] == engine.name
    assert models["data"][0]["max_model_len"] == TEST_CONTEXT
    assert httpx.get(srv.url + "/health").status_code == 200
    tok = httpx.post(srv.url + "/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert tok["tokens"] == engine.tokenizer.encode("hello world")
    assert "".join(tok["token_strs"]) == "hello world"
    assert (
        httpx.post(srv.url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "hello world"
    )


# ---- failures: vLLM's envelope, and the server keeps serving ---------------------------------------------


def test_prompt_longer_than_context_is_vllms_400(
    client: openai.OpenAI, served: tuple[Engine, ServerThread]
) -> None:
    engine, _ = served
    long = [{"role": "user", "content": "word " * (TEST_CONTEXT + 10)}]
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, engine, messages=long, max_tokens=5)
    err = info.value.body
    assert isinstance(err, dict)
    assert err["type"] == "BadRequestError" and err["code"] == 400
    assert err["message"].startswith(f"This model's maximum context length is {TEST_CONTEXT} tokens.")
    assert err["param"] == "input_tokens"
    # prompt fits, prompt + max_tokens does not
    fits = [{"role": "user", "content": "word " * (TEST_CONTEXT - 100)}]
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, engine, messages=fits, max_tokens=500)
    assert "context length is only" in str(info.value)
    assert _chat(client, engine, max_tokens=2).choices[0].finish_reason == "length"


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)
    assert info.value.body == {
        "message": "The model `no-such-model` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 3}, "messages"),
        ({"messages": MESSAGES, "temperature": "hot"}, "temperature"),
        ({"messages": [{"content": "no role"}]}, "messages.0.role"),
        ({"messages": MESSAGES, "top_p": 0}, "top_p"),
        ({"messages": MESSAGES, "n": 0}, "n"),
        ({"messages": MESSAGES, "presence_penalty": 0.5}, "presence_penalty"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages.0.content",
        ),
    ],
)
def test_malformed_requests_are_400_naming_the_field(
    served: tuple[Engine, ServerThread], body: dict[str, Any], param: str
) -> None:
    engine, srv = served
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": engine.name, **body})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "BadRequestError"
    assert httpx.get(srv.url + "/health").status_code == 200


def test_invalid_json_and_unknown_route(served: tuple[Engine, ServerThread]) -> None:
    _, srv = served
    r = httpx.post(
        srv.url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = httpx.get(srv.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
