"""The one shape every dialect is translated to and from.

A harness speaks one of four dialects; the policy's inference server speaks OpenAI Chat with training fields.
Each dialect module parses its wire body into a `CanonicalRequest` (OpenAI Chat messages and tools) and
renders a `Completion` (what the backend sampled, with its token data) back into its own wire shape. Keeping
the middle in Chat form means the upstream body is built once, in one place, whatever the harness spoke.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

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
    """

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    params: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    render: dict[str, Any] = field(default_factory=dict)


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
    prompt_ids: list[int] | None = None
    response_ids: list[int] | None = None
    response_logprobs: list[float] | None = None
    policy_version: int | None = None
    flags: tuple[str, ...] = ()
    created: int = 0

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
