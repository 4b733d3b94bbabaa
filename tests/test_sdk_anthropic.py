"""The official `anthropic` SDK against a running gateway in front of the fake vLLM, as Claude Code uses it.

Every call is checked on what the SDK parsed and on the committed record (exact prompt ids of the body the
server received, exact sampled ids and logprobs). Tool loops resend the assistant's content blocks as
received, so each prompt must extend the previous prompt plus the sampled ids, token for token; thinking
comes back through our signature exactly even when the visible text was dropped.
"""

from __future__ import annotations

from typing import Any

import anthropic
import httpx2
import pytest

from tests.conftest import FakeBackend, Gateway
from tests.fakes.fake_vllm import Reply
from tests.sdk_support import (
    Sampler,
    assistant_messages,
    check_prefix_chain,
    check_records,
    prompt_ids,
    tool_messages,
)

# One fake backend and gateway for the whole module (see conftest.module_stack).
pytestmark = pytest.mark.shared_stack

MODEL = "claude-sonnet-4-6"
BASH_TOOL: dict[str, Any] = {
    "name": "Bash",
    "description": "Run a bash command.",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
}
# Compact JSON, as the gateway writes a tool_use `input` back into history: the prefix stays exact.
LS = '{"command":"ls"}'
CAT = '{"command":"cat a.txt"}'


def client(gw: Gateway, sid: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=sid, max_retries=0)


def blocks(message: Any) -> list[dict[str, Any]]:
    """A response's content as the request blocks a harness sends back."""
    return [b.model_dump(exclude_none=True) for b in message.content]


def test_messages_non_streaming(gateway: Gateway, fake_backend: FakeBackend) -> None:
    reply = Reply(content="Hello! What should we build?")
    sampler = Sampler(fake_backend, reply)
    sid = gateway.new_session()
    m = client(gateway, sid).messages.create(
        model=MODEL,
        max_tokens=1024,
        system=[{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"temperature": 0.7},  # this SDK version no longer types `temperature`
    )
    assert m.model == MODEL and m.role == "assistant" and m.stop_reason == "end_turn"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == reply.content

    (rec,) = check_records(gateway, sid, sampler, dialect="anthropic", model=MODEL)
    assert sampler.requests[0]["messages"] == [
        {"role": "system", "content": "You are Claude Code."},
        {"role": "user", "content": "hi"},
    ]
    assert sampler.requests[0]["max_tokens"] == 1024 and sampler.requests[0]["temperature"] == 0.7
    assert m.usage.input_tokens == len(rec.prompt_ids or []) > 0
    assert m.usage.output_tokens == len(rec.response_ids or []) > 0


def test_messages_streaming(gateway: Gateway, fake_backend: FakeBackend) -> None:
    reply = Reply(
        content="A streamed answer from the policy.",
        reasoning="The user asked for a stream; thinking comes first.",
    )
    sampler = Sampler(fake_backend, reply)
    sid = gateway.new_session()
    with client(gateway, sid).messages.stream(
        model=MODEL,
        max_tokens=2048,
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=[{"role": "user", "content": "stream it"}],
    ) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "thinking" in events and "signature" in events and "text" in events
    assert [b.type for b in final.content] == ["thinking", "text"]
    thinking, text = final.content
    assert thinking.thinking == reply.reasoning and thinking.signature
    assert text.text == reply.content and final.stop_reason == "end_turn" and final.model == MODEL

    (rec,) = check_records(gateway, sid, sampler, dialect="anthropic", model=MODEL)
    assert final.usage.input_tokens == len(rec.prompt_ids or [])
    assert final.usage.output_tokens == len(rec.response_ids or [])
    assert sampler.requests[0]["chat_template_kwargs"] == {"enable_thinking": True}
    assert sampler.requests[0]["stream"] is True and rec.request["stream"] is True


def test_tool_use_round_trip_with_error_result(gateway: Gateway, fake_backend: FakeBackend) -> None:
    replies = [
        Reply(content="Let me look.", tool_calls=[("Bash", LS)]),
        Reply(tool_calls=[("Bash", CAT)]),
        Reply(content="a.txt says hello."),
    ]
    sampler = Sampler(fake_backend, *replies)
    sid = gateway.new_session()
    c = client(gateway, sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What does a.txt say?"}]
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 4096, "tools": [BASH_TOOL]}

    first = c.messages.create(messages=messages, **kwargs)
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["text", "tool_use"]
    use = first.content[1]
    assert use.name == "Bash" and use.input == {"command": "ls"}
    messages += [
        {"role": "assistant", "content": blocks(first)},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use.id,
                    "content": "ls: permission denied",
                    "is_error": True,
                }
            ],
        },
    ]

    with c.messages.stream(messages=messages, **kwargs) as s:
        second = s.get_final_message()
    assert second.stop_reason == "tool_use" and [b.type for b in second.content] == ["tool_use"]
    use2 = second.content[0]
    assert use2.input == {"command": "cat a.txt"}
    messages += [
        {"role": "assistant", "content": blocks(second)},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use2.id,
                    "content": [{"type": "text", "text": "hello"}],
                },
                {"type": "text", "text": "Keep it short."},
            ],
        },
    ]

    third = c.messages.create(messages=messages, **kwargs)
    assert third.stop_reason == "end_turn" and third.content[0].text == "a.txt says hello."

    recs = check_records(gateway, sid, sampler, dialect="anthropic", model=MODEL)
    assert [r.finish_reason for r in recs] == ["tool_calls", "tool_calls", "stop"]
    # is_error has no place in a chat template: the model reads that the tool failed.
    assert tool_messages(sampler.requests[1]) == [
        {"role": "tool", "tool_call_id": use.id, "content": "Error: ls: permission denied"}
    ]
    assert tool_messages(sampler.requests[2])[-1] == {
        "role": "tool",
        "tool_call_id": use2.id,
        "content": "hello",
    }
    assert sampler.requests[2]["messages"][-1] == {
        "role": "user",
        "content": [{"type": "text", "text": "Keep it short."}],
    }
    assert assistant_messages(sampler.requests[2])[0]["tool_calls"] == [
        {"id": use.id, "type": "function", "function": {"name": "Bash", "arguments": LS}}
    ]
    check_prefix_chain(recs)


