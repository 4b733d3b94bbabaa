"""Dynamic sampling and overlong shaping (polar.train.filters) against hand-computed cases; the loop that
uses them runs on real sessions in tests/test_train_loop.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from polar.train.config import ConfigError, parse_config
from polar.train.filters import GroupFilter, Overlong, answer_length, cut, length_penalty
from polar.trajectory import Trace, Trajectory


def trace(
    mask: list[int], reward: float | None = None, finish: str = "stop", offsets: list[int] | None = None
) -> Trace:
    meta: dict[str, Any] = {} if offsets is None else {"turn_offsets": offsets}
    return Trace(
        prompt_ids=[1],
        response_ids=list(range(len(mask))),
        loss_mask=mask,
        response_logprobs=[-0.5 if m else 0.0 for m in mask],
        finish_reason=finish,
        reward=reward,
        metadata=meta,
    )


def session(reward: float, *traces: Trace, masked: bool = False) -> Trajectory:
    return Trajectory(
        traces=list(traces) or [trace([1, 1], reward)],
        metadata={"group_id": "g", "reward": reward, "masked": masked},
    )


def test_the_length_penalty_is_daps_soft_ramp() -> None:
    # 0 up to max_tokens - buffer, then linear to -1 at max_tokens, -1 beyond.
    assert [length_penalty(n, 100, 20) for n in (0, 80, 90, 95, 99, 100, 150)] == [
        0.0,
        0.0,
        -0.5,
        -0.75,
        pytest.approx(-0.95),
        -1.0,
        -1.0,
    ]
    assert length_penalty(99, 100, 0) == 0.0 and length_penalty(100, 100, 0) == -1.0


def test_an_answer_is_one_sampled_turn() -> None:
    # Two turns of 3 and 2 sampled tokens with a tool result (mask 0) between them: the longest is 3,
    # not the trace's 5 trainable tokens.
    two_turns = trace([1, 1, 1, 0, 0, 1, 1], offsets=[0, 5])
    assert answer_length(Trajectory(traces=[two_turns])) == 3
    # Without turn offsets (a custom builder): runs of sampled tokens.
    assert answer_length(Trajectory(traces=[trace([0, 1, 1, 0, 1, 1, 1, 1])])) == 4
    # An untrainable turn (mask 0) is not the policy's answer.
    assert answer_length(Trajectory(traces=[trace([0, 0, 0, 0], offsets=[0])])) == 0


def test_overlong_mask_leaves_out_sessions_with_a_cut_answer() -> None:
    done, cut_off = session(1.0, trace([1, 1], 1.0)), session(0.0, trace([1, 1], 0.0, finish="length"))
    assert not cut(done) and cut(cut_off)
    out, touched = Overlong("mask").apply([done, cut_off])
    assert touched == 1 and out[0] is done
    assert out[1].metadata["masked"] is True and out[1].metadata["overlong"] is True
    assert Overlong("keep").apply([done, cut_off]) == ([done, cut_off], 0)


def test_overlong_penalty_lowers_the_session_and_each_traces_reward() -> None:
    long = session(1.0, trace([1] * 9, 1.0), trace([1] * 2, 0.0))  # one trace's own reward (a broken call)
    short = session(1.0, trace([1] * 4, 1.0))
    out, touched = Overlong("penalty", max_tokens=10, buffer=4, penalty_factor=0.5).apply([long, short])
    assert touched == 1 and out[1] is short
    # 9 tokens: (6 - 9) / 4 = -0.75, times the factor 0.5.
    assert out[0].metadata["reward"] == 1.0 - 0.375 and out[0].metadata["overlong_penalty"] == -0.375
    assert [t.reward for t in out[0].traces] == [1.0 - 0.375, -0.375]
    assert long.metadata["reward"] == 1.0  # the input is left alone


def test_the_filter_names_groups_without_a_gradient() -> None:
    both = GroupFilter(zero_variance=True, all_masked=True)
    assert both.reason([session(1.0), session(1.0)], "rloo") == "zero_variance"
    assert both.reason([session(1.0), session(0.0)], "rloo") is None
    assert both.reason([session(0.0, masked=True), session(0.0, masked=True)], "grpo") == "all_masked"
    # Masked sessions do not count: the live ones decide.
    assert both.reason([session(1.0), session(1.0), session(0.0, masked=True)], "rloo") == "zero_variance"
    # Judged on the advantages the step computes: a trace that earned 0 for a broken tool call in a group of
    # equal session rewards gets 0 too (polar.train.advantages), so the group has no gradient.
    broken = session(1.0, trace([1, 1], 1.0), trace([1, 1], 0.0))
    assert both.reason([session(1.0), broken], "rloo") == "zero_variance"
    assert both.reason([session(0.0), broken], "rloo") is None
    # Each rule only when asked for.
    assert GroupFilter(all_masked=True).reason([session(1.0), session(1.0)], "rloo") is None
    assert GroupFilter(zero_variance=True).reason([session(0.0, masked=True)], "rloo") is None
    assert not GroupFilter().active


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("overlong:\n  mode: penalty\n", "cfg.yaml:3: overlong: mode penalty needs max_tokens"),
        (
            "overlong: {mode: penalty, max_tokens: 8, buffer: 9}\n",
            "cfg.yaml:2: overlong: buffer (9) is longer",
        ),
        (
            "overlong:\n  mode: cut\n",
            "cfg.yaml:3: overlong.mode: Input should be 'keep', 'mask' or 'penalty'",
        ),
        (
            "batch_groups: 4\nfilter:\n  max_groups_per_step: 2\n",
            "cfg.yaml:4: filter.max_groups_per_step: is less than batch_groups (4)",
        ),
        (
            "filter:\n  zero_varience: true\n",
            "cfg.yaml:3: filter.zero_varience: Extra inputs are not permitted",
        ),
    ],
)
def test_bad_filter_and_overlong_settings_name_their_line(tmp_path: Path, text: str, expected: str) -> None:
    (tmp_path / "t.yaml").write_text("task_id: t\ninstruction: do it\n")
    with pytest.raises(ConfigError) as err:
        parse_config("tasks: t.yaml\n" + text, "cfg.yaml", tmp_path)
    assert expected in str(err.value)


def test_the_filter_cap_defaults_to_four_batches(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text("task_id: t\ninstruction: do it\n")
    config, _ = parse_config(
        "tasks: t.yaml\nbatch_groups: 3\nfilter: {zero_variance: true}\n", "c.yaml", tmp_path
    )
    assert config.group_filter() == GroupFilter(zero_variance=True, all_masked=False, max_groups=12)
    config, _ = parse_config(
        "tasks: t.yaml\noverlong: {mode: penalty, max_tokens: 512, buffer: 128, penalty_factor: 0.1}\n",
        "c.yaml",
        tmp_path,
    )
    assert config.overlong.spec() == Overlong("penalty", 512, 128, 0.1)
