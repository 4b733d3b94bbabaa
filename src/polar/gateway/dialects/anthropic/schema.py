"""Anthropic Messages request bodies, one pydantic-validated schema per wire type.

The schemas are `TypedDict`s: pydantic validates them as strictly as models but hands back plain dicts,
about three times faster than building a model instance per content block, which matters because a
Claude Code call re-sends its whole history (hundreds of blocks) every turn.

Only what the gateway reads is declared; everything else (`cache_control` on any block, `metadata`,
`context_management`, `output_config`, `service_tier`, `container`, `mcp_servers`, ...) is accepted and
dropped. Block types the policy cannot consume (`search_result`, server-tool results, ...) are absent from
the unions, so validation refuses them with a 400 naming the block; `document` and `tool_reference`, which
Claude Code sends, are accepted and become text.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import Field, TypeAdapter
from typing_extensions import TypedDict  # pydantic needs this one on Python < 3.12


class TextBlock(TypedDict):
    type: Literal["text"]
    text: str


class Base64ImageSource(TypedDict):
    type: Literal["base64"]
    media_type: str
    data: str


class UrlImageSource(TypedDict):
    type: Literal["url"]
    url: str


class ImageBlock(TypedDict):
    type: Literal["image"]
    source: Annotated[Base64ImageSource | UrlImageSource, Field(discriminator="type")]


class PlainTextSource(TypedDict):
    type: Literal["text"]
    data: str
    media_type: NotRequired[str | None]


class ContentSource(TypedDict):
    type: Literal["content"]
    content: str | list[TextBlock]


class DocumentBlock(TypedDict):
    """A document: Claude Code 2.1.197's Read tool sends a PDF as a base64 `document` block next to its
    `tool_result`. The policy reads text only, so the dialect turns it into text (see anthropic.py)."""

    type: Literal["document"]
    source: Annotated[
        Base64ImageSource | UrlImageSource | PlainTextSource | ContentSource, Field(discriminator="type")
    ]
    title: NotRequired[str | None]
    context: NotRequired[str | None]


class ToolUseBlock(TypedDict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolReferenceBlock(TypedDict):
    """Claude Code 2.1.197's ToolSearch result (with ENABLE_TOOL_SEARCH on): "this deferred tool is now
    loaded"; its definition arrives in the same request's `tools`."""

    type: Literal["tool_reference"]
    tool_name: str


ToolResultContent = Annotated[
    TextBlock | ImageBlock | DocumentBlock | ToolReferenceBlock, Field(discriminator="type")
]


class ToolResultBlock(TypedDict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: NotRequired[str | list[ToolResultContent]]
    is_error: NotRequired[bool]


class ThinkingBlock(TypedDict):
    type: Literal["thinking"]
    thinking: str
    signature: NotRequired[str | None]


class RedactedThinkingBlock(TypedDict):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(TypedDict):
    # Claude Code 2.1.197 sends a mid-conversation `role: "system"` message (its agent-type and skill
    # listing, right after the first user turn) under the beta `mid-conversation-system-2026-04-07`.
    # Only text belongs in one, which the dialect checks so a refusal names the block.
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(TypedDict):
    """A client tool (`type` absent or "custom") or an Anthropic-defined one (`web_search_20250305`,
    `bash_20250124`, ...), which has no schema we could show the policy and is dropped."""

    name: str
    type: NotRequired[str | None]
    description: NotRequired[str | None]
    input_schema: NotRequired[dict[str, Any] | None]


class ToolChoice(TypedDict):
    type: Literal["auto", "any", "tool", "none"]
    name: NotRequired[str | None]
    disable_parallel_tool_use: NotRequired[bool | None]


class ThinkingConfig(TypedDict):
    # "adaptive" is what Claude Code 2.1.x sends; "between_tools" is newer SDK vocabulary.
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: NotRequired[int | None]
    display: NotRequired[Literal["summarized", "omitted"] | None]


class CountTokensRequest(TypedDict):
    """`POST /v1/messages/count_tokens`: a Messages request without generation settings."""

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: NotRequired[str | list[TextBlock] | None]
    tools: NotRequired[list[Tool] | None]
    tool_choice: NotRequired[ToolChoice | None]
    thinking: NotRequired[ThinkingConfig | None]


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`."""

    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: NotRequired[list[str] | None]
    temperature: NotRequired[float | None]
    top_p: NotRequired[float | None]
    top_k: NotRequired[int | None]
    stream: NotRequired[bool | None]


MESSAGES_REQUEST: TypeAdapter[MessagesRequest] = TypeAdapter(MessagesRequest)
COUNT_TOKENS_REQUEST: TypeAdapter[CountTokensRequest] = TypeAdapter(CountTokensRequest)
