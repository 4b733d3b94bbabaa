"""The fake inference server: its tokenizer and template, the prefix property, each kind's shape, each fault."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fakes.chatml import (
    BYTE_OFFSET,
    IM_END,
    IM_START,
    SPECIAL_TOKENS,
    FakeTokenizer,
    assistant_text,
    logprob,
)
from tests.fakes.fake_vllm import FakeInferenceServer, Reply, make_fake_backend, split_reasoning
from tests.fakes.server import ServerThread, serve

TOK = FakeTokenizer()
TOOLS = [
    {
        "type": "function",
        "function": {"name": "bash", "description": "run a command", "parameters": {"type": "object"}},
    }
]


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, tuple[FakeInferenceServer, ServerThread]]]:
    apps = {kind: make_fake_backend(kind) for kind in ("vllm", "sglang", "openai")}
    threads = {kind: ServerThread(app).start() for kind, app in apps.items()}
    try:
        yield {kind: (apps[kind], threads[kind]) for kind in apps}
    finally:
        for t in threads.values():
            t.stop()


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10) as c:
        yield c


def fake_of(
    servers: dict[str, Any], kind: str, script: Any = None, **faults: Any
) -> tuple[FakeInferenceServer, str]:
    app, thread = servers[kind]
    app.reset(script, **faults)
    return app, thread.url


VLLM_TRAINING = {"return_token_ids": True, "logprobs": True, "top_logprobs": 0}
SGLANG_TRAINING = {
    "return_prompt_token_ids": True,
    "return_meta_info": True,
    "logprobs": True,
    "top_logprobs": 0,
}


def chat(client: httpx.Client, url: str, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    return client.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": messages, **extra})


# ---- tokenizer and template ----


def test_encode_decode_round_trip_with_specials_and_unicode() -> None:
    text = "<|im_start|>user\nhé ✓ 日本<think>x</think><|im_end|>\n"
    ids = TOK.encode(text)
    assert ids[0] == IM_START and IM_END in ids
    assert SPECIAL_TOKENS["<think>"] in ids
    assert TOK.decode(ids) == text
    assert TOK.encode("ab") == [ord("a") + 1000, ord("b") + 1000]
    with pytest.raises(ValueError, match="unknown token id 5"):
        TOK.decode([5])


def test_render_matches_qwen_layout() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "list"}, {"type": "text", "text": " files"}]},
        {
            "role": "assistant",
            "content": "sure",
            "reasoning_content": "use ls",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd":"ls"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
        {"role": "tool", "tool_call_id": "c2", "content": "b.py"},
    ]
    text = TOK.render(messages, TOOLS)
    assert text.startswith("<|im_start|>system\nbe brief\n\n# Tools\n")
    assert '\n{"type": "function", "function": {"name": "bash"' in text
    assert "<|im_start|>user\nlist files<|im_end|>\n" in text
    assert (
        "<|im_start|>assistant\n<think>\nuse ls\n</think>\n\nsure\n"
        '<tool_call>\n{"name": "bash", "arguments": {"cmd":"ls"}}\n</tool_call><|im_end|>\n'
    ) in text
    assert (
        "<|im_start|>user\n<tool_response>\na.py\n</tool_response>\n<tool_response>\nb.py\n</tool_response><|im_end|>\n"
    ) in text
    assert text.endswith("<|im_start|>assistant\n")
    assert not TOK.render(messages[:2], None, add_generation_prompt=False).endswith("assistant\n")


def test_split_reasoning_like_a_think_parser() -> None:
    assert split_reasoning("<think>\nplan\n</think>\n\nanswer") == ("answer", "plan")
    assert split_reasoning("<think>\nunfinished pla") == (None, "unfinished pla")
    assert split_reasoning("plain") == ("plain", None)


_TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)  # no lone surrogates


@settings(max_examples=150, deadline=None)
@given(
    user=_TEXT,
    content=st.one_of(st.none(), _TEXT),
    reasoning=st.one_of(st.none(), _TEXT),
    calls=st.lists(st.tuples(_TEXT, _TEXT), max_size=3),
    tool_result=_TEXT,
)
def test_prefix_property_holds_for_any_text(
    user: str, content: str | None, reasoning: str | None, calls: list[tuple[str, str]], tool_result: str
) -> None:
    """encode(render(history + [the sampled turn] + more)) starts with prompt + sampled ids, for any text."""
    history = [{"role": "user", "content": user}]
    prompt = TOK.encode(TOK.render(history, TOOLS))
    sampled = [*TOK.encode(assistant_text(content, reasoning, calls)), IM_END]
    turn: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "reasoning_content": reasoning,
        "tool_calls": [{"function": {"name": n, "arguments": a}} for n, a in calls],
    }
    following: list[dict[str, Any]] = [*history, turn, {"role": "tool", "content": tool_result}]
    nxt = TOK.encode(TOK.render(following, TOOLS))
    assert nxt[: len(prompt) + len(sampled)] == prompt + sampled


# ---- the prefix property over HTTP, a harness-style tool loop ----


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_tool_loop_prompts_extend_previous_prompt_and_sampled_ids(
    servers: Any, client: httpx.Client, kind: str
) -> None:
    script = [
        Reply(reasoning="look first", tool_calls=[("bash", '{"cmd": "ls"}')]),
        Reply(
            content="two files", tool_calls=[("bash", '{"cmd":"cat a.py"}'), ("bash", '{"cmd": "cat b.py"}')]
        ),
        Reply(content="all done", reasoning="I have what I need"),
    ]
    fake, url = fake_of(servers, kind, script)
    extra = VLLM_TRAINING if kind == "vllm" else SGLANG_TRAINING
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "you are terse"},
        {"role": "user", "content": "hi"},
    ]
    previous: list[int] | None = None
    for turn in range(3):
        data = chat(client, url, messages, tools=TOOLS, **extra).json()
        choice = data["choices"][0]
        if kind == "vllm":
            prompt, sampled = data["prompt_token_ids"], choice["token_ids"]
        else:
            prompt = choice["prompt_token_ids"]
            sampled = [e[1] for e in choice["meta_info"]["output_token_logprobs"]]
        assert prompt == TOK.encode(TOK.render(messages, TOOLS))
        if previous is not None:
            assert prompt[: len(previous)] == previous
        previous = prompt + sampled
        assert sampled[-1] == IM_END
        messages.append(choice["message"])  # the harness sends the assistant message back unchanged
        for call in choice["message"].get("tool_calls") or []:
            messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": f"output of {call['id']}"}
            )
        assert choice["finish_reason"] == ("stop" if turn == 2 else "tool_calls")
    assert len(fake.requests) == 3


# ---- each kind's wire shape ----


def test_vllm_shape_and_token_fields_only_when_asked(servers: Any, client: httpx.Client) -> None:
    _, url = fake_of(servers, "vllm", [Reply(content="ok", reasoning="r")] * 2)
    msgs = [{"role": "user", "content": "x"}]
    plain = chat(client, url, msgs).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    assert plain["choices"][0]["logprobs"] is None
    data = chat(client, url, msgs, **VLLM_TRAINING).json()
    choice = data["choices"][0]
    ids = [*TOK.encode(assistant_text("ok", "r", [])), IM_END]
    assert choice["token_ids"] == ids
    assert data["prompt_token_ids"] == TOK.encode(TOK.render(msgs))
    assert [c["logprob"] for c in choice["logprobs"]["content"]] == [logprob(i, t) for i, t in enumerate(ids)]
    assert choice["logprobs"]["content"][-1]["bytes"] == list(b"<|im_end|>")
    assert choice["message"] == {"role": "assistant", "content": "ok", "reasoning": "r"}
    assert data["usage"] == {
        "prompt_tokens": len(data["prompt_token_ids"]),
        "completion_tokens": len(ids),
        "total_tokens": len(data["prompt_token_ids"]) + len(ids),
    }


def test_sglang_shape(servers: Any, client: httpx.Client) -> None:
    _fake, url = fake_of(servers, "sglang", [Reply(tool_calls=[("bash", "{}")])], policy_version=7)
    data = chat(client, url, [{"role": "user", "content": "x"}], tools=TOOLS, **SGLANG_TRAINING).json()
    choice = data["choices"][0]
    assert "prompt_token_ids" not in data
    assert choice["message"]["content"] == ""  # SGLang answers "" rather than null
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "bash", "arguments": "{}"}
    entries = choice["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in entries] == [*TOK.encode(assistant_text(None, None, [("bash", "{}")])), IM_END]
    assert all(e[0] == logprob(i, e[1]) and e[2] is None for i, e in enumerate(entries))
    assert choice["meta_info"]["finish_reason"] == {"type": "tool_calls", "matched": IM_END}
    assert data["metadata"] == {"weight_version": "7"}


def test_openai_shape_has_no_token_data_and_no_tokenize(servers: Any, client: httpx.Client) -> None:
    _, url = fake_of(servers, "openai")
    data = chat(client, url, [{"role": "user", "content": "hello there"}], **VLLM_TRAINING).json()
    choice = data["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "You said: hello there"}
    assert "prompt_token_ids" not in data and "token_ids" not in choice and "meta_info" not in choice
    assert client.post(f"{url}/tokenize", json={"messages": []}).status_code == 404


def test_tokenize_counts_exactly_the_chat_prompt(servers: Any, client: httpx.Client) -> None:
    fake, url = fake_of(servers, "vllm")
    msgs = [{"role": "user", "content": "count me"}]
    tok = client.post(f"{url}/tokenize", json={"model": "m", "messages": msgs, "tools": TOOLS}).json()
    data = chat(client, url, msgs, tools=TOOLS, **VLLM_TRAINING).json()
    assert tok["tokens"] == data["prompt_token_ids"] and tok["count"] == len(tok["tokens"])
    assert client.post(f"{url}/v1/tokenize", json={"prompt": "ab"}).json()["tokens"] == [1097, 1098]
    assert fake.tokenize_requests[0]["tools"] == TOOLS


def test_max_tokens_truncates_without_end_token(servers: Any, client: httpx.Client) -> None:
    _, url = fake_of(servers, "vllm", [Reply(content="a long answer", reasoning="think")])
    data = chat(client, url, [{"role": "user", "content": "x"}], max_tokens=5, **VLLM_TRAINING).json()
    choice = data["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["token_ids"] == TOK.encode("<think>\nthi")
    assert IM_END not in choice["token_ids"]
    assert choice["message"]["reasoning"] == "thi" and choice["message"]["content"] is None


def test_scripted_length_finish_drops_end_token(servers: Any, client: httpx.Client) -> None:
    _, url = fake_of(servers, "vllm", lambda body: Reply(content="cut", finish_reason="length"))
    data = chat(client, url, [{"role": "user", "content": "x"}], **VLLM_TRAINING).json()
    assert data["choices"][0]["token_ids"] == TOK.encode("cut")


def test_models_health_unknown_route_and_bad_bodies(servers: Any, client: httpx.Client) -> None:
    _fake, url = fake_of(servers, "vllm", model="served-model")
    assert client.get(f"{url}/health").status_code == 200
    card = client.get(f"{url}/v1/models").json()["data"][0]
    assert card["id"] == "served-model" and card["max_model_len"] == 131072
    assert client.get(f"{url}/nope").status_code == 404
    assert client.get(f"{url}/v1/chat/completions").status_code == 405
    r = client.post(f"{url}/v1/chat/completions", json={"model": "other", "messages": []})
    assert r.status_code == 404 and r.json()["error"]["message"] == "The model `other` does not exist."
    r = client.post(f"{url}/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and "JSON decode error" in r.json()["error"]["message"]
    r = client.post(f"{url}/v1/chat/completions", json={"model": "served-model"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = client.post(
        f"{url}/v1/chat/completions",
        json={"model": "served-model", "messages": [], "stream_options": {"include_usage": True}},
    )
    assert r.status_code == 400 and "only be defined when `stream=True`" in r.json()["error"]["message"]


def test_script_list_exhausted_is_a_clear_500(servers: Any, client: httpx.Client) -> None:
    _, url = fake_of(servers, "vllm", [Reply(content="only one")])
    assert chat(client, url, [{"role": "user", "content": "x"}]).status_code == 200
    r = chat(client, url, [{"role": "user", "content": "x"}])
    assert r.status_code == 500 and "script exhausted after 1" in r.json()["error"]["message"]


def test_policy_version_and_flags_like_the_embedded_engine(servers: Any, client: httpx.Client) -> None:
    _, url = fake_of(servers, "vllm", [Reply(content="x", flags=["tool_call_parse_error"])], policy_version=3)
    data = chat(client, url, [{"role": "user", "content": "x"}]).json()
    assert data["policy_version"] == 3 and data["polar_flags"] == ["tool_call_parse_error"]


# ---- faults ----


@pytest.mark.parametrize("kind", ["vllm", "sglang", "openai"])
def test_status_fault_answers_the_kinds_error_body(servers: Any, client: httpx.Client, kind: str) -> None:
    _, url = fake_of(servers, kind, status=429)
    r = chat(client, url, [{"role": "user", "content": "x"}])
    assert r.status_code == 429
    body = r.json()
    if kind == "vllm":
        assert body == {
            "error": {
                "message": "fake: too many requests, slow down",
                "type": "TooManyRequestsError",
                "param": None,
                "code": 429,
            }
        }
    elif kind == "sglang":
        assert (
            body["object"] == "error" and body["code"] == 429 and body["message"].startswith("fake: too many")
        )
    else:
        assert body["error"]["type"] == "invalid_request_error"


def test_faults_switch_at_run_time(servers: Any, client: httpx.Client) -> None:
    fake, url = fake_of(servers, "vllm")
    msgs = [{"role": "user", "content": "x"}]
    assert chat(client, url, msgs).status_code == 200
    fake.status = 503
    assert chat(client, url, msgs).status_code == 503
    fake.set(status=None, garbage=True)
    r = chat(client, url, msgs)
    assert r.status_code == 200 and r.headers["content-type"] == "text/html"
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(r.content)
    with pytest.raises(AttributeError, match="no fault named 'nope'"):
        fake.set(nope=1)
    assert fake.calls == 3 and len(fake.requests) == 1  # faulted calls never reach the handler


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_no_token_ids_fault(servers: Any, client: httpx.Client, kind: str) -> None:
    _, url = fake_of(servers, kind, no_token_ids=True)
    extra = VLLM_TRAINING if kind == "vllm" else SGLANG_TRAINING
    data = chat(client, url, [{"role": "user", "content": "x"}], **extra).json()
    choice = data["choices"][0]
    assert "prompt_token_ids" not in data and "prompt_token_ids" not in choice
    assert "token_ids" not in choice and "meta_info" not in choice
    assert choice["message"]["content"] == "You said: x"


def test_max_model_len_gives_vllms_exact_overflow_errors(servers: Any, client: httpx.Client) -> None:
    _, url = fake_of(servers, "vllm", max_model_len=40)
    msgs = [{"role": "user", "content": "x" * 50}]
    n = len(TOK.encode(TOK.render(msgs)))
    r = chat(client, url, msgs)
    assert r.status_code == 400
    assert r.json() == {
        "error": {
            "message": f"This model's maximum context length is 40 tokens. However, your request has {n} input "
            "tokens. Please reduce the length of the input messages.",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }
    short = [{"role": "user", "content": "x"}]
    m = len(TOK.encode(TOK.render(short)))
    r = chat(client, url, short, max_tokens=30)
    assert r.json()["error"]["message"] == (
        f"'max_tokens' or 'max_completion_tokens' is too large: 30. This model's maximum context length is 40 "
        f"tokens and your request has {m} input tokens (30 > 40 - {m})."
    )
    assert chat(client, url, short, max_tokens=5).status_code == 200


def test_max_model_len_sglang_wording(servers: Any, client: httpx.Client) -> None:
    _, url = fake_of(servers, "sglang", max_model_len=10)
    r = chat(client, url, [{"role": "user", "content": "x"}])
    assert r.status_code == 400
    assert "is longer than the model's context length (10 tokens)" in r.json()["message"]


def test_fail_first_n_then_ok(servers: Any, client: httpx.Client) -> None:
    fake, url = fake_of(servers, "vllm", fail_first_n=2)
    msgs = [{"role": "user", "content": "x"}]
    assert [chat(client, url, msgs).status_code for _ in range(3)] == [502, 502, 200]
    fake.set(fail_first_n=4, fail_status=503)
    assert chat(client, url, msgs).status_code == 503  # call 4 of 4 fails


def test_delay_then_answer(servers: Any, client: httpx.Client) -> None:
    _, url = fake_of(servers, "vllm", delay_s=0.05)
    assert chat(client, url, [{"role": "user", "content": "x"}]).status_code == 200


def test_transform_rewrites_successful_bodies(servers: Any, client: httpx.Client) -> None:
    _, url = fake_of(servers, "vllm", transform=lambda b: {**b, "choices": []})
    assert chat(client, url, [{"role": "user", "content": "x"}]).json()["choices"] == []


def test_requests_are_recorded_verbatim(servers: Any, client: httpx.Client) -> None:
    fake, url = fake_of(servers, "vllm")
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0.5, "seed": 1}
    client.post(f"{url}/v1/chat/completions", json=body)
    assert fake.requests == [body]


def test_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        make_fake_backend("tgi")


def test_serve_helper_runs_a_fresh_fake() -> None:
    with serve(make_fake_backend("openai")) as srv, httpx.Client() as c:
        assert c.get(f"{srv.url}/v1/models").json()["data"][0]["id"] == "fake-model"


def test_the_fake_prefix_cache_counts_like_vllm() -> None:
    """Leading full blocks already seen are hits; a prompt's blocks are cached after it (benchmarks)."""
    from tests.fakes.prefix_cache import PrefixCache

    cache = PrefixCache(block=4, capacity_blocks=3)
    assert cache.lookup(list(range(10))) == 0  # blocks [0-3], [4-7] cached; 2 tokens are no full block
    assert cache.lookup([*range(8), 99, 98, 97, 96]) == 8
    assert cache.lookup([5, *range(1, 8)]) == 0  # the same tokens after another first block: a miss
    assert (cache.queries, cache.hits) == (30, 8)
    assert cache.lookup(list(range(8))) == 0  # three blocks were cached since: the oldest went first
    assert b"vllm:prefix_cache_hits_total" in cache.metrics("m")


