"""Gemini `generateContent` request bodies, one pydantic model per wire type, and the schema translation.

Fields are camelCase on the wire (Gemini CLI and the SDKs send camelCase; the REST API also takes
snake_case, so both are accepted). `safetySettings`, `cachedContent`, `labels` and other settings that have
no meaning for the policy are accepted and dropped. Parts the policy cannot consume (`fileData`,
`executableCode`, `codeExecutionResult`) are modelled only so they can be refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field
from pydantic.alias_generators import to_camel

from polar.gateway.dialects.wire import WireModel


class GeminiModel(WireModel):
    model_config = ConfigDict(
        extra="ignore", frozen=True, alias_generator=to_camel, validate_by_name=True, validate_by_alias=True
    )


class Blob(GeminiModel):
    mime_type: str
    data: str


class FunctionCall(GeminiModel):
    id: str | None = None
    name: str
    args: dict[str, Any] | None = None


class FunctionResponsePart(GeminiModel):
    inline_data: Blob | None = None


class FunctionResponse(GeminiModel):
    id: str | None = None
    name: str
    response: dict[str, Any] | None = None
    # Multimodal function responses (newer API): images a tool returned.
    parts: list[FunctionResponsePart] | None = None


class Part(GeminiModel):
    text: str | None = None
    thought: bool | None = None
    thought_signature: str | None = None
    function_call: FunctionCall | None = None
    function_response: FunctionResponse | None = None
    inline_data: Blob | None = None
    file_data: Any = None
    executable_code: Any = None
    code_execution_result: Any = None


class Content(GeminiModel):
    # "function" is the role older clients used for function responses.
    role: Literal["user", "model", "function"] | None = None
    parts: list[Part] = Field(default_factory=list)


class FunctionDeclaration(GeminiModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    parameters_json_schema: dict[str, Any] | None = None


class Tool(GeminiModel):
    # Other kinds (googleSearch, codeExecution, urlContext, ...) are kept as extras so they can be noted.
    model_config = ConfigDict(extra="allow")

    function_declarations: list[FunctionDeclaration] | None = None


class FunctionCallingConfig(GeminiModel):
    mode: Literal["MODE_UNSPECIFIED", "AUTO", "ANY", "NONE", "VALIDATED"] | None = None
    allowed_function_names: list[str] | None = None


class ToolConfig(GeminiModel):
    function_calling_config: FunctionCallingConfig | None = None


class ThinkingConfig(GeminiModel):
    include_thoughts: bool | None = None
    thinking_budget: int | None = None
    thinking_level: str | None = None


class GenerationConfig(GeminiModel):
    temperature: float | None = None
    top_p: float | None = None
    top_k: Annotated[int, Field(ge=1)] | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    stop_sequences: list[str] | None = None
    candidate_count: int | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_mime_type: str | None = None
    response_schema: dict[str, Any] | None = None
    response_json_schema: dict[str, Any] | None = None
    thinking_config: ThinkingConfig | None = None


class GenerateContentRequest(GeminiModel):
    contents: Annotated[list[Content], Field(min_length=1)]
    system_instruction: Content | None = None
    tools: list[Tool] | None = None
    tool_config: ToolConfig | None = None
    generation_config: GenerationConfig | None = None


# ---- OpenAPI subset -> JSON Schema ------------------------------------------------------------------

# Proto int64 fields arrive as JSON strings ("minItems": "1").
_INT_KEYS = frozenset({"minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"})


def to_json_schema(schema: Any) -> Any:
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
