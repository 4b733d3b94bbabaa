"""`render: gateway` on the real vLLM: the gateway renders with the served model's tokenizer (found from
vLLM's `root`), sends token ids to `/v1/completions`, and reads the answer with its own hermes parser.

Greedy first turns are the server-rendered ones to the id; a tool loop is one chain and one trace; the
session model's broken calls (`tests.vllm_support.BROKEN_CALLS`) are flagged as when vLLM parses them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from polar.gateway import toolcheck
from polar.trajectory import build
from tests.conftest import Gateway, start_gateway
from tests.vllm_support import BROKEN_CALLS, TOOL_NAME, TOOL_PARAMETERS, USER_PROMPTS, VLLMServer

pytestmark = pytest.mark.vllm

TOOLS = [{"type": "function", "function": {"name": TOOL_NAME, "parameters": TOOL_PARAMETERS}}]


@pytest.fixture(scope="module")
def gateways(
    vllm_server: VLLMServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Gateway]]:
    tmp = tmp_path_factory.mktemp("render")
    made: dict[str, Gateway] = {}
    try:
        for render in ("server", "gateway"):
            made[render] = start_gateway(
                vllm_server.url,
                tmp,
                store_path=tmp / f"{render}.db",
                served_model=vllm_server.name,
                render=render,
            )
        yield made
    finally:
        for gw in made.values():
            gw.server.stop()


def _ask(gw: Gateway, sid: str, messages: list[Any], stream: bool = False) -> Any:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0, timeout=300)
    if not stream:
        return (
            client.chat.completions.create(
                model="m",
                messages=messages,
                tools=TOOLS,
                temperature=0,
                max_tokens=60,  # type: ignore[arg-type]
            )
            .choices[0]
            .message
        )
    for _ in client.chat.completions.create(
        model="m",
        messages=messages,
        tools=TOOLS,
        temperature=0,
        max_tokens=60,
        stream=True,  # type: ignore[arg-type]
    ):
        pass
    return None


def test_greedy_first_turns_are_the_servers(gateways: dict[str, Gateway]) -> None:
    got = {}
    for render, gw in gateways.items():
        sid = gw.new_session()
        message = _ask(gw, sid, [{"role": "user", "content": USER_PROMPTS[0]}])
        (rec,) = gw.completions(sid)
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        got[render] = (list(rec.prompt_ids), rec.response_ids, calls, message.content)
        assert rec.trainable, rec.flags
    assert got["gateway"] == got["server"]
    assert got["gateway"][2] and got["gateway"][2][0][0] == TOOL_NAME


def test_a_tool_loop_is_one_chain_and_one_trace(gateways: dict[str, Gateway]) -> None:
    traces = {}
    for render, gw in gateways.items():
        sid = gw.new_session()
        messages: list[Any] = [{"role": "user", "content": USER_PROMPTS[0]}]
        for turn in range(3):
            message = _ask(gw, sid, messages)
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls or []:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": f"done {turn}"})
            messages.append({"role": "user", "content": USER_PROMPTS[(turn + 1) % len(USER_PROMPTS)]})
        recs = gw.completions(sid)
        assert len(recs) == 3 and all(r.trainable for r in recs)
        traces[render] = len(build(recs, strategy="prefix_merging").traces)
        if render == "gateway":
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
    assert traces["gateway"] == 1
    # Server-rendered, the answers' tool-call JSON comes back re-serialized: not one trace (reported, not
    # asserted: it depends on what the model wrote).
    print(f"traces per session: server-rendered {traces['server']}, gateway-rendered {traces['gateway']}")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("prompt", "flag"),
    list(
        zip(
            BROKEN_CALLS,
            [toolcheck.FLAG_MARKUP, toolcheck.FLAG_UNKNOWN_TOOL, toolcheck.FLAG_BAD_ARGUMENTS],
            strict=True,
        )
    ),
)
def test_broken_calls_are_flagged_as_the_server_flags_them(
    gateways: dict[str, Gateway], prompt: str, flag: str, stream: bool
) -> None:
    gw = gateways["gateway"]
    sid = gw.new_session()
    _ask(gw, sid, [{"role": "user", "content": prompt}], stream)
    (rec,) = gw.completions(sid)
    assert "tool_call_parse_error" in rec.flags and flag in rec.flags, rec.flags
    assert rec.trainable  # a zero-reward negative, never dropped


def test_the_tokenizer_folder_can_be_named(vllm_server: VLLMServer, tmp_path: Path) -> None:
    gw = start_gateway(
        vllm_server.url,
        tmp_path,
        served_model=vllm_server.name,
        render="gateway",
        tokenizer=str(vllm_server.model_dir),
    )
    try:
        sid = gw.new_session()
        _ask(gw, sid, [{"role": "user", "content": USER_PROMPTS[0]}])
        (rec,) = gw.completions(sid)
        assert "render:gateway" in rec.flags and rec.trainable
    finally:
        gw.server.stop()


def test_a_call_without_max_tokens_gets_the_rest_of_the_context(gateways: dict[str, Gateway]) -> None:
    """/v1/completions' default budget is 16 tokens (vLLM keeps it even for an explicit null): the gateway
    sends what chat would allow, the rest of the context, so the taught call (~25 tokens) is not cut."""
    gw = gateways["gateway"]
    sid = gw.new_session()
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0, timeout=300)
    out = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": USER_PROMPTS[0]}],
        tools=TOOLS,
        temperature=0,  # type: ignore[arg-type]
    )
    (rec,) = gw.completions(sid)
    assert out.choices[0].finish_reason == "tool_calls" and len(rec.response_ids or []) > 16, (
        rec.response_message
    )


def test_streamed_and_whole_answers_record_the_same(gateways: dict[str, Gateway]) -> None:
    """Streamed, the answer comes from vLLM's /v1/completions stream chunk by chunk and is read as it comes;
    greedy, its record is the whole answer's: ids, the parsed call, the content."""
    gw = gateways["gateway"]
    got = []
    for stream in (False, True):
        sid = gw.new_session()
        _ask(gw, sid, [{"role": "user", "content": USER_PROMPTS[0]}], stream)
        (rec,) = gw.completions(sid)
        calls = [
            (c["function"]["name"], c["function"]["arguments"]) for c in rec.response_message["tool_calls"]
        ]
        got.append(
            (list(rec.prompt_ids), rec.response_ids, rec.response_message["content"], calls, rec.flags)
        )
        assert rec.trainable and calls and calls[0][0] == TOOL_NAME
    assert got[0] == got[1]
