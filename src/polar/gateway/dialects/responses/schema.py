"""Pydantic schemas of an OpenAI Responses request (`POST /v1/responses`), one per wire type.

Modelled on what Codex sends (its `ResponseItem` serde types) and what the openai SDK's `ResponseInputItem`
allows. Like the Chat schemas they are pydantic-validated `TypedDict`s (a Codex history is hundreds of
items; plain dicts validate three times faster than model instances). Input items without a `type` are
messages (the API's "easy input message"). Item and content types the policy cannot consume are outside the
unions and refused with a 400 naming `input[i].type`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired, Required

from pydantic import Discriminator, Field, Tag, TypeAdapter
from typing_extensions import TypedDict

from polar.jsontypes import JSON


def _item_type(value: JSON) -> str | None:
    if isinstance(value, dict):
        t = value.get("type", "message")
        return t if isinstance(t, str) else None
    return None


class InputText(TypedDict):
    type: Literal["input_text"]
    text: str


class OutputText(TypedDict):
    type: Literal["output_text"]
    text: str


class Refusal(TypedDict):
    type: Literal["refusal"]
    refusal: str


class InputImage(TypedDict):
    type: Literal["input_image"]
    # `file_id` images live in OpenAI's file store, which the gateway does not have.
    image_url: str
    detail: NotRequired[str | None]


ContentPart = Annotated[InputText | OutputText | Refusal | InputImage, Field(discriminator="type")]
OutputPart = Annotated[InputText | InputImage, Field(discriminator="type")]


class MessageItem(TypedDict):
    type: NotRequired[Literal["message"]]
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]


class FunctionCallItem(TypedDict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: NotRequired[str | None]  # a member of a `namespace` tool: `name` is its name within it


class FunctionCallOutputItem(TypedDict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[OutputPart]


class SummaryText(TypedDict):
    type: Literal["summary_text"]
    text: str


class ReasoningText(TypedDict):
    # Codex's `ReasoningItemContent` is `reasoning_text` or `text`.
    type: Literal["reasoning_text", "text"]
    text: str


class ReasoningItem(TypedDict):
    type: Literal["reasoning"]
    summary: NotRequired[list[SummaryText]]
    encrypted_content: NotRequired[str | None]
    content: NotRequired[list[ReasoningText] | None]


class CustomToolCallItem(TypedDict):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    namespace: NotRequired[str | None]


class CustomToolCallOutputItem(TypedDict):
    type: Literal["custom_tool_call_output"]
    call_id: str
    output: str | list[OutputPart]


class EncryptedText(TypedDict):
    """A part of an `agent_message`: the text of a tool argument its schema marks `"encrypted": true`
    (Codex's `multi_agent_v2` message arguments). OpenAI's server would have encrypted it; through the
    gateway the policy's own text comes back in it, verbatim."""

    type: Literal["encrypted_content"]
    encrypted_content: str


AgentMessagePart = Annotated[InputText | EncryptedText, Field(discriminator="type")]


class AgentMessageItem(TypedDict):
    """A message between Codex 0.171.0's agents under `features.multi_agent_v2`: a spawned agent's task
    ("Message Type: NEW_TASK ... Payload:" and the task) or an agent's answer to its parent."""

    type: Literal["agent_message"]
    author: NotRequired[str | None]
    recipient: NotRequired[str | None]
    content: list[AgentMessagePart]


class ToolSearchCallItem(TypedDict):
    """The policy searched the deferred tools (Codex 0.171.0, `tool_search` with `execution: "client"`):
    `arguments` is the parsed object (`{"query": ..., "limit": ...}`), not JSON text."""

    type: Literal["tool_search_call"]
    call_id: str
    arguments: dict[str, Any]
    execution: NotRequired[Literal["client", "server"] | None]


class ToolSearchOutputItem(TypedDict):
    """What the client's search loaded: tool definitions (namespaces of `defer_loading` members for MCP
    servers), callable from here on without being in the request's `tools`."""

    type: Literal["tool_search_output"]
    call_id: str
    tools: list[ToolSpec]
    execution: NotRequired[Literal["client", "server"] | None]


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
    | Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")]
    | Annotated[ToolSearchCallItem, Tag("tool_search_call")]
    | Annotated[ToolSearchOutputItem, Tag("tool_search_output")]
    | Annotated[AgentMessageItem, Tag("agent_message")],
    Discriminator(_item_type),
]


