"""Re-serialized tool arguments are given back to the policy as it wrote them, so chains stay exact."""

from __future__ import annotations

from typing import Any

import anthropic
import openai

from polar.gateway.canonical import CanonicalRequest, ToolCall
from polar.gateway.restore import ToolArguments
from polar.trajectory import audit, build
from tests.conftest import SERVED_MODEL, FakeBackend, Gateway
from tests.fakes.fake_vllm import Reply

SPACED = '{"command": "ls -la", "timeout": 10}'  # what the model wrote
COMPACT = '{"command":"ls -la","timeout":10}'  # what Qwen Code / OpenCode / Pi send back
SHELL = {"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}


def _req(arguments: str, call_id: str = "c1", name: str = "shell") -> CanonicalRequest:
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return CanonicalRequest(
        model="m",
        messages=[
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": "ok"},
        ],
    )


def test_only_the_same_json_value_is_restored() -> None:
    memory = ToolArguments()
    memory.remember((ToolCall("c1", "shell", SPACED),))
    restored, n = memory.restore(_req(COMPACT))
    assert n == 1 and restored.messages[1]["tool_calls"][0]["function"]["arguments"] == SPACED
    for changed in ('{"command":"rm -rf /","timeout":10}', "not json", SPACED):
        req = _req(changed)
        assert memory.restore(req) == (req, 0)  # edited, unparsable, or already exact: left as sent
    req = _req(COMPACT, call_id="unknown", name="other_tool")  # neither its id nor its tool is known
    assert memory.restore(req) == (req, 0)
    assert _req(COMPACT).messages[1]["tool_calls"][0]["function"]["arguments"] == COMPACT  # input untouched


def test_a_call_whose_id_was_dropped_is_matched_by_tool_and_value() -> None:
    """Pi's Gemini dialect sends function calls back without the id they were given (the gateway names
    them `unnamed_call_<i>_<j>`): the arguments are restored when the session's policy wrote exactly one text
    for that tool and value, and left as sent when it wrote two (which one this is cannot be known). A call
    under an id of the harness's own is never matched by value."""
    memory = ToolArguments()
    memory.remember((ToolCall("c1", "shell", SPACED),))
    renamed = _req(COMPACT, call_id="harness_7")
    assert memory.restore(renamed) == (renamed, 0)
    restored, n = memory.restore(_req(COMPACT, call_id="unnamed_call_1_0"))
    assert n == 1 and restored.messages[1]["tool_calls"][0]["function"]["arguments"] == SPACED
    memory.remember((ToolCall("c2", "shell", '{"timeout": 10, "command": "ls -la"}'),))  # same value
    req = _req(COMPACT, call_id="unnamed_call_1_0")
    assert memory.restore(req) == (req, 0)
    assert memory.restore(_req(COMPACT, call_id="c1"))[1] == 1  # by its id it is still known


def _said(content: Any, call_id: str = "c1") -> CanonicalRequest:
    req = _req(SPACED, call_id)
    return CanonicalRequest(model="m", messages=[req.messages[0], {**req.messages[1], "content": content}])


def test_the_newline_before_a_tool_call_is_given_back_once() -> None:
    """vLLM 0.32's hermes parser returns "Step 0.\n" as the content before `<tool_call>`, and Qwen's templates
    add a newline of their own before the call: upstream, that content loses one newline, so the template
    writes what was sampled ("Step 0.\n<tool_call>"). Only content the harness sent back unchanged, with the
    turn's first call; the rest stays as sent."""
    memory = ToolArguments()
    memory.remember((ToolCall("c1", "shell", SPACED), ToolCall("c2", "shell", SPACED)), "Step 0.\n")
    memory.remember((ToolCall("c3", "shell", SPACED),), "Step 1.")  # no newline at the end: nothing to do
    memory.remember((ToolCall("c4", "shell", SPACED),), "\n")  # emptied, it would lose the template's newline
    fixed, n = memory.restore_separators(_said("Step 0.\n"))
    assert n == 1 and fixed.messages[1]["content"] == "Step 0."
    parts = [{"type": "text", "text": "Step "}, {"type": "text", "text": "0.\n"}]
    fixed, n = memory.restore_separators(_said(parts))
    assert n == 1 and fixed.messages[1]["content"] == [parts[0], {"type": "text", "text": "0."}]
    assert parts[1]["text"] == "0.\n"  # the input is never changed in place
    for req in (
        _said("Step 0.\nand more\n"),  # the harness changed it
        _said("Step 0."),  # it trimmed it itself: the template's newline is the sampled one
        _said("Step 0.\n", call_id="c2"),  # not the turn's first call
        _said("Step 1."),
        _said("Step 1.\n", call_id="c3"),
        _said("\n", call_id="c4"),
        _said([{"type": "image_url", "image_url": {"url": "x"}}]),
    ):
        assert memory.restore_separators(req) == (req, 0)


def test_memory_is_bounded() -> None:
    memory = ToolArguments(limit=2)
    spaced = [f'{{"command": "ls {i}"}}' for i in range(3)]
    memory.remember(tuple(ToolCall(f"c{i}", "shell", spaced[i]) for i in range(3)))
    assert memory.restore(_req('{"command":"ls 0"}', "c0"))[1] == 0  # forgotten by id and by value
    assert memory.restore(_req('{"command":"ls 2"}', "c2"))[1] == 1


def _script(body: dict[str, Any]) -> Reply:
    if any(m.get("role") == "tool" for m in body["messages"]):
        return Reply(content="done")
    return Reply(tool_calls=[("shell", SPACED)])


def test_chat_harness_reserializing_arguments_keeps_one_chain(
    gateway: Gateway, fake_backend: FakeBackend
) -> None:
    fake_backend.app.script = _script
    sid = gateway.new_session()
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=sid, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "list the files"}]
    first = client.chat.completions.create(model="m", messages=messages, tools=[SHELL])  # type: ignore[arg-type]
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.arguments == SPACED
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": "shell", "arguments": COMPACT}}
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "a.txt"},
    ]
    client.chat.completions.create(model="m", messages=messages, tools=[SHELL])  # type: ignore[arg-type]
    upstream = fake_backend.app.requests[-1]["messages"][1]["tool_calls"][0]["function"]["arguments"]
    assert upstream == SPACED
    records = gateway.completions(sid)
    assert "quirk:tool_arguments_restored" in records[1].flags
    trajectory = build(records, strategy="prefix_merging")
    assert len(trajectory.traces) == 1 and trajectory.metadata["drift_turns"] == 0
    assert audit(trajectory, records).ok


