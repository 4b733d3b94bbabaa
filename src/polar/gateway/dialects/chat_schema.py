"""Pydantic schemas of an OpenAI Chat Completions request (`POST /v1/chat/completions`), one per wire type.

Only what the gateway reads is modelled; unknown fields are ignored (see `Wire`). Content the policy cannot
consume (audio, files) is outside the discriminated unions, so it is refused with a 400 naming
`messages[i].content[j].type`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from polar.gateway.dialects.openai_wire import Wire


class TextPart(Wire):
    type: Literal["text"]
    text: str


class ImageURL(Wire):
    url: str
    detail: str | None = None


class ImagePart(Wire):
    type: Literal["image_url"]
    image_url: ImageURL


class RefusalPart(Wire):
    type: Literal["refusal"]
    refusal: str


UserPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]
AssistantPart = Annotated[TextPart | RefusalPart, Field(discriminator="type")]


class SystemMessage(Wire):
    role: Literal["system"]
    content: str | list[TextPart]
    name: str | None = None


class DeveloperMessage(Wire):
    role: Literal["developer"]
    content: str | list[TextPart]
    name: str | None = None


class UserMessage(Wire):
    role: Literal["user"]
    content: str | list[UserPart]
    name: str | None = None


class FunctionCall(Wire):
    name: str
    arguments: str


class ToolCall(Wire):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(Wire):
    role: Literal["assistant"]
    content: str | list[AssistantPart] | None = None
    tool_calls: list[ToolCall] | None = None
    # vLLM/SGLang reasoning parsers answer with `reasoning_content` (newer vLLM: `reasoning`); harnesses
    # that keep reasoning (OpenCode, Pi) send back whichever they got.
    reasoning_content: str | None = None
    reasoning: str | None = None
    name: str | None = None


class ToolMessage(Wire):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str


Message = Annotated[
    SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage,
    Field(discriminator="role"),
]


class FunctionDef(Wire):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Wire):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Wire):
    name: str


class NamedToolChoice(Wire):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Wire):
    include_usage: bool | None = None


class ChatCompletionRequest(Wire):
    model: str
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    n: int | None = Field(default=None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    # Legacy function calling (pre-`tools`): refused rather than silently dropped.
    functions: Any = None
    function_call: Any = None