class FunctionTool(TypedDict):
    type: Literal["function"]
    name: str
    description: NotRequired[str | None]
    parameters: NotRequired[dict[str, Any] | None]
    strict: NotRequired[bool | None]


class CustomTool(TypedDict):
    type: Literal["custom"]
    name: str
    description: NotRequired[str | None]
    # `{"type": "text"}` or `{"type": "grammar", "syntax": "lark" | "regex", "definition": ...}`.
    format: NotRequired[dict[str, Any] | None]


NamespaceMember = Annotated[FunctionTool | CustomTool, Field(discriminator="type")]


class NamespaceTool(TypedDict):
    """A group of function and custom tools the model calls as `namespace` + `name` (Codex 0.171.0 sends
    its sub-agent tools as `multi_agent_v1`); the openai SDK's `NamespaceTool`."""

    type: Literal["namespace"]
    name: Annotated[str, Field(min_length=1)]
    description: NotRequired[str | None]
    tools: list[NamespaceMember]


class ToolSearchTool(TypedDict):
    """Search over deferred tools. `execution: "client"` (what Codex 0.171.0 sends when its model supports it
    and MCP tools are deferred): the client runs the search, so the policy calls it like a function;
    `server`: OpenAI's own search, which the policy cannot run (dropped like a hosted tool)."""

    type: Literal["tool_search"]
    execution: NotRequired[Literal["client", "server"] | None]
    description: NotRequired[str | None]
    parameters: NotRequired[dict[str, Any] | None]


class HostedTool(TypedDict):
    """A tool OpenAI runs itself (web_search, file_search, code_interpreter, ...): the policy cannot."""

    type: str
    name: NotRequired[str | None]


def _tool_type(value: JSON) -> str:
    t = value.get("type") if isinstance(value, dict) else None
    return t if t in ("function", "custom", "namespace", "tool_search") else "hosted"


ToolSpec = Annotated[
    Annotated[FunctionTool, Tag("function")]
    | Annotated[CustomTool, Tag("custom")]
    | Annotated[NamespaceTool, Tag("namespace")]
    | Annotated[ToolSearchTool, Tag("tool_search")]
    | Annotated[HostedTool, Tag("hosted")],
    Discriminator(_tool_type),
]


class ToolChoiceObject(TypedDict):
    type: str
    name: NotRequired[str | None]
    namespace: NotRequired[str | None]


class ReasoningConfig(TypedDict, total=False):
    effort: str | None
    summary: str | None


class PlainText(TypedDict):
    type: Literal["text"]


class JSONObjectText(TypedDict):
    type: Literal["json_object"]


class JSONSchemaText(TypedDict):
    type: Literal["json_schema"]
    name: str
    schema: dict[str, Any]
    description: NotRequired[str | None]
    strict: NotRequired[bool | None]


class TextConfig(TypedDict, total=False):
    # Structured output (Codex's `--output-schema`): forwarded as the chat `response_format`.
    format: Annotated[PlainText | JSONObjectText | JSONSchemaText, Field(discriminator="type")] | None
    verbosity: str | None


class ResponsesRequest(TypedDict, total=False):
    model: Required[str]
    input: Required[str | list[InputItem]]
    instructions: str | None
    tools: list[ToolSpec] | None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None
    parallel_tool_calls: bool | None
    stream: bool | None
    store: bool | None
    include: list[str] | None
    reasoning: ReasoningConfig | None
    max_output_tokens: Annotated[int, Field(ge=1)] | None
    temperature: Annotated[float, Field(ge=0, le=2)] | None
    top_p: Annotated[float, Field(ge=0, le=1)] | None
    top_k: int | None  # not OpenAI's, but vLLM's Responses endpoint takes it
    seed: int | None
    prompt_cache_key: str | None
    metadata: dict[str, Any] | None
    text: TextConfig | None
    # Server-side state the gateway does not keep: refused so a harness never silently loses context.
    previous_response_id: str | None
    conversation: Any
    prompt: Any
    background: bool | None


REQUEST = TypeAdapter(ResponsesRequest)
