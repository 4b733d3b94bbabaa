"""Gateway nodes as Ray actors: sessions per hour over 1, 2 and 3 Ray nodes, and the scheduler's cost per
decision as the queue grows to 10,000 sessions.

    .venv/bin/python bench/ray_scale.py                       # both parts, ~4 minutes here
    .venv/bin/python bench/ray_scale.py --part scheduler      # only the queue-depth part, seconds

*scaling*: a real Ray cluster on this machine (`ray.cluster_utils.Cluster`: a head and three Ray nodes;
the k-node runs place gateway actors only on the Ray nodes declaring the custom resource `k<k>`), a real
rollout server, and a task whose sessions each run the shell harness for a fixed `--service-s` (the policy
is a fixed service time; no model is called). Each gateway node admits `--capacity` sessions, so k nodes
ideally finish k x capacity sessions per service time. The sessions per hour (the median of `--repeats`
runs of `--waves` full waves each), and the scaling efficiency: sessions/hour over k times the one-node
figure. All Ray nodes share this machine's cores, so this measures the control plane (placement, dispatch,
the nodes' pools, runtimes starting), not compute.

*scheduler*: the server's own store (`ServerStore`, SQLite) holding 100, 1,000 and 10,000 queued sessions
(tasks of 10 samples) and 3 nodes of 8 slots; one decision is what `Dispatcher.tick` reads to place a
session: the node views, the open sessions on nodes, the head of the queue, and `scheduler.place`. Timed
with one free slot (a session just finished: the steady state) and with 24 (an empty cluster).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from polar.auth import bearer, new_token  # noqa: E402
from polar.rollout.server.scheduler import NodeView, is_healthy, place  # noqa: E402
from polar.rollout.server.store import ServerStore  # noqa: E402
from polar.task import Task  # noqa: E402


# -- scaling over Ray nodes ---------------------------------------------------------------------------------
async def _one_run(client: Any, run: int, sessions: int, service_s: float) -> float:
    task = {
        "task_id": f"bench-{run}",
        "instruction": "wait",
        "num_samples": sessions,
        "timeout_seconds": 600,
        "agent": {"harness": "shell", "settings": {"command": f"sleep {service_s}"}},
    }
    start = time.perf_counter()
    (await client.post("/rollout/task/submit", json=task)).raise_for_status()
    while True:
        view = (await client.get(f"/rollout/task/bench-{run}", params={"results": "false"})).json()
        if view["state"] != "ACTIVE":
            wall = time.perf_counter() - start
            done = view["counts"].get("COMPLETED", 0)
            if done != sessions:
                raise SystemExit(f"run {run}: {done} of {sessions} sessions completed: {view['counts']}")
            return wall
        await asyncio.sleep(0.05)


async def _scaling(args: argparse.Namespace) -> list[dict[str, Any]]:
    import httpx
    import ray
    from ray.cluster_utils import Cluster

    from polar.dashboard import server_app
    from polar.gateway.config import GatewayConfig
    from polar.rollout.node import NodeConfig
    from polar.rollout.ray.cluster import RayNodes
    from polar.rollout.ray.spec import NodeRequest, RayNodeSpec
    from polar.rollout.server import ServerConfig
    from polar.serving import ServerThread

    rows = []
    # The Ray nodes' worker processes import polar from this tree, as this process does.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    )
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        for i in range(3):  # node i offers k<k> for every k > i: k1 is on one node, k3 on all three
            cluster.add_node(num_cpus=args.capacity, resources={f"k{k}": 1 for k in range(i + 1, 4)})
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        cluster.wait_for_nodes()
        with tempfile.TemporaryDirectory() as tmp:
            for k in (1, 2, 3):
                token = new_token()
                config = ServerConfig(db_path=Path(tmp) / f"server-{k}.db", token=token, tick_s=0.1)
                server = ServerThread(server_app(config), host=ray.util.get_node_ip_address()).start()
                gateway = GatewayConfig(
                    backend_url="http://127.0.0.1:9", served_model="none", control_token=token
                )
                node = NodeConfig(
                    gateway=gateway,
                    capacity=args.capacity,
                    run_workers=args.capacity,
                    init_workers=args.capacity,
                    server_url=server.url,
                    heartbeat_s=1.0,
                    runtime_root=Path(tmp) / "runtimes",
                )
                spec = RayNodeSpec(config=node, store_dir=Path(tmp) / f"nodes-{k}")
                nodes = RayNodes(spec, NodeRequest(resource=f"k{k}", cpus=1), server.url, token)
                try:
                    started = await nodes.start(wait_for_one=True)
                    assert len(started) == k, started
                    sessions = args.waves * k * args.capacity
                    walls = []
                    async with httpx.AsyncClient(
                        base_url=server.url, headers=bearer(token), timeout=60
                    ) as client:
                        await _one_run(
                            client, 0, k * args.capacity, args.service_s
                        )  # warm-up: runtimes, imports
                        for run in range(1, args.repeats + 1):
                            walls.append(await _one_run(client, run, sessions, args.service_s))
                    wall = statistics.median(walls)
                    ideal = args.waves * args.service_s
                    rows.append(
                        {
                            "nodes": k,
                            "sessions": sessions,
                            "wall": wall,
                            "walls": walls,
                            "per_hour": sessions / wall * 3600,
                            "ideal_per_hour": sessions / ideal * 3600,
                        }
                    )
                    print(
                        f"  {k} node(s): {sessions} sessions, walls {[round(w, 2) for w in walls]}",
                        flush=True,
                    )
                finally:
                    await nodes.stop("benchmark finished")
                    server.stop()
    finally:
        ray.shutdown()
        cluster.shutdown()
    return rows


# -- the scheduler's cost at depth --------------------------------------------------------------------------
def _decision_cost(depth: int, free: int, repeats: int, tmp: Path) -> float:
    """Median seconds of one tick's reads and placement, per session placed, with `depth` queued."""
    store = ServerStore(tmp / f"depth-{depth}-{free}.db")
    try:
        per_task = 10
        planned = []
        for t in range(depth // per_task):
            task = Task.model_validate({"task_id": f"t{t}", "instruction": "x", "num_samples": per_task})
            planned.append((task, [f"s-{t}-{i}" for i in range(per_task)]))
        store.add_tasks(planned)
        slots = [8, 8, 8]
        load = {f"n{i}": s for i, s in enumerate(slots)}
        for i, node_id in enumerate(load):
            store.register_node(node_id, f"http://127.0.0.1:{9000 + i}", slots[i], None)
        left = free
        for node_id in load:  # `free` slots open over the three nodes
            take = min(left, slots[0])
            load[node_id] -= take
            left -= take
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            now = time.time()
            rows = store.nodes()
            views = [
                NodeView(
                    n.node_id,
                    n.url,
                    n.capacity,
                    load[n.node_id],
                    is_healthy(n.last_heartbeat, now, 15.0),
                    False,
                )
                for n in rows
            ]
            store.load_by_node()
            store.on_nodes()
            queue = store.queued(sum(v.capacity - v.load for v in views))
            placed = place([s.session_id for s in queue], views)
            samples.append((time.perf_counter() - start) / max(1, len(placed)))
            assert len(placed) == free, (len(placed), free)
        return statistics.median(samples)
    finally:
        store.close()


def _scheduler(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for depth in (100, 1_000, 10_000):
            rows.append(
                {
                    "depth": depth,
                    "one": _decision_cost(depth, 1, args.decisions, Path(tmp)),
                    "burst": _decision_cost(depth, 24, args.decisions, Path(tmp)),
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["all", "scaling", "scheduler"], default="all")
    ap.add_argument("--capacity", type=int, default=4, help="sessions each gateway node runs at once")
    ap.add_argument("--service-s", type=float, default=3.0, help="each session's fixed service time")
    ap.add_argument("--waves", type=int, default=3, help="full waves of sessions per run")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per node count (median)")
    ap.add_argument("--decisions", type=int, default=200, help="timed scheduling decisions per depth")
    args = ap.parse_args()
    if args.part in ("all", "scaling"):
        rows = asyncio.run(_scaling(args))
        base = rows[0]["per_hour"]
        print(
            f"\nsessions of {args.service_s:g} s, {args.capacity} per gateway node, {args.waves} waves per run"
        )
        print("| Ray nodes | sessions/run | wall s (median) | sessions/hour | ideal | scaling efficiency |")
        print("|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            eff = r["per_hour"] / (r["nodes"] * base)
            print(
                f"| {r['nodes']} | {r['sessions']} | {r['wall']:.2f} | {r['per_hour']:,.0f} | "
                f"{r['ideal_per_hour']:,.0f} | {eff:.0%} |"
            )
    if args.part in ("all", "scheduler"):
        rows = _scheduler(args)
        print("\nscheduler: cost per decision (median of", args.decisions, "ticks)")
        print("| queued sessions | 1 free slot (µs/decision) | 24 free slots (µs/decision) |")
        print("|---:|---:|---:|")
        for r in rows:
            print(f"| {r['depth']:,} | {r['one'] * 1e6:,.0f} | {r['burst'] * 1e6:,.0f} |")


if __name__ == "__main__":
    main()
