"""How many records one SQLite store takes from several writer processes at once (`polar gateway --workers`):
the ceiling each worker's own connection shares, and how much of it the lock costs.

    .venv/bin/python bench/store_writers.py                     # 1 and 2 writers, batches of 1 and 8, ~1 minute
    .venv/bin/python bench/store_writers.py --writers 1 2 4 --seconds 5

Each writer process is what a gateway worker's writer thread does, without the HTTP around it: one
`RecordWriter` on its own connection to one WAL store (as `polar.store.writer.AsyncWriter` opens it), records
of bench/gateway.py's chat call (the 7 kB body and its upstream form, a 1,610-id prompt growing by 60 ids a
call, 24 sampled ids and logprobs), one session per writer, committed `--batch` at a time (1: each call
alone, as at concurrency 1; 8: a group commit under load), each record encoded before `BEGIN IMMEDIATE`
(as `polar.store.writer` does: only the inserts hold the lock) or inside the transaction (as it did
before). Configurations alternate in rounds; the table gives medians: records/s summed over the writers, per writer, and the share of time a
writer spent holding the write lock (BEGIN IMMEDIATE to COMMIT) against the time it waited for it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway import bodies  # noqa: E402

from polar.store.records import CompletionRecord  # noqa: E402
from polar.store.sqlite import RecordWriter, connect  # noqa: E402


def record(session: str, seq: int, body: dict[str, Any]) -> CompletionRecord:
    prompt = list(range(1000, 2610 + 60 * seq))
    return CompletionRecord(
        session_id=session,
        seq=seq,
        completion_id=f"cmpl-bench-{seq}",
        dialect="chat",
        created_at=time.time(),
        request=body,
        upstream_request={**body, "logprobs": True, "return_token_ids": True},
        prompt_ids=prompt,
        response_ids=list(range(24)),
        response_logprobs=[-0.5] * 24,
        finish_reason="stop",
        response_message={"role": "assistant", "content": "done " * 20},
        tools=[t["function"] for t in body["tools"]],
        usage={"prompt_tokens": len(prompt), "completion_tokens": 24},
        model_requested="m",
        model_served="m",
    )


def writer(path: str, name: str, batch: int, seconds: float, start: float, out: Any, before: bool) -> None:
    conn = connect(path)
    w = RecordWriter(conn)
    body = bodies(False)["chat"][1]
    seq = held = waited = 0.0
    n = 0
    while time.time() < start:
        time.sleep(0.001)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        # Sessions of 20 calls (prompts of 1,610 to 2,750 ids), as an agent's.
        recs = [record(f"{name}-{(n + i) // 20}", (n + i) % 20, body) for i in range(batch)]
        inserts = [w.stage_completion(r) for r in recs] if before else []  # AsyncWriter's order
        t0 = time.perf_counter()
        conn.execute("BEGIN IMMEDIATE")
        t1 = time.perf_counter()
        if before:
            for insert in inserts:
                insert()
        else:
            for r in recs:
                w.add_completion(r)
        conn.execute("COMMIT")
        t2 = time.perf_counter()
        waited += t1 - t0
        held += t2 - t1
        n += batch
    seq = n
    conn.close()
    out.put((seq, held, waited))


def run(path: Path, writers: int, batch: int, seconds: float, tag: str, before: bool) -> dict[str, float]:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    start = time.time() + 0.5
    procs = [
        ctx.Process(target=writer, args=(str(path), f"{tag}-{k}", batch, seconds, start, out, before))
        for k in range(writers)
    ]
    for p in procs:
        p.start()
    got = [out.get() for _ in procs]
    for p in procs:
        p.join()
    records = sum(g[0] for g in got)
    return {
        "rps": records / seconds,
        "per": records / seconds / writers,
        "held": statistics.mean(g[1] for g in got) / seconds,
        "waited": statistics.mean(g[2] for g in got) / seconds,
        "held_ms": sum(g[1] for g in got) / records * 1000,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--writers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--encode",
        nargs="+",
        choices=["before", "inside"],
        default=["before", "inside"],
        help="where each record is encoded: before BEGIN (as polar.store.writer does) or inside the transaction (as it did at 3d6d3a0)",
    )
    opts = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="polar-bench-store-"))
    cells = [(e, w, b) for e in opts.encode for b in opts.batch for w in opts.writers]
    results: dict[tuple[str, int, int], list[dict[str, float]]] = {}
    for r in range(opts.rounds):
        for i, (e, w, b) in enumerate(cells[r % len(cells) :] + cells[: r % len(cells)]):
            db = tmp / f"r{r}-{i}.db"
            results.setdefault((e, w, b), []).append(run(db, w, b, opts.seconds, f"r{r}", e == "before"))
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        print(f"round {r + 1}/{opts.rounds}, load {load}", flush=True)
    print(f"\n{opts.seconds:g} s per point, medians of {opts.rounds} rounds")
    print(
        "| encoded | writers | records per commit | records/s | per writer | lock held per record ms | held | "
        "waiting |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for e, w, b in cells:
        m = {k: statistics.median(x[k] for x in results[(e, w, b)]) for k in results[(e, w, b)][0]}
        print(
            f"| {e} | {w} | {b} | {m['rps']:.0f} | {m['per']:.0f} | {m['held_ms']:.3f} | "
            f"{m['held'] * 100:.0f} % | {m['waited'] * 100:.0f} % |"
        )


if __name__ == "__main__":
    main()
