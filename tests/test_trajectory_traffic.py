"""Real traffic: sessions recorded through the gateway the way each real CLI sends its history, then rebuilt.

Each test drives a live gateway (loopback HTTP, official SDK as client, SQLite store) in front of the fake
vLLM, replaying one CLI's request shapes turn after turn (request bodies in `tests/data`, facts in
`harness-cli-facts.md`): what it sends, what it echoes back from each answer, what it re-serializes. The
stored records are then rebuilt with `polar.trajectory.build` and checked with `check_session` (every
strategy audited, coverage exactly 1.0, same sampled tokens everywhere) against the chains the session
must form.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest
from google import genai
from google.genai import types

from polar.store.records import CompletionRecord
from polar.trajectory import Trajectory, audit, build
from tests.conftest import FakeBackend, Gateway
from tests.fakes.chatml import IM_END
from tests.fakes.fake_vllm import Reply
from tests.sdk_support import (
    TOKENIZER,
    Sampler,
    prompt_ids,
    sampled_ids,
)
from tests.test_trajectory_invariants import check_session

# One fake backend and gateway for the whole module (see conftest.module_stack).
pytestmark = pytest.mark.shared_stack

DATA = Path(__file__).parent / "data"
QUIRK = "quirk:claude_code_billing_header"


def recorded(gw: Gateway, sid: str, sampler: Sampler) -> list[CompletionRecord]:
    """The session's records, checked one for one against what the fake received and sampled."""
    recs = gw.completions(sid)
    assert recs == gw.stored(sid)
    assert len(recs) == len(sampler.requests) == len(sampler.replies)
    for rec, upstream, reply in zip(recs, sampler.requests, sampler.replies, strict=True):
        assert rec.upstream_request == upstream
        assert rec.prompt_ids == prompt_ids(upstream)
        assert rec.response_ids == sampled_ids(reply)
        assert rec.trainable
    return recs


def chains(t: Trajectory) -> list[list[str]]:
    return [tr.metadata["completion_ids"] for tr in t.traces]


def ids(recs: Sequence[CompletionRecord], *groups: Sequence[int]) -> list[list[str]]:
    """Completion ids of `recs`, grouped by call index: the expected chains."""
    return [[recs[i].completion_id for i in g] for g in groups]


def extends(prev: CompletionRecord, nxt_prompt: Sequence[int]) -> bool:
    """Whether a prompt continues `prev`'s prompt and sampled tokens, token for token."""
    head = [*(prev.prompt_ids or []), *(prev.response_ids or [])]
    return len(nxt_prompt) > len(head) and list(nxt_prompt[: len(head)]) == head


# ---- Claude Code: Anthropic Messages, streaming, ?beta=true, a new billing nonce on every call ------------

CLAUDE = json.loads((DATA / "claude_code_2_1_request.json").read_text())
CC_SMALL_MODEL = "claude-haiku-4-5"
# Claude Code 2.1.x puts this line first in `system`, with a `cch` nonce that changes on every call.
CC_BILLING = "x-anthropic-billing-header: cc_version=2.1.197.a3f; cc_entrypoint=sdk-cli; cch={cch};"
CC_BETAS = ["claude-code-20250219", "interleaved-thinking-2025-05-14", "context-management-2025-06-27"]
# A small/fast-model side call (Claude Code's topic detection); what matters is its shape: another system
# prompt, no tools, another model, the same billing line.
CC_SIDE_SYSTEM = (
    "Analyze if this message indicates a new conversation topic. If it does, extract a 2-3 word title "
    'that captures the new topic. Format your response as a JSON object with two fields: "isNewTopic" '
    '(boolean) and "title" (string, or null if isNewTopic is false).'
)


