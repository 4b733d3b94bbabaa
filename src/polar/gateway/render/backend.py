"""The policy's server with the gateway rendering (`render: gateway`): token ids in, token ids out.

The harness's call is still parsed by its dialect into the canonical chat request, and that chat body (the
served model, messages, tools, sampling settings) is what the record stores as `upstream_request`; the ids
actually sent are the record's `prompt_ids`. This client renders the prompt itself (`Chain.prompt`: the
session's chain continued, or a full rendering), posts it as token ids to the server's `/v1/completions`
(vLLM, and the embedded engine, which answers in vLLM's shape; SGLang's `/generate`, spoken as that route by
`polar.gateway.render.sglang`), and reads the sampled ids back into content,
reasoning and tool calls with the model's parsers (`Template.read`), so all four dialects answer from it as
they answer from a server-rendered call.

Streamed calls are streamed upstream too: each chunk's text is read into reasoning and content deltas as
soon as no later token can change them (`polar.chat.stream`), tool calls come whole in the last chunk. (A
stream delivered whole is not the same to every harness: Gemini CLI's loop detection flagged an answer with a
repeated sentence that it accepts token by token.)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from polar.chat.reasoning import prompt_opens_thought
from polar.chat.render import ChatTemplateError
from polar.chat.stream import AnswerStream
from polar.chat.tool_parsers import chat_calls
from polar.gateway.backends.base import assemble, chat_body, float_list, int_list, upstream_error
from polar.gateway.backends.openai import (
    TOKEN_CHECK_MESSAGES,
    TOKEN_FLAGS,
    TokenDataMissing,
    TokenizingBackend,
)
from polar.gateway.backends.prompt_ids import IdsMemo
from polar.gateway.backends.stream import stream_error, whole_chunk
from polar.gateway.canonical import CanonicalRequest, Completion, StreamChunk, ToolCallDelta
from polar.gateway.errors import GatewayError, invalid
from polar.gateway.fit import clamp
from polar.gateway.render import sglang
from polar.gateway.render.chain import Chain, Prompt
from polar.gateway.render.template import Template
from polar.jsontypes import JSON
from polar.store.records import FLAG_TOOL_PARSE_ERROR

COMPLETIONS = "/v1/completions"
# Chat-only fields: they shape the rendering (done here) or the chat answer, and /v1/completions has no
# use for them (vLLM rejects some). The sampling settings pass through as the harness sent them.
_CHAT_ONLY = frozenset(
    {
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "chat_template",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
        "documents",
        "include_reasoning",
        "reasoning_effort",
        "stream",
        "stream_options",
        "logprobs",
        "top_logprobs",
        "max_completion_tokens",
        "return_token_ids",
        "echo",
    }
)
# A record's flag naming the rendering: `render:gateway`, then `chain:<why>` when its prompt starts a chain.
FLAG_RENDERED = "render:gateway"


class RenderingBackend(TokenizingBackend):
    """`TokenizingBackend` (models, `/tokenize`, start-up) of a `vllm` server, answering chat calls from
    `/v1/completions` with prompts the gateway renders. `template` is the served model's tokenizer."""

    streams = True

    def __init__(
        self,
        inner: TokenizingBackend,
        template: Template,
        context: int | None = None,
        default_budget: int | None = None,
    ) -> None:
        super().__init__(inner.url, inner.options)
        # A call without max_tokens gets what a chat call would: the rest of the server's context
        # (max_model_len), at most the server's own default where its model card says one (the engine's).
        self.context = context
        self.default_budget = default_budget
        self.http = inner.http  # one connection pool: the inner client's, already started
        self.kind = inner.kind
        self.template = template

    def build_body(self, req: CanonicalRequest, served_model: str) -> dict[str, Any]:
        """The chat body the prompt is rendered from (stored as the record's `upstream_request`)."""
        body = chat_body(req, served_model)
        body["stream"] = req.stream
        return body

    async def _prompt(self, body: dict[str, Any], chain: Chain) -> Prompt:
        try:
            # In a worker thread: a chain's next prompt renders only the new messages (under a millisecond),
            # but a new chain renders and tokenizes the whole conversation (~45 ms at 19k tokens), which
            # would stall every other session's call on this loop.
            return await asyncio.to_thread(
                chain.prompt,
                self.template,
                body["messages"],
                body.get("tools"),
                body.get("chat_template_kwargs"),
            )
        except ChatTemplateError as exc:
            raise invalid(str(exc), exc.param or "messages") from None

    def _advance(
        self, chain: Chain, prompt: Prompt, body: dict[str, Any], sampled: list[int], answer: dict[str, Any]
    ) -> None:
        tools, kwargs = body.get("tools"), body.get("chat_template_kwargs")
        chain.advance(prompt, sampled, self.template.end_id, body["messages"], answer, tools, kwargs)

    async def complete(
        self, body: dict[str, Any], memo: IdsMemo | None = None, chain: Chain | None = None
    ) -> Completion:
        chain = chain if chain is not None else Chain()
        prompt = await self._prompt(body, chain)
        wire = completion_body(body, prompt.ids, self.context, self.default_budget)
        fitted = fit_budget(wire, len(prompt.ids), self.context)
        comp = self.read(await self._post(wire), prompt, body.get("tools"), body.get("tool_choice"), fitted)
        if comp.response_ids is not None:
            self._advance(chain, prompt, body, comp.response_ids, comp.message())
        return comp

    async def stream(
        self, body: dict[str, Any], memo: IdsMemo | None = None, chain: Chain | None = None
    ) -> AsyncGenerator[StreamChunk, None]:
        """The answer as vLLM samples it: each upstream chunk's ids, logprobs and text, read into reasoning and
        content deltas as soon as no later token can change them; tool calls in the last chunk."""
        if not body.get("stream"):
            yield whole_chunk(await self.complete(body, memo, chain))
            return
        chain = chain if chain is not None else Chain()
        prompt = await self._prompt(body, chain)
        tools = body.get("tools")
        parser = self.template.parser_for(tools, body.get("tool_choice"))
        reader = AnswerStream(self.template.reasoning, prompt_opens_thought(prompt.rendered), parser, tools)
        wire = completion_body(body, prompt.ids, self.context, self.default_budget)
        fitted = fit_budget(wire, len(prompt.ids), self.context)
        wire.update(stream=True, stream_options={"include_usage": True})
        if parser is not None and parser.needs_special_tokens:
            wire["skip_special_tokens"] = False
        sampled: list[int] = []
        first = True
        async for data in self._stream(wire):
            chunk = _stream_chunk(data)
            if first:
                chunk.prompt_ids, chunk.flags, first = (
                    prompt.ids,
                    [*rendered_flags(prompt), *fitted, *chunk.flags],
                    False,
                )
            if chunk.has_choice:
                done = chunk.finish_reason is not None
                text = chunk.text or ""
                if done and text.endswith(self.template.end_of_turn):  # shown with special tokens only
                    text = text[: -len(self.template.end_of_turn)]
                reasoning, content, calls = reader.feed(text, final=done)
                chunk.reasoning, chunk.content = reasoning or None, content or None
                chunk.tool_calls = tuple(
                    ToolCallDelta(i, c.id, c.name, c.arguments) for i, c in enumerate(calls)
                )
                if calls and chunk.finish_reason == "stop":  # as a chat server says it (harnesses read it)
                    chunk.finish_reason = "tool_calls"
                if done and reader.error is not None:
                    chunk.flags = [*chunk.flags, FLAG_TOOL_PARSE_ERROR]
                sampled += chunk.token_ids or []
            yield chunk
        answer: dict[str, Any] = {"role": "assistant", "content": reader.content or None}
        if reader.calls:
            answer["tool_calls"] = chat_calls(reader.calls)
        self._advance(chain, prompt, body, sampled, answer)

    async def _post(self, wire: dict[str, Any]) -> Any:
        """The server's answer to a `/v1/completions` body, in that route's shape (SGLang's `/generate`
        spoken as it: `polar.gateway.render.sglang`)."""
        if self.kind == "sglang":
            answer = await self.http.post(sglang.GENERATE, sglang.generate_body(wire))
            return sglang.completion_of(answer, wire["model"])
        return await self.http.post(COMPLETIONS, wire)

    def _stream(self, wire: dict[str, Any]) -> AsyncIterator[Any]:
        """The server's stream for a streamed `/v1/completions` body, as that route's chunks."""
        if self.kind == "sglang":
            events = self.http.stream(sglang.GENERATE, sglang.generate_body(wire))
            return sglang.completions_stream(events, wire["model"])
        return self.http.stream(COMPLETIONS, wire)

    def read(
        self,
        raw: JSON,
        prompt: Prompt,
        tools: list[dict[str, Any]] | None,
        tool_choice: JSON,
        fitted: list[str] | None = None,
    ) -> Completion:
        """The `Completion` of a `/v1/completions` answer to `prompt`: ids and logprobs as the server sent
        them (flagged when missing), the message read from the sampled ids."""
        if not isinstance(raw, dict) or not isinstance(raw.get("choices"), list) or not raw["choices"]:
            raise upstream_error("inference server's /v1/completions answer has no `choices`")
        choice = raw["choices"][0]
        if not isinstance(choice, dict):
            raise upstream_error("inference server answer's `choices[0]` is not an object")
        sampled = int_list(choice.get("token_ids"))
        logprobs = _token_logprobs(choice.get("logprobs"))
        flags = [*rendered_flags(prompt), *(fitted or ())]
        for extra in (choice.get("polar_flags"), raw.get("polar_flags")):
            if isinstance(extra, list):
                flags += [f for f in extra if isinstance(f, str) and f not in flags]
        message: dict[str, Any] = {"role": "assistant", "content": None}
        content = reasoning = sampled_text = None
        if sampled is not None:
            answer = self.template.read(sampled, prompt.rendered, tools, tool_choice)
            content, reasoning, sampled_text = answer.content, answer.reasoning, answer.text
            if answer.error is not None:
                flags.append(FLAG_TOOL_PARSE_ERROR)
            message["tool_calls"] = chat_calls(answer.calls) or None
        version = raw.get("policy_version")
        return assemble(
            raw,
            choice,
            message,
            content=content,
            reasoning=reasoning,
            prompt_ids=prompt.ids,
            response_ids=sampled,
            logprobs=logprobs,
            policy_version=version if type(version) is int else None,
            extra_flags=flags,
            sampled_text=sampled_text,
        )

    async def check_token_data(self, served_model: str) -> None:
        """One greedy one-token call as every call is sent (rendered here, token ids in); raises
        `TokenDataMissing` naming what the server left out."""
        body = {"model": served_model, "messages": TOKEN_CHECK_MESSAGES, "max_tokens": 1, "temperature": 0}
        try:
            done = await self.complete(body)
        except GatewayError as err:
            if err.kind == "not_found":
                route = sglang.GENERATE if self.kind == "sglang" else COMPLETIONS
                raise TokenDataMissing(
                    f"the {self.kind} server at {self.url} has no {route} for token-id prompts "
                    "(render: gateway needs one)"
                ) from None
            raise
        missing = [TOKEN_FLAGS[f] for f in done.flags if f in TOKEN_FLAGS]
        if missing:
            raise TokenDataMissing(
                f"the {self.kind} server at {self.url} answered a token-id prompt without token data "
                f"({', '.join(missing)}): render: gateway needs a vLLM, an SGLang or the embedded engine that "
                "returns them"
            )

    async def count_tokens(self, req: CanonicalRequest, served_model: str) -> int:
        """The prompt's length as a fresh chain renders it (a continued chain can be a little longer)."""
        text = self.template.render(req.messages, req.tools, req.params.get("chat_template_kwargs"))
        return len(self.template.encode(text))


