"""Staged pipeline vs serial sessions: how busy does the policy's server stay?

A fake policy server with a fixed service time per call (tests/fakes, wrapped here to measure the time it
has at least one call in flight), runtimes whose start costs seconds (a prepare action), an agent making N
calls (the shell harness running a stdlib HTTP client against the gateway) and an evaluator that takes
seconds. Both runs use the real node (`polar.rollout.node.Node`) with the same number of agents running
at once (`--concurrency`):

- serial: the node admits only `concurrency` sessions, so each slot does init → run → evaluate in turn;
- staged: admission is wider and the INIT, RUN and POSTRUN pools overlap, with a READY buffer of prepared
  runtimes, so the RUN pool (still `concurrency` agents) never waits for a sandbox or an evaluation.

    .venv/bin/python bench/pipeline.py               # ~2 minutes
    .venv/bin/python bench/pipeline.py --sessions 6  # quicker
    .venv/bin/python bench/pipeline.py --runtime docker --init-s 0   # real containers (podman too)

With `--runtime docker|podman` every session is a container of polar's base image (the engine started and
the image built as the test suite does, tests/container_support.py), its harness inside it reaching the
gateway through `network: gateway`, and the evaluation runs in a second, fresh container: the start, the
prepare action, and the evaluation's container are real costs on top of `--init-s` and `--eval-s`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.fakes.fake_vllm import make_fake_backend  # noqa: E402

from polar.gateway.backends.base import BackendOptions  # noqa: E402
from polar.gateway.config import GatewayConfig  # noqa: E402
from polar.rollout.node import Node, NodeConfig  # noqa: E402
from polar.rollout.protocol import SessionSpec  # noqa: E402
from polar.serving import serve  # noqa: E402
from polar.task import Task  # noqa: E402

# The agent: N sequential chat calls with the standard library only (no SDK import cost in the run).
AGENT = """
import json, os, sys, urllib.request
url = os.environ["OPENAI_BASE_URL"] + "/chat/completions"
messages = [{"role": "user", "content": "work on the task"}]
for i in range(int(sys.argv[1])):
    body = json.dumps({"model": os.environ["OPENAI_MODEL"], "messages": messages, "max_tokens": 16}).encode()
    req = urllib.request.Request(url, body, {"authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                             "content-type": "application/json"})
    reply = json.load(urllib.request.urlopen(req))["choices"][0]["message"]["content"]
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"step {i}"}]
"""


class BusyMeter:
    """ASGI wrapper: the union of the intervals during which the backend had a call in flight."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.in_flight = 0
        self.busy_s = 0.0
        self._since = 0.0
        self.calls = 0
        self.first = self.last = 0.0  # first call in, last call out

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        counted = scope["type"] == "http" and scope["path"] == "/v1/chat/completions"
        if counted:
            now = time.perf_counter()
            if self.in_flight == 0:
                self._since = now
            if self.calls == 0:
                self.first = now
            self.in_flight += 1
            self.calls += 1
        try:
            await self.app(scope, receive, send)
        finally:
            if counted:
                self.in_flight -= 1
                if self.in_flight == 0:
                    self.last = time.perf_counter()
                    self.busy_s += self.last - self._since

    def reset(self) -> None:
        self.busy_s, self.calls = 0.0, 0

    @property
    def window_s(self) -> float:
        """From the first call to the last: the stretch in which agents run (start-up and the final
        evaluation, which no pipeline can overlap, fall outside it)."""
        return self.last - self.first


def task(agent: Path, calls: int, init_s: float, eval_s: float, engine: str | None = None) -> Task:
    runtime: dict[str, Any] = {"prepare": [{"type": "exec", "cmd": f"sleep {init_s}"}]}
    command = f"{sys.executable} {agent} {calls}"
    if engine is not None:
        from tests.container_support import IMAGE

        runtime = {
            "backend": engine,
            "image": IMAGE,
            "network": "gateway",
            "prepare": [{"type": "upload", "src": str(agent), "dst": "agent.py"}, *runtime["prepare"]],
        }
        command = f"python3 agent.py {calls}"
    return Task.model_validate(
        {
            "task_id": "bench",
            "instruction": "work",
            "timeout_seconds": 600,
            "runtime": runtime,
            "agent": {"harness": "shell", "settings": {"command": command}},
            "evaluator": {"strategy": "test_on_output", "config": {"command": f"sleep {eval_s}"}},
        }
    )