def cc_system(cch: str, rest: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": CC_BILLING.format(cch=cch)}, *copy.deepcopy(list(rest))]


class ClaudeCode:
    """Claude Code's client side: its captured request body, a fresh `cch` per call, and the echo of each
    answer's content blocks (thinking with signature, text, tool_use) followed by `tool_result` blocks that
    carry `cache_control`, as the 2.1 capture shows."""

    def __init__(self, gw: Gateway, sid: str) -> None:
        self.urls: list[str] = []
        http = httpx2.Client(event_hooks={"request": [lambda r: self.urls.append(str(r.url))]})
        self.client = anthropic.Anthropic(base_url=gw.url, api_key=sid, max_retries=0, http_client=http)
        self.messages: list[dict[str, Any]] = [copy.deepcopy(CLAUDE["messages"][0])]
        self.nonces: list[str] = []

    def _nonce(self) -> str:
        cch = f"{(len(self.nonces) * 0x2F1B7 + 0x5E1D0) % 0xFFFFF:05x}"
        self.nonces.append(cch)
        return cch

    def turn(self, tool_result: str | None = None) -> Any:
        """One main-loop call; `tool_result` answers the previous turn's tool_use first."""
        if tool_result is not None:
            (use,) = [b for b in self.messages[-1]["content"] if b["type"] == "tool_use"]
            block = {
                "type": "tool_result",
                "tool_use_id": use["id"],
                "content": tool_result,
                "is_error": False,
                "cache_control": {"type": "ephemeral"},
            }
            self.messages.append({"role": "user", "content": [block]})
        with self.client.beta.messages.stream(
            model=CLAUDE["model"],
            max_tokens=CLAUDE["max_tokens"],
            system=cc_system(self._nonce(), CLAUDE["system"][1:]),  # type: ignore[arg-type]
            messages=self.messages,  # type: ignore[arg-type]
            tools=CLAUDE["tools"],
            thinking=CLAUDE["thinking"],
            context_management=CLAUDE["context_management"],
            output_config=CLAUDE["output_config"],
            metadata=CLAUDE["metadata"],
            betas=CC_BETAS,
            extra_query={"beta": "true"},  # the TypeScript SDK Claude Code ships adds it; Python does not
        ) as stream:
            final = stream.get_final_message()
        self.messages.append(
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]}
        )
        return final

    def side_call(self, text: str) -> Any:
        """The small/fast model's one-shot call: its own system prompt, no tools, streamed too."""
        with self.client.beta.messages.stream(
            model=CC_SMALL_MODEL,
            max_tokens=512,
            system=cc_system(self._nonce(), [{"type": "text", "text": CC_SIDE_SYSTEM}]),  # type: ignore[arg-type]
            messages=[{"role": "user", "content": [{"type": "text", "text": text}]}],
            metadata=CLAUDE["metadata"],
            betas=CC_BETAS,
            extra_query={"beta": "true"},  # the TypeScript SDK Claude Code ships adds it; Python does not
        ) as stream:
            return stream.get_final_message()


def raw_system_prompt(rec: CompletionRecord) -> list[int]:
    """The prompt the server would have seen had the billing line reached it: the record's upstream body
    with the system message rebuilt from every system block Claude Code sent, rendered and tokenized by the
    same fake tokenizer (so it equals the stored prompt except for that line)."""
    upstream = copy.deepcopy(rec.upstream_request)
    system = upstream["messages"][0]
    assert system["role"] == "system"
    system["content"] = "\n".join(b["text"] for b in rec.request["system"])
    return prompt_ids(upstream)