def rendered_flags(prompt: Prompt) -> list[str]:
    """`render:gateway`, and `chain:<why>` when the prompt starts a chain."""
    return [FLAG_RENDERED] if prompt.restart is None else [FLAG_RENDERED, f"chain:{prompt.restart}"]


def _stream_chunk(data: JSON) -> StreamChunk:
    """One `/v1/completions` stream chunk: its text, sampled ids and their logprobs, finish, usage."""
    if not isinstance(data, dict):
        raise upstream_error("inference server sent a stream chunk that is not an object")
    if "error" in data and "choices" not in data:
        raise stream_error(data)
    cid, model, created = data.get("id"), data.get("model"), data.get("created")
    chunk = StreamChunk(
        id=cid if isinstance(cid, str) else "",
        model=model if isinstance(model, str) else "",
        created=created if type(created) is int else 0,
    )
    if isinstance(data.get("usage"), dict):
        chunk.usage = data["usage"]
    version = data.get("policy_version")
    if type(version) is int:
        chunk.policy_version = version
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        return chunk
    choice = choices[0]
    if not isinstance(choice, dict):
        raise upstream_error("inference server stream chunk's `choices[0]` is not an object")
    text = choice.get("text")
    chunk.has_choice = True
    chunk.text = text if isinstance(text, str) else None
    chunk.token_ids = int_list(choice.get("token_ids"))
    chunk.logprobs = _token_logprobs(choice.get("logprobs"))
    chunk.finish_reason = choice.get("finish_reason")
    if chunk.finish_reason == "abort":
        raise upstream_error("inference server aborted the generation (finish_reason `abort`)")
    extra = choice.get("polar_flags")
    if isinstance(extra, list):
        chunk.flags = [f for f in extra if isinstance(f, str)]
    return chunk


