"""`polar replay`: a session recorded by a gateway, served back to a gateway, gives the same records.

Recorded against the scripted fake vLLM through a real gateway with the official SDKs (a streamed tool call
with reasoning, then a whole answer), then replayed: a second gateway in front of the replay server, asked
the same, answers the same text and records the same token ids, logprobs, messages and trajectory. A request
that departs from the recording is refused (409) naming the first message that differs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from polar.replay import Recording, RecordingError, create_replay_app
from polar.replay.recording import first_difference
from polar.store.records import CompletionRecord
from polar.trajectory import build
from tests.conftest import SERVED_MODEL, FakeBackend, Gateway, start_gateway
from tests.fakes.fake_vllm import Reply
from tests.fakes.server import serve

TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run a command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    }
]
ARGS = '{"cmd":"ls"}'


def conversation(gw: Gateway, sid: str, tool_output: str = "a.txt") -> list[str]:
    """What a small agent does: a streamed call that asks for a tool, then a whole answer after its result;
    then an Anthropic streamed side question. Returns what the SDKs handed over."""
    oc = openai.OpenAI(base_url=gw.url + "/v1", api_key=sid, max_retries=0)
    messages: Any = [{"role": "user", "content": "list the files"}]
    calls: dict[int, dict[str, str]] = {}
    seen = []
    for chunk in oc.chat.completions.create(model="policy", messages=messages, tools=TOOLS, stream=True):
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += tc.id or ""
            entry["name"] += (tc.function.name or "") if tc.function else ""
            entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
    (call,) = calls.values()
    seen.append(json.dumps(call, sort_keys=True))
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
        ]},
        {"role": "tool", "tool_call_id": call["id"], "content": tool_output},
    ]  # fmt: skip
    done = oc.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    seen.append(done.choices[0].message.content or "")
    ac = anthropic.Anthropic(base_url=gw.url, api_key=sid, max_retries=0)
    text = ""
    with ac.messages.stream(model="policy", max_tokens=64, messages=[{"role": "user", "content": "hi"}]) as s:
        for piece in s.text_stream:
            text += piece
    seen.append(text)
    return seen


def _script() -> list[Reply]:
    return [
        Reply("Let me look.", "I should list them.", tool_calls=[("run", ARGS)]),
        Reply("There is one file: a.txt."),
        Reply("Hello there."),
    ]


@pytest.fixture
def recorded(fake_backend: FakeBackend, gateway: Gateway) -> Iterator[tuple[Path, str, list[str]]]:
    fake_backend.app.reset(_script())
    sid = gateway.new_session()
    seen = conversation(gateway, sid)
    yield gateway.store_path, sid, seen


def _same(a: CompletionRecord, b: CompletionRecord) -> None:
    assert list(a.prompt_ids or ()) == list(b.prompt_ids or ())
    assert a.response_ids == b.response_ids and a.response_logprobs == b.response_logprobs
    assert a.response_message == b.response_message and a.upstream_request == b.upstream_request
    assert (a.finish_reason, a.dialect, a.trainable) == (b.finish_reason, b.dialect, b.trainable)


def test_a_replayed_session_records_what_was_recorded(
    recorded: tuple[Path, str, list[str]], tmp_path: Path
) -> None:
    store, sid, seen = recorded
    original = Recording.load(store, sid).records
    assert len(original) == 3 and all(r.trainable for r in original)
    with serve(create_replay_app(Recording.load(store, sid))) as replay:
        gw = start_gateway(replay.url, tmp_path, store_path=tmp_path / "replayed.db")
        try:
            again = gw.new_session()
            assert conversation(gw, again) == seen  # the harness sees the same answers
            replayed = gw.completions(again)
        finally:
            gw.server.stop()
    # Replayed again, a request the recording does not have (the tool gave another output) is refused.
    with serve(create_replay_app(Recording.load(store, sid))) as replay:
        gw = start_gateway(replay.url, tmp_path, store_path=tmp_path / "departed.db")
        try:
            with pytest.raises(openai.APIError) as refused:
                conversation(gw, gw.new_session(), tool_output="b.txt")
        finally:
            gw.server.stop()
    assert len(replayed) == 3
    for a, b in zip(original, replayed, strict=True):
        _same(a, b)
    one, two = build(original, strategy="prefix_merging"), build(replayed, strategy="prefix_merging")
    assert len(one.traces) == len(two.traces) >= 2
    for a, b in zip(one.traces, two.traces, strict=True):
        assert (a.prompt_ids, a.response_ids, a.loss_mask) == (b.prompt_ids, b.response_ids, b.loss_mask)
        assert a.response_logprobs == b.response_logprobs
    assert "messages[2]" in str(refused.value) and "b.txt" in str(refused.value), str(refused.value)


def test_differences_name_the_first_message() -> None:
    a = {"model": "m", "messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "1"}]}
    assert first_difference(a, a) is None
    b = {**a, "messages": [a["messages"][0], {"role": "tool", "content": "2"}]}
    assert first_difference(a, b) == ("messages[1]", a["messages"][1], b["messages"][1])
    assert first_difference(a, {**a, "messages": a["messages"][:1]})[0] == "messages[1]"  # type: ignore[index]
    assert first_difference(a, {**a, "max_tokens": 5}) == ("max_tokens", None, 5)


def test_a_call_asked_twice_is_refused(recorded: tuple[Path, str, list[str]]) -> None:
    store, sid, _ = recorded
    recording = Recording.load(store, sid)
    first = recording.records[0].upstream_request
    assert isinstance(recording.take(first), CompletionRecord)
    again = recording.take(first)
    assert not isinstance(again, CompletionRecord) and "the same call again" in again.message()
    with serve(create_replay_app(recording)) as replay:
        r = httpx.post(replay.url + "/v1/chat/completions", content=b"{nope")
        assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
        models = httpx.get(replay.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == [SERVED_MODEL]


def test_bad_stores_and_sessions_are_one_line(recorded: tuple[Path, str, list[str]], tmp_path: Path) -> None:
    store, sid, _ = recorded
    with pytest.raises(RecordingError, match="no such store"):
        Recording.load(tmp_path / "missing.db", sid)
    with pytest.raises(RecordingError, match=f"no calls recorded for session 'nope'.*{sid}"):
        Recording.load(store, "nope")
    done = subprocess.run(
        [sys.executable, "-m", "polar", "replay", str(store), "nope", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "polar replay: " in done.stderr and "no calls recorded for session 'nope'" in done.stderr
    help_text = subprocess.run(
        [sys.executable, "-m", "polar", "replay", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    assert "Examples:" in help_text and "polar gateway --backend" in help_text


# -- a real CLI, recorded and replayed -------------------------------------------------------------------


async def _run_claude(
    tmp_path: Path, policy_url: str, sid: str, image: str
) -> tuple[Any, list[CompletionRecord]]:
    from polar.store.sqlite import SQLiteStore
    from tests.node_support import running_node, shell_task, spec
    from tests.test_cli_claude_code import HELLO

    task = shell_task(
        "unused",
        instruction="Create hello.txt with a greeting.",
        timeout_seconds=150,
        agent={"harness": "claude_code", "settings": {}},
        # A workdir path that is the same in every container: the prompt Claude Code builds names its cwd.
        runtime={"backend": "docker", "network": "gateway", "image": image, "workdir": "/workspace"},
        evaluator={"strategy": "test_on_output", "config": {"command": "cat hello.txt", "expect": HELLO}},
    )
    async with running_node(policy_url, tmp_path) as node:
        await node.submit(spec(task, sid))
        result = await node.wait(sid)
    with SQLiteStore(tmp_path / "node.db") as store:
        return result, store.completions(sid)


@pytest.mark.cli
@pytest.mark.containers
async def test_a_real_cli_session_replays_to_the_same_trajectory(tmp_path: Path, docker_engine: str) -> None:
    """Claude Code in a container recorded against the scripted policy, then run again, unmodified, against
    the replay: the same upstream requests, the same records and the same trajectory, and the task passes."""
    from polar.rollout.protocol import SessionStatus
    from tests.container_support import base_image
    from tests.node_support import fake_policy
    from tests.test_cli_claude_code import script

    image = base_image(docker_engine)
    (tmp_path / "rec").mkdir()
    (tmp_path / "rep").mkdir()
    with fake_policy(script) as (url, _):
        first, recorded = await _run_claude(tmp_path / "rec", url, "sess-rec", image)
    assert first.status == SessionStatus.COMPLETED and first.reward == 1.0, (first.reason, first.metadata)
    recording = Recording.load(tmp_path / "rec" / "node.db", "sess-rec")
    with serve(create_replay_app(recording)) as replay:
        second, replayed = await _run_claude(tmp_path / "rep", replay.url, "sess-rep", image)
    assert recording.remaining == 0  # every recorded call was asked for, once
    assert second.status == SessionStatus.COMPLETED and second.reward == 1.0, (second.reason, second.metadata)
    assert len(replayed) == len(recorded) >= 2
    for a, b in zip(recorded, replayed, strict=True):
        _same(a, b)
    one, two = build(recorded, strategy="prefix_merging"), build(replayed, strategy="prefix_merging")
    assert [(t.prompt_ids, t.response_ids, t.loss_mask) for t in one.traces] == [
        (t.prompt_ids, t.response_ids, t.loss_mask) for t in two.traces
    ]


def test_a_run_that_departs_from_its_recording_fails_as_infrastructure(tmp_path: Path) -> None:
    """Was: every call a 409 from the replay, yet the session COMPLETED with reward 0 (a zero-reward sample to
    train on) and `polar run` exited 0. A replay that cannot answer is no outcome of the policy's."""
    import yaml

    from polar.store.sqlite import SQLiteStore
    from tests.node_support import CALL_GATEWAY, fake_policy

    (tmp_path / "call_gateway.py").write_text(CALL_GATEWAY)

    def run(calls: int, backend: str, out: str, *extra: str) -> subprocess.CompletedProcess[str]:
        task = {
            "task_id": "say",
            "instruction": "say something",
            "runtime": {"prepare": [{"type": "upload", "src": "call_gateway.py", "dst": "call_gateway.py"}]},
            "agent": {
                "harness": "shell",
                "settings": {"command": f"{sys.executable} call_gateway.py {calls}"},
            },
            "evaluator": {"strategy": "session_completed"},
        }
        (tmp_path / "tasks.yaml").write_text(yaml.safe_dump(task))
        argv = [sys.executable, "-m", "polar", "run", str(tmp_path / "tasks.yaml"), "--backend", backend]
        argv += ["--out", str(tmp_path / out), *extra]
        return subprocess.run(argv, capture_output=True, text=True, timeout=180)

    with fake_policy() as (url, _):
        recorded = run(1, url, "recorded")
    assert recorded.returncode == 0, recorded.stdout + recorded.stderr
    with SQLiteStore(tmp_path / "recorded" / "gateway.db") as store:
        (sid,) = [info.session_id for info in store.sessions() if store.completions(info.session_id)]
    with serve(create_replay_app(Recording.load(tmp_path / "recorded" / "gateway.db", sid))) as replay:
        wrong = run(1, replay.url, "wrong", "--model", "tiny")  # docs/harnesses.md's example said so
        departed = run(2, replay.url, "departed")  # a second call the recording does not have
    assert wrong.returncode == 2 and wrong.stderr.splitlines() == [
        f"polar run: --model tiny: not served by {replay.url} (it serves {SERVED_MODEL})"
    ]
    assert departed.returncode == 3, departed.stdout + departed.stderr
    (line,) = (tmp_path / "departed" / "results.jsonl").read_text().splitlines()
    result = json.loads(line)
    assert result["status"] == "ERROR" and result["reward"] is None
    assert "inference backend failed during the run" in result["reason"]
    assert "HTTP 409" in result["reason"] and "at messages[1]" in result["reason"], result["reason"]
    assert "1 of 1 sessions ended in an infrastructure failure" in departed.stderr
