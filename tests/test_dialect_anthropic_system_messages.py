"""Mid-conversation `role: "system"` messages in Anthropic Messages requests.

Claude Code 2.1.197 sends its agent-type and skill listing as a system message right after the first user
turn (beta `mid-conversation-system-2026-04-07` in its `anthropic-beta` header). The request below was
captured from that CLI talking to the gateway (turn 2, after one Bash call): it must reach the policy as a
system message at its position, not be refused and not be dropped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import pytest

from polar.gateway.dialects.anthropic.dialect import AnthropicDialect
from polar.gateway.errors import GatewayError
from polar.gateway.quirks import apply_quirks
from polar.gateway.signatures import ReasoningCodec
from tests.fakes.chatml import FakeTokenizer
from tests.test_dialect_anthropic import completion, sdk_client

DATA = Path(__file__).parent / "data"
CODEC = ReasoningCodec(b"test-key")
D = AnthropicDialect()


def real_turn2() -> dict[str, Any]:
    return json.loads((DATA / "claude_code_2_1_197_turn2.json").read_text())


def test_claude_code_2_1_197_request_keeps_its_system_message_in_place() -> None:
    body = real_turn2()
    req, applied = apply_quirks(D.parse(body, CODEC))
    assert applied == ("claude_code_billing_header",)
    roles = [m["role"] for m in req.messages]
    assert roles == ["system", "user", "system", "assistant", "tool"]
    top, _, listing, call, result = req.messages
    assert top["content"].startswith("You are a Claude agent, built on Anthropic's Claude Agent SDK.\n")
    assert "x-anthropic-billing-header" not in top["content"]
    assert listing == {"role": "system", "content": body["messages"][1]["content"]}
    assert listing["content"].startswith("Available agent types for the Agent tool:\n")
    assert call["tool_calls"][0]["function"] == {
        "name": "Bash",
        "arguments": '{"command":"printf hi > hello.txt","description":"write"}',
    }
    assert result == {
        "role": "tool",
        "tool_call_id": "call_1_0",
        "content": "(Bash completed with no output)",
    }
    assert req.tools is not None and len(req.tools) == 24 and req.stream is True

    # A Qwen-style template renders it where it stands: the prompt keeps turn 1's prompt as its prefix.
    tok = FakeTokenizer()
    turn1 = tok.render(req.messages[:3], req.tools)
    assert tok.render(req.messages, req.tools).startswith(turn1.removesuffix("<|im_start|>assistant\n"))
    assert "<|im_start|>system\nAvailable agent types for the Agent tool:" in turn1


def test_system_message_text_blocks_are_joined_like_the_top_level_system() -> None:
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "user", "content": "go on"},
        ],
    }
    req = D.parse(body, CODEC)
    assert req.messages[1] == {"role": "system", "content": "a\nb"}


@pytest.mark.parametrize(
    "block",
    [
        {"type": "tool_use", "id": "t", "name": "n", "input": {}},
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}},
        {"type": "tool_result", "tool_use_id": "t", "content": "x"},
    ],
)
def test_system_message_with_a_non_text_block_is_refused_by_field(block: dict[str, Any]) -> None:
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "system", "content": [{"type": "text", "text": "a"}, block]},
        ],
    }
    with pytest.raises(GatewayError) as info:
        D.parse(body, CODEC)
    err = info.value
    assert err.status == 400 and err.param == "messages[1].content[1].type"
    assert "system message" in err.message and repr(block["type"]) in err.message


def test_unknown_role_is_still_refused() -> None:
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}
    with pytest.raises(GatewayError) as info:
        D.parse(body, CODEC)
    assert info.value.param == "messages[0].role" and "'system'" in info.value.message


def test_sdk_sends_the_real_request_and_gets_a_message() -> None:
    """The official SDK (its transport is the dialect) with Claude Code's real body, streamed as it does."""
    body = real_turn2()
    seen: list[Any] = []
    client = sdk_client(completion(content="Done."), seen)
    extra = {k: body[k] for k in ("context_management", "output_config")}
    params = {k: v for k, v in body.items() if k not in extra and k != "stream"}
    with client.messages.stream(**params, extra_body=extra) as stream:
        message = stream.get_final_message()
    assert isinstance(message, anthropic.types.Message)
    assert [b.text for b in message.content if b.type == "text"] == ["Done."]
    assert [m["role"] for m in seen[0].messages][2] == "system"
