"""The one HTTP client every backend uses: pooled connections, timeouts, retries, error mapping.

Calls to an `http://` server the operator configured, streamed or not, go over `polar.gateway.backends.h1`
(kept-alive connections and httptools' parser: a sixth of the gateway's CPU per call less than aiohttp);
`https://` servers and task-named URLs (vetted at every connection by the outbound policy) over one aiohttp
`ClientSession` per backend. Either keeps connections alive across calls (a gateway makes thousands per
minute to the same server). Bodies go out as orjson bytes and come back as raw bytes parsed by orjson,
which is several times cheaper than aiohttp's stdlib-json helpers.

Retries are only for failures where the server certainly did not produce an answer we could use: a connection
that could not be made or was dropped, and 502/503/504 (a proxy or a server that is starting or overloaded).
A 4xx is the request's fault and is never retried; a timeout is not retried either, since the call already
used its whole budget. A destination the options' `OutboundPolicy` refuses is not retried either. A retry
waits `retry_backoff_s`, doubling, `retries` times at most (`polar.retry`; the first attempt runs outside
the retry policy, so a call that succeeds pays nothing for it).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

import aiohttp
import orjson
from tenacity import retry_if_exception_type

from polar.gateway.backends import h1
from polar.gateway.backends.base import BackendOptions
from polar.gateway.errors import GatewayError
from polar.jsontypes import JSON
from polar.netguard import OutboundRefused, guarded_session
from polar.retry import continue_after, retrying

_RETRY_STATUS = frozenset((502, 503, 504))
_JSON_HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}
_SSE_HEADERS = {"Accept": "text/event-stream"}
T = TypeVar("T")
# What the lean client raises for a call that failed, and what reading either client's streamed answer can.
_H1_FAILURES = (TimeoutError, h1.Unreachable, h1.Dropped, h1.Malformed)
_READ_FAILURES = (TimeoutError, aiohttp.ClientError, h1.Dropped, h1.Malformed)
# How an answer's bytes become data: `orjson.loads`, or a backend's reader that takes some part apart
# itself (`polar.gateway.backends.prompt_ids`); either raises `orjson.JSONDecodeError` on a non-JSON body.
Decoder = Callable[[bytes], JSON]


class UpstreamUnavailable(GatewayError):
    """An upstream failure that delivered nothing (no connection, a dropped one, a 502/503/504), after this
    client's own retries. Nothing reached the harness or the record, so a `BackendPool` may send the call
    to another server."""


class _Retryable(Exception):
    """An attempt that failed where the server certainly produced nothing: worth another attempt."""

    def __init__(self, failure: GatewayError) -> None:
        super().__init__(failure.message)
        self.failure = failure


class UpstreamClient:
    """JSON over HTTP to one server at `base_url` (no trailing slash)."""

    def __init__(self, base_url: str, options: BackendOptions) -> None:
        self.base_url = base_url.rstrip("/")
        self.options = options
        self._session: aiohttp.ClientSession | None = None
        self._headers = dict(_JSON_HEADERS)
        if options.api_key:
            self._headers["Authorization"] = f"Bearer {options.api_key}"
        self._h1: h1.H1Pool | None = None
        if options.outbound is None and self.base_url.startswith("http://"):
            self._h1 = h1.H1Pool(
                self.base_url,
                self._headers,
                options.max_connections,
                options.connect_timeout_s,
                stream_headers=_SSE_HEADERS,
            )

    async def start(self) -> None:
        if self._session is not None and not self._session.closed:
            return
        o = self.options
        connector: dict[str, Any] = {
            "limit": o.max_connections,
            "limit_per_host": o.max_connections,
            # vLLM (VLLM_HTTP_TIMEOUT_KEEP_ALIVE) and SGLang serve through uvicorn, which closes idle keep-alive
            # connections after 5 s by default; letting go first avoids reusing one the server is closing.
            "keepalive_timeout": 4.0,
            "ttl_dns_cache": 300,
        }
        session: dict[str, Any] = {
            "timeout": aiohttp.ClientTimeout(total=o.timeout_s, sock_connect=o.connect_timeout_s),
            # No cookies: every call stands alone, and the jar costs time per response.
            "cookie_jar": aiohttp.DummyCookieJar(),
            "headers": self._headers,
        }
        if o.outbound is not None:
            self._session = guarded_session(o.outbound, connector=connector, **session)
        else:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(**connector), **session)

    async def aclose(self) -> None:
        if self._h1 is not None:
            await self._h1.aclose()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def get(self, path: str) -> JSON:
        return await self._request("GET", path, None)

    async def post(self, path: str, body: dict[str, Any], decode: Decoder = orjson.loads) -> JSON:
        return await self._request("POST", path, _encode(body), decode)

    async def _request(
        self, method: str, path: str, payload: bytes | None, decode: Decoder = orjson.loads
    ) -> JSON:
        if self._h1 is not None:
            pool = self._h1
            return await self._with_retries(lambda: self._attempt_h1(pool, method, path, payload, decode))
        if self._session is None or self._session.closed:
            await self.start()
        url = self.base_url + path
        return await self._with_retries(lambda: self._attempt(method, url, payload, decode))

    async def _with_retries(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """`attempt()`, again after a `_Retryable` failure while the options allow; its GatewayError else."""
        o = self.options
        try:
            try:
                return await attempt()
            except _Retryable as first:
                if o.retries < 1:
                    raise
                policy = retrying(
                    attempts=o.retries + 1,
                    first_s=o.retry_backoff_s,
                    retry=retry_if_exception_type(_Retryable),
                )
                return await continue_after(policy, first, attempt)
        except _Retryable as e:
            f = e.failure
            raise UpstreamUnavailable(f.kind, f.message, param=f.param, status=f.status) from None

    async def _attempt(self, method: str, url: str, payload: bytes | None, decode: Decoder) -> JSON:
        """One request: the decoded body, a GatewayError, or `_Retryable` (nothing came back)."""
        assert self._session is not None
        try:
            async with self._session.request(method, url, data=payload, allow_redirects=False) as resp:
                raw = await resp.read()
                status = resp.status
        except (OutboundRefused, TimeoutError, aiohttp.ClientError) as e:
            raise self._failure(e) from None
        return _answered(status, raw, decode)

    async def _attempt_h1(
        self, pool: h1.H1Pool, method: str, path: str, payload: bytes | None, decode: Decoder
    ) -> JSON:
        """`_attempt` over the lean client; the same outcomes for the same failures."""
        try:
            status, raw = await pool.request(method, path, payload, self._deadline())
        except _H1_FAILURES as e:
            raise self._failure(e) from None
        return _answered(status, raw, decode)

    def _deadline(self) -> float:
        """When an attempt starting now must have its whole answer, on the loop's clock."""
        return asyncio.get_running_loop().time() + self.options.timeout_s

    def _failure(self, e: BaseException) -> Exception:
        """What a failed connection attempt means: a `GatewayError`, or `_Retryable` when nothing came back."""
        if isinstance(e, h1.Malformed):
            return GatewayError(
                "upstream_error", f"inference server at {self.base_url} sent a malformed HTTP answer: {e}"
            )
        if isinstance(e, OutboundRefused):
            return GatewayError("upstream_error", f"inference server at {self.base_url} is not allowed: {e}")
        if isinstance(e, TimeoutError):
            # aiohttp's ServerTimeoutError/ConnectionTimeoutError are TimeoutError subclasses too.
            return GatewayError(
                "timeout",
                f"inference server at {self.base_url} did not answer within {self.options.timeout_s:g} s",
            )
        if isinstance(e, aiohttp.ClientConnectorError | h1.Unreachable):
            return _Retryable(
                GatewayError("upstream_error", f"inference server unreachable at {self.base_url}")
            )
        if isinstance(
            e,
            aiohttp.ServerDisconnectedError | aiohttp.ClientOSError | aiohttp.ClientPayloadError | h1.Dropped,
        ):
            # A pooled keep-alive connection the server had already closed lands here; a new one works.
            return _Retryable(
                GatewayError(
                    "upstream_error", f"inference server at {self.base_url} dropped the connection ({e})"
                )
            )
        return GatewayError(
            "upstream_error", f"inference server at {self.base_url} failed: {type(e).__name__}: {e}"
        )

    # ---- streams ----------------------------------------------------------------------------------------

    async def stream(
        self, path: str, body: dict[str, Any], decode: Decoder = orjson.loads
    ) -> AsyncIterator[Any]:
        """The decoded `data:` events of a server-sent-events answer to `POST path`, up to `[DONE]`.

        Until the answer has begun this retries like `post`; once it has, nothing is retried (tokens were
        sampled and perhaps already passed on): a dropped connection, a timeout or an end without `[DONE]`
        is a `GatewayError`. Leaving the iteration early closes the connection, which makes vLLM and SGLang
        abort the generation."""
        payload = _encode(body)
        answer: _Streamed
        if self._h1 is not None:
            pool = self._h1
            answer = await self._with_retries(lambda: self._open_stream_h1(pool, path, payload))
        else:
            if self._session is None or self._session.closed:
                await self.start()
            url = self.base_url + path
            answer = await self._with_retries(lambda: self._open_stream(url, payload))
        done = False
        try:
            async for data in _sse_data(answer):
                if data == b"[DONE]":
                    # Read the body's end too, so the connection goes back to the pool (a closed one
                    # costs the next call a new connection).
                    while await answer.read():
                        pass
                    done = True
                    return
                try:
                    yield decode(data)
                except orjson.JSONDecodeError:
                    raise GatewayError(
                        "upstream_error",
                        f"inference server sent a stream event that is not JSON: {_snippet(data)}",
                    ) from None
            raise GatewayError(
                "upstream_error", f"inference server at {self.base_url} ended the stream early"
            )
        except _READ_FAILURES as e:
            failure = self._failure(e)
            err = failure.failure if isinstance(failure, _Retryable) else failure
            assert isinstance(err, GatewayError)
            raise GatewayError(err.kind, f"{err.message} mid-stream") from None
        finally:
            if done:
                answer.release()
            else:
                answer.close()  # closing the connection is how vLLM learns to abort the generation

    async def _open_stream(self, url: str, payload: bytes) -> _Streamed:
        """One attempt to start a streamed answer: the open 2xx response, a GatewayError or `_Retryable`."""
        assert self._session is not None
        try:
            resp = await self._session.post(url, data=payload, headers=_SSE_HEADERS, allow_redirects=False)
        except (OutboundRefused, TimeoutError, aiohttp.ClientError) as e:
            raise self._failure(e) from None
        return await self._opened(_AiohttpStream(resp))

    async def _open_stream_h1(self, pool: h1.H1Pool, path: str, payload: bytes) -> _Streamed:
        """`_open_stream` over the lean client, the attempt's whole answer bounded by `timeout_s`."""
        try:
            stream = await pool.open_stream(path, payload, self._deadline())
        except _H1_FAILURES as e:
            raise self._failure(e) from None
        return await self._opened(stream)

    async def _opened(self, answer: _Streamed) -> _Streamed:
        """`answer` if it is a 2xx event stream; else its body is read and the error it means raised."""
        if answer.status < 300 and answer.content_type == "text/event-stream":
            return answer
        parts = []
        try:
            while piece := await answer.read():
                parts.append(piece)
        except _READ_FAILURES:
            pass
        finally:
            answer.release()
        raw = b"".join(parts)
        if answer.status < 300:
            _decode(raw, answer.status)  # not JSON either: says so
            raise GatewayError(
                "upstream_error",
                f"inference server answered a streamed request with {answer.content_type}, not an event stream",
            )
        raise _refused(answer.status, raw)


