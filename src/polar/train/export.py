"""Training data from rollout results: trainer rows (token sequences) and OpenAI-style conversations.

`polar run` and `polar generate` write one `SessionResult` per JSON line, each carrying the trajectory the
node built (rewards already assigned, fail-closed). This module reads those lines, keeps the sessions that
pass a `Filter`, and turns them into
- trainer rows (`polar.trajectory.export.rows`: ids, loss mask, behaviour logprobs, reward, advantage, group,
  trajectory and policy version), one per trace;
- conversations for SFT (`conversation`): the main chain's prompt messages, then its assistant turns (with
  their tool calls) and the tool results / user turns between them, exactly as the harness sent them
  through the gateway. Messages are never rebuilt from token ids, and token ids never from messages.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import ValidationError

from polar.rollout.protocol import SessionResult
from polar.train.advantages import Estimator, GroupStats, trajectory_advantages
from polar.trajectory.export import PerTrace, rows
from polar.trajectory.models import Trace, Trajectory

if TYPE_CHECKING:
    import pyarrow as pa


class ResultsError(ValueError):
    """A results file that cannot be read, with `path:line` and the reason."""


def read_results(path: str | Path, *, retried: bool = False) -> Iterator[SessionResult]:
    """The `SessionResult`s of a results JSONL file, in file order (blank lines skipped).

    A re-run of `polar run` retries the sessions an infrastructure failure ended and appends the retry's
    line, same task and sample index, new session id (`polar.rollout.rundir`): by default only the last line
    of each (task_id, sample_index) is given, so a group counts each sample once; `retried=True` gives every
    line, the failed attempts too."""
    every = list(_read(path))
    if retried:
        yield from every
        return
    last: dict[tuple[str, Any], int] = {}
    for i, r in enumerate(every):
        if r.metadata.get("sample_index") is not None:
            last[(r.task_id, r.metadata["sample_index"])] = i
    for i, r in enumerate(every):
        sample = r.metadata.get("sample_index")
        if sample is None or last[(r.task_id, sample)] == i:
            yield r


def _read(path: str | Path) -> Iterator[SessionResult]:
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield SessionResult.model_validate(orjson.loads(line))
            except orjson.JSONDecodeError as e:
                raise ResultsError(f"{path}:{n}: not JSON: {e}") from None
            except ValidationError as e:
                first = e.errors()[0]
                field = ".".join(str(p) for p in first["loc"]) or "line"
                raise ResultsError(f"{path}:{n}: {field}: {first['msg']}") from None


@dataclass(frozen=True, slots=True)
class Filter:
    """Which sessions to keep: every condition must hold. `statuses` empty means any status; a session
    without a reward (masked, or its evaluation failed) never passes `min_reward`."""

    statuses: Collection[str] = ("COMPLETED",)
    min_reward: float | None = None
    task_ids: Collection[str] = ()

    def __call__(self, result: SessionResult) -> bool:
        if self.statuses and result.status.value not in self.statuses:
            return False
        if self.task_ids and result.task_id not in self.task_ids:
            return False
        if self.min_reward is not None and (result.reward is None or result.reward < self.min_reward):
            return False
        return result.trajectory is not None


def trajectory_of(result: SessionResult) -> Trajectory | None:
    """The result's trajectory with the session's metadata (task, group, sample) filled in."""
    if result.trajectory is None:
        return None
    t = Trajectory.model_validate(result.trajectory)
    meta = {**result.metadata, "task_id": result.task_id, **t.metadata, "session_id": result.session_id}
    return t.model_copy(update={"metadata": meta})


def result_rows(
    results: Iterable[SessionResult], advantages: PerTrace | None = None, weights: PerTrace | None = None
) -> Iterator[dict[str, Any]]:
    """Trainer rows (one per trace) of every result that has a trajectory."""
    for r in results:
        t = trajectory_of(r)
        if t is not None:
            yield from rows(t, r.task_id, advantages=advantages, weights=weights)


def advantage_maps(
    trajectories: Sequence[Trajectory], estimator: Estimator = "grpo"
) -> tuple[dict[tuple[str, int], float], dict[tuple[str, int], float], GroupStats]:
    """Advantages and per-trajectory weights of every trace, keyed (session id, trace index) for `rows`.

    Groups are formed over `trajectories` only, so pass whole groups (every sample of a task). Raises
    ValueError naming the trajectory when one has no reward or no group."""
    per_trace, stats = trajectory_advantages(trajectories, estimator)
    advantages: dict[tuple[str, int], float] = {}
    weights: dict[tuple[str, int], float] = {}
    for a in per_trace:
        key = (str(trajectories[a.trajectory].metadata.get("session_id")), a.trace)
        advantages[key], weights[key] = a.advantage, a.weight
    return advantages, weights, stats


# -- conversations ----------------------------------------------------------------------------------------


def main_trace(trajectory: Trajectory) -> int | None:
    """Index of the main chain: the trace whose conversation has the most messages (the first on ties).
    With prefix_merging that is the agent loop's chain (side calls such as title generation are short
    chains of their own); with per_request it is the loop's last call, whose prompt holds the history."""
    best, size = None, -1
    for i, t in enumerate(trajectory.traces):
        n = len(t.prompt_messages) + len(t.response_messages)
        if n > size:
            best, size = i, n
    return best


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """Text-only part lists become one string (what SFT chat templates expect); anything else is kept."""
    content = message.get("content")
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return {**message, "content": "".join(p["text"] for p in content)}
    return message


def conversation(trace: Trace) -> list[dict[str, Any]]:
    """The trace as one OpenAI Chat conversation: its prompt messages, then every message after them
    (assistant turns with tool calls, tool results, user turns), in order."""
    return [_plain(m) for m in (*trace.prompt_messages, *trace.response_messages)]


def conversation_row(result: SessionResult) -> dict[str, Any] | None:
    """One SFT row for a session: its main chain's conversation and tools, or None without traces."""
    t = trajectory_of(result)
    if t is None:
        return None
    i = main_trace(t)
    if i is None:
        return None
    trace = t.traces[i]
    messages = conversation(trace)
    return {
        "session_id": result.session_id,
        "task_id": result.task_id,
        "group_id": None if t.metadata.get("group_id") is None else str(t.metadata["group_id"]),
        "status": result.status.value,
        "reward": result.reward,
        "trace_index": i,
        "messages": messages,
        "tools": orjson.dumps(trace.tools).decode(),
        "assistant_turns": sum(1 for m in messages if m.get("role") == "assistant"),
    }


def conversation_schema() -> pa.Schema:
    """Parquet schema for conversation rows: messages as JSON text (their shapes vary row to row)."""
    import pyarrow as pa

    return pa.schema(
        [
            ("session_id", pa.string()),
            ("task_id", pa.string()),
            ("group_id", pa.string()),
            ("status", pa.string()),
            ("reward", pa.float64()),
            ("trace_index", pa.int32()),
            ("messages", pa.string()),
            ("tools", pa.string()),
            ("assistant_turns", pa.int32()),
        ]
    )


def as_parquet_conversation(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "messages": orjson.dumps(row["messages"]).decode()}
