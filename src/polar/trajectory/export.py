"""Traces as rows for trainers and `datasets`: JSON Lines or Parquet, one row per trace.

Both formats share one flat schema. Token columns are lists of numbers; messages, tools and metadata are
JSON text, because their shapes vary call to call (string or part-list content, tool schemas with
arbitrary keys, arguments as text or objects) and Arrow cannot unify such structs across rows: as text,
`datasets.load_dataset("json" | "parquet", data_files=...)` loads any export without a schema fight.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson

from polar.trajectory.models import Trajectory

JSON_COLUMNS = ("prompt_messages", "response_messages", "tools", "metadata")


def rows(trajectory: Trajectory, task_id: str | None = None) -> Iterator[dict[str, Any]]:
    meta = trajectory.metadata
    for i, t in enumerate(trajectory.traces):
        yield {
            "session_id": meta.get("session_id"),
            "task_id": task_id,
            "trace_index": i,
            "status": trajectory.status.value,
            "strategy": meta.get("strategy"),
            "prompt_ids": t.prompt_ids,
            "response_ids": t.response_ids,
            "loss_mask": t.loss_mask,
            "response_logprobs": t.response_logprobs,
            "reward": t.reward,
            "finish_reason": t.finish_reason,
            **{c: orjson.dumps(getattr(t, c)).decode() for c in JSON_COLUMNS},
        }


def write_jsonl(records: Iterable[dict[str, Any]], path: str | Path) -> int:
    n = 0
    with open(path, "wb") as f:
        for row in records:
            f.write(orjson.dumps(row))
            f.write(b"\n")
            n += 1
    return n


def _schema() -> Any:
    import pyarrow as pa

    ids = pa.list_(pa.int64())
    return pa.schema(
        [
            ("session_id", pa.string()),
            ("task_id", pa.string()),
            ("trace_index", pa.int32()),
            ("status", pa.string()),
            ("strategy", pa.string()),
            ("prompt_ids", ids),
            ("response_ids", ids),
            ("loss_mask", pa.list_(pa.int8())),
            ("response_logprobs", pa.list_(pa.float64())),  # float64: the server's values, unrounded
            ("reward", pa.float64()),
            ("finish_reason", pa.string()),
            *((c, pa.string()) for c in JSON_COLUMNS),
        ]
    )


def write_parquet(records: Iterable[dict[str, Any]], path: str | Path, batch_rows: int = 256) -> int:
    """Write in row groups of `batch_rows` traces so a large export never sits in memory twice."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:  # pyarrow is the `export` extra
        raise RuntimeError("Parquet export needs pyarrow: pip install 'polar[export]'") from e
    schema = _schema()
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
