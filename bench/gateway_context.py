"""Gateway CPU per call as the context grows: 1.5k, 16k and 64k prompt tokens (issue 12, point 5).

The fake vLLM (tests/fakes, ~4 bytes of text per token) serves one or two `polar gateway` processes: this
tree's code and, with `--before SRC`, another checkout's `src` (e.g. main in a second worktree), so both
columns of the table come from one run on the same machine state. Each session starts with a history of
about N tokens (system prompt, six tools, then tool round trips of ~1 kB each, unique per session so the
store does real work) and makes `--calls` calls, appending the answer and a new tool result each time, as a
harness does. Sessions alternate between the gateways.

What is measured is the gateway process's own CPU time (the sum over its threads of
`/proc/PID/task/TID/schedstat`, nanoseconds), not wall time: the machine is shared and noisy, and the fake
and this client run on the same cores. Each figure is the median over sessions of (CPU over the session's
calls) / calls.

    PYTHONPATH=src .venv/bin/python bench/gateway_context.py --before /work/wt/main-ref/src
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.processes import start  # noqa: E402

from polar.serving import free_port  # noqa: E402

SYSTEM = "You are a coding agent. " + "Follow the repository conventions and explain nothing. " * 30
TOOLS = [
    {
        "name": name,
        "description": f"{name}: " + "does a thing in the workspace with care. " * 6,
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path"],
        },
    }
    for name in ("read_file", "write_file", "bash", "grep", "list_dir", "apply_patch")
]
TOOL_OUT = "tests/test_parser.py ....F.......\nE   AssertionError: expected 3 items, got 2\n" * 12  # ~1 kB


def cpu_ns(pid: int) -> int:
    """CPU time of every live thread of `pid`, in ns (schedstat's first field)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def round_trip(tag: str, i: int) -> list[dict[str, Any]]:
    args = orjson.dumps({"path": f"src/{tag}/mod_{i}.py"}).decode()
    call = {"id": f"call_{tag}_{i}", "type": "function", "function": {"name": "read_file", "arguments": args}}
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": f"[{tag} {i}]\n" + TOOL_OUT},
    ]


def history(tokens: int, tag: str) -> list[dict[str, Any]]:
    """Chat messages whose rendering is about `tokens` tokens (4 bytes each), unique to `tag`."""
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"[{tag}] Fix the failing test in tests/test_parser.py."},
    ]
    size = len(orjson.dumps(msgs)) + 3000  # the tools' rendering
    i = 0
    while size < tokens * 4:
        msgs += round_trip(tag, i)
        size += 1150
        i += 1
    return msgs


