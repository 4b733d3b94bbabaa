"""`document` blocks in Anthropic requests become text the policy can read.

Claude Code 2.1.197's Read tool on a PDF answers with a `tool_result` ("PDF file read: ...") followed by a
base64 `document` block in the same user turn. The request below was captured from that CLI talking to
the gateway (turn 2, after `Read` of a one-page PDF); the gateway used to refuse it with a 400, which ended
the run. The PDF is not parsed: the policy is told it is there and not shown.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from polar.gateway.dialects.anthropic.dialect import AnthropicDialect
from polar.gateway.errors import GatewayError
from polar.gateway.signatures import ReasoningCodec
from tests.test_dialect_anthropic import completion, sdk_client

DATA = Path(__file__).parent / "data"
CODEC = ReasoningCodec(b"test-key")
D = AnthropicDialect()


def real_request() -> dict[str, Any]:
    return json.loads((DATA / "claude_code_2_1_197_read_pdf.json").read_text())


def test_claude_code_pdf_read_reaches_the_policy_as_text() -> None:
    body = real_request()
    result_block, document = body["messages"][3]["content"]
    assert document["type"] == "document" and document["source"]["media_type"] == "application/pdf"
    req = D.parse(body, CODEC)
    tool, user = req.messages[-2:]
    assert tool == {"role": "tool", "tool_call_id": "call_1_0", "content": result_block["content"]}
    assert user == {
        "role": "user",
        "content": [
            {
                "type": "text",
                "text": '<document media_type="application/pdf" bytes="584">(binary content not shown)</document>',
            }
        ],
    }


def _user(*blocks: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": list(blocks)}]}


@pytest.mark.parametrize(
    ("document", "text"),
    [
        (
            {
                "type": "document",
                "source": {"type": "text", "media_type": "text/plain", "data": "line 1\nline 2"},
            },
            "<document>\nline 1\nline 2\n</document>",
        ),
        (
            {
                "type": "document",
                "title": 'notes "v2"',
                "source": {
                    "type": "content",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            },
            '<document title="notes \\"v2\\"">\na\nb\n</document>',
        ),
        (
            {"type": "document", "source": {"type": "content", "content": "plain"}},
            "<document>\nplain\n</document>",
        ),
        (
            {"type": "document", "source": {"type": "url", "url": "https://example.com/a.pdf"}},
            '<document url="https://example.com/a.pdf">(not fetched: content not shown)</document>',
        ),
        (
            {
                "type": "document",
                "source": {"type": "base64", "media_type": "application/pdf", "data": "YWJjZA=="},
            },
            '<document media_type="application/pdf" bytes="4">(binary content not shown)</document>',
        ),
    ],
)
def test_each_source_kind_becomes_text(document: dict[str, Any], text: str) -> None:
    req = D.parse(_user(document), CODEC)
    assert req.messages == [{"role": "user", "content": [{"type": "text", "text": text}]}]


def test_a_document_inside_a_tool_result_joins_its_text() -> None:
    doc = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "inside"}}
    block = {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "read:"}, doc]}
    req = D.parse(_user(block), CODEC)
    assert req.messages == [
        {"role": "tool", "tool_call_id": "t", "content": "read:\n<document>\ninside\n</document>"}
    ]


@pytest.mark.parametrize(
    ("document", "param"),
    [
        ({"type": "document"}, "messages[0].content[0].source"),
        (
            {"type": "document", "source": {"type": "file", "file_id": "f"}},
            "messages[0].content[0].source.type",
        ),
        ({"type": "document", "source": {"type": "text"}}, "messages[0].content[0].source.data"),
        (
            {"type": "document", "source": {"type": "base64", "data": "x"}},
            "messages[0].content[0].source.media_type",
        ),
    ],
)
def test_malformed_documents_are_refused_by_field(document: dict[str, Any], param: str) -> None:
    with pytest.raises(GatewayError) as info:
        D.parse(_user(document), CODEC)
    assert info.value.status == 400 and info.value.param == param


def test_sdk_sends_the_real_request_and_gets_a_message() -> None:
    body = real_request()
    seen: list[Any] = []
    client = sdk_client(completion(content="It says hello pdf."), seen)
    extra = {k: body[k] for k in ("context_management", "output_config")}
    params = {k: v for k, v in body.items() if k not in extra and k != "stream"}
    with client.messages.stream(**params, extra_body=extra) as stream:
        message = stream.get_final_message()
    assert [b.text for b in message.content if b.type == "text"] == ["It says hello pdf."]
    assert "application/pdf" in str(seen[0].messages[-1])
