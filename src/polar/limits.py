"""Limits every polar HTTP server puts on what a caller sends: nesting depth and body read time.

The agent under training is untrusted, and so is what its harness sends. Two things must be refused up
front, before any work is done for them:

- JSON nested deeper than `MAX_JSON_DEPTH` containers. orjson parses up to 1,024 levels but serializes only
  254, so a body between the two was accepted, generated for, and then could not be stored (the caller was
  told to retry a call that can never succeed). Everything accepted must fit orjson with room to spare: a
  record wraps a body in a few more levels (the store's skeleton, `{"completions": [...]}` on the control
  plane, a trajectory inside a rollout result), and pydantic's JSON reader stops at 200.
- A body that never arrives: a `Content-Length` larger than what is sent would otherwise hold the request
  (and a server task) forever.
"""

from __future__ import annotations

import asyncio
import functools
import re
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request

from polar.jsontypes import JSON

MAX_JSON_DEPTH = 128  # containers (objects and arrays) nested in one another, the outermost counting 1
DEFAULT_BODY_TIMEOUT_S = 30.0

_ORJSON_DEPTH = 254  # orjson.dumps raises "Recursion limit reached" past this many nested containers
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


class BodyError(Exception):
    """A body that cannot be read: too large (413), not sent in time (408), cut short (400). Callers answer in their own
    error format; `status` is the HTTP status to use."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The whole body, refusing more than `limit` bytes and giving up after `timeout_s` seconds.

    A declared length over the limit is refused before reading anything. The server stops at the declared
    length, so a `Content-Length` larger than what the client sends leaves the read waiting: the timeout
    ends it (uvicorn has no body timeout of its own).
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyError(413, f"request body of {declared} bytes exceeds the limit of {limit}")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise BodyError(413, f"request body exceeds the limit of {limit} bytes")
                if chunk:
                    chunks.append(chunk)
    except ClientDisconnect:
        raise BodyError(400, f"the client disconnected after {size} bytes of the body") from None
    except TimeoutError:
        promised = f" of the {declared} declared in Content-Length" if declared is not None else ""
        raise BodyError(
            408, f"the request body did not arrive within {timeout_s:g} s ({size} bytes received{promised})"
        ) from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def nesting_path(value: JSON, limit: int = MAX_JSON_DEPTH) -> list[str | int] | None:
    """None when `value` nests at most `limit` containers deep, else the path to the first container past
    the limit (keys and indices).

    The common case costs one orjson serialization, at C speed (a Python walk over an 80 kB agent request
    is several times slower): the value, put inside `254 - limit` prebuilt lists (orjson's `default` hook
    fills the innermost hole, so nothing is built per call), serializes iff it nests at most `limit` deep.
    Only a refused value is walked, to name where it goes too deep.
    """
    if not isinstance(value, (dict, list)):
        return None
    try:
        orjson.dumps(_wrapper(limit), default=lambda _: value)
        return None
    except TypeError:
        pass
    return _deep_path(value, limit)


class _Hole:
    """The innermost element of a wrapper; orjson asks `default` what to write in its place."""


@functools.cache
def _wrapper(limit: int) -> object:
    if not 0 < limit <= _ORJSON_DEPTH:
        raise ValueError(f"limit must be between 1 and {_ORJSON_DEPTH}")
    wrapped: object = _Hole()
    for _ in range(_ORJSON_DEPTH - limit):
        wrapped = [wrapped]
    return wrapped


def _deep_path(value: JSON, limit: int) -> list[str | int] | None:
    """Depth-first, iteratively (a recursive walk would hit Python's own recursion limit first)."""
    stack: list[tuple[Any, list[str | int]]] = [(value, [])]
    while stack:
        node, path = stack.pop()
        if len(path) >= limit:
            return path
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in reversed(list(items)):
            if isinstance(child, (dict, list)):
                stack.append((child, [*path, key]))
    return None


def format_path(path: list[str | int], max_steps: int = 6) -> str:
    """`contents[2].parts[0].functionResponse.response…`: the first steps of a path, as a caller writes
    them; keys that are not identifiers are quoted, and a cut path ends in an ellipsis."""
    out = ""
    for step in path[:max_steps]:
        if isinstance(step, int):
            out += f"[{step}]"
        elif _IDENT.match(step):
            out += f".{step}" if out else step
        else:
            out += f"[{orjson.dumps(step[:64]).decode()}]"
    return out + ("…" if len(path) > max_steps else "")


def nesting_message(path: list[str | int], limit: int = MAX_JSON_DEPTH) -> str:
    return (
        f"JSON nested deeper than {limit} levels at {format_path(path)}; at most {limit} levels are accepted"
    )


def json_error(exc: orjson.JSONDecodeError) -> str:
    """Why a body is not JSON, in orjson's words; past orjson's own depth limit (1,024), in ours."""
    if "depth limit exceeded" in str(exc):
        return (
            f"JSON nested deeper than {MAX_JSON_DEPTH} levels; at most {MAX_JSON_DEPTH} levels are accepted"
        )
    return f"request body is not valid JSON: {exc}"
