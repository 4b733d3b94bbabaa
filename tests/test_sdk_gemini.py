"""The official `google-genai` SDK against a running gateway in front of the fake vLLM, as Gemini CLI uses it.

Every call is checked on what the SDK parsed and on the committed record (exact prompt ids of the body the
server received, exact sampled ids and logprobs). The function-calling loop resends the model's content as
received, so each prompt extends the previous prompt plus the sampled ids, token for token; reasoning comes
back exactly through our `thoughtSignature` even when the thought parts are dropped from history.

Each test runs twice: at the SDK's default API version (`v1` since google-genai 3.x) and at `v1beta` (what
Gemini CLI's SDK calls), chosen as users choose it, with `GOOGLE_GENAI_API_VERSION`. The client is built
from the environment alone (`GOOGLE_GEMINI_BASE_URL`, as the README points Gemini clients at a gateway), so
the SDK's defaults (path, version, headers) are what the gateway sees.
"""

from __future__ import annotations

from typing import Any

import pytest
from google import genai
from google.genai import types

from tests.conftest import SERVED_MODEL, FakeBackend, Gateway
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

MODEL = "gemini-2.5-pro"
SHELL = types.FunctionDeclaration(
    name="run_shell_command",
    description="Run a shell command.",
    parameters_json_schema={
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
)
# Compact JSON, as the gateway writes a functionCall's `args` back into history: the prefix stays exact.
LS = '{"command":"ls"}'


@pytest.fixture(params=["sdk-default", "env-v1beta"])
def api_version(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, gateway: Gateway) -> str:
    """The API version the SDK will call; the gateway's URL in `GOOGLE_GEMINI_BASE_URL`."""
    monkeypatch.setenv("GOOGLE_GEMINI_BASE_URL", gateway.url)
    if request.param == "env-v1beta":
        monkeypatch.setenv("GOOGLE_GENAI_API_VERSION", "v1beta")
        return "v1beta"
    monkeypatch.delenv("GOOGLE_GENAI_API_VERSION", raising=False)
    return "v1"  # google-genai 3.x's default; this test fails the day it changes, so it is looked at


def client(api_version: str, sid: str) -> genai.Client:
    c = genai.Client(api_key=sid)  # nothing but the key: base URL and version as the SDK resolves them
    assert c._api_client._http_options.api_version == api_version  # the path it calls: /{version}/models/...
    return c


def test_generate_content(gateway: Gateway, fake_backend: FakeBackend, api_version: str) -> None:
    reply = Reply(content="Hello from the policy.")
    sampler = Sampler(fake_backend, reply)
    sid = gateway.new_session()
    c = client(api_version, sid)  # keep it: a collected genai.Client closes its HTTP client
    r = c.models.generate_content(
        model=MODEL,
        contents="hi",
        config=types.GenerateContentConfig(
            system_instruction="You are Gemini CLI.", temperature=0.3, max_output_tokens=300
        ),
    )
    assert r.text == reply.content and r.model_version == MODEL
    assert r.candidates is not None and r.candidates[0].finish_reason == types.FinishReason.STOP

    (rec,) = check_records(gateway, sid, sampler, dialect="gemini", model=MODEL)
    upstream = sampler.requests[0]
    assert upstream["messages"] == [
        {"role": "system", "content": "You are Gemini CLI."},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    assert upstream["temperature"] == 0.3 and upstream["max_tokens"] == 300
    u = r.usage_metadata
    assert u is not None and u.prompt_token_count == len(rec.prompt_ids or []) > 0
    assert u.candidates_token_count == len(rec.response_ids or []) > 0
    assert r.response_id == rec.upstream_id  # the server's id; `completion_id` is the gateway's own


def test_generate_content_stream_with_thoughts(
    gateway: Gateway, fake_backend: FakeBackend, api_version: str
) -> None:
    reply = Reply(content="The streamed answer.", reasoning="Let me think before streaming.")
    sampler = Sampler(fake_backend, reply)
    sid = gateway.new_session()
    config = types.GenerateContentConfig(
        thinking_config=types.ThinkingConfig(include_thoughts=True, thinking_budget=-1)
    )
    c = client(api_version, sid)
    chunks = list(c.models.generate_content_stream(model=MODEL, contents="stream it", config=config))
    parts = [p for c in chunks for p in (c.candidates or [])[0].content.parts or []]  # type: ignore[union-attr]
    thoughts = [p.text for p in parts if p.thought]
    answer = "".join(p.text or "" for p in parts if not p.thought)
    # Streamed from the backend: thought and answer pieces arrive as they are sampled.
    assert "".join(thoughts) == reply.reasoning and len(thoughts) > 1 and answer == reply.content
    assert sum(1 for p in parts if p.thought_signature) == 1
    assert len(chunks) > 2 and chunks[-1].candidates[0].finish_reason == types.FinishReason.STOP  # type: ignore[index]

    (rec,) = check_records(gateway, sid, sampler, dialect="gemini", model=MODEL)
    assert chunks[-1].usage_metadata is not None
    assert chunks[-1].usage_metadata.prompt_token_count == len(rec.prompt_ids or [])
    assert sampler.requests[0]["chat_template_kwargs"] == {"enable_thinking": True}
    assert sampler.requests[0]["stream"] is True  # streamed from the backend too


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_function_calling_round_trip(
    gateway: Gateway, fake_backend: FakeBackend, api_version: str, stream: bool
) -> None:
    replies = [
        Reply(content="I'll list the files.", tool_calls=[("run_shell_command", LS)]),
        Reply(content="There is one file, a.txt."),
    ]
    sampler = Sampler(fake_backend, *replies)
    sid = gateway.new_session()
    c = client(api_version, sid)
    config = types.GenerateContentConfig(
        tools=[types.Tool(function_declarations=[SHELL])],
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
    )
    contents: list[Any] = [types.Content(role="user", parts=[types.Part(text="what is here?")])]

    def turn() -> types.Content:
        if not stream:
            got = c.models.generate_content(model=MODEL, contents=contents, config=config)
            assert got.candidates and got.candidates[0].content
            return got.candidates[0].content
        chunks = list(c.models.generate_content_stream(model=MODEL, contents=contents, config=config))
        parts = [p for ch in chunks for p in ch.candidates[0].content.parts]  # type: ignore[index,union-attr]
        return types.Content(role="model", parts=parts)

    first = turn()
    (call,) = [p.function_call for p in first.parts or [] if p.function_call]
    assert call.name == "run_shell_command" and call.args == {"command": "ls"} and call.id
    contents.append(first)
    contents.append(
        types.Content(
            role="user",
            parts=[
                types.Part(
                    function_response=types.FunctionResponse(
                        id=call.id, name=call.name, response={"output": "a.txt"}
                    )
                )
            ],
        )
    )

    second = turn()
    assert "".join(p.text or "" for p in second.parts or []) == "There is one file, a.txt."

    recs = check_records(gateway, sid, sampler, dialect="gemini", model=MODEL)
    assert [r.finish_reason for r in recs] == ["tool_calls", "stop"]
    assert tool_messages(sampler.requests[1]) == [
        {"role": "tool", "tool_call_id": call.id, "content": "a.txt"}
    ]
    assert assistant_messages(sampler.requests[1]) == [
        {
            "role": "assistant",
            "content": "I'll list the files.",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "run_shell_command", "arguments": LS},
                }
            ],
        }
    ]
    check_prefix_chain(recs)


