"""The public surface: builder registry, options, the JSON contract, the models, and audit failures."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from pydantic import ValidationError

from polar.store.records import CompletionRecord
from polar.trajectory import (
    BuildError,
    Trace,
    Trajectory,
    TrajectoryStatus,
    audit,
    build,
    builders,
    register_builder,
)
from polar.trajectory.per_request import per_request
from tests.test_trajectory_rules import A1, A2, P1, P2, U1, rec

RECORDS = [rec(0, P1, A1), rec(1, P2, A2), rec(2, [1, 8, 7], [4, 2])]


def first_call_only(
    records: Sequence[CompletionRecord], *, status: TrajectoryStatus, keep: int = 1
) -> Trajectory:
    """A custom builder loaded by import path in the tests below (it drops calls, so its audit fails)."""
    t = per_request(records[:keep], status=status)
    t.metadata["strategy"] = "first_call_only"
    return t


def test_custom_builder_by_import_path_and_by_registration() -> None:
    t = build(RECORDS, "tests.test_trajectory_api:first_call_only", keep=2)
    assert t.metadata["strategy"] == "first_call_only" and len(t.traces) == 2
    report = audit(t, RECORDS)
    assert not report.ok and report.coverage < 1.0
    assert any("c2" in e and "missing" in e for e in report.errors)
    register_builder("first_call_only", "tests.test_trajectory_api:first_call_only", replace=True)
    assert "first_call_only" in builders()
    assert len(build(RECORDS, "first_call_only").traces) == 1
    with pytest.raises(BuildError) as e:
        register_builder("per_request", first_call_only)
    assert e.value.param == "name"


@pytest.mark.parametrize(
    ("strategy", "options", "param"),
    [
        ("nope", {}, "strategy"),
        ("tests.test_trajectory_api:missing", {}, "strategy"),
        ("no_such_module_xyz:f", {}, "strategy"),
        ("tests.test_trajectory_api:RECORDS", {}, "strategy"),
        ("prefix_merging", {"bogus": 1}, "options"),
        ("per_request", {"on_drift": "merge"}, "options"),
        ("prefix_merging", {"on_drift": "sometimes"}, "on_drift"),
        ("prefix_merging", {"eot_id": -3}, "eot_id"),
        ("prefix_merging", {"status": "DONE"}, "status"),
    ],
)
def test_bad_input_is_a_build_error_naming_the_parameter(
    strategy: str, options: dict[str, Any], param: str
) -> None:
    with pytest.raises(BuildError) as e:
        build(RECORDS, strategy, **options)
    assert e.value.param == param


def test_records_must_be_one_session_with_unique_ids() -> None:
    with pytest.raises(BuildError, match="sessions"):
        build([rec(0, P1, A1), rec(1, P2, A2, session="other")])
    with pytest.raises(BuildError, match="completion_id"):
        build([rec(0, P1, A1), rec(0, P2, A2)])


def test_gateway_json_contract() -> None:
    body = build(RECORDS, "prefix_merging", status="TIMEOUT").model_dump(mode="json")
    assert body["status"] == "TIMEOUT"
    assert body["metadata"]["coverage"] == 1.0 and body["metadata"]["session_id"] == "s"
    for key in (
        "calls",
        "chains",
        "merged_calls",
        "breaks",
        "drift_turns",
        "trainable_tokens",
        "sampled_tokens",
    ):
        assert key in body["metadata"]
    trace = body["traces"][0]
    assert set(trace) == {
        "prompt_ids",
        "response_ids",
        "loss_mask",
        "response_logprobs",
        "prompt_messages",
        "response_messages",
        "tools",
        "finish_reason",
        "reward",
        "metadata",
    }
    assert trace["reward"] is None
    assert {"session_id", "completion_ids", "chain_index", "policy_version"} <= set(trace["metadata"])
    # What the gateway serves loads back as a validated Trajectory.
    again = Trajectory.model_validate(body)
    assert again.traces[0].response_ids == A1 + U1 + A2


def test_trace_rejects_misaligned_or_non_binary_fields() -> None:
    ok = {"prompt_ids": [1], "response_ids": [2, 3], "loss_mask": [1, 0], "response_logprobs": [-0.5, 0.0]}
    Trace.model_validate(ok)
    for bad in ({"loss_mask": [1]}, {"response_logprobs": [0.0]}, {"loss_mask": [1, 2]}, {"unknown": 1}):
        with pytest.raises(ValidationError):
            Trace.model_validate({**ok, **bad})


def _tampered(change: Any, **options: Any) -> list[str]:
    t = build(RECORDS, **options)
    change(t.traces[0])
    report = audit(t, RECORDS)
    assert not report.ok
    return report.errors


def test_audit_catches_a_token_the_server_did_not_sample() -> None:
    errors = _tampered(lambda tr: tr.response_ids.__setitem__(0, 999))
    assert any("differ from what the server sampled" in e for e in errors)


def test_audit_catches_a_changed_logprob_and_a_masked_logprob() -> None:
    assert any(
        "logprobs differ" in e for e in _tampered(lambda tr: tr.response_logprobs.__setitem__(1, -0.01))
    )
    assert any(
        "non-zero logprobs" in e for e in _tampered(lambda tr: tr.response_logprobs.__setitem__(4, -0.01))
    )


def test_audit_catches_loss_on_tokens_the_policy_did_not_sample() -> None:
    errors = _tampered(lambda tr: tr.loss_mask.__setitem__(len(A1), 1))
    assert any("interstitial tokens carry loss" in e for e in errors)


def test_audit_catches_an_interstitial_not_from_the_server_prompt() -> None:
    errors = _tampered(lambda tr: tr.response_ids.__setitem__(len(A1) + 1, 777))
    assert any("not the tail of the server prompt" in e for e in errors)
    assert any("context differs" in e for e in errors)


def test_audit_catches_undeclared_drift() -> None:
    p2 = [*P1, 21, 2, *U1]
    records = [rec(0, P1, A1), rec(1, p2, A2)]
    t = build(records, on_drift="merge")
    assert audit(t, records).ok
    t.traces[0].metadata["drift_turns"] = []
    errors = audit(t, records).errors
    assert any("context differs from the prompt the server saw" in e for e in errors)


def test_audit_catches_duplicates_misalignment_and_missing_metadata() -> None:
    t = build(RECORDS)
    t.traces.append(t.traces[0].model_copy(deep=True))
    assert any("trained in 2 traces" in e for e in audit(t, RECORDS).errors)
    t = build(RECORDS)
    t.traces[0].loss_mask.pop()
    assert any("do not align" in e for e in audit(t, RECORDS).errors)
    t = build(RECORDS)
    del t.traces[0].metadata["turn_offsets"]
    assert any("turn_offsets" in e for e in audit(t, RECORDS).errors)
    t = build(RECORDS)
    t.traces[0].metadata["completion_ids"][0] = "ghost"
    assert any("ghost" in e for e in audit(t, RECORDS).errors)
    t = build(RECORDS)
    t.traces[0].response_ids.append(5)
    t.traces[0].loss_mask.append(0)
    t.traces[0].response_logprobs.append(0.0)  # type: ignore[union-attr]
    assert any("after the last turn" in e for e in audit(t, RECORDS).errors)
    t = build(RECORDS)
    t.traces[0].prompt_ids[0] = 42
    assert any("prompt_ids differ" in e for e in audit(t, RECORDS).errors)
