"""Gemini `generateContent` request bodies, one pydantic-validated schema per wire type, and the schema
translation.

Schemas are `TypedDict`s (validated by pydantic, returned as plain dicts; see `anthropic_schema` for why).
`safetySettings`, `cachedContent`, `labels` and other settings without meaning for the policy are
accepted and dropped. Parts the policy cannot consume
(`fileData`, `executableCode`, `codeExecutionResult`) are declared only so they can be refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import ConfigDict, Field, TypeAdapter, with_config
from pydantic.alias_generators import to_camel
from typing_extensions import TypedDict  # pydantic needs this one on Python < 3.12

from polar.jsontypes import JSON

# Fields are declared snake_case and read under their camelCase names (Gemini CLI, the JS SDK) or as they
# are (the Python SDK sends some nested fields snake_case, e.g. `thinkingConfig.include_thoughts`); the
# REST API accepts both spellings.
_wire = with_config(ConfigDict(alias_generator=to_camel, validate_by_name=True, validate_by_alias=True))


@_wire
class Blob(TypedDict):
    mime_type: str
    data: str


@_wire
class FunctionCall(TypedDict):
    id: NotRequired[str | None]
    name: str
    args: NotRequired[dict[str, Any] | None]


@_wire
class FunctionResponsePart(TypedDict):
    inline_data: NotRequired[Blob | None]


@_wire
class FunctionResponse(TypedDict):
    id: NotRequired[str | None]
    name: str
    response: NotRequired[dict[str, Any] | None]
    # Multimodal function responses (newer API): images a tool returned.
    parts: NotRequired[list[FunctionResponsePart] | None]


@_wire
class Part(TypedDict):
    text: NotRequired[str | None]
    thought: NotRequired[bool | None]
    thought_signature: NotRequired[str | None]
    function_call: NotRequired[FunctionCall | None]
    function_response: NotRequired[FunctionResponse | None]
    inline_data: NotRequired[Blob | None]
    file_data: NotRequired[Any]
    executable_code: NotRequired[Any]
    code_execution_result: NotRequired[Any]


@_wire
class Content(TypedDict):
    # "function" is the role older clients used for function responses.
    role: NotRequired[Literal["user", "model", "function"] | None]
    parts: NotRequired[list[Part]]


@_wire
class FunctionDeclaration(TypedDict):
    name: str
    description: NotRequired[str | None]
    parameters: NotRequired[dict[str, Any] | None]
    parameters_json_schema: NotRequired[dict[str, Any] | None]


@with_config(
    ConfigDict(alias_generator=to_camel, validate_by_name=True, validate_by_alias=True, extra="allow")
)
class Tool(TypedDict):
    """Other kinds (googleSearch, codeExecution, urlContext, ...) stay as extra keys so they can be noted."""

    function_declarations: NotRequired[list[FunctionDeclaration] | None]


@_wire
class FunctionCallingConfig(TypedDict):
    mode: NotRequired[Literal["MODE_UNSPECIFIED", "AUTO", "ANY", "NONE", "VALIDATED"] | None]
    allowed_function_names: NotRequired[list[str] | None]


@_wire
class ToolConfig(TypedDict):
    function_calling_config: NotRequired[FunctionCallingConfig | None]


@_wire
class ThinkingConfig(TypedDict):
    include_thoughts: NotRequired[bool | None]
    thinking_budget: NotRequired[int | None]
    thinking_level: NotRequired[str | None]


@_wire
class GenerationConfig(TypedDict):
    temperature: NotRequired[float | None]
    top_p: NotRequired[float | None]
    top_k: NotRequired[Annotated[int, Field(ge=1)] | None]
    max_output_tokens: NotRequired[Annotated[int, Field(ge=1)] | None]
    stop_sequences: NotRequired[list[str] | None]
    candidate_count: NotRequired[int | None]
    seed: NotRequired[int | None]
    presence_penalty: NotRequired[float | None]
    frequency_penalty: NotRequired[float | None]
    response_mime_type: NotRequired[str | None]
    response_schema: NotRequired[dict[str, Any] | None]
    response_json_schema: NotRequired[dict[str, Any] | None]
    thinking_config: NotRequired[ThinkingConfig | None]


@_wire
class GenerateContentRequest(TypedDict):
    contents: Annotated[list[Content], Field(min_length=1)]
    system_instruction: NotRequired[Content | None]
    tools: NotRequired[list[Tool] | None]
    tool_config: NotRequired[ToolConfig | None]
    generation_config: NotRequired[GenerationConfig | None]


GENERATE_CONTENT_REQUEST: TypeAdapter[GenerateContentRequest] = TypeAdapter(GenerateContentRequest)


# ---- OpenAPI subset -> JSON Schema ------------------------------------------------------------------

# Proto int64 fields arrive as JSON strings ("minItems": "1").
_INT_KEYS = frozenset({"minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"})


def to_json_schema(schema: JSON) -> JSON:
    """Gemini's `Schema` (OpenAPI 3.0 subset, uppercase `type`) as plain JSON Schema.

    `type` is lowercased, `nullable: true` becomes a `"null"` alternative, int64 strings become integers,
    `propertyOrdering` orders `properties` (the model sees them in that order), `format: "enum"` (Gemini's
    marker for string enums) is dropped; every other keyword passes through.
    """
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type":
            if isinstance(value, str) and value.upper() != "TYPE_UNSPECIFIED":
                out["type"] = value.lower()
        elif key == "properties" and isinstance(value, dict):
            out["properties"] = _properties(value, schema.get("propertyOrdering"))
        elif key in ("items", "additionalProperties", "not"):
            out[key] = to_json_schema(value)
        elif key in ("anyOf", "oneOf", "allOf") and isinstance(value, list):
            out[key] = [to_json_schema(v) for v in value]
        elif key in _INT_KEYS and isinstance(value, str) and value.isdigit():
            out[key] = int(value)
        elif key == "format" and value == "enum":
            continue
        elif key == "example":
            out["examples"] = [value]
        elif key not in ("nullable", "propertyOrdering"):
            out[key] = value
    if schema.get("nullable") is True:
        t = out.get("type")
        if isinstance(t, str):
            out["type"] = [t, "null"]
        elif "anyOf" in out:
            out["anyOf"] = [*out["anyOf"], {"type": "null"}]
    return out


def _properties(props: dict[str, Any], ordering: Any) -> dict[str, Any]:
    names: list[str] = list(props)
    if isinstance(ordering, list):
        ordered = [n for n in ordering if n in props]
        names = ordered + [n for n in names if n not in ordered]
    return {n: to_json_schema(props[n]) for n in names}
