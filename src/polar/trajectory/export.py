"""Traces as rows for trainers and `datasets`: JSON Lines or Parquet, one row per trace.

Both formats share one flat schema (`COLUMNS`; `docs/training.md` maps it onto verl, slime, NeMo RL and
TRL). Token columns are lists of numbers; messages, tools and metadata are JSON text, because their shapes
vary call to call (string or part-list content, tool schemas with arbitrary keys, arguments as text or
objects) and Arrow cannot unify such structs across rows: as text, `datasets.load_dataset("json" |
"parquet", data_files=...)` loads any export without a schema fight.

`session_id` is the trajectory id (a session is single-use, so it names exactly one trajectory); with
`trace_index` it names one row. `advantage` and `weight` stay null unless the caller passes them: they
depend on the whole group (`polar.train.advantages`), so a single trajectory cannot compute its own.
`weight` is the trace's share of its trajectory (1/k for k trainable traces): a trainer that scales each
row's loss by it counts a session split into several traces once, not k times.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from polar.extras import PARQUET, require
from polar.jsontypes import JSON
from polar.trajectory.models import Trajectory

if TYPE_CHECKING:
    import pyarrow as pa

JSON_COLUMNS = ("prompt_messages", "response_messages", "tools", "metadata")

# Keyed by session id (one value for every trace of the trajectory) or by (session id, trace index) for
# per-trace values; a trace key wins over its session's. Used for advantages and for weights.
PerTrace = Mapping[Any, float]


def _lookup(values: PerTrace | None, session_id: JSON, index: int) -> float | None:
    if not values:
        return None
    value = values.get((session_id, index))
    if value is None:
        value = values.get(session_id)
    return None if value is None else float(value)


def rows(
    trajectory: Trajectory,
    task_id: str | None = None,
    *,
    advantages: PerTrace | None = None,
    weights: PerTrace | None = None,
    context: Mapping[str, Any] | None = None,
) -> Iterator[dict[str, Any]]:
    """One row per trace. `context` (the gateway session's metadata: task, group, sample index) fills in
    what the trajectory's own metadata lacks; the rollout node already copies it there."""
    meta = {**(context or {}), **trajectory.metadata}
    session_id = meta.get("session_id")
    task_id = task_id if task_id is not None else meta.get("task_id")
    group_id = meta.get("group_id", task_id)
    sample_index = meta.get("sample_index")
    for i, t in enumerate(trajectory.traces):
        yield {
            "session_id": session_id,
            "task_id": task_id,
            "group_id": None if group_id is None else str(group_id),
            "sample_index": sample_index if isinstance(sample_index, int) else None,
            "trace_index": i,
            "status": trajectory.status.value,
            "strategy": meta.get("strategy"),
            "policy_version": t.metadata.get("policy_version"),
            "prompt_ids": t.prompt_ids,
            "response_ids": t.response_ids,
            "loss_mask": t.loss_mask,
            "response_logprobs": t.response_logprobs,
            "reward": t.reward,
            "advantage": _lookup(advantages, session_id, i),
            "weight": _lookup(weights, session_id, i),
            "finish_reason": t.finish_reason,
            **{c: orjson.dumps(getattr(t, c)).decode() for c in JSON_COLUMNS},
        }


def write_jsonl(records: Iterable[dict[str, Any]], path: str | Path) -> int:
    """Write rows as JSON Lines (one object per line); the number of rows written."""
    n = 0
    with open(path, "wb") as f:
        for row in records:
            f.write(orjson.dumps(row))
            f.write(b"\n")
            n += 1
    return n


def row_schema() -> pa.Schema:
    """The pyarrow schema of trace rows: the column types of a Parquet export."""
    import pyarrow as pa

    ids = pa.list_(pa.int64())
    return pa.schema(
        [
            ("session_id", pa.string()),
            ("task_id", pa.string()),
            ("group_id", pa.string()),
            ("sample_index", pa.int32()),
            ("trace_index", pa.int32()),
            ("status", pa.string()),
            ("strategy", pa.string()),
            ("policy_version", pa.int64()),
            ("prompt_ids", ids),
            ("response_ids", ids),
            ("loss_mask", pa.list_(pa.int8())),
            ("response_logprobs", pa.list_(pa.float64())),  # float64: the server's values, unrounded
            ("reward", pa.float64()),
            ("advantage", pa.float64()),
            ("weight", pa.float64()),
            ("finish_reason", pa.string()),
            *((c, pa.string()) for c in JSON_COLUMNS),
        ]
    )


COLUMNS: tuple[str, ...] = (
    "session_id",
    "task_id",
    "group_id",
    "sample_index",
    "trace_index",
    "status",
    "strategy",
    "policy_version",
    "prompt_ids",
    "response_ids",
    "loss_mask",
    "response_logprobs",
    "reward",
    "advantage",
    "weight",
    "finish_reason",
    *JSON_COLUMNS,
)


def write_parquet(
    records: Iterable[dict[str, Any]],
    path: str | Path,
    batch_rows: int = 256,
    schema: pa.Schema | None = None,
) -> int:
    """Write in row groups of `batch_rows` rows so a large export never sits in memory twice. `schema`
    (a pyarrow schema) defaults to the trace-row schema above."""
    require(PARQUET)
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = schema if schema is not None else row_schema()
    n = 0
    with pq.ParquetWriter(str(path), schema) as writer:
        batch: list[dict[str, Any]] = []
        for row in records:
            batch.append(row)
            if len(batch) == batch_rows:
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                n, batch = n + len(batch), []
        if batch or n == 0:
            writer.write_table(pa.Table.from_pylist(batch, schema=schema))
            n += len(batch)
    return n
