"""Pydantic schemas of an OpenAI Responses request (`POST /v1/responses`), one per wire type.

Modelled on what Codex sends (its `ResponseItem` serde types) and what the openai SDK's `ResponseInputItem`
allows. Input items without a `type` are messages (the API's "easy input message"). Item and content types
the policy cannot consume are outside the unions and refused with a 400 naming `input[i].type`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from polar.gateway.dialects.openai_wire import Wire


def _type_tag(default: str | None) -> Any:
    def tag(value: Any) -> str | None:
        if isinstance(value, dict):
            t = value.get("type", default)
            return t if isinstance(t, str) else None
        return getattr(value, "type", None)

    return tag


class InputText(Wire):
    type: Literal["input_text"]
    text: str


class OutputText(Wire):
    type: Literal["output_text"]
    text: str


class Refusal(Wire):
    type: Literal["refusal"]
    refusal: str


class InputImage(Wire):
    type: Literal["input_image"]
    # `file_id` images live in OpenAI's file store, which the gateway does not have.
    image_url: str
    detail: str | None = None


ContentPart = Annotated[InputText | OutputText | Refusal | InputImage, Field(discriminator="type")]
OutputPart = Annotated[InputText | InputImage, Field(discriminator="type")]


class MessageItem(Wire):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]


class FunctionCallItem(Wire):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(Wire):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[OutputPart]


class SummaryText(Wire):
    type: Literal["summary_text"]
    text: str


class ReasoningText(Wire):
    # Codex's `ReasoningItemContent` is `reasoning_text` or `text`.
    type: Literal["reasoning_text", "text"]
    text: str


class ReasoningItem(Wire):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = []
    encrypted_content: str | None = None
    content: list[ReasoningText] | None = None


class CustomToolCallItem(Wire):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    id: str | None = None


class CustomToolCallOutputItem(Wire):
    type: Literal["custom_tool_call_output"]
    call_id: str
    output: str | list[OutputPart]


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
    | Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")],
    Discriminator(_type_tag("message")),
]


class FunctionTool(Wire):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class CustomTool(Wire):
    type: Literal["custom"]
    name: str
    description: str | None = None
    # `{"type": "text"}` or `{"type": "grammar", "syntax": "lark" | "regex", "definition": ...}`.
    format: dict[str, Any] | None = None


class HostedTool(Wire):
    """A tool OpenAI runs itself (web_search, file_search, code_interpreter, ...): the policy cannot."""

    type: str
    name: str | None = None


def _tool_tag(value: Any) -> str:
    t = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return t if t in ("function", "custom") else "hosted"


ToolSpec = Annotated[
    Annotated[FunctionTool, Tag("function")]
    | Annotated[CustomTool, Tag("custom")]
    | Annotated[HostedTool, Tag("hosted")],
    Discriminator(_tool_tag),
]


class ToolChoiceObject(Wire):
    type: str
    name: str | None = None


class ReasoningConfig(Wire):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(Wire):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = None
    store: bool | None = None
    include: list[str] | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = None  # not OpenAI's, but vLLM's Responses endpoint takes it
    seed: int | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    # Server-side state the gateway does not keep: refused so a harness never silently loses context.
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None