def test_claude_code_tool_loop_with_a_new_billing_nonce_every_call_is_one_chain(
    gateway: Gateway, fake_backend: FakeBackend
) -> None:
    replies = [
        Reply(
            reasoning="The user wants a command run first, then a file read.",
            content="I'll run the command first.",
            tool_calls=[("Bash", '{"command":"echo hi-from-tool","description":"Print a test string"}')],
        ),
        Reply(content='{"isNewTopic": true, "title": "Echo and read"}'),  # side call
        Reply(
            reasoning="It printed hi-from-tool. Now the file.",
            tool_calls=[("Read", '{"file_path":"/work/repo/missing.txt"}')],
        ),
        Reply(tool_calls=[("Bash", '{"command":"ls /work/repo","description":"List the repo"}')]),
        Reply(content='{"isNewTopic": false, "title": null}'),  # side call
        Reply(
            reasoning="The file is missing; ls confirms it.",
            content="`echo` printed hi-from-tool, and /work/repo/missing.txt does not exist.",
        ),
    ]
    sampler = Sampler(fake_backend, *replies)
    sid = gateway.new_session(task_id="claude-code")
    cc = ClaudeCode(gateway, sid)

    first = cc.turn()
    assert [b.type for b in first.content] == ["thinking", "text", "tool_use"]
    assert first.content[0].signature and first.stop_reason == "tool_use"
    cc.side_call("Run `echo hi-from-tool`, then read /work/repo/missing.txt and tell me both results.")
    cc.turn(tool_result="hi-from-tool")
    cc.turn(tool_result="<tool_use_error>File does not exist.</tool_use_error>")
    cc.side_call("ok, thanks")
    last = cc.turn(tool_result="CLAUDE.md\nsrc")
    assert last.stop_reason == "end_turn" and last.content[-1].text == replies[-1].content

    recs = recorded(gateway, sid, sampler)
    main = [0, 2, 3, 5]  # calls 1 and 4 are side calls
    assert len(set(cc.nonces)) == len(recs) == 6
    assert cc.urls == [f"{gateway.url}/v1/messages?beta=true"] * 6
    assert [r.model_requested for r in recs] == [
        CLAUDE["model"] if i in main else CC_SMALL_MODEL for i in range(6)
    ]
    for rec, cch in zip(recs, cc.nonces, strict=True):
        # The harness sent its nonce; the normalizer took the line out before the policy saw it, said so.
        assert f"cch={cch};" in rec.request["system"][0]["text"]
        assert QUIRK in rec.flags
        system = rec.upstream_request["messages"][0]
        assert system["role"] == "system" and "x-anthropic-billing-header" not in system["content"]
        assert system["content"] == "\n".join(b["text"] for b in rec.request["system"][1:])
    # The echoed thinking came back exactly through our signature: each main prompt extends the last.
    assert all(extends(recs[a], recs[b].prompt_ids or []) for a, b in pairwise(main))

    built = check_session(recs, expected_chains=ids(recs, main, [1], [4]))
    split = built["split"]
    assert [tr.metadata["started_by"] for tr in split.traces] == ["root", "root", "root"]
    assert split.metadata["merged_calls"] == 3 and split.metadata["breaks"] == {}
    assert split.metadata["drift_turns"] == 0
    trace = split.traces[0]
    assert all(QUIRK in f for f in trace.metadata["flags"].values())
    # One trace holds the whole loop: prompt of the first call, then every sampled turn and tool result.
    last_rec = recs[main[-1]]
    assert trace.prompt_ids + trace.response_ids == [
        *(last_rec.prompt_ids or []),
        *(last_rec.response_ids or []),
    ]

    # Without the normalizer: the same calls with the billing line left in the system prompt. Each call's
    # prompt then differs from the previous one at its nonce, so no call extends another and the loop falls
    # apart into one chain per call (nothing lost, but nothing merged).
    raw = [dataclasses.replace(r, prompt_ids=raw_system_prompt(r)) for r in recs]
    for r, unnormalized in zip(recs, raw, strict=True):
        assert unnormalized.prompt_ids != r.prompt_ids
        assert TOKENIZER.decode(unnormalized.prompt_ids or []).replace(
            r.request["system"][0]["text"] + "\n", "", 1
        ) == TOKENIZER.decode(r.prompt_ids or [])
    assert not any(extends(raw[a], raw[b].prompt_ids or []) for a, b in pairwise(main))
    unmerged = build(raw, "prefix_merging")
    assert chains(unmerged) == ids(raw, *([i] for i in range(6)))
    assert unmerged.metadata["coverage"] == 1.0 and audit(unmerged, raw).ok


# ---- Codex: Responses, streaming, store=false, encrypted reasoning, output items echoed byte for byte ----

# Shaped after Codex 0.171's first request (harness-cli-facts.md): developer + user context, its tools (one
# freeform), reasoning summary, store false, encrypted reasoning included, a prompt cache key.
CODEX = json.loads((DATA / "codex_request.json").read_text())


def codex_item(item: Any) -> dict[str, Any]:
    """An output item as Codex sends it back: its item types serialize without `id`, and the reasoning
    item keeps its summary and encrypted content."""
    if item.type == "reasoning":
        summary = [s.model_dump() for s in item.summary]
        return {"type": "reasoning", "summary": summary, "encrypted_content": item.encrypted_content}
    if item.type == "function_call":
        return {
            "type": "function_call",
            "name": item.name,
            "arguments": item.arguments,
            "call_id": item.call_id,
        }
    assert item.type == "message"
    text = [{"type": "output_text", "text": c.text} for c in item.content]
    return {"type": "message", "role": "assistant", "content": text}


