"""Tool calls that did not come out as calls never pass as answers: raw call markup left in the content (what
vLLM's parsers return when they fail), a call to a tool the request did not offer, and arguments that are
not an object the tool's schema accepts are flagged on the record with `tool_call_parse_error`, and the
trace's reward is 0 (still trainable). Through the real gateway over HTTP, with the fake vLLM answering as
vLLM does (no flags of its own); the real vLLM is tests/test_vllm_toolcheck.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from polar.evaluate.base import EvalResult
from polar.gateway import toolcheck
from polar.gateway.canonical import ToolCall
from polar.gateway.dialects.responses.dialect import ResponsesDialect
from polar.gateway.signatures import ReasoningCodec
from polar.rollout.rewards import assign_rewards
from polar.trajectory import build
from tests.conftest import start_gateway
from tests.fakes.fake_vllm import Reply
from tests.node_support import fake_policy

PARAMS = {
    "type": "object",
    "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}},
    "required": ["path"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": PARAMS}}]


def _call(name: str = "read_file", arguments: str = '{"path": "a.py"}') -> ToolCall:
    return ToolCall("call_1", name, arguments)


@pytest.mark.parametrize("tag", toolcheck.START_TAGS)
def test_any_parsers_start_tag_left_in_the_content_is_markup(tag: str) -> None:
    content = f"Let me look.\n{tag}read_file a.py"
    assert toolcheck.problems(TOOLS, content, []) == [toolcheck.FLAG_MARKUP]


@pytest.mark.parametrize(
    ("arguments", "fits"),
    [
        ('{"path": "a.py"}', True),
        ('{"path": "a.py", "lines": 3}', True),
        ('{"path": "a.py"', False),  # cut off
        ('["a.py"]', False),  # not an object
        ('"a.py"', False),
        ("{}", False),  # the required path is missing
        ('{"path": 3}', False),  # the wrong type
        ('{"path": "a.py", "lines": "3"}', False),
        ('{"path": "a.py", "mode": "r"}', False),  # additionalProperties: false
    ],
)
def test_arguments_must_be_an_object_the_schema_accepts(arguments: str, fits: bool) -> None:
    found = toolcheck.problems(TOOLS, None, [_call(arguments=arguments)])
    assert found == ([] if fits else [toolcheck.FLAG_BAD_ARGUMENTS])


GOOD = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call><|im_end|>'
CUT = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}\n</tool_call><|im_end|>'


def test_the_sampled_text_shows_markup_a_parser_swallowed_or_repaired() -> None:
    """vLLM's streaming hermes parser completed CUT into a call with `{"path": "a.py"}` (measured on 0.32):
    the answer looks right, the sampled text does not. A parser that swallows a broken call answers
    nothing at all. A tag inside the reasoning is no call."""
    assert toolcheck.problems(TOOLS, None, [_call()], GOOD) == []
    assert toolcheck.problems(TOOLS, None, [_call()], CUT) == [toolcheck.FLAG_MARKUP]
    assert toolcheck.problems(TOOLS, None, [], CUT) == [toolcheck.FLAG_MARKUP]
    assert toolcheck.problems(TOOLS, None, [_call(), _call()], GOOD) == [toolcheck.FLAG_MARKUP]
    thought = "<think>I could write <tool_call> here.</think>The file is fine.<|im_end|>"
    assert toolcheck.problems(TOOLS, "The file is fine.", [], thought) == []
    coder = (
        "<tool_call>\n<function=read_file>\n<parameter=path>\na.py\n</parameter>\n</function>\n</tool_call>"
    )
    assert toolcheck.problems(TOOLS, None, [_call()], coder) == []  # its parser's call count decides
    assert toolcheck.problems(TOOLS, None, [], coder) == [toolcheck.FLAG_MARKUP]


def test_a_call_to_a_tool_not_offered_and_what_no_tools_cannot_fail() -> None:
    assert toolcheck.problems(TOOLS, None, [_call("delete_everything", "{}")]) == [
        toolcheck.FLAG_UNKNOWN_TOOL
    ]
    # Offered no tools, there is no call to fail: markup in prose is the model's text, as the server said.
    assert toolcheck.problems(None, "<tool_call>{}</tool_call>", []) == []
    assert toolcheck.problems(TOOLS, "All done: a.py reads fine.", [_call()]) == []
    # A schema-less tool takes any object.
    bare = [{"type": "function", "function": {"name": "ping"}}]
    assert toolcheck.problems(bare, None, [ToolCall("c", "ping", '{"x": 1}')]) == []


def test_a_tool_a_client_tool_search_loaded_is_offered() -> None:
    """Codex lists what its tool search loaded in the tool message, not in `tools`: calling it is no error."""
    forecast = {
        "type": "function",
        "name": "forecast",
        "defer_loading": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
    search = {
        "type": "tool_search",
        "execution": "client",
        "parameters": {"type": "object", "properties": {}},
    }
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        {
            "type": "tool_search_call",
            "call_id": "ts1",
            "execution": "client",
            "arguments": {"query": "weather"},
        },
        {
            "type": "tool_search_output",
            "call_id": "ts1",
            "execution": "client",
            "tools": [{"type": "namespace", "name": "mcp__weather", "description": "", "tools": [forecast]}],
        },
    ]
    req = ResponsesDialect().parse(
        {"model": "gpt-5.5", "input": items, "tools": [search]}, ReasoningCodec(b"k")
    )
    offered = [*(req.tools or ()), *req.loaded_tools]
    ok = ToolCall("c1", "mcp__weather__forecast", '{"city": "Oslo"}')
    assert toolcheck.problems(offered, None, [ok]) == []
    assert toolcheck.problems(req.tools, None, [ok]) == [toolcheck.FLAG_UNKNOWN_TOOL]


BROKEN = {
    # vLLM's hermes parser, failing on a cut-off call, returns the text as it was sampled.
    "markup": Reply(content='<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}\n</tool_call>'),
    "unknown": Reply(tool_calls=[("delete_everything", "{}")]),
    "arguments": Reply(tool_calls=[("read_file", '{"path": 3}')]),
    "fine": Reply(tool_calls=[("read_file", '{"path": "a.py"}')]),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_through_the_gateway_a_broken_call_is_flagged_and_its_trace_earns_0(
    case: str, tmp_path: Path
) -> None:
    with fake_policy([BROKEN[case]]) as (url, _):
        gw = start_gateway(url, tmp_path)
        try:
            sid = gw.new_session()
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)
            messages: list[Any] = [{"role": "user", "content": "Read a.py"}]
            client.chat.completions.create(model="m", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
            (record,) = gw.completions(sid)
        finally:
            gw.server.stop()
    flag = {"markup": toolcheck.FLAG_MARKUP, "unknown": toolcheck.FLAG_UNKNOWN_TOOL}.get(
        case, toolcheck.FLAG_BAD_ARGUMENTS
    )
    traj = assign_rewards(build([record]), "COMPLETED", EvalResult(reward=1.0, passed=True))
    (trace,) = traj.traces
    if case == "fine":
        assert not set(record.flags) & {*toolcheck.FLAGS, "tool_call_parse_error"}
        assert trace.reward == 1.0
        return
    assert flag in record.flags and "tool_call_parse_error" in record.flags and record.trainable
    # The lucky outcome does not pay a broken call: reward 0, still trained on (as a negative).
    assert trace.reward == 0.0 and any(trace.loss_mask)
    assert trace.metadata["reward_reason"] == "tool_call_parse_error"