class _Streamed(Protocol):
    """An answer read as it arrives (`h1.Stream`, or aiohttp's response through `_AiohttpStream`): `read()`
    gives what has arrived, `b""` at the end; `release()` once it is all read, `close()` to abandon it."""

    status: int
    content_type: str

    async def read(self) -> bytes: ...
    def release(self) -> None: ...
    def close(self) -> None: ...


class _AiohttpStream:
    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.status = resp.status
        self.content_type = resp.content_type

    async def read(self) -> bytes:
        return await self.resp.content.readany()

    def release(self) -> None:
        self.resp.release()

    def close(self) -> None:
        self.resp.close()


async def _sse_data(answer: _Streamed) -> AsyncIterator[bytes]:
    """The data of each server-sent event (its `data:` lines joined by newlines); other fields are skipped."""
    buf = b""
    data: list[bytes] = []
    while piece := await answer.read():
        lines = (buf + piece).split(b"\n")
        buf = lines.pop()
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if data:
                    yield b"\n".join(data)
                    data = []
            elif line.startswith(b"data:"):
                data.append(line[6:] if line[5:6] == b" " else line[5:])
    if buf.startswith(b"data:"):
        data.append(buf[6:] if buf[5:6] == b" " else buf[5:])
    if data:
        yield b"\n".join(data)