def completion_body(
    chat: dict[str, Any], prompt_ids: list[int], context: int | None = None, default_budget: int | None = None
) -> dict[str, Any]:
    """The `/v1/completions` body: the chat body's sampling settings, the prompt as ids, and the fields that
    make vLLM return the sampled ids and their logprobs. A call that names no budget gets the rest of the
    `context` (the model's length), at most `default_budget` (the server's own default for chat)."""
    body = {k: v for k, v in chat.items() if k not in _CHAT_ONLY}
    budget = chat.get("max_completion_tokens")
    if budget is not None and body.get("max_tokens") is None:
        body["max_tokens"] = budget
    # Chat's default budget is the rest of the context; /v1/completions' is 16 tokens (OpenAI's legacy
    # default; vLLM 0.32 keeps it even for an explicit null, the engine takes null as the rest).
    if body.get("max_tokens") is None:
        room = max(1, context - len(prompt_ids)) if context is not None else None
        body["max_tokens"] = min(room, default_budget) if room and default_budget else room or default_budget
    body.update(prompt=prompt_ids, stream=False, return_token_ids=True, logprobs=0)
    return body


def fit_budget(wire: dict[str, Any], prompt_len: int, context: int | None) -> list[str]:
    """Cut a `max_tokens` that would run past the context to what fits after the prompt actually sent, and
    return the record's flags saying so (as `polar.gateway.fit` does once a server refused a call). The
    gateway knows the chain's exact length here; the refusal path counts a fresh rendering, which a
    continued chain can exceed by a few tokens (the cut would then be refused again). Nothing is cut when
    the context is unknown or the prompt alone fills it (the server's error stands)."""
    requested = wire.get("max_tokens")
    if context is None or type(requested) is not int:
        return []
    cut = clamp(requested, context, prompt_len)
    if cut is None:
        return []
    wire["max_tokens"] = cut[0]
    return list(cut[1])


def _token_logprobs(value: JSON) -> list[float] | None:
    """`logprobs.token_logprobs` of a completions choice; None when absent or not all numbers."""
    raw = value.get("token_logprobs") if isinstance(value, dict) else None
    if type(raw) is not list or any(v is None for v in raw):
        return None
    return float_list(raw)