# ---- /v1/completions with token-id prompts (what a gateway rendering prompts itself sends) ----


def test_completions_answers_token_ids_and_logprobs_in_vllm_s_shape(
    servers: dict[str, Any], client: httpx.Client
) -> None:
    _, url = fake_of(servers, "vllm", [Reply(content="ok")])
    body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 8, "return_token_ids": True, "logprobs": 0}
    r = client.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == [ord("o") + BYTE_OFFSET, ord("k") + BYTE_OFFSET, IM_END]
    assert choice["prompt_token_ids"] == [5, 6, 7]
    assert len(choice["logprobs"]["token_logprobs"]) == 3
    assert choice["finish_reason"] == "stop"
    assert r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_completions_cut_by_max_tokens_has_no_end_of_turn(
    servers: dict[str, Any], client: httpx.Client
) -> None:
    _, url = fake_of(servers, "vllm", [Reply(content="a longer answer")])
    body = {"prompt": [1], "max_tokens": 4, "return_token_ids": True}
    choice = client.post(url + "/v1/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 4 and IM_END not in choice["token_ids"]
    assert choice["logprobs"] is None  # not asked for


@pytest.mark.parametrize("prompt", ["text", [], [1, -2], [1, "2"]])
def test_completions_refuses_a_prompt_that_is_not_token_ids(
    servers: dict[str, Any], client: httpx.Client, prompt: Any
) -> None:
    _, url = fake_of(servers, "vllm")
    r = client.post(url + "/v1/completions", json={"prompt": prompt})
    assert r.status_code == 400 and "token ids" in r.text


@pytest.mark.parametrize("kind", ["sglang", "openai"])
def test_completions_is_served_by_the_vllm_kind_only(
    servers: dict[str, Any], client: httpx.Client, kind: str
) -> None:
    _, url = fake_of(servers, kind)
    assert client.post(url + "/v1/completions", json={"prompt": [1]}).status_code == 404


def test_a_gateway_rendering_prompts_itself_runs_over_the_fake(tmp_path: Path) -> None:
    """bench/soak.py's `--render gateway` runs: the gateway renders with Qwen3's template, sends ids to the
    fake's /v1/completions, reads the answer back and continues the session's chain on the next call."""
    from polar.engine.tiny import qwen_tokenizer_dir
    from polar.trajectory import build
    from tests.conftest import start_gateway

    fake = make_fake_backend("vllm", model="m")
    with serve(fake) as srv:
        gw = start_gateway(
            srv.url, tmp_path, served_model="m", render="gateway", tokenizer=str(qwen_tokenizer_dir())
        )
        try:
            sid = gw.new_session()
            oai = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)
            messages: list[Any] = [{"role": "user", "content": "hi"}]
            for n in range(2):
                answer = oai.chat.completions.create(model="m", messages=messages, max_tokens=32)
                messages += [answer.choices[0].message.model_dump(exclude_none=True)]
                messages += [{"role": "user", "content": f"and {n}"}]
            records = gw.completions(sid)
        finally:
            gw.server.stop()
    assert len(records) == 2
    assert all(r.response_ids and r.response_ids[-1] == IM_END and r.trainable for r in records)
    first, second = (body["prompt"] for body in fake.requests[-2:])  # after the gateway's start-up check
    assert second[: len(first)] == first  # the second call's prompt continues the first's chain
    assert not [f for r in records[1:] for f in r.flags if f.startswith("chain:")]
    assert len(build(records, strategy="prefix_merging").traces) == 1
