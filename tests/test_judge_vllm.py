"""`judge` on the real vLLM (the session server of tests/conftest.py, a small real model on the CPU) as both
the policy and the frozen judge: structured outputs hold the verdict to its schema even for a model that
answers at random, the score lands in the judge's record and becomes the session's reward, and
`polar replay` serves the judge session back so a second judgement gives the same verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polar.evaluate import get_evaluator
from polar.evaluate.judge import JudgeConfig
from polar.evaluate.judging import parse_verdict, verdict_schema
from polar.gateway.backends.base import BackendOptions
from polar.replay import Recording, create_replay_app
from polar.rollout.protocol import SessionStatus
from polar.store.sqlite import SQLiteStore
from polar.trajectory import Trajectory
from tests.evaluate_support import (
    MakeRepo,
    make_repo,  # noqa: F401
)
from tests.fakes.server import serve
from tests.judge_support import context
from tests.node_support import PY, program, running_node, shell_task, spec
from tests.vllm_support import VLLMServer

pytestmark = pytest.mark.vllm

# One short call, as a harness makes it (the random model would otherwise write until its context ends).
ASK = """
import os, openai
client = openai.OpenAI(max_retries=0)
r = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], max_tokens=8, temperature=0,
                                   messages=[{"role": "user", "content": "What is the capital of France?"}])
print(r.choices[0].message.content)
"""


async def test_a_task_judged_by_vllm_is_recorded_and_replayed(
    vllm_server: VLLMServer,
    tmp_path: Path,
    make_repo: MakeRepo,  # noqa: F811
) -> None:
    config = {
        "rubric": "The answer names Paris.",
        "backend": {"url": vllm_server.url, "kind": "vllm", "model": vllm_server.name},
        "diff": False,
        "reasoning_chars": 16,  # the schema bounds what the random model writes
        "sampling": {"max_tokens": 64},
    }
    task = shell_task(
        f"{PY} {program('ask.py', ASK)}",
        instruction="What is the capital of France?",
        evaluator={"strategy": "judge", "config": config},
    )
    options = BackendOptions(retries=0, timeout_s=300.0)
    async with running_node(
        vllm_server.url, tmp_path, served_model=vllm_server.name, backend=options
    ) as node:
        await node.submit(spec(task, "sess-judged-vllm"))
        result = await node.wait("sess-judged-vllm")
    assert result.status == SessionStatus.COMPLETED, result.reason
    details = result.metadata["evaluation"]["details"]
    judge_sid = details["judge"]["session_id"]
    assert details["judge"]["attempts"] == 1, details  # the first answer held to the schema
    with SQLiteStore(tmp_path / "node.db") as store:
        (record,) = store.completions(judge_sid)
    schema = verdict_schema(JudgeConfig.model_validate(config))
    answer = parse_verdict(record.response_message["content"], schema)  # the schema holds
    assert answer["score"] == details["score"] and result.reward == answer["score"] / 10
    assert record.upstream_request["response_format"]["json_schema"]["schema"] == schema
    assert record.tags == ("judge",) and not record.trainable
    assert record.response_ids and len(record.response_ids) == len(record.response_logprobs or ())

    # `polar replay` serves the judge session back: the same judgement, asked again, is the recorded one.
    recording = Recording.load(tmp_path / "node.db", judge_sid)
    trajectory = Trajectory.model_validate(result.trajectory)
    runtime = await make_repo({"a": "a"}, git=False)
    with serve(create_replay_app(recording)) as replay:
        again = {**config, "backend": {**config["backend"], "url": replay.url}, "cache": False}
        (tmp_path / "replay").mkdir()
        async with running_node(
            vllm_server.url, tmp_path / "replay", served_model=vllm_server.name, backend=options
        ) as node:
            ctx = context(node, runtime, trajectory, task, sid="sess-judged-vllm")
            replayed = await get_evaluator("judge", again).evaluate(ctx)
    assert recording.remaining == 0
    assert replayed.details["score"] == details["score"]
    assert replayed.details["reasoning"] == json.loads(record.response_message["content"])["reasoning"]


async def test_a_group_judged_by_vllm_holds_to_its_schema(vllm_server: VLLMServer, tmp_path: Path) -> None:
    """`judge_group` on the real vLLM: every ordering's answer holds to the ranking schema at the first
    attempt (a score for every label, nothing else), the means land in the answer the server settles with,
    and each call is a judge record naming the whole group."""
    from polar.evaluate.group_judging import JUDGED_SESSIONS, GroupJudgeConfig, ranking_schema
    from tests.node_support import control_client

    config = {
        "rubric": "The answer names Paris.",
        "backend": {"url": vllm_server.url, "kind": "vllm", "model": vllm_server.name},
        "diff": False,
        "reasoning_chars": 16,
        "sampling": {"max_tokens": 64},
        "repeats": 2,
    }
    outcomes = [
        {"session_id": "s-paris", "text": "Paris is the capital."},
        {"session_id": "s-berlin", "text": "Berlin."},
    ]
    body = {"config": config, "instruction": "What is the capital of France?", "outcomes": outcomes}
    options = BackendOptions(retries=0, timeout_s=300.0)
    async with (
        running_node(vllm_server.url, tmp_path, served_model=vllm_server.name, backend=options) as node,
        control_client(node, timeout=600) as client,
    ):
        r = await client.post("/node/judge_group", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert "failed" not in got, got
    assert set(got["rewards"]) == {"s-paris", "s-berlin"} and all(
        0 <= v <= 1 for v in got["rewards"].values()
    )
    schema = ranking_schema(2, GroupJudgeConfig.model_validate(config))
    with SQLiteStore(tmp_path / "node.db") as store:
        for k, detail in enumerate(got["details"]):
            assert detail["judge"]["attempts"] == 1, detail  # the first answer held to the schema
            (record,) = store.completions(detail["judge"]["session_id"])
            answer = parse_verdict(record.response_message["content"], schema)
            assert {
                got["orderings"][k][int(label) - 1]: s for label, s in answer["scores"].items()
            } == detail["scores"]
            info = store.session(detail["judge"]["session_id"])
            assert info is not None and info.metadata[JUDGED_SESSIONS] == ["s-paris", "s-berlin"]
            assert record.tags == ("judge",) and not record.trainable
