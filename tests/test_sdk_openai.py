"""The official `openai` SDK against a running gateway in front of the fake vLLM: Chat and Responses.

Every call is checked twice: what the SDK parsed, and the record the gateway committed (prompt ids equal the
fake tokenizer's encoding of the body the server received, sampled ids and logprobs equal what it sent).
Multi-turn loops send history back the way Qwen Code (Chat) and Codex (Responses, `store: false`) do, and
each prompt must extend the previous prompt plus the sampled ids, token for token.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.conftest import FakeBackend, Gateway
from tests.fakes.fake_vllm import Reply
from tests.sdk_support import (
    Sampler,
    assistant_messages,
    check_prefix_chain,
    check_records,
    tool_messages,
)

# One fake backend and gateway for the whole module (see conftest.module_stack).
pytestmark = pytest.mark.shared_stack

SHELL_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "shell",
        "description": "Run a shell command.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}
RESPONSES_SHELL: dict[str, Any] = {"type": "function", **SHELL_TOOL["function"], "strict": False}
LS = '{"command":"ls -a"}'


def client(gw: Gateway, sid: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)


# ---- Chat Completions -------------------------------------------------------------------------------


def test_chat_non_streaming(gateway: Gateway, fake_backend: FakeBackend) -> None:
    reply = Reply(content="Hello! How can I help with your code today?", reasoning="A greeting; be friendly.")
    sampler = Sampler(fake_backend, reply)
    sid = gateway.new_session()
    r = client(gateway, sid).chat.completions.create(
        model="qwen3-coder-plus",
        messages=[{"role": "system", "content": "You are a coder."}, {"role": "user", "content": "hi"}],
        temperature=0.6,
        max_tokens=256,
    )
    msg = r.choices[0].message
    assert msg.content == reply.content and msg.tool_calls is None
    assert getattr(msg, "reasoning_content", None) == reply.reasoning
    assert r.choices[0].finish_reason == "stop" and r.model == "qwen3-coder-plus"

    (rec,) = check_records(gateway, sid, sampler, dialect="chat", model="qwen3-coder-plus")
    upstream = sampler.requests[0]
    assert upstream["temperature"] == 0.6 and upstream["max_tokens"] == 256
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(rec.prompt_ids or []) > 0
    assert r.usage.completion_tokens == len(rec.response_ids or []) > 0
    assert r.id == rec.upstream_id  # the server's id; `completion_id` is the gateway's own
    assert rec.response_message == {
        "role": "assistant",
        "content": reply.content,
        "reasoning_content": reply.reasoning,
    }


def test_chat_streaming_with_usage(gateway: Gateway, fake_backend: FakeBackend) -> None:
    reply = Reply(
        content="Streaming works: this sentence is long enough to arrive in several deltas.",
        reasoning="The user wants a streamed answer, so I answer in one go and the gateway splits it.",
    )
    sampler = Sampler(fake_backend, reply)
    sid = gateway.new_session()
    stream = client(gateway, sid).chat.completions.create(
        model="qwen3-coder-plus",
        messages=[{"role": "user", "content": "stream please"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert content == reply.content and reasoning == reply.reasoning and finishes == ["stop"]
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1  # really streamed in pieces
    assert {c.model for c in chunks} == {"qwen3-coder-plus"} and len({c.id for c in chunks}) == 1
    # include_usage: one trailing chunk with no choices and the usage of the whole call.
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None

    (rec,) = check_records(gateway, sid, sampler, dialect="chat", model="qwen3-coder-plus")
    assert last.usage.prompt_tokens == len(rec.prompt_ids or [])
    assert last.usage.completion_tokens == len(rec.response_ids or [])
    # One streamed upstream call, asking for the usage chunk whatever the harness asked.
    assert sampler.requests[0]["stream"] is True
    assert sampler.requests[0]["stream_options"] == {"include_usage": True}
    assert rec.request["stream"] is True


def _chat_turn(c: openai.OpenAI, messages: list[dict[str, Any]], stream: bool) -> Any:
    """One call the way a harness makes it; returns the assistant message (streamed or not)."""
    kwargs: dict[str, Any] = {"model": "qwen3-coder-plus", "messages": messages, "tools": [SHELL_TOOL]}
    if not stream:
        return c.chat.completions.create(**kwargs).choices[0]
    with c.chat.completions.stream(**kwargs) as s:
        return s.get_final_completion().choices[0]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_chat_tool_call_round_trip(gateway: Gateway, fake_backend: FakeBackend, stream: bool) -> None:
    replies = [
        Reply(reasoning="I need to look at the files first.", tool_calls=[("shell", LS)]),
        Reply(content="Two files.", reasoning="The listing shows a.txt and b.txt."),
    ]
    sampler = Sampler(fake_backend, *replies)
    sid = gateway.new_session()
    c = client(gateway, sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What files are here?"}]

    first = _chat_turn(c, messages, stream)
    assert first.finish_reason == "tool_calls"
    (call,) = first.message.tool_calls
    assert call.type == "function" and call.function.name == "shell" and call.function.arguments == LS
    # The harness runs the tool and sends the assistant turn back as it got it, then the result.
    messages.append(
        {
            "role": "assistant",
            "content": first.message.content,
            "reasoning_content": replies[0].reasoning,
            "tool_calls": [call.model_dump(include={"id", "type", "function"})],
        }
    )
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "a.txt\nb.txt"})

    second = _chat_turn(c, messages, stream)
    assert second.finish_reason == "stop" and second.message.content == "Two files."

    recs = check_records(gateway, sid, sampler, dialect="chat", model="qwen3-coder-plus")
    assert [r.finish_reason for r in recs] == ["tool_calls", "stop"]
    assert tool_messages(sampler.requests[1]) == [
        {"role": "tool", "tool_call_id": call.id, "content": "a.txt\nb.txt"}
    ]
    check_prefix_chain(recs)


# ---- Responses --------------------------------------------------------------------------------------


def test_responses_non_streaming(gateway: Gateway, fake_backend: FakeBackend) -> None:
    reply = Reply(content="Hi, I am ready to edit code.")
    sampler = Sampler(fake_backend, reply)
    sid = gateway.new_session()
    r = client(gateway, sid).responses.create(
        model="gpt-5-codex", instructions="You are Codex.", input="hello", max_output_tokens=500, store=False
    )
    assert r.status == "completed" and r.model == "gpt-5-codex" and r.output_text == reply.content
    assert [item.type for item in r.output] == ["message"]

    (rec,) = check_records(gateway, sid, sampler, dialect="responses", model="gpt-5-codex")
    assert sampler.requests[0]["messages"] == [
        {"role": "system", "content": "You are Codex."},
        {"role": "user", "content": "hello"},
    ]
    assert sampler.requests[0]["max_tokens"] == 500
    assert r.usage is not None
    assert r.usage.input_tokens == len(rec.prompt_ids or []) and r.usage.output_tokens == len(
        rec.response_ids or []
    )


def test_responses_streaming_helper_and_raw_events(gateway: Gateway, fake_backend: FakeBackend) -> None:
    replies = [
        Reply(
            content="A streamed answer, long enough to come in more than one delta event.", reasoning="Think."
        ),
        Reply(content="Second streamed answer, also long enough for several output_text deltas."),
    ]
    sampler = Sampler(fake_backend, *replies)
    sid = gateway.new_session()
    c = client(gateway, sid)

    with c.responses.stream(model="gpt-5-codex", input="first") as s:
        events = list(s)
        final = s.get_final_response()
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert "response.reasoning_summary_text.delta" in types
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == replies[0].content
    assert final.output_text == replies[0].content and final.status == "completed"
    assert [i.type for i in final.output] == ["reasoning", "message"]

    raw = list(c.responses.create(model="gpt-5-codex", input="second", stream=True))
    assert raw[-1].type == "response.completed"
    assert [e.sequence_number for e in raw] == list(range(len(raw)))
    text = "".join(e.delta for e in raw if e.type == "response.output_text.delta")
    assert text == replies[1].content == raw[-1].response.output_text

    recs = check_records(gateway, sid, sampler, dialect="responses", model="gpt-5-codex")
    assert [r.request["stream"] for r in recs] == [True, True]
    assert all(r["stream"] is True for r in sampler.requests)  # streamed from the backend too


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_responses_function_call_and_reasoning_round_trip(
    gateway: Gateway, fake_backend: FakeBackend, stream: bool
) -> None:
    """Codex's loop: `store: false`, encrypted reasoning included, the whole history resent every turn."""
    reasoning = "The user wants the files.\n\nI will run `ls -a` — exactly this text must come back."
    replies = [
        Reply(reasoning=reasoning, tool_calls=[("shell", LS)]),
        Reply(content="There are two files.", reasoning="Summarize the listing."),
    ]
    sampler = Sampler(fake_backend, *replies)
    sid = gateway.new_session()
    c = client(gateway, sid)
    common: dict[str, Any] = {
        "model": "gpt-5-codex",
        "instructions": "You are Codex.",
        "tools": [RESPONSES_SHELL],
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "reasoning": {"effort": "medium", "summary": "auto"},
    }
    history: list[dict[str, Any]] = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]}
    ]

    def turn() -> Any:
        if not stream:
            return c.responses.create(input=history, **common)
        with c.responses.stream(input=history, **common) as s:
            return s.get_final_response()

    first = turn()
    rs, fc = first.output
    assert rs.type == "reasoning" and fc.type == "function_call"
    assert rs.encrypted_content and rs.summary[0].text == reasoning
    assert fc.name == "shell" and fc.arguments == LS
    # Codex resends output items as it got them; make the visible summary useless to prove that only the
    # encrypted content carries the reasoning back.
    rs_item = rs.model_dump(exclude_none=True)
    rs_item["summary"] = [{"type": "summary_text", "text": "**Listing files**"}]
    history += [rs_item, fc.model_dump(exclude_none=True)]
    history.append({"type": "function_call_output", "call_id": fc.call_id, "output": "a.txt\nb.txt"})

    second = turn()
    assert second.output_text == "There are two files."

    recs = check_records(gateway, sid, sampler, dialect="responses", model="gpt-5-codex")
    (assistant,) = assistant_messages(sampler.requests[1])
    assert assistant["reasoning_content"] == reasoning  # restored exactly from encrypted_content
    assert assistant["tool_calls"] == [
        {"id": fc.call_id, "type": "function", "function": {"name": "shell", "arguments": LS}}
    ]
    assert tool_messages(sampler.requests[1]) == [
        {"role": "tool", "tool_call_id": fc.call_id, "content": "a.txt\nb.txt"}
    ]
    assert sampler.requests[0]["reasoning_effort"] == "medium"
    check_prefix_chain(recs)
    assert json.loads(recs[0].response_message["tool_calls"][0]["function"]["arguments"]) == {
        "command": "ls -a"
    }
