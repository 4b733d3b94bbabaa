"""The completions table as a rowid table against WITHOUT ROWID, side by side: time and pages per record.

    .venv/bin/python bench/store_layout.py                     # 3,000 records, 2 a transaction, 5 rounds
    .venv/bin/python bench/store_layout.py --batch 1 2 8 --records 2000

A WITHOUT ROWID table keeps a row in its b-tree page only up to ~1 kB of a 4 kB page (SQLite's file format:
an index b-tree's local payload limit); a longer row spills onto overflow pages, one at least of its own. A
gateway record (body skeletons, sampled ids and logprobs, the answer) is ~1 kB and more. This bench writes
the same records, encoded as the gateway encodes them (`RecordWriter.stage_completion`: a 7 kB Chat request
with six tools, 1,610 prompt ids, 24 sampled tokens, as bench/gateway.py sends), into one store of each
layout in turn, `--batch` records a transaction as the gateway's group commit does, rounds interleaved, and
prints per record: the time of the inserts and the commit (the encoding is the same for both and left
out), the WAL frames written (pages), and the database's bytes once checkpointed. Medians over rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from bench.gateway import bodies  # noqa: E402

from polar.store import codec  # noqa: E402
from polar.store import sqlite as store_sqlite  # noqa: E402
from polar.store.records import CompletionRecord  # noqa: E402

ROWID = store_sqlite.SCHEMA
WITHOUT_ROWID = ROWID.replace(
    "    UNIQUE (session_id, seq)\n);", "    PRIMARY KEY (session_id, seq)\n) WITHOUT ROWID;", 1
)
assert WITHOUT_ROWID != ROWID, "the completions table's definition changed: update this bench"
LAYOUTS = {"rowid (now)": ROWID, "WITHOUT ROWID (before)": WITHOUT_ROWID}
SESSION = "polar-" + "x" * 24  # as long as the gateway's ids


def record(seq: int) -> CompletionRecord:
    _, body = bodies(False)["chat"]
    upstream = {**body, "model": "m", "logprobs": True, "return_token_ids": True}
    return CompletionRecord(
        session_id=SESSION,
        seq=seq,
        completion_id=f"cmpl-0123456789abcdef-{seq}",
        upstream_id=f"chatcmpl-{seq}",
        dialect="chat",
        created_at=time.time(),
        request=body,
        upstream_request=upstream,
        prompt_ids=codec.TokenIds(codec.ids_to_bytes(list(range(1610)))),
        response_ids=list(range(24)),
        response_logprobs=[-0.25 - i / 100 for i in range(24)],
        finish_reason="stop",
        response_message={
            "role": "assistant",
            "content": "The answer, in about a hundred bytes of text. " * 2,
        },
        tools=body["tools"],
        usage={"prompt_tokens": 1610, "completion_tokens": 24, "total_tokens": 1634},
        model_requested="m",
        model_served="m",
        policy_version=0,
        upstream_latency_ms=2.0,
        gateway_overhead_ms=0.5,
        flags=(),
        tags=(),
    )


@contextmanager
def schema(text: str) -> Iterator[None]:
    saved = store_sqlite.SCHEMA
    store_sqlite.SCHEMA = text
    try:
        yield
    finally:
        store_sqlite.SCHEMA = saved


def one(text: str, records: int, batch: int, tmp: Path) -> tuple[float, float, float]:
    """(us of inserts and commit, WAL frames, database bytes) per record, for one fresh store."""
    path = tmp / f"s{time.monotonic_ns()}.db"
    with schema(text):
        conn = store_sqlite.connect(path, "normal")
    conn.execute("PRAGMA wal_autocheckpoint=0")  # count every frame; checkpoint once at the end
    writer = store_sqlite.RecordWriter(conn)
    template = record(0)
    spent = 0.0
    for start in range(0, records, batch):
        staged = [
            writer.stage_completion(dataclasses.replace(template, seq=s))
            for s in range(start, min(start + batch, records))
        ]
        t = time.perf_counter()
        conn.execute("BEGIN IMMEDIATE")
        for insert in staged:
            insert()
        conn.execute("COMMIT")
        spent += time.perf_counter() - t
    frames = os.path.getsize(f"{path}-wal") / (4096 + 24)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    size = os.path.getsize(path)
    conn.close()
    return spent / records * 1e6, frames / records, size / records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=3000)
    ap.add_argument("--batch", type=int, nargs="+", default=[2], help="records a transaction")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(
        "| records a transaction | layout | inserts + commit us/record | pages written/record | bytes/record |"
    )
    print("|---:|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as d:
        for batch in args.batch:
            got: dict[str, list[tuple[float, float, float]]] = {name: [] for name in LAYOUTS}
            for r in range(args.rounds):
                order = list(LAYOUTS.items())
                if r % 2:
                    order.reverse()
                for name, text in order:
                    got[name].append(one(text, args.records, batch, Path(d)))
            for name in LAYOUTS:
                us, frames, size = (statistics.median(x[i] for x in got[name]) for i in range(3))
                print(f"| {batch} | {name} | {us:.1f} | {frames:.2f} | {size:,.0f} |")


if __name__ == "__main__":
    main()
