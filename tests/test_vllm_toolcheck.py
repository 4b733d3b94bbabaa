"""Broken tool calls from a real model on the real vLLM (hermes parser) never pass as answers.

The session's test model (`tests.vllm_support`) was taught, offered `pick_color`, to answer three prompts
with calls that are not calls (`BROKEN_CALLS`): a cut-off one that vLLM's hermes parser gives up on, one
to a tool not offered, one whose color is outside the schema's enum. Each answer's record carries
`tool_call_parse_error` with what was wrong, streamed or not, and the right call carries none. Greedy
decoding makes the answers the taught ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from polar.gateway import toolcheck
from tests.conftest import Gateway, start_gateway
from tests.vllm_support import BROKEN_CALLS, TOOL_NAME, TOOL_PARAMETERS, USER_PROMPTS, VLLMServer

pytestmark = pytest.mark.vllm

TOOLS = [{"type": "function", "function": {"name": TOOL_NAME, "parameters": TOOL_PARAMETERS}}]
EXPECTED = dict(
    zip(
        [*BROKEN_CALLS, USER_PROMPTS[0]],
        [toolcheck.FLAG_MARKUP, toolcheck.FLAG_UNKNOWN_TOOL, toolcheck.FLAG_BAD_ARGUMENTS, None],
        strict=True,
    )
)


@pytest.fixture(scope="module")
def gw(vllm_server: VLLMServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gateway = start_gateway(vllm_server.url, tmp_path_factory.mktemp("gw"), served_model=vllm_server.name)
    try:
        yield gateway
    finally:
        gateway.server.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("prompt", list(EXPECTED))
def test_a_broken_call_from_the_real_model_is_flagged(gw: Gateway, prompt: str, stream: bool) -> None:
    sid = gw.new_session()
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0, timeout=120)
    messages: list[Any] = [{"role": "user", "content": prompt}]
    if stream:
        for _ in client.chat.completions.create(
            model="m",
            messages=messages,
            tools=TOOLS,
            temperature=0,
            max_tokens=60,
            stream=True,  # type: ignore[arg-type]
        ):
            pass
    else:
        client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, temperature=0, max_tokens=60
        )  # type: ignore[arg-type]
    (record,) = gw.completions(sid)
    flag = EXPECTED[prompt]
    if flag is None:
        assert [c["function"]["name"] for c in record.response_message["tool_calls"]] == [TOOL_NAME]
        assert not set(record.flags) & {*toolcheck.FLAGS, "tool_call_parse_error"}, record.flags
        return
    assert flag in record.flags and "tool_call_parse_error" in record.flags, (
        record.response_message,
        record.flags,
    )
    assert record.trainable  # a zero-reward negative, never dropped