def test_codex_responses_loop_echoing_items_byte_for_byte_is_one_chain(
    gateway: Gateway, fake_backend: FakeBackend
) -> None:
    # Arguments with spaces: Codex echoes `arguments` as it received them, so nothing is re-serialized.
    replies = [
        Reply(reasoning="Run the echo first.", tool_calls=[("exec_command", '{"cmd": "echo hi-from-tool"}')]),
        Reply(
            reasoning="Now read the README.",
            tool_calls=[("exec_command", '{"cmd": "cat README.md", "workdir": "/work/repo"}')],
        ),
        Reply(reasoning="Answer.", content="It printed hi-from-tool; README.md says: polar."),
    ]
    sampler = Sampler(fake_backend, *replies)
    sid = gateway.new_session(task_id="codex")
    c = openai.OpenAI(base_url=gateway.url + "/v1", api_key=sid, max_retries=0)
    body = copy.deepcopy(CODEX)
    history: list[dict[str, Any]] = body.pop("input")
    body.pop("stream")
    outputs = ["hi-from-tool\n", "# polar\n"]
    for k in range(3):
        events: list[Any] = list(c.responses.create(input=history, stream=True, **body))  # type: ignore[arg-type]
        assert events[-1].type == "response.completed"
        items = [e.item for e in events if e.type == "response.output_item.done"]
        history += [codex_item(i) for i in items]
        if k < 2:
            (call,) = [i for i in items if i.type == "function_call"]
            assert call.arguments == replies[k].tool_calls[0][1]
            history.append({"type": "function_call_output", "call_id": call.call_id, "output": outputs[k]})
    assert events[-1].response.output_text == replies[-1].content

    recs = recorded(gateway, sid, sampler)
    assert [r.dialect for r in recs] == ["responses"] * 3
    assert all(r.request["store"] is False for r in recs)
    # The function_call came back byte for byte and the reasoning exactly through encrypted_content.
    assistant = next(m for m in recs[2].upstream_request["messages"] if m["role"] == "assistant")
    assert assistant["reasoning_content"] == replies[0].reasoning
    assert assistant["tool_calls"][0]["function"]["arguments"] == replies[0].tool_calls[0][1]
    built = check_session(recs, expected_chains=ids(recs, [0, 1, 2]))
    assert built["split"].metadata["drift_turns"] == 0 and built["split"].metadata["merged_calls"] == 2


# ---- Gemini CLI: streamGenerateContent?alt=sse, functionCall echoed with its thoughtSignature -------------

GEMINI = json.loads((DATA / "gemini_cli_request.json").read_text())
GEMINI_MODEL = "gemini-2.5-pro"


def test_gemini_cli_function_loop_with_thought_signatures_is_one_chain(
    gateway: Gateway, fake_backend: FakeBackend
) -> None:
    replies = [
        Reply(
            reasoning="Run the command the user asked for.",
            tool_calls=[("run_shell_command", '{"command":"echo hi-from-tool","description":"Print it."}')],
        ),
        Reply(
            reasoning="Check the README too.",
            tool_calls=[("read_file", '{"file_path":"/work/repo/README.md"}')],
        ),
        Reply(reasoning="Done.", content="It printed hi-from-tool. README.md is empty."),
    ]
    sampler = Sampler(fake_backend, *replies)
    sid = gateway.new_session(task_id="gemini-cli")
    urls: list[str] = []
    http = httpx.Client(event_hooks={"request": [lambda r: urls.append(str(r.url))]})
    c = genai.Client(
        api_key=sid,
        http_options=types.HttpOptions(base_url=gateway.url, api_version="v1beta", httpx_client=http),
    )
    gen = GEMINI["generationConfig"]
    config = types.GenerateContentConfig(
        system_instruction=types.Content.model_validate(GEMINI["systemInstruction"]),
        tools=[types.Tool.model_validate(t) for t in GEMINI["tools"]],
        temperature=gen["temperature"],
        top_p=gen["topP"],
        top_k=gen["topK"],
        thinking_config=types.ThinkingConfig.model_validate(gen["thinkingConfig"]),
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
    )
    # The capture's session start: the CLI's context turn, its canned model answer, then the prompt.
    contents = [types.Content.model_validate(m) for m in GEMINI["contents"][:3]]
    outputs = [{"output": "Command: echo hi-from-tool\nOutput: hi-from-tool\nExit Code: 0"}, {"output": ""}]
    for k in range(3):
        chunks = list(c.models.generate_content_stream(model=GEMINI_MODEL, contents=contents, config=config))
        parts = [p for ch in chunks for p in ch.candidates[0].content.parts or []]  # type: ignore[index,union-attr]
        assert any(p.thought for p in parts)
        # Gemini CLI drops the thought parts and keeps the signed functionCall part as it came.
        kept = [p for p in parts if not p.thought]
        contents.append(types.Content(role="model", parts=kept))
        if k < 2:
            (call,) = [p for p in kept if p.function_call]
            assert call.thought_signature and call.function_call and call.function_call.id
            fc = call.function_call
            response = types.FunctionResponse(id=fc.id, name=fc.name, response=outputs[k])
            contents.append(types.Content(role="user", parts=[types.Part(function_response=response)]))
    assert "".join(p.text or "" for p in kept) == replies[-1].content
    http.close()

    recs = recorded(gateway, sid, sampler)
    # On the wire: the functionCall part came back with its thoughtSignature, answered by a functionResponse;
    # the signature alone brought the dropped thought back, exactly.
    sent = recs[1].request["contents"]
    (signed,) = [p for p in sent[3]["parts"] if "functionCall" in p]
    assert signed["thoughtSignature"] and "functionResponse" in sent[4]["parts"][0]
    assistant = next(
        m for m in recs[1].upstream_request["messages"] if m["role"] == "assistant" and m.get("tool_calls")
    )
    assert assistant["reasoning_content"] == replies[0].reasoning
    assert urls == [f"{gateway.url}/v1beta/models/{GEMINI_MODEL}:streamGenerateContent?alt=sse"] * 3
    assert [r.dialect for r in recs] == ["gemini"] * 3
    built = check_session(recs, expected_chains=ids(recs, [0, 1, 2]))
    assert built["split"].metadata["drift_turns"] == 0


