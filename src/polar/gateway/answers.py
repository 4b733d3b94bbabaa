"""Reading a call's body and writing its answer: the HTTP edges of `polar.gateway.proxy`, shared with the
control routes and the token-counting routes."""

from __future__ import annotations

import orjson
from starlette.requests import Request
from starlette.responses import Response

from polar import jsontypes
from polar.gateway.call import Call
from polar.gateway.canonical import CanonicalRequest, Completion
from polar.gateway.dialects.base import Dialect, StreamFormat
from polar.gateway.errors import GatewayError, invalid
from polar.gateway.signatures import ReasoningCodec
from polar.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    BodyError,
    format_path,
    json_error,
    nesting_message,
    nesting_path,
    read_body,
)

JSON = "application/json"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
CLOSE = {"connection": "close"}


def render(dialect: Dialect, req: CanonicalRequest, comp: Completion, codec: ReasoningCodec) -> Response:
    """A whole answer as the dialect's JSON body (streamed calls are answered by `polar.gateway.relay`)."""
    return Response(orjson.dumps(dialect.render(req, comp, codec)), media_type=JSON)


def failure_response(call: Call, err: GatewayError, fmt: StreamFormat) -> Response:
    """A failed call's answer: the dialect's in-stream error event when the harness asked for an SSE stream
    (Gemini's JSON-array stream is one JSON document, so its errors stay plain JSON), else its envelope."""
    if call.req is not None and call.req.stream and fmt == "sse":
        return Response(
            call.dialect.stream_error(err),
            status_code=call.dialect.stream_error_status(err),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    return error_response(call.dialect, err)


def error_response(dialect: Dialect, err: GatewayError) -> Response:
    status, body = dialect.error(err)
    # A body that did not arrive in time leaves the connection mid-request: whatever the client sends next
    # would be read as the rest of it, so the connection is closed with the answer.
    headers = CLOSE if err.status == 408 else None
    return Response(orjson.dumps(body), status_code=status, media_type=JSON, headers=headers)


async def read_json(
    request: Request, limit: int, timeout_s: float = DEFAULT_BODY_TIMEOUT_S
) -> jsontypes.JSON:
    """The request body as JSON: at most `limit` bytes, read within `timeout_s`, nested at most
    `MAX_JSON_DEPTH` deep (so that whatever is accepted can be stored)."""
    body = parse_json(await read_raw(request, limit, timeout_s))
    check_nesting(body)
    return body


async def read_raw(request: Request, limit: int, timeout_s: float) -> bytes:
    try:
        return await read_body(request, limit, timeout_s)
    except BodyError as exc:
        if exc.status == 413:
            raise GatewayError("request_too_large", exc.message) from None
        raise GatewayError("invalid_request", exc.message, status=exc.status) from None


def parse_json(raw: bytes) -> jsontypes.JSON:
    if not raw:
        raise invalid("request body is empty; expected a JSON object")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise invalid(json_error(exc)) from None


def check_nesting(body: jsontypes.JSON) -> None:
    """Refuse a body nested deeper than `MAX_JSON_DEPTH`, naming where, before any generation for it."""
    path = nesting_path(body)
    if path is not None:
        raise invalid(nesting_message(path), format_path(path))