def test_thinking_signature_restores_reasoning_exactly(gateway: Gateway, fake_backend: FakeBackend) -> None:
    reasoning = "Plan:\n1. list the files\n2. read a.txt — «exactly» these bytes must come back."
    replies = [
        Reply(reasoning=reasoning, tool_calls=[("Bash", LS)]),
        Reply(content="Done.", reasoning="Easy."),
    ]
    sampler = Sampler(fake_backend, *replies)
    sid = gateway.new_session()
    c = client(gateway, sid)
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 8192,
        "tools": [BASH_TOOL],
        "thinking": {"type": "enabled", "budget_tokens": 4096},
    }
    messages: list[dict[str, Any]] = [{"role": "user", "content": "list"}]

    first = c.messages.create(messages=messages, **kwargs)
    thinking, use = first.content
    assert thinking.type == "thinking" and thinking.thinking == reasoning
    assert use.type == "tool_use"
    # A harness that edits or drops the visible thinking text: the signature alone carries it back.
    sent = blocks(first)
    sent[0]["thinking"] = "(summarized)"
    messages += [
        {"role": "assistant", "content": sent},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "a.txt"}]},
    ]
    second = c.messages.create(messages=messages, **kwargs)
    assert second.content[-1].text == "Done."

    recs = check_records(gateway, sid, sampler, dialect="anthropic", model=MODEL)
    (assistant,) = assistant_messages(sampler.requests[1])
    assert assistant["reasoning_content"] == reasoning
    check_prefix_chain(recs)

    # A forged signature is not trusted: the visible text is used instead.
    sampler2 = Sampler(fake_backend, Reply(content="ok"))
    sid2 = gateway.new_session()
    forged = [dict(sent[0], signature="p1.forged.sig"), sent[1]]
    client(gateway, sid2).messages.create(
        messages=[*messages[:1], {"role": "assistant", "content": forged}, messages[2]], **kwargs
    )
    (assistant,) = assistant_messages(sampler2.requests[0])
    assert assistant["reasoning_content"] == "(summarized)"


def test_count_tokens_matches_the_prompt_of_the_call(gateway: Gateway, fake_backend: FakeBackend) -> None:
    sampler = Sampler(fake_backend, Reply(content="fine"))
    sid = gateway.new_session()
    c = client(gateway, sid)
    body: dict[str, Any] = {
        "model": MODEL,
        "system": "You are Claude Code.",
        "messages": [{"role": "user", "content": "How many tokens is this?"}],
        "tools": [BASH_TOOL],
    }
    counted = c.messages.count_tokens(**body)
    assert gateway.completions(sid) == []  # counting is not a generation
    m = c.messages.create(max_tokens=100, **body)
    (rec,) = check_records(gateway, sid, sampler, dialect="anthropic", model=MODEL)
    assert counted.input_tokens == len(rec.prompt_ids or []) == m.usage.input_tokens
    # The count is the server's own tokenization of the same rendered prompt.
    (tokenized,) = fake_backend.app.tokenize_requests
    assert counted.input_tokens == len(prompt_ids(tokenized))


def test_beta_messages_with_claude_code_fields(gateway: Gateway, fake_backend: FakeBackend) -> None:
    """Claude Code calls `/v1/messages?beta=true` with `anthropic-beta` and fields the policy cannot use."""
    reply = Reply(content="Beta works.", reasoning="Thinking in beta.")
    sampler = Sampler(fake_backend, reply)
    sid = gateway.new_session()
    seen: list[httpx2.Request] = []
    c = anthropic.Anthropic(
        base_url=gateway.url,
        api_key=sid,
        max_retries=0,
        http_client=httpx2.Client(event_hooks={"request": [seen.append]}),
    )
    m = c.beta.messages.create(
        model=MODEL,
        max_tokens=16000,
        betas=["claude-code-20250219", "interleaved-thinking-2025-05-14", "context-management-2025-06-27"],
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
            }
        ],
        thinking={"type": "enabled", "budget_tokens": 10000},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        output_config={"effort": "high"},
        metadata={"user_id": "user_abc_account_def_session_123"},
        extra_headers={"x-app": "cli"},
        # Claude Code's bundled SDK adds `?beta=true` to beta calls; this Python SDK sends only the header.
        extra_query={"beta": "true"},
    )
    (sent,) = seen
    assert sent.url.path == "/v1/messages" and sent.url.params["beta"] == "true"
    assert sent.headers["anthropic-beta"].split(",") == [
        "claude-code-20250219",
        "interleaved-thinking-2025-05-14",
        "context-management-2025-06-27",
    ]
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == reply.reasoning and m.content[1].text == reply.content
    (rec,) = check_records(gateway, sid, sampler, dialect="anthropic", model=MODEL)
    assert rec.request["context_management"] == {
        "edits": [{"type": "clear_thinking_20251015", "keep": "all"}]
    }
    assert rec.request["metadata"] == {"user_id": "user_abc_account_def_session_123"}
    upstream = sampler.requests[0]
    for key in ("context_management", "output_config", "metadata", "betas"):
        assert key not in upstream  # nothing the inference server would refuse goes upstream