# ---- Chat harnesses (Qwen Code, OpenCode, Pi): streaming with include_usage, history re-serialized --------

QWEN_SYSTEM = (
    "You are Qwen Code, an interactive CLI agent developed by Alibaba Group, specializing in software "
    "engineering tasks. Your primary goal is to help users safely and efficiently.\n\n# Core Mandates\n"
)
QWEN_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "run_shell_command",
            "description": "Executes a given shell command as `bash -c <command>`.",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string", "description": "Exact bash command to execute."},
                    "is_background": {"type": "boolean"},
                },
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Reads and returns the content of a specified file.",
            "parameters": {
                "type": "object",
                "properties": {"absolute_path": {"type": "string"}},
                "required": ["absolute_path"],
            },
        },
    },
]


class ChatHarness:
    """A Chat-speaking CLI: streams every call with `include_usage`, assembles the answer from the deltas,
    and sends it back the way Qwen Code, OpenCode and Pi do: tool-call arguments re-serialized from the
    parsed object (`JSON.stringify`: no spaces), tool results as a string or, like Qwen Code, as an array
    of text parts."""

    def __init__(
        self, gw: Gateway, sid: str, model: str, *, result_parts: bool = False, rename_ids: bool = False
    ) -> None:
        self.client = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)
        self.model = model
        self.result_parts = result_parts
        # A client that rebuilds its history under call ids of its own: the gateway cannot tell the calls
        # are the ones it returned, so it cannot restore their arguments (the drift reaches the server).
        self.rename_ids = rename_ids
        self.sampled_arguments: list[str] = []  # tool-call arguments as the model wrote them

    def call(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        """One streamed call; returns the assistant message as the harness puts it into its history."""
        stream = self.client.chat.completions.create(  # type: ignore[call-overload]
            model=self.model,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            tools=tools or openai.omit,
        )
        content, usage = "", None
        calls: dict[int, dict[str, str]] = {}
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for tc in choice.delta.tool_calls or []:
                    slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                    slot["id"] += tc.id or ""
                    if tc.function is not None:
                        slot["name"] += tc.function.name or ""
                        slot["arguments"] += tc.function.arguments or ""
        assert usage is not None and usage.completion_tokens > 0  # the include_usage chunk came
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = []
            for c in (calls[i] for i in sorted(calls)):
                self.sampled_arguments.append(c["arguments"])
                args = json.dumps(json.loads(c["arguments"]), separators=(",", ":"))
                fn = {"name": c["name"], "arguments": args}
                call_id = f"local_{len(self.sampled_arguments)}" if self.rename_ids else c["id"]
                message["tool_calls"].append({"id": call_id, "type": "function", "function": fn})
        messages.append(message)
        return message

    def loop(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], outputs: Sequence[str]
    ) -> None:
        """Call, run the tool and send its result, once per output; then one last call that answers."""
        for output in outputs:
            (call,) = self.call(messages, tools)["tool_calls"]
            content: Any = [{"type": "text", "text": output}] if self.result_parts else output
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
        assert "tool_calls" not in self.call(messages, tools)


