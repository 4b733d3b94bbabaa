"""Exact outputs through the real engine and server: a scripted network makes the model emit known tool
calls and thoughts, so parsing, flags and finish reasons are checked end to end with the `openai` SDK."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from polar.engine import Engine, create_engine_app
from tests.engine_support import ScriptedLM, scripted_engine
from tests.fakes.server import ServerThread, serve

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]
MESSAGES = [{"role": "user", "content": "list files"}]
GOOD_CALL = '<tool_call>\n{"name": "run_shell", "arguments": {"command": "ls -la"}}\n</tool_call>'
BAD_CALL = '<tool_call>\n{"name": "run_shell", "arguments": {"command": "ls -la"\n</tool_call>'


@pytest.fixture(scope="module")
def setup() -> Iterator[tuple[Engine, ScriptedLM, ServerThread]]:
    engine, model = scripted_engine()
    with serve(create_engine_app(engine)) as srv:
        yield engine, model, srv
    engine.stop()


def _script(setup: tuple[Engine, ScriptedLM, ServerThread], text: str, **tokenize: Any) -> list[int]:
    engine, model, srv = setup
    prompt = httpx.post(srv.url + "/tokenize", json={"messages": MESSAGES, **tokenize}).json()["tokens"]
    model.start = len(prompt)
    model.script = engine.tokenizer.encode(text, add_special_tokens=False)
    return model.script


def _client(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


def _create(srv: ServerThread, **kw: Any) -> Any:
    return _client(srv).chat.completions.create(
        model="scripted",
        messages=MESSAGES,
        temperature=0,
        max_tokens=80,
        extra_body={
            "return_token_ids": True,
            "logprobs": True,
            "top_logprobs": 0,
            **kw.pop("extra_body", {}),
        },
        **kw,
    )


def test_tool_call_is_structured(setup: tuple[Engine, ScriptedLM, ServerThread]) -> None:
    engine, _, srv = setup
    script = _script(setup, "Let me look.\n" + GOOD_CALL, tools=TOOLS)
    body = _create(srv, tools=TOOLS).model_dump()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    assert call["function"] == {"name": "run_shell", "arguments": '{"command": "ls -la"}'}
    assert call["id"].startswith("chatcmpl-tool-")
    assert choice["message"]["content"] == "Let me look.\n"
    assert choice["token_ids"] == [*script, engine.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert body["polar_flags"] == []


def test_unparsable_tool_call_is_text_and_flagged(setup: tuple[Engine, ScriptedLM, ServerThread]) -> None:
    _, _, srv = setup
    _script(setup, BAD_CALL, tools=TOOLS)
    body = _create(srv, tools=TOOLS).model_dump()
    choice = body["choices"][0]
    assert choice["message"]["content"] == BAD_CALL
    assert choice["message"]["tool_calls"] == []
    assert choice["finish_reason"] == "stop"
    assert body["polar_flags"] == ["tool_call_parse_error"]


def test_tool_choice_none_leaves_text_alone(setup: tuple[Engine, ScriptedLM, ServerThread]) -> None:
    _, _, srv = setup
    _script(setup, GOOD_CALL, tools=TOOLS)
    body = _create(srv, tools=TOOLS, tool_choice="none").model_dump()
    assert body["choices"][0]["message"]["content"] == GOOD_CALL
    assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("text", ["Let me look.\n" + GOOD_CALL, BAD_CALL])
def test_streamed_tool_calls_match_the_whole_answer(
    setup: tuple[Engine, ScriptedLM, ServerThread], text: str
) -> None:
    _, _, srv = setup
    _script(setup, text, tools=TOOLS)
    whole = _create(srv, tools=TOOLS).model_dump()
    chunks = [c.model_dump() for c in _create(srv, tools=TOOLS, stream=True)]
    deltas = [ch["delta"] for c in chunks for ch in c["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [tc for d in deltas for tc in (d.get("tool_calls") or [])]
    msg = whole["choices"][0]["message"]
    assert content == (msg["content"] or "")
    assert [tc["function"] for tc in calls] == [tc["function"] for tc in msg["tool_calls"]]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["polar_flags"] == whole["polar_flags"]


def test_thought_is_reasoning_content(setup: tuple[Engine, ScriptedLM, ServerThread]) -> None:
    _, _, srv = setup
    _script(setup, "<think>\nThe user wants files.\n</think>\n\nSure.")
    msg = _create(srv).model_dump()["choices"][0]["message"]
    assert msg["reasoning_content"] == "\nThe user wants files.\n" == msg["reasoning"]
    assert msg["content"] == "\n\nSure."
    chunks = [c.model_dump() for c in _create(srv, stream=True)]
    deltas = [ch["delta"] for c in chunks for ch in c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
    no_reasoning = _create(srv, extra_body={"include_reasoning": False}).model_dump()["choices"][0]["message"]
    assert no_reasoning["reasoning_content"] is None and no_reasoning["content"] == "\n\nSure."


def test_eos_is_a_sampled_token_but_not_text(setup: tuple[Engine, ScriptedLM, ServerThread]) -> None:
    engine, _, srv = setup
    script = _script(setup, "Done.")
    choice = _create(srv).model_dump()["choices"][0]
    assert choice["message"]["content"] == "Done."
    assert choice["token_ids"][-1] == engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert len(choice["token_ids"]) == len(script) + 1
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None
