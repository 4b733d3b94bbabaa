"""A deterministic fake of the policy's inference server (vLLM, SGLang or a plain OpenAI endpoint).

A raw ASGI app, no framework, so it stays far faster than anything it is used to measure. It serves
`POST /v1/chat/completions`, `POST /tokenize` (and `/v1/tokenize`), `GET /v1/models` and `GET /health`,
renders prompts with `FakeTokenizer` (see chatml.py for the prefix property this guarantees) and answers in
the wire shape of its `kind`. Test double only: nothing under src/ may import it.

The vLLM kind also serves `POST /v1/completions` with a prompt of token ids, as a gateway that renders
prompts itself calls it (`render: gateway`), in vLLM 0.32's shape with `return_token_ids` (the choice's
`token_ids`, `prompt_token_ids` and `logprobs.token_logprobs`). Unlike vLLM it cannot read the ids (they are
the gateway's tokenizer's): the reply is the script's for the body, sampled as one id per byte of its text
(`BYTE_OFFSET` + byte, ids that every real vocabulary of Qwen's size has) and `<|im_end|>`. Not streamed.

Faults are constructor keywords and plain attributes, switchable while it runs (`fake.status = 503`):
`status` (every call answers this status with the kind's error body), `delay_s`, `garbage` (a non-JSON 200),
`no_token_ids` (no token fields at all), `max_model_len` (longer prompts get the server's exact overflow
400: vLLM 0.11's checks, or with `context_checks="0.32"` vLLM 0.32's, which refuse only `max_tokens` above the
context or a prompt that fills it, and cut `max_tokens` to what fits otherwise), `fail_first_n` (the first N calls answer `fail_status`, default 502), `transform` (a callable that may
rewrite each successful chat body before it is sent: for corrupting one field precisely).
`policy_version` is reported like our embedded engine does (vLLM kind) or as SGLang's weight_version.

`stream: true` is answered in real vLLM 0.32's streamed shape (`tests.fakes.stream`), cut from the body the
fake would have sent whole; `streaming` (a `StreamFaults`) holds the per-token delay and the mid-stream
faults (drop the connection, an error event, a malformed chunk, hold until released). SGLang refuses the
training fields on streamed requests, and so does the fake of that kind.

vLLM's dev-mode RL routes (`VLLM_SERVER_DEV_MODE=1`), as vLLM 0.32 answers them: `POST /pause?mode=wait`
waits for the chat calls in flight and holds new ones until `POST /resume`; `GET /is_paused`;
`POST /collective_rpc` (`reload_weights` remembers `kwargs.weights_path` in `weights_path`);
`POST /update_weight_version` (`weight_version`); `POST /reset_prefix_cache`. Each is logged in
`control_calls` as (path, query, body); `fail_route` names one that answers 500 (a worker that failed).

For benchmarks, a server with a capacity: `slots` generations at once (the rest queue), each taking
`decode_s` plus `uncached_token_s` per prompt token missing from its `prefix_cache` (`tests.fakes.prefix_cache`, whose
counters `GET /metrics` shows as vLLM names them).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

import orjson

from polar.gateway.backends.openai import TOKEN_CHECK_MESSAGES
from tests.fakes.chatml import BYTE_OFFSET, IM_END, FakeTokenizer, assistant_text, text_of
from tests.fakes.prefix_cache import PrefixCache
from tests.fakes.server import lifespan, read_body
from tests.fakes.stream import StreamFaults, StreamWriter, stream_body
from tests.fakes.wire import (
    Sampled,
    chat_body,
    completions_body,
    error_body,
    overflow_message,
    vllm_032_context_check,
)

KINDS = ("vllm", "sglang", "openai")
_DEV_ROUTES = frozenset(
    ("/pause", "/resume", "/is_paused", "/collective_rpc", "/update_weight_version", "/reset_prefix_cache")
)
_JSON = b"application/json"


@dataclass(frozen=True)
class Reply:
    """One scripted assistant turn. `tool_calls` are (name, arguments JSON text); the text is sent verbatim.

    `finish_reason` None means "tool_calls" when there are calls, else "stop"; "length" drops the end token.
    `flags` are reported as our embedded engine's `polar_flags` (vLLM kind).
    """

    content: str | None = None
    reasoning: str | None = None
    tool_calls: Sequence[tuple[str, str]] = ()
    finish_reason: str | None = None
    flags: Sequence[str] = ()


Script = Callable[[dict[str, Any]], Reply] | Sequence[Reply] | None


class HTTPError(Exception):
    def __init__(self, status: int, message: str, err_type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type = status, message, err_type


class FakeInferenceServer:
    """The ASGI app. `requests` holds every chat body received, `tokenize_requests` every /tokenize body."""

    def __init__(
        self,
        kind: str = "vllm",
        script: Script = None,
        *,
        model: str | None = None,
        status: int | None = None,
        error_message: str | None = None,
        delay_s: float = 0.0,
        garbage: bool = False,
        no_token_ids: bool = False,
        max_model_len: int | None = None,
        context_checks: str = "0.11",
        fail_first_n: int = 0,
        fail_status: int = 502,
        transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        policy_version: int | None = None,
        record: bool = True,
        bytes_per_token: int = 1,
        streaming: StreamFaults | None = None,
        fail_route: str | None = None,
        slots: int | None = None,
        prefix_cache: PrefixCache | None = None,
        uncached_token_s: float = 0.0,
        decode_s: float = 0.0,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
        self.kind = kind
        self.script = script
        self.model = model  # None: serve whatever model is asked for
        self.status = status
        self.error_message = error_message
        self.delay_s = delay_s
        self.garbage = garbage
        self.no_token_ids = no_token_ids
        self.max_model_len = max_model_len
        self.context_checks = context_checks
        self.fail_first_n = fail_first_n
        self.fail_status = fail_status
        self.transform = transform
        self.policy_version = policy_version
        self.record = record
        self.tokenizer = FakeTokenizer(bytes_per_token)
        self.streaming = streaming or StreamFaults()
        self.bytes_per_token = bytes_per_token
        self.requests: list[dict[str, Any]] = []
        self.token_checks: list[dict[str, Any]] = []  # the gateway's start-up calls (`_token_check`)
        self.tokenize_requests: list[dict[str, Any]] = []
        self.calls = 0  # POSTs received, faulted ones included
        self.last_headers: dict[str, str] = {}  # headers of the last POST, lower-cased names
        self._seq = 0  # chat completions generated
        self._script_pos = 0
        self.fail_route = fail_route
        self.prefix_cache = prefix_cache
        self.uncached_token_s = uncached_token_s
        self.decode_s = decode_s
        self._slots = asyncio.Semaphore(slots) if slots else None
        self.control_calls: list[tuple[str, dict[str, str], dict[str, Any]]] = []
        self.weights_path: str | None = None
        self.weight_version: str | None = None
        self._running = asyncio.Event()  # cleared while paused: new chat calls wait
        self._running.set()
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def reset(self, script: Script = None, **faults: Any) -> None:
        """Back to a fresh server of the same kind (a module-scoped server reused across tests)."""
        self.__init__(self.kind, script, **faults)  # type: ignore[misc]

    def set(self, **faults: Any) -> None:
        """Switch faults at run time, e.g. `fake.set(status=None, delay_s=0)`."""
        for name, value in faults.items():
            if not hasattr(self, name) or name.startswith("_"):
                raise AttributeError(f"no fault named {name!r}")
            setattr(self, name, value)

    # ---- ASGI ----

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        if method == "POST":
            self.last_headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        raw = await read_body(receive)
        query = dict(parse_qsl(scope.get("query_string", b"").decode()))
        try:
            if path in _DEV_ROUTES:
                status, body, ctype = await self._dev(method, path, query, raw)
            else:
                status, body, ctype = await self._route(method, path, raw)
        except HTTPError as e:
            status, ctype = e.status, _JSON
            body = orjson.dumps(error_body(self.kind, e.status, e.message, e.err_type))
        if isinstance(body, StreamWriter):
            headers = [(b"content-type", b"text/event-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for piece in stream_body(body, self.streaming, receive):
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _route(self, method: str, path: str, raw: bytes) -> tuple[int, bytes | StreamWriter, bytes]:
        if path == "/health":
            return 200, b"", _JSON
        if path == "/metrics" and self.prefix_cache is not None:
            return 200, self.prefix_cache.metrics(self.model or "fake-model"), b"text/plain; version=0.0.4"
        if path == "/v1/models" and method == "GET":
            self._faults_for_get()
            return 200, orjson.dumps(self._models()), _JSON
        handler = {
            "/v1/chat/completions": self._chat,
            "/v1/completions": self._completions,
            "/tokenize": self._tokenize,
            "/v1/tokenize": self._tokenize,
        }
        fn = handler.get(path)
        served = fn is not None and {
            self._tokenize: self.kind != "openai",
            self._completions: self.kind == "vllm",
        }.get(fn, True)
        if not served:
            return 404, b'{"detail":"Not Found"}', _JSON
        if method != "POST":
            return 405, b'{"detail":"Method Not Allowed"}', _JSON
        if fn not in (self._chat, self._completions):
            return await self._handle(fn, raw)
        await self._running.wait()  # a paused server holds new generations
        self._in_flight += 1
        self._idle.clear()
        try:
            return await self._handle(fn, raw)
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def _handle(
        self, fn: Callable[[dict[str, Any]], dict[str, Any]], raw: bytes
    ) -> tuple[int, bytes, bytes]:
        # Parsed once, up front: every chat body is looked at for the gateway's start-up check.
        try:
            body: Any = orjson.loads(raw)
            decode_error: orjson.JSONDecodeError | None = None
        except orjson.JSONDecodeError as e:
            body, decode_error = None, e
        if fn == self._chat and _is_token_check(body):
            return self._token_check(body)
        self.calls += 1
        n = self.calls
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if n <= self.fail_first_n:
            raise HTTPError(
                self.fail_status, self.error_message or f"fake: failing call {n} of {self.fail_first_n}"
            )
        if self.status is not None:
            raise HTTPError(self.status, self.error_message or _default_message(self.status, self.model))
        if self.garbage:
            return 200, b"<html><body>this is not JSON</body></html>", b"text/html"
        if decode_error is not None:
            raise HTTPError(400, f"JSON decode error: {decode_error}")
        if not isinstance(body, dict):
            raise HTTPError(400, "the request body must be a JSON object")
        if fn != self._tokenize and (self._slots or self.prefix_cache or self.decode_s):
            await self._generate_slowly(body)
        out = fn(body)
        if isinstance(out, StreamWriter):
            return 200, out, b"text/event-stream"
        return 200, orjson.dumps(out), _JSON

    async def _generate_slowly(self, body: dict[str, Any]) -> None:
        """Wait for a slot, then for the prompt tokens the prefix cache misses (benchmarks only)."""
        async with self._slots or contextlib.nullcontext():
            busy = self.decode_s
            if self.prefix_cache is not None:
                ids = self._prompt_ids(body)
                busy += (len(ids) - self.prefix_cache.lookup(ids)) * self.uncached_token_s
            if busy:
                await asyncio.sleep(busy)

    async def _dev(
        self, method: str, path: str, query: dict[str, str], raw: bytes
    ) -> tuple[int, bytes, bytes]:
        """vLLM's dev-mode RL routes (see the module doc)."""
        if path == "/is_paused":
            return 200, orjson.dumps({"is_paused": not self._running.is_set()}), _JSON
        if method != "POST":
            return 405, b'{"detail":"Method Not Allowed"}', _JSON
        body = orjson.loads(raw) if raw else {}
        self.control_calls.append((path, query, body))
        if path == self.fail_route:
            raise HTTPError(500, f"fake: {path} failed on a worker", "InternalServerError")
        if path == "/pause":
            self._running.clear()
            if query.get("mode", "abort") == "wait":
                await self._idle.wait()
        elif path == "/resume":
            self._running.set()
        elif path == "/collective_rpc":
            if body.get("method") == "reload_weights":
                self.weights_path = body.get("kwargs", {}).get("weights_path")
        elif path == "/update_weight_version":
            self.weight_version = str(body.get("new_version"))
        return 200, orjson.dumps({"status": "ok"}), _JSON

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def _faults_for_get(self) -> None:
        if self.status is not None:
            raise HTTPError(self.status, self.error_message or _default_message(self.status, self.model))

    def _models(self) -> dict[str, Any]:
        card = {
            "id": self.model or "fake-model",
            "object": "model",
            "created": 1_700_000_000,
            "owned_by": "fake",
        }
        if self.kind != "openai":
            card["max_model_len"] = self.max_model_len or 131072
        return {"object": "list", "data": [card]}

    # ---- endpoints ----

    def _prompt_ids(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise HTTPError(400, "messages: Field required (a list of message objects)")
        tools = body.get("tools")
        try:
            text = self.tokenizer.render(messages, tools, body.get("add_generation_prompt", True))
        except (TypeError, AttributeError) as e:
            raise HTTPError(400, f"could not render the messages: {e}") from None
        return self.tokenizer.encode(text)

    def _check_model(self, body: dict[str, Any]) -> None:
        if self.model is not None and body.get("model") != self.model:
            raise HTTPError(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")

    def _tokenize(self, body: dict[str, Any]) -> dict[str, Any] | StreamWriter:
        if self.record:
            self.tokenize_requests.append(body)
        self._check_model(body)
        ids = self.tokenizer.encode(str(body["prompt"])) if "prompt" in body else self._prompt_ids(body)
        return {"count": len(ids), "max_model_len": self.max_model_len or 131072, "tokens": ids}

    def _token_check(self, body: dict[str, Any]) -> tuple[int, bytes, bytes]:
        """The gateway's start-up call (`Backend.check_token_data`), kept apart from the calls tests count
        and script: it lands in `token_checks`, consumes no scripted reply and no call number, and is
        answered in the fake's kind (token data or not), or with its `status`."""
        self.token_checks.append(body)
        if self.status is not None:
            raise HTTPError(self.status, self.error_message or _default_message(self.status, self.model))
        self._check_model(body)
        prompt = self._prompt_ids(body)
        sampled = self._sampled(Reply(content="OK"), prompt, 1)
        out = chat_body(self.kind, sampled, body, self.tokenizer, with_tokens=not self.no_token_ids)
        return 200, orjson.dumps(out), _JSON

    def _chat(self, body: dict[str, Any]) -> dict[str, Any] | StreamWriter:
        if self.record:
            self.requests.append(body)
        self._check_model(body)
        streamed = bool(body.get("stream"))
        if not streamed and body.get("stream_options") is not None:
            raise HTTPError(400, "Stream options can only be defined when `stream=True`.")
        if (
            streamed
            and self.kind == "sglang"
            and (body.get("return_meta_info") or body.get("return_prompt_token_ids"))
        ):
            raise HTTPError(400, "fake: SGLang does not return token data on streamed requests")
        prompt = self._prompt_ids(body)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        limit = self.max_model_len
        if limit is not None and self.kind == "vllm" and self.context_checks == "0.32":
            param = "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"
            refused, max_tokens = vllm_032_context_check(limit, len(prompt), max_tokens, param)
            if refused is not None:
                raise HTTPError(400, refused, "BadRequestError")
        elif limit is not None and (len(prompt) > limit or (max_tokens and len(prompt) + max_tokens > limit)):
            raise HTTPError(400, overflow_message(self.kind, limit, len(prompt), max_tokens))
        self._seq += 1
        sampled = self._sample(body, prompt, max_tokens)
        out = chat_body(self.kind, sampled, body, self.tokenizer, with_tokens=not self.no_token_ids)
        if self.kind == "vllm":
            if self.policy_version is not None:
                out["policy_version"] = self.policy_version
            if sampled["flags"]:
                out["polar_flags"] = list(sampled["flags"])
        out = self.transform(out) if self.transform is not None else out
        if streamed:
            return StreamWriter(self.kind, out, sampled["ids"], body, self.tokenizer)
        return out

    def _completions(self, body: dict[str, Any]) -> dict[str, Any]:
        """`/v1/completions` with a prompt of token ids (see the module's docstring)."""
        if self.record:
            self.requests.append(body)
        self._check_model(body)
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not prompt or not all(type(i) is int and i >= 0 for i in prompt):
            raise HTTPError(400, "fake: prompt must be a non-empty list of token ids")
        if body.get("stream"):
            raise HTTPError(400, "fake: streamed /v1/completions is not served")
        max_tokens = body.get("max_tokens")
        limit = self.max_model_len
        if limit is not None and (len(prompt) > limit or (max_tokens and len(prompt) + max_tokens > limit)):
            raise HTTPError(400, overflow_message(self.kind, limit, len(prompt), max_tokens))
        self._seq += 1
        reply = self._next_reply(body)
        ids = [b + BYTE_OFFSET for b in (reply.content or "").encode()]
        finish = "stop"
        if max_tokens is not None and len(ids) >= max_tokens:
            ids, finish = ids[:max_tokens], "length"
        else:
            ids.append(IM_END)
        return completions_body(self._seq, ids, prompt, finish, body, self.policy_version)

    def _next_reply(self, body: dict[str, Any]) -> Reply:
        script = self.script
        if script is None:
            return default_reply(body)
        if callable(script):
            return script(body)
        if self._script_pos >= len(script):
            raise HTTPError(500, f"fake script exhausted after {len(script)} replies", "InternalServerError")
        self._script_pos += 1
        return script[self._script_pos - 1]

    def _sample(self, body: dict[str, Any], prompt: list[int], max_tokens: int | None) -> Sampled:
        return self._sampled(self._next_reply(body), prompt, max_tokens)

    def _sampled(self, reply: Reply, prompt: list[int], max_tokens: int | None) -> Sampled:
        calls = [(name, args) for name, args in reply.tool_calls]
        ids = self.tokenizer.encode(assistant_text(reply.content, reply.reasoning, calls))
        content, reasoning = reply.content, reply.reasoning
        finish = reply.finish_reason or ("tool_calls" if calls else "stop")
        if max_tokens is not None and len(ids) >= max_tokens:
            # Cut off by max_tokens: no end-of-turn token, and the message is whatever text got out.
            ids = ids[:max_tokens]
            finish, calls = "length", []
            content, reasoning = split_reasoning(self.tokenizer.decode(ids))
        elif finish != "length":
            ids.append(IM_END)
        version = self.policy_version
        return {
            "seq": self._seq,
            "prompt_ids": prompt,
            "ids": ids,
            "content": content,
            "reasoning": reasoning,
            "tool_calls": calls,
            "finish": finish,
            "flags": tuple(reply.flags),
            "weight_version": str(version) if version is not None else "default",
        }


def split_reasoning(text: str) -> tuple[str | None, str | None]:
    """(content, reasoning) of raw assistant text, the way a `<think>` reasoning parser splits it."""
    if not text.startswith("<think>\n"):
        return text or None, None
    rest = text[len("<think>\n") :]
    reasoning, sep, content = rest.partition("\n</think>\n\n")
    return (content or None) if sep else None, reasoning


def default_reply(body: dict[str, Any]) -> Reply:
    """A short deterministic answer derived from the last user message."""
    last = next((m for m in reversed(body.get("messages") or []) if m.get("role") == "user"), None)
    said = text_of(last.get("content")) if last else ""
    return Reply(content=f"You said: {said[:80]}" if said else "Hello.")


def _default_message(status: int, model: str | None) -> str:
    return {
        400: "fake: the request is invalid",
        404: f"The model `{model or 'fake-model'}` does not exist.",
        429: "fake: too many requests, slow down",
        500: "fake: internal server error",
        502: "fake: bad gateway",
        503: "fake: the server is not ready",
    }.get(status, f"fake: HTTP {status}")


def make_fake_backend(kind: str = "vllm", script: Script = None, **faults: Any) -> FakeInferenceServer:
    """The fake inference server of `kind`; serve it with tests.fakes.server.serve(app)."""
    return FakeInferenceServer(kind, script, **faults)


def _is_token_check(body: Any) -> bool:
    """The gateway's start-up call (`Backend.check_token_data`)."""
    return (
        isinstance(body, dict)
        and body.get("messages") == TOKEN_CHECK_MESSAGES
        and body.get("max_tokens") == 1
    )


if __name__ == "__main__":  # `python -m tests.fakes.fake_vllm --port 8000`: the benchmarks' backend
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser(description="Deterministic fake inference server (a test double).")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--kind", choices=["vllm", "sglang", "openai"], default="vllm")
    parser.add_argument("--bytes-per-token", type=int, default=4, help="about 4 for BPE-like id counts")
    parser.add_argument("--token-delay-ms", type=float, default=0.0, help="streamed answers: delay per token")
    parser.add_argument("--answer-chars", type=int, default=0, help="answer every call with this many chars")
    parser.add_argument("--model", default=None, help="the model it lists and serves (default: any name)")
    cli = parser.parse_args()
    faults = StreamFaults(token_delay_s=cli.token_delay_ms / 1000.0)
    script: Script = None
    if cli.answer_chars:
        text = ("The quick brown fox jumps over the lazy dog. " * (cli.answer_chars // 45 + 1))[
            : cli.answer_chars
        ]
        script = lambda body: Reply(content=text)  # noqa: E731
    app = make_fake_backend(
        cli.kind,
        script,
        record=False,
        bytes_per_token=cli.bytes_per_token,
        streaming=faults,
        model=cli.model,
    )
    uvicorn.run(app, host="127.0.0.1", port=cli.port, log_level="warning", access_log=False)
