"""Any OpenAI-compatible Chat endpoint, with no token data: a frozen model (a judge, a teacher, a hosted API).

This is also the base the vLLM and SGLang clients extend: they send the same Chat body with a few training
fields added and read the token data their server returns (`training_fields`, `read_tokens`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import orjson

from polar.gateway.backends.base import (
    BackendOptions,
    assemble,
    chat_body,
    first_choice,
    text_field,
    upstream_error,
)
from polar.gateway.backends.http import Decoder, UpstreamClient
from polar.gateway.backends.prompt_ids import IdsMemo
from polar.gateway.backends.stream import parse_chunk, whole_chunk
from polar.gateway.canonical import CanonicalRequest, Completion, StreamChunk
from polar.jsontypes import JSON

if TYPE_CHECKING:
    from polar.gateway.render.chain import Chain
from polar.store.records import FLAG_NO_LOGPROBS, FLAG_NO_PROMPT_IDS, FLAG_NO_RESPONSE_IDS

TOKEN_FLAGS = {
    FLAG_NO_PROMPT_IDS: "no prompt ids",
    FLAG_NO_RESPONSE_IDS: "no sampled ids",
    FLAG_NO_LOGPROBS: "no logprobs",
}


# The start-up call of `check_token_data` (tests tell it from the calls they count by these messages).
TOKEN_CHECK_MESSAGES = [{"role": "user", "content": "Say OK."}]


class TokenDataMissing(RuntimeError):
    """The policy's server does not return the token data training needs (found at start-up)."""


# Rough bytes per token of JSON-serialized chat messages with a BPE tokenizer (English prose and code land
# between 3 and 4.5); the openai kind has no tokenizer endpoint, so its counts are estimates.
ESTIMATE_BYTES_PER_TOKEN = 4


@dataclass(slots=True)
class TokenData:
    """What a kind reads from a response besides the message: token ids, logprobs, engine extras."""

    prompt_ids: Sequence[int] | None = None
    response_ids: list[int] | None = None
    logprobs: list[float] | None = None
    policy_version: int | None = None
    flags: list[str] = field(default_factory=list)
    text: str | None = None  # the sampled tokens' text as the server reports it (vLLM's logprob entries)


