"""A record's encoding (`RecordWriter.stage_completion`), this checkout against an earlier commit, interleaved.

    .venv/bin/python bench/store_encoding.py --ref HEAD~1                   # 5 rounds, a 100-call session
    .venv/bin/python bench/store_encoding.py --ref HEAD~1 --rounds 3 --history 16000 64000

Before its transaction, the gateway's writer encodes each record: the prompt as a delta over the session's
earlier prompts, the request and upstream bodies as skeletons over the previous record's lists, the tool
list's blob. This bench encodes the records of one growing session the way the gateway does, in a fresh
process per side and round (the earlier commit's `polar` from a temporary `git worktree`), sides
alternating, and prints the median microseconds a record for each shape:

- `chat`: bench/gateway.py's Chat body (7 kB, 1,610 prompt tokens, six tools); the upstream body sends the
  same messages and tools, as a Chat harness's call to a vLLM-like server does;
- `chat, history N`: the same with N more tokens of history before it (~4 bytes a token of tool round trips);
- `translated`: the upstream body's messages differ from the request's (a translated dialect: nothing of
  the request's split can be taken over).

Each call of the session adds an assistant tool call and a ~200-character tool result (~60 prompt tokens),
as a harness does; the session's first record (stored whole) is not counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway_cpu import worktree  # noqa: E402

CHILD = r"""
import dataclasses, json, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from bench.gateway import bodies
from polar.store import codec
from polar.store.records import CompletionRecord
from polar.store.sqlite import RecordWriter, connect

shape, records, history = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
_, body = bodies(False)["chat"]
messages = list(body["messages"])
turn = 0
def round_trip():
    global turn
    turn += 1
    call = {"id": f"call_{turn}", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}
    return [{"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{turn}", "content": f"out {turn} " + "y" * 200}]
while sum(len(m.get("content") or "") for m in messages) < 4 * history:
    messages[1:1] = [*round_trip(), *round_trip(), *round_trip(), *round_trip()]
prompt = list(range(1000, 1000 + 1610 + history))
writer = RecordWriter(connect(Path(tempfile.mkdtemp()) / "s.db"))
made = []
for seq in range(records):
    messages = [*messages, *round_trip()]
    prompt = [*prompt, *range(60)]
    request = {**body, "messages": messages}
    if shape == "translated":
        upstream = {**request, "messages": [{**m, "name": "x"} for m in messages], "logprobs": True}
    else:
        upstream = {**request, "logprobs": True, "return_token_ids": True}
    made.append(CompletionRecord(
        session_id="polar-" + "x" * 24, seq=seq, completion_id=f"cmpl-{seq}", dialect="chat",
        created_at=time.time(), request=request, upstream_request=upstream,
        prompt_ids=codec.TokenIds(codec.ids_to_bytes(prompt)), response_ids=list(range(24)),
        response_logprobs=[-0.5] * 24, finish_reason="tool_calls",
        response_message={"role": "assistant", "content": "done " * 20},
        tools=[t["function"] for t in body["tools"]], usage={"prompt_tokens": len(prompt)},
        model_requested="m", model_served="m"))
writer.stage_completion(made[0])  # the session's first record is stored whole: not what is measured
start = time.perf_counter()
for r in made[1:]:
    writer.stage_completion(r)
print(json.dumps({"us": (time.perf_counter() - start) / (records - 1) * 1e6}))
"""


def encode(src: Path, shape: str, records: int, history: int) -> float:
    """Microseconds a record, in a fresh process importing polar from `src`."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(ROOT), shape, str(records), str(history)],
        env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    return float(json.loads(out.stdout.splitlines()[-1])["us"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", default="HEAD~1", help="the commit compared with this checkout (default HEAD~1)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--records", type=int, default=100, help="calls of the session (default 100)")
    ap.add_argument("--history", type=int, nargs="+", default=[16000], help="tokens before the bench body")
    opts = ap.parse_args()
    shapes = [("chat", 0), *[("chat", h) for h in opts.history], ("translated", 0)]
    with worktree(opts.ref) as ref:
        sides = {opts.ref: ref / "src", "this checkout": ROOT / "src"}
        runs: dict[tuple[str, str, int], list[float]] = {}
        for round_ in range(opts.rounds):
            for i, (shape, history) in enumerate(shapes):
                order = list(sides.items())
                if (round_ + i) % 2:
                    order.reverse()
                for name, src in order:
                    us = encode(src, shape, opts.records, history)
                    runs.setdefault((name, shape, history), []).append(us)
                    print(f"round {round_ + 1} {name}: {shape} history {history}: {us:.1f} us", flush=True)
    print(f"\nmedians of {opts.rounds} interleaved rounds, microseconds to encode a record")
    print(f"| shape | {opts.ref} | this checkout | ratio |\n|---|---:|---:|---:|")
    for shape, history in shapes:
        label = shape if not history else f"{shape}, history {history:,} tokens"
        before = statistics.median(runs[(opts.ref, shape, history)])
        after = statistics.median(runs[("this checkout", shape, history)])
        print(f"| {label} | {before:.1f} | {after:.1f} | {after / before:.2f}x |")


if __name__ == "__main__":
    main()