SPACED_LS = '{"command": "ls -la"}'  # what the model wrote
COMPACT_LS = '{"command":"ls -la"}'  # what Qwen Code / OpenCode / Pi send back


def qwen_session(
    gw: Gateway, fake: FakeBackend, *, result_parts: bool, rename_ids: bool = True
) -> tuple[str, list[CompletionRecord]]:
    """Three calls: a tool call whose arguments the model wrote with spaces, one written compactly, an
    answer. The harness re-serializes the first; under its own call ids (`rename_ids`) the gateway cannot
    give the policy its original text back, so the server re-renders that turn differently."""
    replies = [
        Reply(content="Let me look.", tool_calls=[("run_shell_command", SPACED_LS)]),
        Reply(tool_calls=[("read_file", '{"absolute_path":"/work/repo/README.md"}')]),
        Reply(content="The repo holds README.md, which says: polar."),
    ]
    sampler = Sampler(fake, *replies)
    sid = gw.new_session(task_id="qwen-code")
    harness = ChatHarness(gw, sid, "qwen3-coder-plus", result_parts=result_parts, rename_ids=rename_ids)
    messages = [
        {"role": "system", "content": QWEN_SYSTEM},
        {"role": "user", "content": "What is in this repo?"},
    ]
    harness.loop(messages, QWEN_TOOLS, ["total 8\n-rw-r--r-- 1 root root 6 README.md", "# polar"])
    assert harness.sampled_arguments[0] == SPACED_LS
    recs = recorded(gw, sid, sampler)
    (sent,) = [m for m in recs[1].upstream_request["messages"] if m["role"] == "assistant"]
    assert sent["tool_calls"][0]["function"]["arguments"] == (COMPACT_LS if rename_ids else SPACED_LS)
    tool = recs[2].upstream_request["messages"][-1]
    assert (
        tool["role"] == "tool" and (tool["content"] == [{"type": "text", "text": "# polar"}]) is result_parts
    )
    return sid, recs


@pytest.mark.parametrize("result_parts", [True, False], ids=["qwen-code", "opencode-pi"])
def test_chat_harness_reserializing_arguments_gets_them_restored_and_stays_one_chain(
    gateway: Gateway, fake_backend: FakeBackend, result_parts: bool
) -> None:
    """The gateway gives the policy back the arguments text it wrote (polar.gateway.restore)."""
    _, recs = qwen_session(gateway, fake_backend, result_parts=result_parts, rename_ids=False)
    assert "quirk:tool_arguments_restored" in recs[1].flags
    built = check_session(recs, expected_chains=ids(recs, [0, 1, 2]))
    assert built["split"].metadata["drift_turns"] == 0 and built["split"].metadata["breaks"] == {}


