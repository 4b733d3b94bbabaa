"""The validation edge all four dialects share: field paths as the caller wrote them, one analysis, two
wordings (OpenAI's, and pydantic's plain one for Anthropic and Gemini)."""

from __future__ import annotations

from typing import Any

import pytest

from polar.gateway.dialects.anthropic.dialect import AnthropicDialect
from polar.gateway.dialects.chat.dialect import ChatDialect
from polar.gateway.dialects.gemini.dialect import GeminiDialect
from polar.gateway.dialects.openai_wire import OPENAI_STYLE
from polar.gateway.dialects.validation import Style, field_path
from polar.gateway.dialects.wire import PLAIN_STYLE
from polar.gateway.signatures import ReasoningCodec
from tests.dialect_support import refusal

CODEC = ReasoningCodec(b"test-key")


def anthropic(body: Any) -> Any:
    return AnthropicDialect().parse(body, CODEC)


def chat(body: Any) -> Any:
    return ChatDialect().parse(body, CODEC)


def gemini(body: Any) -> Any:
    return GeminiDialect().parse(body, CODEC, path_model="m", path_stream=False)


def _blocks(*blocks: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": list(blocks)}]}


@pytest.mark.parametrize(
    ("loc", "body", "path", "value"),
    [
        # `text` is the discriminator tag of the block, not its `text` field.
        (
            ("m", 0, "text", "cache_control"),
            {"m": [{"type": "text", "text": "hi", "cache_control": 5}]},
            "m[0].cache_control",
            5,
        ),
        (("m", 0, "text", "text"), {"m": [{"type": "text", "text": 5}]}, "m[0].text", 5),
        (("m", 0, "text", "text"), {"m": [{"type": "text"}]}, "m[0].text", None),
        # `function` is the field of a tool call whose `type` happens to read `function`.
        (
            ("t", 0, "function", "name"),
            {"t": [{"type": "function", "function": {}}]},
            "t[0].function.name",
            None,
        ),
        (
            ("t", 0, "function", "name"),
            {"t": [{"type": "function", "function": {"name": 1}}]},
            "t[0].function.name",
            1,
        ),
        # Union member labels are not fields, not even as the last step.
        (("system", "str"), {"system": {}}, "system", {}),
        (("c", "list[union[TextBlock,ImageBlock]]", 0, "x"), {"c": [{"x": 1}]}, "c[0].x", 1),
        # An index past the end names the list.
        (("c", 3), {"c": [1]}, "c", [1]),
    ],
)
def test_field_path_walks_the_data(loc: tuple[int | str, ...], body: Any, path: str, value: Any) -> None:
    assert field_path(loc, body) == (path, value)


def test_union_type_errors_name_every_accepted_type_in_both_wordings() -> None:
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": {"text": "x"}}]}
    err = refusal(anthropic, body)
    assert err.param == "messages[0].content"
    assert err.message == (
        "invalid messages[0].content: Input should be a valid string or a valid list, got an object"
    )
    err = refusal(chat, {"model": "m", "messages": [{"role": "user", "content": {"text": "x"}}]})
    assert err.message == (
        "Invalid type for 'messages[0].content': expected a string or an array, but got an object instead."
    )


def test_a_union_label_is_never_named_as_a_field() -> None:
    err = refusal(
        anthropic,
        {"model": "m", "max_tokens": 5, "system": {}, "messages": [{"role": "user", "content": "x"}]},
    )
    assert err.param == "system"


def test_a_tag_that_is_also_a_field_name_is_walked_past() -> None:
    err = refusal(anthropic, _blocks({"type": "thinking", "thinking": "x", "signature": 5}))
    assert err.param == "messages[0].content[0].signature"
    msg = {"role": "user", "content": [{"type": "text", "text": {}}]}
    err = refusal(chat, {"model": "m", "messages": [msg]})
    assert err.param == "messages[0].content[0].text"
    assert "expected a string, but got an object" in err.message


@pytest.mark.parametrize(
    ("block", "param", "plain", "openai"),
    [
        (
            {"type": 5},
            "messages[0].content[0].type",
            "Input should be a valid string, got a number",
            "expected a string",
        ),
        (
            {"text": "x"},
            "messages[0].content[0].type",
            "missing required field",
            "Missing required parameter",
        ),
        ({"type": "video"}, "messages[0].content[0].type", "unsupported", "Unsupported value"),
    ],
)
def test_discriminator_problems_name_the_tag_field(
    block: dict[str, Any], param: str, plain: str, openai: str
) -> None:
    err = refusal(anthropic, _blocks(block))
    assert err.param == param and plain in err.message
    err = refusal(chat, {"model": "m", "messages": [{"role": "user", "content": [block]}]})
    assert err.param == param and openai in err.message


def test_a_discriminated_item_that_is_not_an_object() -> None:
    err = refusal(anthropic, _blocks("hello"))
    assert err.param == "messages[0].content[0]"
    err = refusal(chat, {"model": "m", "messages": [{"role": "user", "content": ["hello"]}]})
    assert err.param == "messages[0].content[0]"
    assert (
        err.message
        == "Invalid type for 'messages[0].content[0]': expected an object, but got a string instead."
    )


def test_strictness_follows_the_style() -> None:
    # OpenAI refuses a number written as a string; the lax style takes it, as protobuf's JSON mapping does.
    err = refusal(chat, {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "64"})
    assert err.param == "max_tokens" and "expected an integer, but got a string" in err.message
    req = gemini(
        {"contents": [{"role": "user", "parts": [{"text": "x"}]}], "generationConfig": {"topK": "3"}}
    )
    assert req.params["top_k"] == 3


@pytest.mark.parametrize("parse", [anthropic, gemini, chat])
@pytest.mark.parametrize("body", [[1], "x", None, 3])
def test_a_body_that_is_not_an_object(parse: Any, body: Any) -> None:
    err = refusal(parse, body)
    assert err.param is None
    assert "JSON object" in err.message


def test_a_style_must_name_every_type_error() -> None:
    with pytest.raises(ValueError, match="type errors"):
        Style(
            strict=True,
            types={"string_type": "a string"},
            not_object="",
            missing="",
            wrong_type="",
            unsupported="",
            invalid="",
        )
    assert set(OPENAI_STYLE.types) == set(PLAIN_STYLE.types)