def test_anthropic_tool_use_objects_get_their_original_text(
    gateway: Gateway, fake_backend: FakeBackend
) -> None:
    """Anthropic carries arguments as an object; the gateway's own serialization is compact."""
    fake_backend.app.script = lambda body: (
        Reply(content="done")
        if any(m.get("role") == "tool" for m in body["messages"])
        else Reply(tool_calls=[("shell", SPACED)])
    )
    sid = gateway.new_session()
    client = anthropic.Anthropic(base_url=gateway.url, api_key=sid, max_retries=0)
    tools = [{"name": "shell", "input_schema": {"type": "object"}}]
    first = client.messages.create(
        model="m",
        max_tokens=512,
        tools=tools,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "list"}],
    )
    use = next(b for b in first.content if b.type == "tool_use")
    client.messages.create(
        model="m",
        max_tokens=512,
        tools=tools,  # type: ignore[arg-type]
        messages=[
            {"role": "user", "content": "list"},
            {"role": "assistant", "content": [use.model_dump()]},  # type: ignore[list-item]
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "a.txt"}]},
        ],
    )
    records = gateway.completions(sid)
    trajectory = build(records, strategy="prefix_merging")
    assert len(trajectory.traces) == 1 and audit(trajectory, records).ok
    assert gateway.control("GET", f"/sessions/{sid}").json()["completions"] == 2
    assert records[0].model_served == SERVED_MODEL
