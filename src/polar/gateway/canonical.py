"""The one shape every dialect is translated to and from.

A harness speaks one of four dialects; the policy's inference server speaks OpenAI Chat with training fields.
Each dialect module parses its wire body into a `CanonicalRequest` (OpenAI Chat messages and tools) and
renders a `Completion` (what the backend sampled, with its token data) back into its own wire shape. Keeping
the middle in Chat form means the upstream body is built once, in one place, whatever the harness spoke.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from polar.jsontypes import JSON

FinishReason = Literal["stop", "length", "tool_calls", "content_filter"]


@dataclass(frozen=True, slots=True)
class CanonicalRequest:
    """A harness call, normalized to OpenAI Chat semantics.

    `messages` are OpenAI Chat messages (`role` system/user/assistant/tool; assistant messages may carry
    `tool_calls` and `reasoning_content`; content is a string or a list of OpenAI content parts).
    `tools` are OpenAI Chat function tools. `params` holds sampling and template fields forwarded upstream
    as they are (temperature, top_p, top_k, max_tokens, stop, seed, parallel_tool_calls,
    chat_template_kwargs, ...). `render` carries what the dialect needs to answer in kind (for example the
    names of Responses custom tools, or whether Anthropic thinking was asked for); it never goes upstream.
    `loaded_tools` are Chat function tools callable without being in `tools` (what a client-executed tool
    search loaded: Codex lists them in the tool message); never sent upstream as tools.
    """

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: JSON = None
    params: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    render: dict[str, Any] = field(default_factory=dict)
    loaded_tools: tuple[dict[str, Any], ...] = ()


# The id the gateway gives a tool call that came back without one (Gemini's `functionCall.id` is optional, and
# Pi's Gemini dialect drops it): `polar.gateway.restore` may then match the call by name and value instead.
UNNAMED_CALL_PREFIX = "unnamed_call_"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One structured tool call the policy made; `arguments` is the JSON text the model produced."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Completion:
    """What the backend answered, with the token-level data capture needs.

    Token fields are `None` when the backend did not return them (an `openai` backend, or a vLLM that was
    not asked); `flags` then says so, and the record is not trainable for those tokens. Nothing here is ever
    recomputed from text.
    """

    id: str
    model: str
    content: str | None
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    prompt_ids: Sequence[int] | None = None
    response_ids: list[int] | None = None
    response_logprobs: list[float] | None = None
    policy_version: int | None = None
    flags: tuple[str, ...] = ()
    created: int = 0
    sampled_text: str | None = None  # the sampled tokens' text, when the server reports it (never stored)

    def message(self) -> dict[str, Any]:
        """The assistant message in OpenAI Chat form (what a record stores as the response)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments}}
                for tc in self.tool_calls
            ]
        return msg


# ---- streams ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of tool call `index` in a stream: its first piece has `name` (and usually `id`); `arguments`
    is the next piece of the JSON text the model writes."""

    index: int
    id: str | None
    name: str | None
    arguments: str

    @property
    def call_id(self) -> str:
        """The call's id, from its first piece: the server's, else `call_{index}` (as for a whole answer).
        Dialect encoders and the stream accumulator both use this, so the stream and the record agree."""
        return self.id or f"call_{self.index}"


@dataclass(slots=True)
class StreamChunk:
    """One upstream chunk of a streamed answer, parsed (`polar.gateway.backends.stream`).

    Dialect encoders read the pieces (`content`, `reasoning`, `tool_calls`: None or empty when the chunk
    carries none); the accumulator also reads the token fields, which are None when the chunk does not have
    them. `whole` is set by a backend that cannot stream and answers one finished completion as one chunk."""

    id: str = ""
    model: str = ""
    created: int = 0
    content: str | None = None
    reasoning: str | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()
    finish_reason: JSON = None
    has_choice: bool = False
    prompt_ids: Sequence[int] | None = None
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    usage: dict[str, Any] | None = None
    policy_version: int | None = None
    flags: list[str] = field(default_factory=list)
    whole: Completion | None = None
    text: str | None = None  # this chunk's sampled tokens' text, when the server reports it

    @property
    def has_output(self) -> bool:
        """Whether the chunk carries something sampled (text, reasoning, a tool-call piece)."""
        return bool(self.content or self.reasoning or self.tool_calls)


@dataclass(frozen=True, slots=True)
class StreamHead:
    """What a stream's opening events announce, known from its first upstream chunk: the completion id,
    the served model, the creation time and the prompt's length (0 when the server sends no prompt ids)."""

    id: str
    model: str
    created: int
    prompt_tokens: int
