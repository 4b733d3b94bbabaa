"""The example session behind the reference's example lines, made by polar's own code.

Two captured calls of a tool-using agent (the token ids are short and made up; everything else is what the
code produces from them): the `prefix_merging` builder merges them into one trace, the node's side-call
policy and session metadata are applied, the `session_completed` evaluator scores the session, the
fail-closed reward rules assign its reward, and the node's timings are computed from stage times. So the
example lines in docs/reference show exactly the keys a real run writes, and change when the code does.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, fields
from typing import Any

from polar.evaluate.base import EvalContext
from polar.evaluate.registry import get_evaluator
from polar.harness.registry import get_harness
from polar.rollout.node.deadline import Deadline
from polar.rollout.node.lifecycle import session_metadata
from polar.rollout.node.session import NodeSession
from polar.rollout.node.side_calls import apply_policy
from polar.rollout.protocol import SessionResult, SessionSpec, SessionStatus
from polar.rollout.rewards import assign_rewards
from polar.runtime.base import ExecResult
from polar.store.records import CompletionRecord
from polar.task import Task
from polar.train.metrics import METRICS, StepMetrics
from polar.trajectory import build
from polar.trajectory.retries import DEAD_BRANCH, tag_retries

TASK = Task.model_validate(
    {
        "task_id": "repair-slugify",
        "instruction": "Make the tests in tests/ pass.",
        "num_samples": 4,
        "agent": {"harness": "shell", "settings": {"command": "my-agent"}},
        "evaluator": {"strategy": "session_completed"},
        "metadata": {"group_id": "repair-slugify", "policy_version": 3},
    }
)
SESSION_ID = "repair-slugify-s1"
SYSTEM = {"role": "system", "content": "You are a coding agent."}
USER = {"role": "user", "content": TASK.instruction}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "shell",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    }
]
CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "shell", "arguments": '{"cmd": "pytest -q"}'},
        }
    ],
}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "1 failed"}
ANSWER = {"role": "assistant", "content": "Fixed the hyphen handling."}
EOT = 2  # plays the end-of-turn token
P1 = [1, 5, 6, 7]  # system + user + generation prompt
A1 = [20, 21, EOT]  # the tool call, closed by the end-of-turn token
P2 = [*P1, *A1, 9, 1, 30, 31, EOT, 9, 1, 7]  # ... + the tool result + the next generation prompt
A2 = [22, 23, EOT]


def _record(
    seq: int, prompt: list[int], sampled: list[int], messages: list[dict[str, Any]], reply: dict[str, Any]
) -> CompletionRecord:
    return CompletionRecord(
        session_id=SESSION_ID,
        seq=seq,
        completion_id=f"cmpl-{seq}",
        dialect="chat",
        created_at=1_760_000_000.0 + seq,
        request={"messages": messages},
        upstream_request={"messages": messages, "tools": TOOLS},
        prompt_ids=prompt,
        response_ids=sampled,
        response_logprobs=[round(-0.25 * (i + 1) - seq / 10, 3) for i in range(len(sampled))],
        finish_reason="tool_calls" if reply.get("tool_calls") else "stop",
        response_message=reply,
        tools=TOOLS,
        usage={"prompt_tokens": len(prompt), "completion_tokens": len(sampled)},
        model_requested="policy",
        model_served="policy",
        policy_version=3,
    )


RECORDS = [
    _record(0, P1, A1, [SYSTEM, USER], CALL),
    _record(1, P2, A2, [SYSTEM, USER, CALL, TOOL_RESULT], ANSWER),
]

# Seconds after the node accepted the session at which each stage began, and when it ended: the only
# invented numbers in the result (a real node measures them).
STAGE_STARTS = {"INITIALIZING": 0.02, "READY": 2.91, "RUNNING": 3.05, "POST_RUN": 41.7}
ENDED_AT = 43.26


@dataclass(frozen=True, slots=True)
class Example:
    result: SessionResult
    records: list[CompletionRecord]


def example() -> Example:
    """The example session's `SessionResult`, built as a node builds one (`polar.rollout.node`)."""
    spec = SessionSpec(session_id=SESSION_ID, task=TASK, sample_index=1)
    session = NodeSession(
        spec=spec,
        harness=get_harness(TASK.agent.harness, TASK.agent.settings),
        evaluator=get_evaluator(TASK.evaluator.strategy, TASK.evaluator.config),
        deadline=Deadline(TASK.timeout_seconds),
        submitted_at=0.0,
        marks=dict(STAGE_STARTS),
    )
    records, side_calls = apply_policy(RECORDS, TASK.agent.side_calls)
    records = tag_retries(records)
    built = build(records, TASK.builder, **TASK.builder_options)
    # As lifecycle.build_trajectory does: the session's metadata joins the build's.
    dead = [r.completion_id for r in records if DEAD_BRANCH in r.tags]
    meta = {
        **built.metadata,
        **session_metadata(session),
        "session_id": SESSION_ID,
        "side_calls": side_calls,
        "dead_branches": dead,
    }
    trajectory = built.model_copy(update={"metadata": meta})
    agent = ExecResult(exit_code=0, stdout="", stderr="", duration_s=38.6)
    ctx = EvalContext(TASK, SESSION_ID, runtime=None, fresh=None, agent=agent, trajectory=trajectory)  # type: ignore[arg-type]
    evaluation = asyncio.run(session.evaluator.evaluate(ctx))
    final = assign_rewards(trajectory, SessionStatus.COMPLETED.value, evaluation)
    result = SessionResult(
        session_id=SESSION_ID,
        task_id=TASK.task_id,
        node_id="node-a1b2c3",
        status=SessionStatus(final.status.value),
        reward=None if final.metadata.get("masked") else final.metadata.get("reward"),
        trajectory=final.model_dump(mode="json"),
        timings=session.timings(ENDED_AT),
        metadata={
            **session_metadata(session),
            "harness": {},  # the shell harness's post-run hook collects nothing unless told to
            "evaluation": {"passed": evaluation.passed, "details": evaluation.details},
        },
    )
    return Example(result, RECORDS)


