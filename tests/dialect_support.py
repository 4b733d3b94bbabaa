"""What the dialect tests share: refusals, an `openai` SDK client on a mock transport, a Responses stream cut
into SDK-validated events, and a JSON mutator for property tests that every mutated body is either parsed
and answerable or refused by field."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx2
import openai
import orjson
import pytest
from hypothesis import strategies as st
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from polar.gateway.canonical import Completion
from polar.gateway.dialects.base import Dialect
from polar.gateway.errors import GatewayError
from polar.gateway.signatures import ReasoningCodec
from tests.json_strategies import json_values


def refusal(parse: Callable[[Any], object], body: Any) -> GatewayError:
    """The error `parse(body)` raises, checked to be a 400 `invalid_request`."""
    with pytest.raises(GatewayError) as info:
        parse(body)
    assert info.value.kind == "invalid_request" and info.value.status == 400
    return info.value


def openai_refusal(dialect: Dialect, body: Any, codec: ReasoningCodec, param: str | None) -> GatewayError:
    """A refusal naming `param`, in an OpenAI error envelope that names it too."""
    err = refusal(lambda b: dialect.parse(b, codec), body)
    assert err.param == param
    status, envelope = dialect.error(err)
    assert status == 400
    assert envelope["error"]["type"] == "invalid_request_error"
    assert envelope["error"]["param"] == param
    if param is not None:
        assert param in envelope["error"]["message"]
    return err


def openai_client(handler: Callable[[httpx2.Request], httpx2.Response]) -> openai.OpenAI:
    """The official SDK, its HTTP transport replaced by `handler`."""
    return openai.OpenAI(
        api_key="session-key",
        base_url="http://gateway.test/v1",
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
    )


def sse_response(frames: list[bytes]) -> httpx2.Response:
    return httpx2.Response(200, content=b"".join(frames), headers={"content-type": "text/event-stream"})


# Integers stay in the range orjson (the gateway's JSON decoder) can produce.
RESPONSES_EVENT = TypeAdapter(ResponseStreamEvent)


def frames_of(blob: bytes) -> list[bytes]:
    """An SSE byte stream cut into its frames (each with its blank line)."""
    return [f + b"\n\n" for f in blob.split(b"\n\n") if f]


def events_of(frames: list[bytes]) -> list[dict[str, Any]]:
    """The `data` of each Responses SSE frame, each validated as an event of the openai SDK's own types."""
    events = []
    for frame in frames:
        data = orjson.loads(frame.rstrip(b"\n").split(b"\n")[1].removeprefix(b"data: "))
        RESPONSES_EVENT.validate_python(data)
        events.append(data)
    return events


JSON = json_values(int_max=2**64 - 1, allow_infinity=True, text_size=8, key_size=8, size=3, max_leaves=10)


def mutate(node: Any, data: st.DataObject, depth: int = 0) -> Any:
    """Replace, delete or recurse into one randomly chosen place of a JSON value."""
    if isinstance(node, dict) and node and depth < 6:
        key = data.draw(st.sampled_from(sorted(node)))
        action = data.draw(st.sampled_from(["replace", "delete", "recurse", "recurse"]))
        out = dict(node)
        if action == "delete":
            del out[key]
        elif action == "replace":
            out[key] = data.draw(JSON)
        else:
            out[key] = mutate(node[key], data, depth + 1)
        return out
    if isinstance(node, list) and node and depth < 6:
        i = data.draw(st.integers(0, len(node) - 1))
        out_list = list(node)
        out_list[i] = mutate(node[i], data, depth + 1) if data.draw(st.booleans()) else data.draw(JSON)
        return out_list
    return data.draw(JSON)


def assert_parsed_or_refused(
    dialect: Dialect, body: Any, codec: ReasoningCodec, comp: Completion, **path: Any
) -> None:
    """`body` is refused with a 400 naming the field in the dialect's envelope, or parsed into a request
    the dialect can answer in both forms. `path` carries what a dialect takes from the URL."""
    try:
        req = dialect.parse(body, codec, **path)
    except GatewayError as err:
        assert err.kind == "invalid_request"
        status, envelope = dialect.error(err)
        assert status == 400 and envelope["error"]["message"]
        orjson.dumps(envelope)
        if err.param is not None:
            assert err.param in err.message
        return
    orjson.dumps(dialect.render(req, comp, codec))
    assert b"".join(dialect.stream(req, comp, codec))
