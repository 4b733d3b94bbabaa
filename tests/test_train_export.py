"""Training exports: trainer rows from rollout results (`polar traces export --results`), loaded for real by
Hugging Face `datasets`, advantages and weights carried per trace, filters, and SFT conversations."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from polar.cli import main
from polar.evaluate.base import EvalResult
from polar.rollout.protocol import SessionResult, SessionStatus
from polar.rollout.rewards import assign_rewards
from polar.store.records import CompletionRecord
from polar.train.export import (
    Filter,
    ResultsError,
    conversation,
    conversation_row,
    main_trace,
    read_results,
    result_rows,
)
from polar.trajectory import Trajectory, build
from polar.trajectory.export import COLUMNS, row_schema, rows

EOT = 2
SYSTEM = {"role": "system", "content": "You are a coding agent."}
USER = {
    "role": "user",
    "content": [{"type": "text", "text": "Create "}, {"type": "text", "text": "hello.txt"}],
}
CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": '{"command":"ls"}'}}
    ],
}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "README.md"}
DONE = {"role": "assistant", "content": "Done."}
TOOLS = [{"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}]


def _rec(
    session: str, seq: int, prompt: list[int], sampled: list[int], messages: list[dict[str, Any]],
    reply: dict[str, Any], version: int | None = 7,
) -> CompletionRecord:  # fmt: skip
    return CompletionRecord(
        session_id=session,
        seq=seq,
        completion_id=f"{session}-c{seq}",
        dialect="chat",
        created_at=float(seq),
        request={},
        upstream_request={"messages": messages, "tools": TOOLS},
        prompt_ids=prompt,
        response_ids=sampled,
        response_logprobs=[-0.5 - seq - i / 8 for i in range(len(sampled))],
        finish_reason="tool_calls" if reply.get("tool_calls") else "stop",
        response_message=reply,
        tools=TOOLS,
        usage={},
        model_requested="m",
        model_served="m",
        policy_version=version,
    )


P1 = [1, 5, 6, 7]
A1 = [20, 21, EOT]
U1 = [9, 1, 30, 31, EOT, 9, 1, 7]
A2 = [22, EOT]


def agent_session(session: str) -> list[CompletionRecord]:
    """A two-turn agent loop (tool call, tool result, answer) plus a one-call side chain (a title call)."""
    return [
        _rec(session, 0, P1, A1, [SYSTEM, USER], CALL),
        _rec(session, 1, [1, 40, 41, 7], [42, EOT], [{"role": "user", "content": "title?"}], DONE, 8),
        _rec(session, 2, P1 + A1 + U1, A2, [SYSTEM, USER, CALL, RESULT], DONE),
    ]


def result(
    session: str, task: str, reward: float | None, status: str = "COMPLETED", **meta: Any
) -> SessionResult:
    evaluation = None if reward is None else EvalResult(reward=reward, passed=reward >= 1.0)
    trajectory = assign_rewards(build(agent_session(session)), status, evaluation)
    meta = {"task_id": task, "group_id": f"g-{task}", "sample_index": int(session[-1]), **meta}
    return SessionResult(
        session_id=session,
        task_id=task,
        status=SessionStatus(status),
        reward=reward,
        trajectory=trajectory.model_dump(mode="json"),
        metadata=meta,
    )


@pytest.fixture
def results_file(tmp_path: Path) -> Path:
    path = tmp_path / "results.jsonl"
    rs = [result("s0", "t1", 1.0), result("s1", "t1", 0.0), result("s2", "t2", None, "ERROR")]
    path.write_bytes(b"".join(orjson.dumps(r.model_dump(mode="json")) + b"\n" for r in rs))
    return path


def export(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(main, ["traces", "export", *args], catch_exceptions=False)
    return r.exit_code, r.output


def test_schema_row_keys_and_columns_agree() -> None:
    t = build(agent_session("s0"))
    (row, *_) = rows(t)
    assert tuple(row) == COLUMNS == tuple(row_schema().names)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_results_export_loads_with_datasets(results_file: Path, tmp_path: Path, fmt: str) -> None:
    import datasets  # 0.6 s to import: paid by the tests that read with it, not by every worker

    out = tmp_path / f"traces.{fmt}"
    code, text = export("--results", str(results_file), "--out", str(out))
    assert code == 0 and "wrote 6 traces" in text, text
    ds = datasets.load_dataset(
        "json" if fmt == "jsonl" else "parquet",
        data_files=str(out),
        split="train",
        cache_dir=str(tmp_path / "hf"),
    )
    assert ds.num_rows == 6 and set(COLUMNS) <= set(ds.column_names)
    expected = [r for res in read_results(results_file) for r in result_rows([res])]
    for got, want in zip(ds, expected, strict=True):
        for key in (
            "prompt_ids",
            "response_ids",
            "loss_mask",
            "response_logprobs",
            "reward",
            "policy_version",
        ):
            assert got[key] == want[key], key
    by_session = {(r["session_id"], r["trace_index"]): r for r in ds}
    main = by_session[("s0", 0)]
    assert main["task_id"] == "t1" and main["group_id"] == "g-t1" and main["sample_index"] == 0
    assert main["status"] == "COMPLETED" and main["reward"] == 1.0 and main["policy_version"] == 7
    assert main["response_ids"] == A1 + U1 + A2 and main["loss_mask"] == [1] * 3 + [0] * len(U1) + [1] * 2
    assert main["advantage"] is None and main["weight"] is None  # only when the caller passes them
    assert by_session[("s0", 1)]["policy_version"] == 8  # the side chain, sampled by a later policy
    failed = by_session[("s2", 0)]  # fail-closed: an ERROR session exports fully masked
    assert failed["status"] == "ERROR" and set(failed["loss_mask"]) == {0} and failed["reward"] == 0.0
    assert json.loads(main["metadata"])["completion_ids"] == ["s0-c0", "s0-c2"]


def test_results_export_selects_sessions_and_tasks(results_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    code, text = export("--results", str(results_file), "--task", "t2", "--out", str(out))
    assert code == 0 and "wrote 2 traces" in text
    code, text = export("--results", str(results_file), "s1", "--out", str(out))
    assert code == 0 and "wrote 2 traces" in text
    assert {json.loads(line)["session_id"] for line in out.read_text().splitlines()} == {"s1"}


def test_results_export_failures_are_usage_errors(results_file: Path, tmp_path: Path) -> None:
    out = str(tmp_path / "t.jsonl")
    code, text = export("--results", str(results_file), "nope", "--out", out)
    assert code == 2 and "no such session: nope" in text
    code, text = export("--results", str(results_file), "--task", "t9", "--out", out)
    assert code == 2 and "no sessions for task 't9'" in text
    code, text = export("--results", str(results_file), "s0", "--task", "t1", "--out", out)
    assert code == 2 and "not both" in text
    code, text = export("--results", str(tmp_path / "missing.jsonl"), "--out", out)
    assert code == 2 and "does not exist" in text
    bad = tmp_path / "bad.jsonl"
    bad.write_text(results_file.read_text().splitlines()[0] + "\n{not json\n")
    code, text = export("--results", str(bad), "--out", out)
    assert code == 2 and f"{bad}:2: not JSON" in text
    bad.write_text('{"session_id": "x", "task_id": "t", "status": "DONE"}\n')
    code, text = export("--results", str(bad), "--out", out)
    assert code == 2 and f"{bad}:1: status:" in text
    code, text = export("--store", str(tmp_path / "missing.db"), "--out", out)  # no --results: the store
    assert code == 2 and "does not exist" in text


def test_read_results_reports_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text('\n{"session_id": "x", "status": "COMPLETED"}\n')
    with pytest.raises(ResultsError, match=r"r.jsonl:2: task_id: Field required"):
        list(read_results(path))


def test_a_retried_sample_counts_once_by_its_last_line(tmp_path: Path) -> None:
    """A re-run retries a session an infrastructure failure ended and appends the retry's line (same task
    and sample index, new id): a group must still count that sample once, as its retry."""

    def line(sid: str, sample: int, status: str) -> bytes:
        result = SessionResult(
            session_id=sid, task_id="t", status=SessionStatus(status), metadata={"sample_index": sample}
        )
        return orjson.dumps(result.model_dump(mode="json")) + b"\n"

    path = tmp_path / "results.jsonl"
    path.write_bytes(line("a", 0, "COMPLETED") + line("b", 1, "ERROR") + line("c", 1, "COMPLETED"))
    assert [r.session_id for r in read_results(path)] == ["a", "c"]
    assert [r.session_id for r in read_results(path, retried=True)] == ["a", "b", "c"]


def test_advantages_and_weights_are_looked_up_per_trace_then_per_session() -> None:
    t = build(agent_session("s0"))
    got = list(rows(t, advantages={"s0": 0.5, ("s0", 1): -1.0}, weights={("s0", 0): 0.5, ("s0", 1): 0.5}))
    assert [(r["advantage"], r["weight"]) for r in got] == [(0.5, 0.5), (-1.0, 0.5)]
    other = list(rows(t, advantages={"s9": 1.0}))
    assert [r["advantage"] for r in other] == [None, None]


def test_context_fills_what_the_trajectory_lacks() -> None:
    t = build(agent_session("s0"))  # rebuilt from a store: no task or group in the trajectory itself
    (row, _) = rows(t, context={"task_id": "t1", "group_id": "g1", "sample_index": 3, "session_id": "zz"})
    assert (row["task_id"], row["group_id"], row["sample_index"], row["session_id"]) == ("t1", "g1", 3, "s0")
    (row, _) = rows(t, context={"task_id": "t1"})
    assert row["group_id"] == "t1"  # the group defaults to the task, as on the rollout node


def test_filter_keeps_by_status_reward_and_task() -> None:
    ok, zero, failed = result("s0", "t1", 1.0), result("s1", "t1", 0.0), result("s2", "t2", None, "ERROR")
    assert [Filter()(r) for r in (ok, zero, failed)] == [True, True, False]
    assert [Filter(min_reward=0.5)(r) for r in (ok, zero, failed)] == [True, False, False]
    anything = Filter(statuses=())
    assert [anything(r) for r in (ok, zero, failed)] == [True, True, True]
    assert not Filter(statuses=(), min_reward=0.0)(failed)  # no reward never passes a reward bar
    assert [Filter(task_ids=("t2",), statuses=("ERROR",))(r) for r in (ok, failed)] == [False, True]
    empty = ok.model_copy(update={"trajectory": None})
    assert not Filter()(empty) and conversation_row(empty) is None


def test_conversation_is_the_main_chain_with_tool_results_in_order() -> None:
    t = build(agent_session("s0"))
    assert main_trace(t) == 0 and main_trace(Trajectory()) is None
    messages = conversation(t.traces[0])
    assert messages == [SYSTEM, {"role": "user", "content": "Create hello.txt"}, CALL, RESULT, DONE]
    row = conversation_row(result("s0", "t1", 1.0))
    assert row is not None
    assert row["messages"] == messages and row["assistant_turns"] == 2 and row["trace_index"] == 0
    assert json.loads(row["tools"]) == TOOLS and row["group_id"] == "g-t1" and row["reward"] == 1.0


def test_per_request_conversation_is_the_last_loop_call() -> None:
    t = build(agent_session("s0"), "per_request")
    i = main_trace(t)
    assert i is not None and t.traces[i].metadata["completion_ids"] == ["s0-c2"]
    assert conversation(t.traces[i])[-2:] == [RESULT, DONE]


def test_non_text_parts_are_kept_as_they_are() -> None:
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
    t = build([_rec("s0", 0, P1, A1, [image], DONE)])
    assert conversation(t.traces[0])[0] == image


@pytest.mark.parametrize(("estimator", "expected"), [("grpo", 2**-0.5), ("rloo", 1.0), ("dr_grpo", 0.5)])
def test_export_fills_advantages_and_weights_per_group(
    results_file: Path, tmp_path: Path, estimator: str, expected: float
) -> None:
    import datasets  # 0.6 s to import: paid by the tests that read with it, not by every worker

    out = tmp_path / "t.parquet"
    code, text = export("--results", str(results_file), "--advantages", estimator, "--out", str(out))
    assert code == 0 and "over 1 groups (2 sessions, 1 masked)" in text, text
    ds = datasets.load_dataset("parquet", data_files=str(out), split="train", cache_dir=str(tmp_path / "hf"))
    got = {(r["session_id"], r["trace_index"]): (r["advantage"], r["weight"]) for r in ds}
    # s0 (reward 1) and s1 (reward 0) form group g-t1; each has two trainable traces, one unit together.
    for i in (0, 1):
        assert got[("s0", i)] == pytest.approx((expected, 0.5), rel=1e-5)
        assert got[("s1", i)] == pytest.approx((-expected, 0.5), rel=1e-5)
        assert got[("s2", i)] == (0.0, 0.0)  # the masked ERROR session moves nothing


def test_advantages_need_rewards(results_file: Path, tmp_path: Path) -> None:
    out = str(tmp_path / "t.jsonl")
    code, text = export("--store", str(tmp_path / "x.db"), "--advantages", "grpo", "--out", out)
    assert code == 2 and "export --results" in text
    unrewarded = SessionResult(
        session_id="s5", task_id="t1", status=SessionStatus.COMPLETED,
        trajectory=build(agent_session("s5")).model_dump(mode="json"), metadata={"group_id": "g"},
    )  # fmt: skip
    path = tmp_path / "r.jsonl"
    path.write_bytes(orjson.dumps(unrewarded.model_dump(mode="json")) + b"\n")
    code, text = export("--results", str(path), "--advantages", "grpo", "--out", out)
    assert code == 2 and "no reward" in text and "--advantages" in text
