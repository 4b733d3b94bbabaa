"""Pydantic schemas of an OpenAI Chat Completions request (`POST /v1/chat/completions`), one per wire type.

They are `TypedDict`s validated by pydantic: validation yields plain dicts (three times cheaper than model
instances on a 100-message agent history), and validated messages are already in the canonical Chat shape,
so most pass through untouched. Only what the gateway reads is declared; unknown keys are dropped, as
OpenAI-compatible servers tolerate them. Content the policy cannot consume (audio, files) is outside the
discriminated unions, so it is refused with a 400 naming `messages[i].content[j].type`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired, Required

from pydantic import Field, TypeAdapter
from typing_extensions import TypedDict


class TextPart(TypedDict):
    type: Literal["text"]
    text: str


class ImageURL(TypedDict):
    url: str
    detail: NotRequired[str]


class ImagePart(TypedDict):
    type: Literal["image_url"]
    image_url: ImageURL


class RefusalPart(TypedDict):
    type: Literal["refusal"]
    refusal: str


UserPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]
AssistantPart = Annotated[TextPart | RefusalPart, Field(discriminator="type")]


class SystemMessage(TypedDict):
    role: Literal["system", "developer"]
    content: str | list[TextPart]
    name: NotRequired[str]


class UserMessage(TypedDict):
    role: Literal["user"]
    content: str | list[UserPart]
    name: NotRequired[str]


class FunctionCall(TypedDict):
    name: str
    arguments: str


class ToolCall(TypedDict):
    id: str
    type: NotRequired[Literal["function"]]
    function: FunctionCall


class AssistantMessage(TypedDict):
    role: Literal["assistant"]
    content: NotRequired[str | list[AssistantPart] | None]
    tool_calls: NotRequired[list[ToolCall] | None]
    # vLLM/SGLang reasoning parsers answer with `reasoning_content` (newer vLLM: `reasoning`); harnesses
    # that keep reasoning (OpenCode, Pi) send back whichever they got.
    reasoning_content: NotRequired[str | None]
    reasoning: NotRequired[str | None]
    name: NotRequired[str]


class ToolMessage(TypedDict):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str


Message = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage,
    Field(discriminator="role"),
]


class FunctionDef(TypedDict):
    name: str
    description: NotRequired[str | None]
    parameters: NotRequired[dict[str, Any] | None]
    strict: NotRequired[bool | None]


class Tool(TypedDict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(TypedDict):
    name: str


class NamedToolChoice(TypedDict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(TypedDict, total=False):
    include_usage: bool | None


class TextFormat(TypedDict):
    type: Literal["text"]


class JSONObjectFormat(TypedDict):
    type: Literal["json_object"]


class JSONSchema(TypedDict):
    name: str
    schema: NotRequired[dict[str, Any]]
    description: NotRequired[str]
    strict: NotRequired[bool | None]


class JSONSchemaFormat(TypedDict):
    type: Literal["json_schema"]
    json_schema: JSONSchema


# Structured output (a judge's answer, a harness asking for JSON): forwarded, the server constrains sampling.
ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")]


class ChatCompletionRequest(TypedDict, total=False):
    model: Required[str]
    messages: Required[Annotated[list[Message], Field(min_length=1)]]
    tools: list[Tool] | None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None
    parallel_tool_calls: bool | None
    stream: bool | None
    stream_options: StreamOptions | None
    temperature: Annotated[float, Field(ge=0, le=2)] | None
    top_p: Annotated[float, Field(ge=0, le=1)] | None
    top_k: int | None
    max_tokens: Annotated[int, Field(ge=1)] | None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None
    stop: str | list[str] | None
    seed: int | None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None
    n: Annotated[int, Field(ge=1)] | None
    chat_template_kwargs: dict[str, Any] | None
    reasoning_effort: str | None
    response_format: ResponseFormat | None
    # Legacy function calling (pre-`tools`): refused rather than silently dropped.
    functions: Any
    function_call: Any


REQUEST = TypeAdapter(ChatCompletionRequest)
