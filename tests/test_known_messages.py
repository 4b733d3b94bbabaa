"""A session's next Chat call validates and translates only the messages it adds (`dialects.known`), and
parses to exactly what a whole parse gives: the same request, the same refusal naming the same field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polar.gateway.app import create_app
from polar.gateway.backends.base import BackendOptions
from polar.gateway.backends.prompt_ids import MemoBudget
from polar.gateway.config import GatewayConfig
from polar.gateway.dialects.chat.dialect import ChatDialect
from polar.gateway.dialects.known import KnownMessages
from polar.gateway.errors import GatewayError
from polar.gateway.signatures import ReasoningCodec
from polar.harness.registry import classifier
from polar.serving import ServerThread
from polar.store.sqlite import SQLiteStore
from tests.conftest import SERVED_MODEL, FakeBackend

CODEC = ReasoningCodec(b"test-key")
CHAT = ChatDialect()

GOOD = [
    {"role": "system", "content": "be brief"},
    {"role": "developer", "content": [{"type": "text", "text": "a developer note"}]},
    {"role": "user", "content": "list the files", "name": "me", "extra": 1},
    {
        "role": "assistant",
        "content": [{"type": "text", "text": "calling"}],
        "reasoning": "I should look",
        "tool_calls": [{"id": "c1", "function": {"name": "ls", "arguments": "{}"}}],
    },
    {"role": "assistant", "content": None, "tool_calls": []},
    {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
    {"role": "user", "content": [{"type": "text", "text": "x" * 400}]},
    {"role": "assistant", "reasoning_content": "thought", "content": "done"},
]
BAD = [
    {"role": "user", "content": 5},
    {"role": "robot", "content": "hi"},
    {"role": "tool", "content": "no id"},
    {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]},
    "not an object",
]


def outcome(body: dict[str, Any], known: KnownMessages | None) -> Any:
    """What parsing gives: the canonical request's fields, or the refusal's status, field and words."""
    try:
        req = CHAT.parse(body, CODEC, known=known)
    except GatewayError as err:
        return ("refused", err.status, err.param, str(err))
    return (req.messages, req.tools, req.tool_choice, req.params, req.stream, req.render)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["grow", "grow", "same", "rewrite", "truncate", "bad", "empty"]),
            st.integers(0, len(GOOD) - 1),
            st.integers(0, len(BAD) - 1),
        ),
        min_size=1,
        max_size=12,
    )
)
@settings(max_examples=200, deadline=None)
def test_a_call_parses_as_a_whole_parse_would(steps: list[tuple[str, int, int]]) -> None:
    known = KnownMessages()
    messages: list[Any] = [GOOD[0]]
    for op, good, bad in steps:
        if op == "grow":
            messages = [*messages, GOOD[good]]
        elif op == "rewrite":  # a compaction: the history changes from the start
            messages = [GOOD[good], *messages[1:]]
        elif op == "truncate":
            messages = messages[: max(1, len(messages) // 2)]
        elif op == "bad":  # a call the dialect refuses: the memo keeps the previous good call
            messages = [*messages, BAD[bad], GOOD[good]]
        elif op == "empty":
            messages = []
        before = list(known.raw)
        body = {"model": "m", "messages": [dict(m) if isinstance(m, dict) else m for m in messages]}
        fresh = {"model": "m", "messages": [dict(m) if isinstance(m, dict) else m for m in messages]}
        assert outcome(body, known) == outcome(fresh, None)
        if before and outcome(fresh, None)[0] != "refused":
            shared = 0
            while shared < min(len(before), len(messages)) and before[shared] == messages[shared]:
                shared += 1
            assert known.reused == min(shared, len(messages) - 1)  # the messages it did not parse again
        if op in ("bad", "empty"):
            messages = [m for m in messages if m in GOOD] or [GOOD[0]]


def test_a_bad_message_after_known_ones_is_named_where_the_caller_put_it() -> None:
    known = KnownMessages()
    history = [GOOD[0], GOOD[2], GOOD[3], GOOD[5]]
    CHAT.parse({"model": "m", "messages": history}, CODEC, known=known)
    with pytest.raises(GatewayError) as err:
        CHAT.parse({"model": "m", "messages": [*history, {"role": "user", "content": 5}]}, CODEC, known=known)
    assert err.value.param == "messages[4].content" and err.value.status == 400
    req = CHAT.parse({"model": "m", "messages": [*history, GOOD[6]]}, CODEC, known=known)
    assert known.reused == 4 and req.messages[1]["content"] == "list the files"


def test_known_messages_stay_within_their_budget() -> None:
    budget = MemoBudget(max_bytes=40_000)
    sessions = [KnownMessages(budget) for _ in range(8)]
    for i, known in enumerate(sessions):
        body = {"model": "m", "messages": [GOOD[0], {"role": "user", "content": f"{i}" * 3000}]}
        CHAT.parse(body, CODEC, known=known)
        assert budget.nbytes <= 40_000 and known.nbytes >= 9000
    assert budget.emptied >= 4 and sessions[0].raw == [] and sessions[-1].raw != []
    grown = {"model": "m", "messages": [*sessions[-1].raw, GOOD[2]]}
    size = sessions[-1].nbytes
    CHAT.parse(grown, CODEC, known=sessions[-1])  # counted by what it adds
    assert sessions[-1].reused == 2 and sessions[-1].nbytes > size


def test_the_gateway_parses_only_what_a_session_adds(fake_backend: FakeBackend, tmp_path: Path) -> None:
    """Through the gateway and the OpenAI SDK: the second call of a session takes its earlier messages from
    the first, and both are answered and recorded whole."""
    config = GatewayConfig(
        backend_url=fake_backend.url,
        served_model=SERVED_MODEL,
        store_path=tmp_path / "gw.db",
        backend=BackendOptions(retries=0, timeout_s=30.0),
    )
    app = create_app(config, classifier)
    server = ServerThread(app.data, also=[app.control]).start()
    try:
        admin = {"authorization": f"Bearer {config.control_token}"}
        made = httpx.post(server.urls[1] + "/sessions", json={"task_id": "t"}, headers=admin)
        sid = made.json()["session_id"]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=sid, max_retries=0)
        messages: list[Any] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        first = client.chat.completions.create(model="m", messages=messages)
        messages += [{"role": "assistant", "content": first.choices[0].message.content}]
        messages += [{"role": "user", "content": "and again"}]
        client.chat.completions.create(model="m", messages=messages)
        state = app.state.proxy.sessions.get(sid)
        assert state is not None and state.known.reused == 2 and len(state.known.parsed) == 4
        with SQLiteStore(config.store_path) as store:
            sent = [[m["content"] for m in r.upstream_request["messages"]] for r in store.completions(sid)]
        assert sent == [["be brief", "hi"], ["be brief", "hi", first.choices[0].message.content, "and again"]]
    finally:
        server.stop()