# One metrics line's values: illustrative numbers (a real line comes from `polar train`). Every declared
# metric needs one, so a new metric cannot be left out of the example; keys and order are the writer's.
METRIC_VALUES: dict[str, float] = {
    "step": 12,
    "policy_version": 12,
    "reward_mean": 0.4375,
    "reward_std": 0.4961,
    "pass_rate": 0.4375,
    "groups": 2,
    "samples": 16,
    "zero_variance_groups": 0,
    "dropped_stale_groups": 1,
    "staleness_mean": 0.5,
    "staleness_max": 1,
    "traces": 17,
    "tokens": 48213,
    "trainable_tokens": 6120,
    "loss": -0.0132,
    "grad_norm": 0.84,
    "clip_fraction": 0.0,
    "kl": 0.0,
    "tis_mean": 0.998,
    "logprob_diff": 0.021,
    "rollout_wait_s": 3.2,
    "train_s": 41.5,
    "sync_s": 2.7,
    "masked": 0.0,
    "untrainable_traces": 0.0,
    "lr": 1.0e-6,
    "tool_call_parse_errors": 0.0,
    "filtered_zero_variance_groups": 1.0,
    "filtered_masked_groups": 0.0,
    "filter_cap_reached": 0.0,
    "overlong_samples": 0.0,
    "eval_accuracy": 0.375,
    "eval_accuracy_low": 0.25,
    "eval_accuracy_high": 0.5,
    "eval_reward_mean": 0.375,
    "eval_samples": 32.0,
    "eval_errors": 0.0,
    "eval_s": 48.2,
    "sync_drained": 1.0,
}


def metrics_example() -> StepMetrics:
    """A `StepMetrics` holding `METRIC_VALUES`: its fields, and the rest as the loop's extra keys."""
    names = {f.name for f in fields(StepMetrics)} - {"extra"}
    values = {k: METRIC_VALUES[k] for k in METRICS}
    extra = {k: float(v) for k, v in values.items() if k not in names}
    return StepMetrics(**{k: v for k, v in values.items() if k in names}, extra=extra)  # type: ignore[arg-type]