async def run_mode(
    mode: str, backend_url: str, meter: BusyMeter, t: Task, sessions: int, concurrency: int, tmp: Path
) -> dict[str, float]:
    staged = mode == "staged"
    config = NodeConfig(
        gateway=GatewayConfig(
            backend_url=backend_url,
            served_model="m",
            store_path=tmp / f"{mode}.db",
            backend=BackendOptions(retries=0),
            port=0,
        ),
        capacity=sessions if staged else concurrency,
        init_workers=sessions if staged else concurrency,
        run_workers=concurrency,
        post_workers=sessions if staged else concurrency,
        ready_buffer=sessions if staged else 1,
        runtime_root=tmp / mode,
        node_id=f"bench-{mode}",
        upload_roots=(tmp,),
    )
    node = Node(config)
    await node.start()
    try:
        meter.reset()
        t0 = time.perf_counter()
        pending = [f"polar-bench-{mode}-{i:04d}" for i in range(sessions)]
        submitted: list[str] = []
        while pending or submitted:
            # Feed the node as fast as it admits (a trainer's client does the same with the server).
            while pending and node.status().active < config.capacity:
                sid = pending.pop(0)
                await node.submit(SessionSpec(session_id=sid, task=t, sample_index=len(submitted)))
                submitted.append(sid)
            if submitted:
                done, _ = await asyncio.wait(
                    [asyncio.ensure_future(node.wait(s)) for s in submitted],
                    return_when=asyncio.FIRST_COMPLETED,
                )
                results = [d.result() for d in done]
                for r in results:
                    if r.status.value != "COMPLETED":
                        raise RuntimeError(f"{r.session_id}: {r.status.value} {r.reason}")
                    submitted.remove(r.session_id)
        wall = time.perf_counter() - t0
    finally:
        await node.stop()
    return {
        "wall": wall,
        "busy": meter.busy_s / wall,
        "steady": meter.busy_s / meter.window_s,
        "per_hour": sessions / wall * 3600,
        "calls": meter.calls,
    }


async def main_async(opts: argparse.Namespace) -> None:
    fake = make_fake_backend("vllm", delay_s=opts.service_s, record=False)
    meter = BusyMeter(fake)
    tmp = Path(tempfile.mkdtemp(prefix="polar-pipeline-"))
    agent = tmp / "agent.py"
    agent.write_text(AGENT)
    t = task(agent, opts.calls, opts.init_s, opts.eval_s, opts.runtime if opts.runtime != "local" else None)
    with serve(meter) as backend:
        rows = {}
        for mode in ("serial", "staged"):
            rows[mode] = await run_mode(mode, backend.url, meter, t, opts.sessions, opts.concurrency, tmp)
    print()
    print(
        f"runtime {opts.runtime}; "
        f"{opts.sessions} sessions, {opts.concurrency} agent(s) at once; per session: init {opts.init_s} s, "
        f"{opts.calls} calls x {opts.service_s} s of backend time, evaluation {opts.eval_s} s"
    )
    print(
        f"{'pipeline':<10} {'wall s':>8} {'busy (wall)':>12} {'busy (agents running)':>22} {'sessions/h':>11}"
    )
    for mode, r in rows.items():
        print(f"{mode:<10} {r['wall']:>8.1f} {r['busy']:>12.1%} {r['steady']:>22.1%} {r['per_hour']:>11.0f}")
    s, g = rows["serial"], rows["staged"]
    print(
        f"staged/serial: {g['per_hour'] / s['per_hour']:.2f}x sessions per hour; backend busy while agents "
        f"run {s['steady']:.1%} -> {g['steady']:.1%}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--calls", type=int, default=4, help="model calls per session")
    ap.add_argument("--service-s", type=float, default=0.3, help="backend time per call")
    ap.add_argument("--init-s", type=float, default=3.0, help="runtime start cost (a prepare action)")
    ap.add_argument("--eval-s", type=float, default=2.0, help="evaluation cost")
    ap.add_argument("--runtime", choices=["local", "docker", "podman"], default="local")
    opts = ap.parse_args()
    if opts.runtime == "local":
        asyncio.run(main_async(opts))
        return
    from tests.container_support import base_image, docker_daemon, podman_config

    with (docker_daemon if opts.runtime == "docker" else podman_config)() as why:
        if why is not None:
            sys.exit(f"--runtime {opts.runtime}: {why}")
        base_image(opts.runtime)
        asyncio.run(main_async(opts))


if __name__ == "__main__":
    main()