def to_anthropic(msgs: list[dict[str, Any]]) -> dict[str, Any]:
    out: list[dict[str, Any]] = []
    for m in msgs[1:]:
        if m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [
                {
                    "type": "tool_use",
                    "id": c["id"],
                    "name": c["function"]["name"],
                    "input": orjson.loads(c["function"]["arguments"]),
                }
                for c in m["tool_calls"]
            ]
            if m.get("content"):
                blocks.insert(0, {"type": "text", "text": m["content"]})
            out.append({"role": "assistant", "content": blocks})
        elif m["role"] == "tool":
            out.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}
                    ],
                }
            )
        else:
            out.append({"role": m["role"], "content": m["content"]})
    tools = [
        {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in TOOLS
    ]
    return {"model": "m", "max_tokens": 32, "system": msgs[0]["content"], "messages": out, "tools": tools}


def request(dialect: str, msgs: list[dict[str, Any]]) -> tuple[str, bytes]:
    if dialect == "anthropic":
        return "/v1/messages", orjson.dumps(to_anthropic(msgs))
    body = {
        "model": "m",
        "messages": msgs,
        "tools": [{"type": "function", "function": t} for t in TOOLS],
        "max_tokens": 32,
    }
    return "/v1/chat/completions", orjson.dumps(body)


def answer(dialect: str, data: dict[str, Any]) -> dict[str, Any]:
    if dialect == "anthropic":
        text = "".join(b.get("text", "") for b in data["content"] if b["type"] == "text")
        return {"role": "assistant", "content": text}
    msg = data["choices"][0]["message"]
    return {"role": "assistant", "content": msg.get("content")}


class Gateway:
    def __init__(self, name: str, src: Path, backend: str, tmp: Path) -> None:
        self.name = name
        port, cport = free_port(), free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.control = f"http://127.0.0.1:{cport}"
        self.token = secrets.token_urlsafe(32)
        cmd = [
            sys.executable,
            "-m",
            "polar",
            "gateway",
            "--backend",
            backend,
            "--model",
            "m",
            "--port",
            str(port),
            "--control-port",
            str(cport),
            "--store",
            str(tmp / f"{name}.db"),
            "--log-level",
            "warning",
        ]
        self.proc = start(cmd, self.url, {"POLAR_TOKEN": self.token}, pythonpath=f"{src}:{ROOT}")

    def session(self, client: httpx.Client) -> str:
        r = client.post(
            self.control + "/sessions",
            json={"task_id": "ctx"},
            headers={"authorization": f"Bearer {self.token}"},
        )
        r.raise_for_status()
        return str(r.json()["session_id"])

    def close(self, client: httpx.Client, sid: str) -> None:
        client.delete(f"{self.control}/sessions/{sid}", headers={"authorization": f"Bearer {self.token}"})


def run_session(
    gw: Gateway, client: httpx.Client, dialect: str, msgs: list[dict[str, Any]], calls: int, tag: str
) -> tuple[float, float]:
    """(ms of gateway CPU for the first call, median ms over the later calls)."""
    sid = gw.session(client)
    headers = {
        "authorization": f"Bearer {sid}",
        "x-api-key": sid,
        "content-type": "application/json",
        "anthropic-version": "2023-06-01",
    }
    per_call: list[float] = []
    for i in range(calls):
        path, raw = request(dialect, msgs)
        c0 = cpu_ns(gw.proc.pid)
        r = client.post(gw.url + path, content=raw, headers=headers)
        c1 = cpu_ns(gw.proc.pid)
        r.raise_for_status()
        per_call.append((c1 - c0) / 1e6)
        msgs = [*msgs, answer(dialect, r.json()), *round_trip(tag + "n", i)[1:]]
    gw.close(client, sid)
    return per_call[0], statistics.median(per_call[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, help="another checkout's src/ to run side by side ('before')")
    ap.add_argument("--sizes", default="1500,16000,64000", help="prompt tokens at the session's start")
    ap.add_argument("--sessions", type=int, default=10, help="sessions per size and gateway")
    ap.add_argument("--calls", type=int, default=8, help="calls per session")
    ap.add_argument("--dialects", default="chat,anthropic")
    opts = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="polar-ctx-"))
    bport = free_port()
    backend = f"http://127.0.0.1:{bport}"
    procs = [
        start(
            [sys.executable, "-m", "tests.fakes.fake_vllm", "--port", str(bport)],
            backend,
            pythonpath=str(ROOT),
        )
    ]
    gateways: list[Gateway] = []
    try:
        if opts.before is not None:
            gateways.append(Gateway("before", opts.before.resolve(), backend, tmp))
        gateways.append(Gateway("after" if opts.before else "this", ROOT / "src", backend, tmp))
        procs += [g.proc for g in gateways]
        rows = []
        with httpx.Client(timeout=300) as client:
            for dialect in opts.dialects.split(","):
                for size in (int(s) for s in opts.sizes.split(",")):
                    first: dict[str, list[float]] = {g.name: [] for g in gateways}
                    later: dict[str, list[float]] = {g.name: [] for g in gateways}
                    for s in range(opts.sessions):
                        tag = secrets.token_hex(4)
                        msgs = history(size, tag)
                        order = gateways if s % 2 == 0 else gateways[::-1]
                        for gw in order:
                            f, rest = run_session(gw, client, dialect, msgs, opts.calls, tag)
                            first[gw.name].append(f)
                            later[gw.name].append(rest)
                    _, raw = request(dialect, history(size, "x"))
                    rows.append(
                        (
                            dialect,
                            size,
                            len(raw),
                            {
                                g.name: (statistics.median(first[g.name]), statistics.median(later[g.name]))
                                for g in gateways
                            },
                        )
                    )
                    print(
                        dialect,
                        size,
                        {k: [round(x, 2) for x in v] for k, v in rows[-1][3].items()},
                        flush=True,
                    )
        names = [g.name for g in gateways]
        print()
        head = f"{'dialect':<10} {'tokens':>7} {'body kB':>8} " + " ".join(
            f"{n + ' 1st':>11} {n + ' next':>11}" for n in names
        )
        print(head + ("  next after/before" if len(names) == 2 else ""))
        for dialect, size, nbytes, m in rows:
            line = f"{dialect:<10} {size:>7} {nbytes / 1000:>8.0f} " + " ".join(
                f"{m[n][0]:>11.2f} {m[n][1]:>11.2f}" for n in names
            )
            if len(names) == 2:
                line += f"  {m[names[1]][1] / m[names[0]][1]:>18.2f}"
            print(line)
        print()
        print(
            "ms of gateway CPU per call, median over sessions; RSS at the end: "
            + ", ".join(f"{g.name} {rss_mib(g.proc.pid):.0f} MiB" for g in gateways)
        )
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)


if __name__ == "__main__":
    main()