def _encode(body: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError as e:
        # Only harness-given values reach here (e.g. a seed beyond 64 bits): the caller's fault.
        raise GatewayError("invalid_request", f"the request cannot be sent upstream as JSON: {e}") from None


def _decode(raw: bytes, status: int, decode: Decoder = orjson.loads) -> JSON:
    try:
        return decode(raw)
    except orjson.JSONDecodeError:
        raise GatewayError(
            "upstream_error",
            f"inference server answered HTTP {status} with a body that is not JSON: {_snippet(raw)}",
        ) from None


def _answered(status: int, raw: bytes, decode: Decoder) -> JSON:
    """A whole answer: its decoded body (2xx), else `_Retryable` (502/503/504) or its `GatewayError`."""
    if status < 300:
        return _decode(raw, status, decode)
    raise _refused(status, raw)


def _refused(status: int, raw: bytes) -> Exception:
    """A non-2xx answer: `_Retryable` for 502/503/504, else its `GatewayError`."""
    return _Retryable(map_status(status, raw)) if status in _RETRY_STATUS else map_status(status, raw)


def _snippet(raw: bytes, limit: int = 200) -> str:
    text = raw[:limit].decode("utf-8", errors="replace").strip()
    return repr(text + ("..." if len(raw) > limit else "")) if text else "(empty body)"


def error_detail(raw: bytes) -> tuple[str, str | None]:
    """(message, param) of an error body in any of the shapes servers use, else a snippet of the body.

    vLLM (recent) and OpenAI: {"error": {"message", "type", "param", "code"}}; SGLang and vLLM <= 0.10:
    {"object": "error", "message", "type", "param", "code"}; FastAPI's own errors (unknown route, request
    validation): {"detail": str | list}.
    """
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _snippet(raw), None
    if not isinstance(data, dict):
        return _snippet(raw), None
    err = data.get("error")
    src = err if isinstance(err, dict) else data
    msg = src.get("message")
    param = src.get("param")
    if isinstance(err, str):
        msg = err
    if not isinstance(msg, str):
        detail = data.get("detail")
        if isinstance(detail, str):
            msg = detail
        elif detail is not None:
            msg = orjson.dumps(detail).decode()
        else:
            msg = _snippet(raw)
    return msg, param if isinstance(param, str) else None


def map_status(status: int, raw: bytes) -> GatewayError:
    """The `GatewayError` for a non-2xx upstream answer."""
    msg, param = error_detail(raw)
    if status == 400:
        if is_context_overflow(msg):
            prompt_tokens, max_tokens = context_numbers(msg)
            return GatewayError("context_length", msg, prompt_tokens=prompt_tokens, max_tokens=max_tokens)
        return GatewayError("invalid_request", msg, param=param)
    if status == 404:
        return GatewayError("not_found", msg, param=param)
    if status == 413:
        return GatewayError("request_too_large", msg)
    if status == 429:
        return GatewayError("rate_limit", msg)
    if status in (401, 403):
        # The gateway's own credentials for the upstream are wrong: not the harness's key, so not a 401.
        return GatewayError(
            "upstream_error", f"inference server refused the gateway's credentials (HTTP {status}): {msg}"
        )
    if status == 409:
        # The server's state refuses the call, whatever the request says: `polar replay` answering a call it
        # did not record. Not the policy's doing, so the session is an infrastructure failure, not a sample.
        return GatewayError("upstream_error", f"inference server refused the call (HTTP 409): {msg}")
    if 400 <= status < 500:
        return GatewayError("invalid_request", msg, param=param)
    return GatewayError("upstream_error", f"inference server failed (HTTP {status}): {msg}")


# Context-length overflow, as vLLM and SGLang word it across versions (all HTTP 400):
#   vLLM <= 0.9:   "This model's maximum context length is M tokens. However, you requested T tokens
#                   (N in the messages, O in the completion). ..."  /  "... you requested N tokens in the messages, ..."
#   vLLM 0.10-0.17: "This model's maximum context length is M tokens. However, your request has N input tokens. ..."
#                  "'max_tokens' or 'max_completion_tokens' is too large: O. This model's maximum context length
#                   is M tokens and your request has N input tokens (O > M - N)."
#   vLLM 0.18+:    "This model's maximum context length is M tokens. However, you requested O output tokens and
#                   your prompt contains [at least ]N input tokens, for a total of [at least ]T tokens. ..."
#   vLLM renderer: "You passed N input tokens and requested O output tokens. However, the model's context length
#                   is only M tokens, ..." (and "You passed C input characters ..." before tokenizing)
#   vLLM engine:   "The decoder prompt (length N) is longer than the maximum model length of M. ..."
#   vLLM 0.32 (and our engine): "max_tokens=O cannot be greater than max_model_len=M. Please request fewer
#                  output tokens." (a prompt plus max_tokens over M is no error there: vLLM cuts max_tokens)
#   SGLang:        "The input (N tokens) is longer than the model's context length (M tokens)."
#                  "Requested token count exceeds the model's maximum context length of M tokens. You requested a
#                   total of T tokens: N tokens from the input messages and O tokens for the completion. ..."
_OVERFLOW = re.compile(
    r"maximum context length|context length is only|longer than the maximum model length"
    r"|longer than the model's context length|cannot be greater than max_model_len",
    re.IGNORECASE,
)
_MAX_PATTERNS = tuple(
    re.compile(p, re.IGNORECASE)
    for p in (
        r"maximum context length (?:is|of) (\d+)",
        r"context length is only (\d+)",
        r"maximum model length of (\d+)",
        r"model's context length \((\d+) tokens\)",
        r"max_model_len=(\d+)",
    )
)
_PROMPT_PATTERNS = tuple(
    re.compile(p, re.IGNORECASE)
    for p in (
        r"request has (\d+) input tokens",
        r"prompt contains (?:at least )?(\d+) input tokens",
        r"\((\d+) in the messages",
        r"requested (\d+) tokens in the messages",
        r"you passed (\d+) input tokens",
        r"prompt \(length (\d+)\)",
        r"the input \((\d+) tokens\)",
        r"(\d+) tokens from the input messages",
    )
)


def is_context_overflow(message: str) -> bool:
    return _OVERFLOW.search(message) is not None


def context_numbers(message: str) -> tuple[int | None, int | None]:
    """(prompt_tokens, max context tokens) where the message states them."""
    return _first_int(_PROMPT_PATTERNS, message), _first_int(_MAX_PATTERNS, message)


def _first_int(patterns: tuple[re.Pattern[str], ...], text: str) -> int | None:
    for p in patterns:
        m = p.search(text)
        if m:
            return int(m.group(1))
    return None