def test_thought_signature_restores_reasoning_exactly(
    gateway: Gateway, fake_backend: FakeBackend, api_version: str
) -> None:
    reasoning = "First list the files.\nThen answer — «exactly» this text must come back."
    replies = [
        Reply(reasoning=reasoning, tool_calls=[("run_shell_command", LS)]),
        Reply(content="Done.", reasoning="Short."),
    ]
    sampler = Sampler(fake_backend, *replies)
    sid = gateway.new_session()
    c = client(api_version, sid)
    config = types.GenerateContentConfig(
        tools=[types.Tool(function_declarations=[SHELL])],
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
        thinking_config=types.ThinkingConfig(include_thoughts=True, thinking_budget=8192),
    )
    contents: list[Any] = [types.Content(role="user", parts=[types.Part(text="list")])]

    first = c.models.generate_content(model=MODEL, contents=contents, config=config)
    assert first.candidates and first.candidates[0].content and first.candidates[0].content.parts
    thought, call_part = first.candidates[0].content.parts
    assert thought.thought and thought.text == reasoning
    assert call_part.function_call is not None and call_part.thought_signature
    # Gemini CLI keeps the signed part but drops thought parts from the history it resends.
    contents.append(types.Content(role="model", parts=[call_part]))
    fc = call_part.function_call
    contents.append(
        types.Content(
            role="user",
            parts=[types.Part.from_function_response(name=fc.name or "", response={"output": "a.txt"})],
        )
    )
    second = c.models.generate_content(model=MODEL, contents=contents, config=config)
    assert second.text == "Done."

    recs = check_records(gateway, sid, sampler, dialect="gemini", model=MODEL)
    (assistant,) = assistant_messages(sampler.requests[1])
    assert assistant["reasoning_content"] == reasoning
    # A functionResponse without an id is matched to the oldest unanswered call of that name.
    assert tool_messages(sampler.requests[1]) == [{"role": "tool", "tool_call_id": fc.id, "content": "a.txt"}]
    check_prefix_chain(recs)


def test_count_tokens_matches_the_prompt_of_the_call(
    gateway: Gateway, fake_backend: FakeBackend, api_version: str
) -> None:
    sampler = Sampler(fake_backend, Reply(content="ok"))
    sid = gateway.new_session()
    c = client(api_version, sid)
    contents = [types.Content(role="user", parts=[types.Part(text="How many tokens is this?")])]
    counted = c.models.count_tokens(model=MODEL, contents=contents)
    assert gateway.completions(sid) == []  # counting is not a generation
    r = c.models.generate_content(model=MODEL, contents=contents)
    (rec,) = check_records(gateway, sid, sampler, dialect="gemini", model=MODEL)
    assert counted.total_tokens == len(rec.prompt_ids or []) == r.usage_metadata.prompt_token_count  # type: ignore[union-attr]
    (tokenized,) = fake_backend.app.tokenize_requests
    assert counted.total_tokens == len(prompt_ids(tokenized))


def test_model_listing_and_lookup(gateway: Gateway, api_version: str) -> None:
    c = client(api_version, gateway.new_session())
    assert [m.name for m in c.models.list()] == [f"models/{SERVED_MODEL}"]
    got = c.models.get(model=MODEL)
    assert got.name == f"models/{MODEL}" and got.display_name == MODEL
