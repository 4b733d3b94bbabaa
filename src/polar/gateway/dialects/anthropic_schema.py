"""Anthropic Messages request bodies, one pydantic model per wire type.

Only what the gateway reads is modelled; everything else (`cache_control` on any block, `metadata`,
`context_management`, `output_config`, `service_tier`, `container`, `mcp_servers`, ...) is accepted and
dropped by `WireModel`'s `extra="ignore"`. Block types the policy cannot consume (`document`,
`search_result`, server-tool results, ...) are absent from the unions, so validation refuses them with a
400 naming the block.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from polar.gateway.dialects.wire import WireModel


class TextBlock(WireModel):
    type: Literal["text"]
    text: str


class Base64ImageSource(WireModel):
    type: Literal["base64"]
    media_type: str
    data: str


class UrlImageSource(WireModel):
    type: Literal["url"]
    url: str


ImageSource = Annotated[Base64ImageSource | UrlImageSource, Field(discriminator="type")]


class ImageBlock(WireModel):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(WireModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


ToolResultContent = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


class ToolResultBlock(WireModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ToolResultContent] = ""
    is_error: bool = False


class ThinkingBlock(WireModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(WireModel):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(WireModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(WireModel):
    """A client tool (`type` absent or "custom") or an Anthropic-defined one (`web_search_20250305`,
    `bash_20250124`, ...), which has no schema we could show the policy and is dropped."""

    name: str
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(WireModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(WireModel):
    # "adaptive" is what Claude Code 2.1.x sends; "between_tools" is newer SDK vocabulary.
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class CountTokensRequest(WireModel):
    """`POST /v1/messages/count_tokens`: a Messages request without generation settings."""

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`."""

    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
