"""Harness-quirk normalization: Claude Code's per-call billing line must not reach the policy."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from polar.gateway.canonical import CanonicalRequest
from polar.gateway.dialects.anthropic.dialect import AnthropicDialect
from polar.gateway.quirks import QUIRKS, apply_quirks
from polar.gateway.signatures import ReasoningCodec

DATA = Path(__file__).parent / "data"
CODEC = ReasoningCodec(b"k")
BILLING = "x-anthropic-billing-header: cc_version=2.1.197.a3f; cc_entrypoint=sdk-cli; cch={cch};"


def claude_code_call(cch: str, extra_turns: int = 0) -> dict[str, Any]:
    """The captured Claude Code 2.1.x body with its `cch` nonce set; later calls carry more history."""
    body = json.loads((DATA / "claude_code_2_1_request.json").read_text())
    body["system"][0]["text"] = BILLING.format(cch=cch)
    for k in range(extra_turns):
        body["messages"].append(
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": f"toolu_{k}", "name": "Bash", "input": {"command": "ls"}}
                ],
            }
        )
        body["messages"].append(
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": f"toolu_{k}",
                        "content": "a\nb",
                        "cache_control": {"type": "ephemeral"},
                    }
                ],
            }
        )
    return body


def test_two_claude_code_calls_normalize_to_identical_system_prompts() -> None:
    dialect = AnthropicDialect()
    first, applied1 = apply_quirks(dialect.parse(claude_code_call("36ee5"), CODEC))
    second, applied2 = apply_quirks(dialect.parse(claude_code_call("0aaa9", extra_turns=1), CODEC))
    assert applied1 == applied2 == ("claude_code_billing_header",)
    sys1, sys2 = first.messages[0], second.messages[0]
    assert sys1 == sys2
    assert sys1["role"] == "system"
    assert "x-anthropic-billing-header" not in sys1["content"]
    # Only that line went: the rest of the system prompt is byte-for-byte what Claude Code sent.
    raw = claude_code_call("36ee5")
    assert sys1["content"] == "\n".join(b["text"] for b in raw["system"][1:])
    # The first call's messages are a prefix of the second's (what prefix merging relies on).
    assert second.messages[: len(first.messages)] == first.messages
    assert first.tools == second.tools and first.params == second.params


def test_only_the_billing_line_is_removed_wherever_it_sits() -> None:
    text = (
        "You are X.\nx-anthropic-billing-header: cc_version=2.1.181.73f; cc_entrypoint=cli;\nRule: be kind.\n"
    )
    req = CanonicalRequest(
        model="m", messages=[{"role": "system", "content": text}, {"role": "user", "content": text}]
    )
    out, applied = apply_quirks(req)
    assert applied == ("claude_code_billing_header",)
    assert out.messages[0] == {"role": "system", "content": "You are X.\nRule: be kind.\n"}
    # User text is the user's own: never touched.
    assert out.messages[1] == {"role": "user", "content": text}


def test_a_line_that_merely_mentions_the_header_stays() -> None:
    text = "Docs: the x-anthropic-billing-header: line is sent by Claude Code."
    req = CanonicalRequest(model="m", messages=[{"role": "system", "content": text}])
    out, applied = apply_quirks(req)
    assert applied == () and out is req


def test_request_without_the_quirk_is_returned_as_is() -> None:
    req = CanonicalRequest(
        model="m", messages=[{"role": "system", "content": "plain"}, {"role": "user", "content": "hi"}]
    )
    out, applied = apply_quirks(req)
    assert out is req and applied == ()


def test_system_that_was_only_the_billing_line_is_dropped() -> None:
    req = CanonicalRequest(
        model="m",
        messages=[
            {"role": "system", "content": BILLING.format(cch="00000")},
            {"role": "user", "content": "hi"},
        ],
    )
    out, _ = apply_quirks(req)
    assert out.messages == [{"role": "user", "content": "hi"}]


def test_chat_style_system_parts() -> None:
    parts = [
        {"type": "text", "text": BILLING.format(cch="fa690")},
        {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
    ]
    req = CanonicalRequest(model="m", messages=[{"role": "system", "content": parts}])
    out, applied = apply_quirks(req)
    assert applied == ("claude_code_billing_header",)
    assert out.messages[0]["content"] == [parts[1]]


def test_input_request_is_not_mutated() -> None:
    req = AnthropicDialect().parse(claude_code_call("abcde"), CODEC)
    before = copy.deepcopy(req.messages)
    out, _ = apply_quirks(req)
    assert req.messages == before
    assert out.messages is not req.messages and out.messages[1] is req.messages[1]


def test_registry_names_are_unique() -> None:
    names = [name for name, _ in QUIRKS]
    assert len(names) == len(set(names)) and "claude_code_billing_header" in names
