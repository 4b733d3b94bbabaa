"""Wire schemas of the engine's OpenAI-compatible API (requests), and vLLM's error envelope.

Field names and defaults follow vLLM's `ChatCompletionRequest` / `CompletionRequest` so that anything that
talks to vLLM (the gateway's `vllm` backend, the OpenAI SDK with `extra_body`) talks to us unchanged. Like
vLLM, unknown fields are accepted and ignored. Fields vLLM supports and we do not (beam search, penalties,
structured output, ...) are refused with a 400 naming the field instead of being silently ignored: the
logprobs we return must describe the distribution the caller asked for.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

_LONG_MIN, _LONG_MAX = -(2**63), 2**63 - 1


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` (vLLM's ErrorResponse)."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, kind: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or {
            400: "BadRequestError",
            404: "NotFoundError",
            503: "ServiceUnavailableError",
        }.get(status, "InternalServerError")

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}
        }


def validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400 whose `param` is the dotted path of the offending field."""
    err = exc.errors()[0]
    path = ".".join(str(p) for p in err["loc"]) or None
    msg = f"{path}: {err['msg']}" if path else str(err["msg"])
    return APIError(400, msg, param=path)


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Base):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class FunctionDefinition(_Base):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolParam(_Base):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Base):
    name: str


class NamedToolChoice(_Base):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatMessage(_Base):
    role: str
    content: str | list[Any] | None = None


class _SamplingFields(_Base):
    model: str | None = None
    n: int = Field(1, ge=1, le=64)
    seed: int | None = Field(None, ge=_LONG_MIN, le=_LONG_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    # Accepted only at their neutral values (see module doc).
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    use_beam_search: bool = False
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    echo: bool | None = False

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 64:
            raise ValueError("at most 64 stop strings")
        return v

    def unsupported(self) -> str | None:
        """The first field set to something this engine cannot honour, if any."""
        checks: list[tuple[str, bool]] = [
            ("frequency_penalty", bool(self.frequency_penalty)),
            ("presence_penalty", bool(self.presence_penalty)),
            ("repetition_penalty", self.repetition_penalty not in (None, 1.0)),
            ("logit_bias", bool(self.logit_bias)),
            ("use_beam_search", self.use_beam_search),
            ("prompt_logprobs", self.prompt_logprobs is not None),
            ("allowed_token_ids", bool(self.allowed_token_ids)),
            ("bad_words", bool(self.bad_words)),
            ("echo", bool(self.echo)),
        ]
        extra = self.model_extra or {}
        for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            checks.append((name, extra.get(name) is not None))
        return next((name for name, bad in checks if bad), None)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(0, ge=0, le=20)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    response_format: dict[str, Any] | None = None
    include_reasoning: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None

    def unsupported(self) -> str | None:
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return "response_format"
        return super().unsupported()


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    max_tokens: int | None = Field(16, ge=0)
    add_special_tokens: bool = True
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(
        cls, v: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        if v == "" or v == []:
            raise ValueError("prompt must be non-empty")
        return v

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        return super().unsupported()


class TokenizeRequest(_Base):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolParam] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[int]


class UpdateWeightsRequest(_Base):
    """`path` (SGLang calls it `model_path`): a checkpoint folder readable by the server."""

    path: str | None = None
    model_path: str | None = None
    policy_version: int | None = Field(None, ge=0)

    def folder(self) -> str:
        folder = self.path or self.model_path
        if not folder:
            raise APIError(400, "path: a checkpoint directory is required", param="path")
        return folder