@pytest.mark.parametrize("result_parts", [True, False], ids=["qwen-code", "opencode-pi"])
def test_chat_harness_reserializing_arguments_drifts_and_splits_or_merges(
    gateway: Gateway, fake_backend: FakeBackend, result_parts: bool
) -> None:
    _, recs = qwen_session(gateway, fake_backend, result_parts=result_parts)
    first, second, third = recs
    p0, a0 = first.prompt_ids or [], first.response_ids or []
    p1 = second.prompt_ids or []
    # The server's next prompt keeps the first prompt but re-renders the sampled turn without the space.
    assert p1[: len(p0)] == p0 and not extends(first, p1) and extends(second, third.prompt_ids or [])

    built = check_session(recs, expected_chains=ids(recs, [0], [1, 2]))
    split = built["split"]
    meta = split.metadata
    assert meta["breaks"] == {"context_drift": 1} and meta["coverage"] == 1.0
    assert (meta["drift_turns"], meta["drift_merged"], meta["merged_calls"]) == (1, 0, 1)
    head = split.traces[1].metadata
    assert head["started_by"] == "context_drift" and head["split_from"] == first.completion_id
    assert head["diverged_from"] == 0
    (drift,) = audit(split, recs).drift
    assert (drift.completion_id, drift.next_completion_id, drift.merged) == (
        first.completion_id,
        second.completion_id,
        False,
    )
    # It is found exactly where the model wrote a space the harness took out.
    assert TOKENIZER.decode(a0[: drift.diverges_at]).endswith('"arguments": {"command":')
    assert TOKENIZER.decode(a0[drift.diverges_at : drift.diverges_at + 1]) == " "
    assert drift.rendered_tokens == drift.sampled_tokens - 1

    # on_drift="merge": one trace, the drift counted and declared; the audit still proves every trainable
    # token is what was sampled, and that only the turns after the drift saw another context.
    merged = built["merge"]
    assert chains(merged) == ids(recs, [0, 1, 2])
    assert (merged.metadata["drift_turns"], merged.metadata["drift_merged"]) == (1, 1)
    assert merged.metadata["breaks"] == {} and merged.metadata["coverage"] == 1.0
    trace = merged.traces[0]
    assert trace.metadata["drift_turns"] == [1]
    report = audit(merged, recs)
    assert report.ok and report.coverage == 1.0
    assert (report.turns, report.exact_turns) == (3, 1) and [d.merged for d in report.drift] == [True]
    # The trace holds the sampled turn (with its space), then the next prompt from after the re-rendered
    # turn's end-of-turn token: the re-rendering itself is not in it.
    off = trace.metadata["turn_offsets"]
    assert trace.response_ids[: len(a0)] == a0 and sum(trace.loss_mask[: len(a0)]) == len(a0)
    cut = p1.index(IM_END, len(p0)) + 1
    assert trace.response_ids[len(a0) : off[1]] == p1[cut:]
    assert not any(trace.loss_mask[len(a0) : off[1]])


# ---- OpenCode: a title-generation side call (no tools, its own system prompt) before the agent loop --------

OPENCODE_TITLE_SYSTEM = (
    "You are a title generator. You output ONLY a thread title. Nothing else.\n\n<task>\nGenerate a brief "
    "title that would help the user find this conversation later.\n</task>"
)
OPENCODE_SYSTEM = (
    "You are opencode, an interactive CLI tool that helps users with software engineering tasks."
)
OPENCODE_ENV = "<env>\n  Working directory: /work/repo\n  Platform: linux\n</env>"
OPENCODE_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {arg: {"type": "string"}},
                "required": [arg],
                "additionalProperties": False,
                "$schema": "http://json-schema.org/draft-07/schema#",
            },
        },
    }
    for name, arg, description in (
        ("bash", "command", "Executes a given bash command in a persistent shell session."),
        ("read", "filePath", "Reads a file from the local filesystem."),
        ("glob", "pattern", "Fast file pattern matching tool."),
    )
]


def test_opencode_title_call_then_agent_loop_form_two_chains(
    gateway: Gateway, fake_backend: FakeBackend
) -> None:
    # Compact arguments: OpenCode's re-serialization leaves them as they are, so the loop stays exact.
    replies = [
        Reply(content="Echo and read README"),
        Reply(tool_calls=[("bash", '{"command":"echo hi-from-tool"}')]),
        Reply(tool_calls=[("read", '{"filePath":"/work/repo/README.md"}')]),
        Reply(content="It printed hi-from-tool; README.md says polar."),
    ]
    sampler = Sampler(fake_backend, *replies)
    sid = gateway.new_session(task_id="opencode")
    prompt = "Run `echo hi-from-tool`, then read README.md."
    title = ChatHarness(gateway, sid, "small-model")
    title_messages = [
        {"role": "system", "content": OPENCODE_TITLE_SYSTEM},
        {"role": "user", "content": "Generate a title for this conversation:\n"},
        {"role": "user", "content": prompt},
    ]
    assert title.call(title_messages, None)["content"] == replies[0].content
    agent = ChatHarness(gateway, sid, "policy")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": OPENCODE_SYSTEM},
        {"role": "system", "content": OPENCODE_ENV},
        {"role": "user", "content": prompt},
    ]
    agent.loop(messages, OPENCODE_TOOLS, ["hi-from-tool\n", "polar\n"])

    recs = recorded(gateway, sid, sampler)
    assert recs[0].tools is None and recs[1].tools is not None
    built = check_session(recs, expected_chains=ids(recs, [0], [1, 2, 3]))
    split = built["split"]
    assert [tr.metadata["started_by"] for tr in split.traces] == ["root", "root"]
    assert split.metadata["breaks"] == {} and split.metadata["drift_turns"] == 0


