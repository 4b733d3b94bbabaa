"""The gateway in front of the embedded engine, through the official SDKs: what the gateway records is
exactly what the engine generated (token ids, logprobs recomputed by a forward pass, policy version)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest
import torch

from polar.engine import Engine, create_engine_app
from polar.store.records import CompletionRecord
from tests.conftest import Gateway, start_gateway
from tests.engine_support import ScriptedLM, reference_logprobs, scripted_engine
from tests.fakes.server import serve

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a command",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]


@pytest.fixture
def gw(tiny: tuple[Engine, str], tmp_path: Path) -> Iterator[Gateway]:
    engine, url = tiny
    gateway = start_gateway(url, tmp_path, served_model=engine.name)
    yield gateway
    gateway.server.stop()


def _check_exact(engine: Engine, rec: CompletionRecord, temperature: float = 1.0) -> None:
    assert rec.trainable, rec.flags
    assert rec.prompt_ids and rec.response_ids and rec.response_logprobs
    want = reference_logprobs(engine.model, rec.prompt_ids, rec.response_ids, temperature=temperature)
    assert rec.response_logprobs == pytest.approx(want, abs=2e-3)
    assert rec.policy_version == engine.policy_version


def test_openai_sdk_through_gateway_records_what_the_engine_sampled(
    tiny: tuple[Engine, str], gw: Gateway
) -> None:
    engine, _ = tiny
    sid = gw.new_session()
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)
    resp = client.chat.completions.create(
        model="any-name-the-harness-likes",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=12,
        temperature=0.8,
        seed=4,
    )
    (rec,) = gw.completions(sid)
    _check_exact(engine, rec, temperature=0.8)
    assert len(rec.response_ids) == 12
    assert resp.choices[0].message.content == engine.tokenizer.decode(
        rec.response_ids, skip_special_tokens=True
    )
    # Streaming answers are recorded the same way.
    chunks = list(
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "again"}], max_tokens=6, stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    recs = gw.completions(sid)
    assert len(recs) == 2
    _check_exact(engine, recs[1])
    assert text == engine.tokenizer.decode(recs[1].response_ids, skip_special_tokens=True)


def test_anthropic_sdk_through_gateway(tiny: tuple[Engine, str], gw: Gateway) -> None:
    engine, _ = tiny
    sid = gw.new_session()
    client = anthropic.Anthropic(base_url=gw.url, api_key=sid, max_retries=0)
    msg = client.messages.create(
        model="claude-whatever", max_tokens=10, messages=[{"role": "user", "content": "hi there"}]
    )
    (rec,) = gw.completions(sid)
    _check_exact(engine, rec)
    assert msg.stop_reason == "max_tokens"
    assert msg.usage.output_tokens == len(rec.response_ids)


def test_policy_version_follows_weight_updates(tiny: tuple[Engine, str], gw: Gateway) -> None:
    engine, _ = tiny
    sid = gw.new_session()
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    try:
        g = torch.Generator().manual_seed(9)
        engine.update_weights(
            {k: v + 0.02 * torch.randn(v.shape, generator=g).to(v.device) for k, v in state.items()}, 41
        )
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=4)
        (rec,) = gw.completions(sid)
        assert rec.policy_version == 41
        _check_exact(engine, rec)
    finally:
        engine.update_weights(state, 0)


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[tuple[Engine, ScriptedLM, Gateway]]:
    engine, model = scripted_engine()
    with serve(create_engine_app(engine)) as srv:
        gateway = start_gateway(srv.url, tmp_path, served_model=engine.name)
        yield engine, model, gateway
        gateway.server.stop()
    engine.stop()


@pytest.mark.parametrize("broken", [False, True])
def test_tool_calls_and_parse_errors_reach_the_record(
    scripted: tuple[Engine, ScriptedLM, Gateway], broken: bool
) -> None:
    engine, model, gw = scripted
    messages = [{"role": "user", "content": "list files"}]
    call = (
        '<tool_call>\n{"name": "run_shell", "arguments": {"command": "ls"'
        + ("" if broken else "}")
        + "}\n</tool_call>"
    )
    prompt = engine.tokenizer.encode(
        engine.tokenizer.apply_chat_template(
            messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
        ),
        add_special_tokens=False,
    )
    model.start = len(prompt)
    model.script = engine.tokenizer.encode(call, add_special_tokens=False)
    sid = gw.new_session()
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)
    resp = client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, temperature=0, max_tokens=60
    )  # type: ignore[arg-type]
    (rec,) = gw.completions(sid)
    assert rec.prompt_ids == prompt
    assert rec.response_ids == [*model.script, model.eos]
    if broken:
        assert resp.choices[0].message.content == call
        assert "tool_call_parse_error" in rec.flags
        assert rec.trainable  # a failed call is a zero-reward sample, not dropped
    else:
        (tc,) = resp.choices[0].message.tool_calls or []
        assert tc.function.name == "run_shell" and tc.function.arguments == '{"command": "ls"}'
        assert resp.choices[0].finish_reason == "tool_calls"
        assert "tool_call_parse_error" not in rec.flags
