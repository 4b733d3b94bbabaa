"""The keys of free-form mappings in polar's outputs (`timings`, `metadata`, export columns), with meanings.

Pydantic models document their own fields; these mappings are plain dicts filled in by several modules,
so their keys are declared here. `tests/test_reference_docs.py` checks each declaration against what the
code really writes (a built trajectory, the reward rules, a node session's timings, the export schemas), so
a key added in the code without a line here fails a test instead of going undocumented.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Key:
    name: str
    type: str
    meaning: str
    always: bool = True  # False: present only in some cases (the meaning says when)


# Terminal `SessionResult.status` values.
SESSION_STATUSES: tuple[Key, ...] = (
    Key("COMPLETED", "", "the harness finished and its evaluation was usable: rewarded and trainable"),
    Key(
        "TIMEOUT",
        "",
        "the session deadline passed (fully masked), or the agent ran out of its own `budget_seconds` "
        '(`reason` starts with "agent budget exhausted": reward 0, still trainable)',
    ),
    Key(
        "ERROR",
        "",
        "a runtime, prepare, harness, builder or evaluator failure, or an unusable evaluation: fully masked",
    ),
    Key("CANCELLED", "", "cancelled by the trainer, an early stop or a shutdown: masked, or no trajectory"),
)

# `SessionResult.timings`, in stage order (`polar.rollout.node.session.NodeSession.timings`).
TIMINGS: tuple[Key, ...] = (
    Key("queued_s", "seconds", "from the node accepting the session to the start of INIT"),
    Key(
        "init_s",
        "seconds",
        "INIT: runtime start, prepare actions, gateway session, harness setup, and waiting for room in the "
        "node's READY buffer",
        always=False,
    ),
    Key("ready_wait_s", "seconds", "READY: prepared, waiting for a run slot", always=False),
    Key("run_s", "seconds", "RUNNING: the harness's process", always=False),
    Key(
        "post_s",
        "seconds",
        "POSTRUN: post-run hook, trajectory build, evaluation, rewards (and waiting for a POSTRUN worker)",
        always=False,
    ),
    Key("total_s", "seconds", "from the node accepting the session to its end"),
)

# `SessionResult.metadata` (`polar.rollout.node.lifecycle.session_metadata` plus the stages' output).
RESULT_METADATA: tuple[Key, ...] = (
    Key("task_id", "str", "the task"),
    Key("group_id", "str", "the GRPO group: the task's `metadata.group_id`, else the task id"),
    Key("sample_index", "int", "which of the task's `num_samples` this session was (0-based)"),
    Key(
        "harness",
        "object",
        "what the harness's post-run hook returned (e.g. the built-in agent's turns and stop reason)",
        always=False,
    ),
    Key(
        "evaluation",
        "object",
        "`{passed, details}` from the evaluator (details are the evaluator's own: exit code, output, ...)",
        always=False,
    ),
)

TASK_METADATA_NOTE = (
    "Every key of the task's `metadata` is copied here too (`polar train` sets `group_id`, `source_task_id`, "
    "`policy_version`, `rollout_round` and `run_id` on the tasks it submits)."
)

# `Trajectory.metadata` as the builder writes it: the session id and `polar.trajectory.stats.BuildStats`.
TRAJECTORY_BUILD: tuple[Key, ...] = (
    Key("session_id", "str", "the session whose records were built"),
    Key("strategy", "str", "the builder: `prefix_merging` or `per_request`"),
    Key("calls", "int", "records given to the builder"),
    Key("traces", "int", "traces built"),
    Key("chains", "int", "chains of calls (one trace each)"),
    Key("merged_calls", "int", "calls that continued a chain instead of starting a trace"),
    Key("roots", "int", "chains that continue nothing: first call, subagents, side calls"),
    Key("siblings", "int", "chains started by a retry of an identical prompt"),
    Key(
        "breaks",
        "object",
        "chains started because a conversation broke, by cause: `context_drift`, `unprovable_boundary`, "
        "`compaction`, `history_rewrite`, `tools_changed`",
    ),
    Key(
        "drift_turns", "int", "boundaries where the server's re-rendered turn differs from the sampled tokens"
    ),
    Key("drift_merged", "int", "of those, merged anyway (`on_drift: merge`)"),
    Key(
        "skipped",
        "object",
        "calls placed in no trace, by cause (`missing_prompt_ids`, `invalid_prompt_ids`, `dead_branch`)",
    ),
    Key("prompt_tokens", "int", "prompt tokens captured over all calls"),
    Key("sampled_tokens", "int", "trainable sampled tokens captured: the denominator of `coverage`"),
    Key("untrainable_tokens", "int", "sampled tokens captured without the data to train them"),
    Key(
        "trainable_tokens",
        "int",
        "tokens with `loss_mask` 1 over all traces, as built (before the reward rules)",
    ),
    Key(
        "coverage",
        "float",
        "`trainable_tokens / sampled_tokens`: 1.0 means every sampled token is trainable exactly once",
    ),
    Key("trainer_tokens", "int", "prompt + response tokens over all traces: what a trainer processes"),
    Key("eot_id", "int | null", "the end-of-turn token used at drifted boundaries (inferred when not given)"),
    Key(
        "options",
        "object",
        "the builder's options (`on_drift`, `eot_id`, `train_without_logprobs`, `dead_branches`)",
    ),
)

# What the node adds to `Trajectory.metadata` before the evaluation (`lifecycle.build_trajectory`).
TRAJECTORY_NODE: tuple[Key, ...] = (
    Key("task_id", "str", "the task"),
    Key("group_id", "str", "the GRPO group (see above)"),
    Key("sample_index", "int", "the session's sample index"),
    Key("side_calls", "object", "the side-call policy and the calls it applied to (table below)"),
    Key(
        "dead_branches",
        "list[str]",
        "completion ids of answers a harness retried and never used (tagged `dead_branch`; their retries "
        "`retry`); `builder_options.dead_branches` trains (default), masks or drops them",
    ),
)

# What the reward rules add to `Trajectory.metadata` (`polar.rollout.rewards.assign_rewards`).
TRAJECTORY_REWARDS: tuple[Key, ...] = (
    Key("reward", "float | null", "the session's outcome reward (0.0 when masked)"),
    Key(
        "masked",
        "bool",
        "true: trainers must skip it; every trace is fully masked (loss_mask all 0), except while a "
        "`judge_group` reward is pending (`reward_pending`)",
    ),
    Key(
        "reward_reason",
        "str",
        "why the reward is what it is (masking cause, agent budget, ...)",
        always=False,
    ),
    Key("evaluation", "object", "`{passed, details}` when the evaluator ran", always=False),
    Key(
        "reward_pending",
        "str",
        "`judge_group`: the reward waits for the group's judgement (masked meanwhile; seen only on the "
        "node: the server releases results settled, docs/rewards.md)",
        always=False,
    ),
)

# `Trajectory.metadata.side_calls` (`polar.rollout.node.side_calls.apply_policy`).
SIDE_CALLS: tuple[Key, ...] = (
    Key("policy", "str", "the task's `agent.side_calls`: `train`, `exclude` or `route`"),
    Key("calls", "int", "records the harness preset tagged as side calls"),
    Key("completion_ids", "list[str]", "their completion ids"),
    Key("sampled_tokens", "int", "tokens they sampled"),
    Key(
        "routed_completion_ids",
        "list[str]",
        "those the gateway sent to the frozen `side_call_backend` (policy `route` only)",
        always=False,
    ),
)

# `Trace.metadata` (`polar.trajectory.sequences.chain_trace`, then the reward rules).
TRACE_METADATA: tuple[Key, ...] = (
    Key("session_id", "str", "the session"),
    Key("chain_index", "int", "the chain this trace was built from"),
    Key("completion_ids", "list[str]", "the gateway records merged into this trace, in order"),
    Key("seqs", "list[int]", "their call order in the session"),
    Key("turn_offsets", "list[int]", "where each sampled turn starts in `response_ids`"),
    Key(
        "policy_version",
        "int | null",
        "the oldest policy version that produced a token here (what staleness is measured against)",
    ),
    Key("policy_versions", "list[int | null]", "the policy version of each merged call"),
    Key(
        "started_by",
        "str",
        "why the chain starts: `root`, `retry`, a break cause (`context_drift`, `unprovable_boundary`, "
        "`compaction`, `history_rewrite`, `tools_changed`), or `per_request`",
    ),
    Key("drift_turns", "list[int]", "turns merged across a drifted boundary (`on_drift: merge`)"),
    Key("trainable_tokens", "int", "tokens with `loss_mask` 1 (0 once masked)"),
    Key("sibling_of", "int", "for a retry: the chain holding the earlier identical prompt", always=False),
    Key("retry_of", "str", "for a retry: that call's completion id", always=False),
    Key("split_from", "str", "for a drift split: the completion id of the turn before it", always=False),
    Key("diverged_from", "int", "for a break: the chain this one breaks away from", always=False),
    Key(
        "flags",
        "object",
        "completion id -> the gateway's flags for that call (`not_trainable`, `tool_call_parse_error`, ...)",
        always=False,
    ),
    Key("masked", "bool", "true when the reward rules masked this trace", always=False),
    Key("reward_reason", "str", "why this trace's reward was set or masked", always=False),
)

# Columns of `polar traces export` and `polar generate`'s tokens.* (`polar.trajectory.export.COLUMNS`).
TRACE_COLUMNS: tuple[Key, ...] = (
    Key("session_id", "", "the trajectory id (a session is single-use: one session, one trajectory)"),
    Key("task_id", "", "the task"),
    Key("group_id", "", "the GRPO group (the task's `group_id`, default the task id)"),
    Key("sample_index", "", "which of the task's `num_samples` this session was"),
    Key("trace_index", "", "position of the trace in its trajectory; with `session_id`, the row's key"),
    Key("status", "", "`COMPLETED`, `TIMEOUT` or `ERROR` (ERROR rows are fully masked)"),
    Key("strategy", "", "the builder that made the trace"),
    Key("policy_version", "", "the oldest policy version that produced a token of this trace"),
    Key("prompt_ids", "", "the prompt, exactly as the inference server tokenized it"),
    Key("response_ids", "", "sampled turns and, between them, tool results and template glue"),
    Key("loss_mask", "", "same length as `response_ids`: 1 = sampled by the policy and trainable"),
    Key(
        "response_logprobs",
        "",
        "same length: the behaviour logprob of each sampled token, 0.0 where the mask is 0; null only for "
        "builds with `train_without_logprobs`",
    ),
    Key("reward", "", "the trace's reward after the fail-closed rules; null when rebuilt from the store"),
    Key("advantage", "", "filled by `--advantages` (group-relative, per trajectory); else null"),
    Key(
        "weight",
        "",
        "the trace's share of its trajectory, 1/k for k trainable traces (0 when masked); filled with "
        "`advantage`",
    ),
    Key("finish_reason", "", "how the trace's last call ended: `stop`, `tool_calls`, `length`"),
    Key("prompt_messages", "", "JSON text: the first call's messages (OpenAI Chat form)"),
    Key("response_messages", "", "JSON text: the messages after them (assistant turns, tool results, ...)"),
    Key("tools", "", "JSON text: the tools the policy was given"),
    Key("metadata", "", "JSON text: the trace's metadata (table in results.md)"),
)

# Columns of `polar generate`'s messages.* (`polar.train.export.conversation_row`).
CONVERSATION_COLUMNS: tuple[Key, ...] = (
    Key("session_id", "", "the session"),
    Key("task_id", "", "the task"),
    Key("group_id", "", "the GRPO group"),
    Key("status", "", "the session's status"),
    Key("reward", "", "the session's reward"),
    Key("trace_index", "", "the main chain: the trace whose conversation has the most messages"),
    Key(
        "messages",
        "",
        "the main chain's conversation in OpenAI Chat form, as the harness sent it (a list in JSONL, JSON "
        "text in Parquet)",
    ),
    Key("tools", "", "JSON text: the tools"),
    Key("assistant_turns", "", "assistant messages in `messages`"),
)