# ---- Compaction: after three turns the harness replaces its history with a summary -------------------------


def test_compaction_starts_a_new_chain_and_drops_nothing(gateway: Gateway, fake_backend: FakeBackend) -> None:
    summary = "Summary: ran `echo hi-from-tool` (printed hi-from-tool) and read README.md (it says polar)."
    replies = [
        Reply(
            content="First the command.",
            tool_calls=[("run_shell_command", '{"command":"echo hi-from-tool"}')],
        ),
        Reply(tool_calls=[("read_file", '{"absolute_path":"/work/repo/README.md"}')]),
        Reply(content="It printed hi-from-tool; README.md says polar."),
        Reply(content=summary),  # the harness's summarization request, sent on the full history
        Reply(tool_calls=[("run_shell_command", '{"command":"ls"}')]),
        Reply(content="The repo holds README.md only."),
    ]
    sampler = Sampler(fake_backend, *replies)
    sid = gateway.new_session(task_id="compaction")
    harness = ChatHarness(gateway, sid, "qwen3-coder-plus", result_parts=True)
    system = {"role": "system", "content": QWEN_SYSTEM}
    task = {"role": "user", "content": "Run `echo hi-from-tool`, then read README.md."}
    messages: list[dict[str, Any]] = [system, task]
    harness.loop(messages, QWEN_TOOLS, ["hi-from-tool", "polar"])
    messages.append({"role": "user", "content": "Summarize the conversation so far for a fresh context."})
    assert harness.call(messages, QWEN_TOOLS)["content"] == summary
    # The compacted context: system prompt, the task, the summary; the loop goes on from there.
    messages = [system, task, {"role": "user", "content": summary + "\nNow list the repo."}]
    harness.loop(messages, QWEN_TOOLS, ["README.md"])

    recs = recorded(gateway, sid, sampler)
    assert len(recs[4].prompt_ids or []) < len(recs[3].prompt_ids or [])
    built = check_session(recs, expected_chains=ids(recs, [0, 1, 2, 3], [4, 5]))
    split = built["split"]
    assert split.metadata["breaks"] == {"compaction": 1} and split.metadata["coverage"] == 1.0
    head = split.traces[1].metadata
    assert head["started_by"] == "compaction" and head["diverged_from"] == 0
    # Nothing dropped: every call's sampled tokens are trainable in exactly one trace.
    assert split.metadata["trainable_tokens"] == sum(len(r.response_ids or []) for r in recs)
    assert build(recs, "per_request").metadata["trainable_tokens"] == split.metadata["trainable_tokens"]


# ---- The gateway's trajectory endpoint on a recorded session ---------------------------------------------


def test_trajectory_endpoint_serves_what_build_makes(gateway: Gateway, fake_backend: FakeBackend) -> None:
    sid, recs = qwen_session(gateway, fake_backend, result_parts=True)
    auth = {"authorization": f"Bearer {gateway.control_token}"}
    with httpx.Client(base_url=gateway.control_url, timeout=30, headers=auth) as http:
        for strategy, traces in (("prefix_merging", 2), ("per_request", 3)):
            r = http.get(f"/sessions/{sid}/trajectory", params={"strategy": strategy})
            assert r.status_code == 200 and r.headers["content-type"] == "application/json"
            body = r.json()
            assert body["status"] == "COMPLETED" and len(body["traces"]) == traces
            assert body["metadata"]["coverage"] == 1.0 and body["metadata"]["strategy"] == strategy
            assert body["metadata"]["session_id"] == sid
            served = Trajectory.model_validate(body)
            assert served == build(recs, strategy)
            assert audit(served, recs).ok
        default = http.get(f"/sessions/{sid}/trajectory").json()
        assert default == http.get(f"/sessions/{sid}/trajectory?strategy=prefix_merging").json()

        # An unknown name, and an import path: builders are never loaded from a path sent over the network.
        for strategy in ("nope", "tests.test_trajectory_api:first_call_only"):
            r = http.get(f"/sessions/{sid}/trajectory", params={"strategy": strategy})
            assert r.status_code == 400 and strategy in r.json()["error"]["message"]
        r = http.get("/sessions/polar-no-such-session/trajectory", params={"strategy": "per_request"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