class OpenAIBackend:
    """`url` is an OpenAI base URL such as `http://host:8000/v1`; a bare `http://host:8000` gets `/v1`."""

    kind = "openai"
    chat_path = "/chat/completions"
    models_path = "/models"
    # Whether a streamed harness request is streamed from this server (with its token data, where it has any).
    streams = True

    def __init__(self, url: str, options: BackendOptions | None = None) -> None:
        self.url = url.rstrip("/")
        self.options = options or BackendOptions()
        self.http = UpstreamClient(self._base_url(self.url), self.options)

    @staticmethod
    def _base_url(url: str) -> str:
        return url if urlsplit(url).path not in ("", "/") else url + "/v1"

    async def start(self) -> None:
        await self.http.start()

    async def aclose(self) -> None:
        await self.http.aclose()

    def training_fields(self) -> dict[str, Any]:
        """Fields this kind adds to every body so the server returns token data; they override `params`."""
        return {}

    def build_body(self, req: CanonicalRequest, served_model: str) -> dict[str, Any]:
        body = chat_body(req, served_model)
        if req.stream and self.streams:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        body.update(self.training_fields())
        return body

    async def complete(
        self, body: dict[str, Any], memo: IdsMemo | None = None, chain: Chain | None = None
    ) -> Completion:
        return self.parse_completion(await self.http.post(self.chat_path, body, self.decoder(memo)))

    async def stream(
        self, body: dict[str, Any], memo: IdsMemo | None = None, chain: Chain | None = None
    ) -> AsyncGenerator[StreamChunk, None]:
        if not body.get("stream"):
            yield whole_chunk(await self.complete(body, memo))
            return
        async for data in self.http.stream(self.chat_path, body, self.decoder(memo)):
            yield parse_chunk(data, self.read_tokens, self.read_content, self.read_reasoning)

    def decoder(self, memo: IdsMemo | None) -> Decoder:
        """How this kind decodes an answer (`orjson.loads`; vLLM's prompt ids go through `memo`)."""
        return orjson.loads

    def parse_completion(self, raw: JSON) -> Completion:
        """The `Completion` from a decoded response body; raises `GatewayError` on a shape-less one."""
        data, choice, message = first_choice(raw)
        tokens = self.read_tokens(data, choice)
        return assemble(
            data,
            choice,
            message,
            content=self.read_content(message),
            reasoning=self.read_reasoning(message),
            prompt_ids=tokens.prompt_ids,
            response_ids=tokens.response_ids,
            logprobs=tokens.logprobs,
            policy_version=tokens.policy_version,
            extra_flags=tokens.flags,
            sampled_text=tokens.text,
        )

    def read_content(self, message: dict[str, Any]) -> str | None:
        return text_field(message, "content")

    def read_reasoning(self, message: dict[str, Any]) -> str | None:
        # `reasoning_content` is what DeepSeek-style OpenAI-compatible APIs (and vLLM < 0.10.2) send.
        return text_field(message, "reasoning_content") or text_field(message, "reasoning")

    def read_tokens(self, data: dict[str, Any], choice: dict[str, Any]) -> TokenData:
        """No token data from a plain OpenAI endpoint: every token flag is raised by `assemble`."""
        return TokenData()

    async def check_token_data(self, served_model: str) -> None:
        """A plain OpenAI endpoint gives no token data, and was declared so on purpose: nothing to check."""
        return None

    async def count_tokens(self, req: CanonicalRequest, served_model: str) -> int:
        """An estimate: serialized messages and tools at ESTIMATE_BYTES_PER_TOKEN bytes per token."""
        size = len(orjson.dumps(req.messages))
        if req.tools:
            size += len(orjson.dumps(req.tools))
        return -(-size // ESTIMATE_BYTES_PER_TOKEN)

    async def list_models(self) -> list[str]:
        data = await self.http.get(self.models_path)
        items = data.get("data") if isinstance(data, dict) else None
        if not isinstance(items, list):
            raise upstream_error("inference server's /v1/models answer has no `data` list")
        return [m["id"] for m in items if isinstance(m, dict) and isinstance(m.get("id"), str)]


class TokenizingBackend(OpenAIBackend):
    """A server with the `/tokenize` extension taking chat messages (vLLM, SGLang): exact prompt counts.

    `url` is the server root (`http://host:8000`); a trailing `/v1` is accepted and dropped, since
    `/tokenize` lives at the root and chat at `/v1/chat/completions`.
    """

    chat_path = "/v1/chat/completions"
    models_path = "/v1/models"

    @staticmethod
    def _base_url(url: str) -> str:
        return url[: -len("/v1")] if url.endswith("/v1") else url

    async def check_token_data(self, served_model: str) -> None:
        """One greedy one-token call with the training fields; raises `TokenDataMissing` naming what the
        server left out.

        A server that answers chat but not with token ids (an OpenAI-compatible API declared `vllm`, a vLLM
        older than `return_token_ids`, an SGLang without `return_meta_info`) would otherwise yield a whole
        run of untrainable records before anyone looks."""
        body = {
            "model": served_model,
            "messages": TOKEN_CHECK_MESSAGES,
            "max_tokens": 1,
            "temperature": 0,
            **self.training_fields(),
        }
        done = self.parse_completion(await self.http.post(self.chat_path, body))
        missing = [TOKEN_FLAGS[f] for f in done.flags if f in TOKEN_FLAGS]
        if missing:
            raise TokenDataMissing(
                f"the {self.kind} server at {self.url} answered without token data "
                f"({', '.join(missing)}): it is not a {self.kind} that returns token ids and logprobs. "
                "Records from it cannot be trained on; pass --backend-kind openai to serve it anyway"
            )

    async def count_tokens(self, req: CanonicalRequest, served_model: str) -> int:
        body: dict[str, Any] = {
            "model": served_model,
            "messages": req.messages,
            "add_generation_prompt": True,
        }
        if req.tools:
            body["tools"] = req.tools
        # The template's switches (e.g. Qwen3's enable_thinking) change the rendered prompt.
        kwargs = req.params.get("chat_template_kwargs")
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        data = await self.http.post("/tokenize", body)
        count = data.get("count") if isinstance(data, dict) else None
        if type(count) is not int:
            raise upstream_error("inference server's /tokenize answer has no integer `count`")
        return count
