"""`tool_reference` blocks in Anthropic tool results: Claude Code's ToolSearch.

With `ENABLE_TOOL_SEARCH=true` Claude Code 2.1.197 defers most tools and offers `ToolSearch`; its result is
a `tool_result` holding `{"type": "tool_reference", "tool_name": ...}` blocks, and the next request defines
the loaded tool in `tools`. The request below was captured from that CLI talking to the gateway (turn 2,
after `ToolSearch` with `select:TaskCreate`). The gateway refused it with a 400; the policy must instead
read what the ToolSearch description promises: the tool's definition, inside a `<functions>` block.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from polar.gateway.dialects.anthropic.dialect import AnthropicDialect
from polar.gateway.errors import GatewayError
from polar.gateway.signatures import ReasoningCodec
from tests.test_dialect_anthropic import completion, sdk_client

DATA = Path(__file__).parent / "data"
CODEC = ReasoningCodec(b"test-key")
D = AnthropicDialect()


def real_request() -> dict[str, Any]:
    return json.loads((DATA / "claude_code_2_1_197_tool_search.json").read_text())


def function_line(tool: dict[str, Any]) -> str:
    shown = {"description": tool["description"], "name": tool["name"], "parameters": tool["input_schema"]}
    return f"<function>{orjson.dumps(shown).decode()}</function>"


def test_claude_code_tool_search_result_becomes_the_tool_definition() -> None:
    body = real_request()
    assert body["messages"][3]["content"][0]["content"] == [
        {"type": "tool_reference", "tool_name": "TaskCreate"}
    ]
    req = D.parse(body, CODEC)
    (result,) = [m for m in req.messages if m["role"] == "tool"]
    (task_create,) = [t for t in body["tools"] if t["name"] == "TaskCreate"]
    assert result == {
        "role": "tool",
        "tool_call_id": "call_1_0",
        "content": f"<functions>\n{function_line(task_create)}\n</functions>",
    }
    assert "Use this tool to create a structured task list" in result["content"]
    # The text after the tool result ("Tool loaded.") stays its own user message.
    assert req.messages[-1] == {"role": "user", "content": [{"type": "text", "text": "Tool loaded."}]}


def _body(parts: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 5,
        "tools": tools or [],
        "messages": [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": parts}]},
        ],
    }


def test_runs_of_references_share_a_block_and_keep_their_order_with_text() -> None:
    tools = [
        {"name": "A", "description": "does a", "input_schema": {"type": "object"}},
        {"name": "B", "input_schema": {"type": "object", "properties": {"x": {"type": "string"}}}},
    ]
    parts = [
        {"type": "text", "text": "found:"},
        {"type": "tool_reference", "tool_name": "A"},
        {"type": "tool_reference", "tool_name": "B"},
        {"type": "text", "text": "and"},
        {"type": "tool_reference", "tool_name": "Missing"},
    ]
    (result,) = [m for m in D.parse(_body(parts, tools), CODEC).messages if m["role"] == "tool"]
    assert result["content"] == (
        "found:\n"
        "<functions>\n"
        '<function>{"description":"does a","name":"A","parameters":{"type":"object"}}</function>\n'
        '<function>{"name":"B","parameters":{"type":"object","properties":{"x":{"type":"string"}}}}</function>\n'
        "</functions>\n"
        "and\n"
        # A tool the request does not define is still named, never dropped.
        '<functions>\n<function>{"name":"Missing"}</function>\n</functions>'
    )


@pytest.mark.parametrize(
    ("part", "param"),
    [
        ({"type": "tool_reference"}, "messages[2].content[0].content[0].tool_name"),
        ({"type": "tool_reference", "tool_name": 5}, "messages[2].content[0].content[0].tool_name"),
        ({"type": "search_result", "source": "s"}, "messages[2].content[0].content[0].type"),
    ],
)
def test_malformed_or_unsupported_parts_are_refused_by_field(part: dict[str, Any], param: str) -> None:
    with pytest.raises(GatewayError) as info:
        D.parse(_body([part]), CODEC)
    assert info.value.status == 400 and info.value.param == param


def test_sdk_sends_the_real_request_and_gets_a_message() -> None:
    body = real_request()
    seen: list[Any] = []
    client = sdk_client(completion(content="Done."), seen)
    extra = {k: body[k] for k in ("context_management", "output_config")}
    params = {k: v for k, v in body.items() if k not in extra and k != "stream"}
    with client.messages.stream(**params, extra_body=extra) as stream:
        message = stream.get_final_message()
    assert [b.text for b in message.content if b.type == "text"] == ["Done."]
    assert any(m["role"] == "tool" and "<functions>" in m["content"] for m in seen[0].messages)
