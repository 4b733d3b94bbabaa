"""Image-aware placement against load-only placement: image fetches per node, time to first session, how
busy the pipeline is, and the makespan, for GRPO groups whose tasks run in several container images.

    .venv/bin/python bench/placement.py                 # 3 nodes x 4 slots, 30 tasks x 4 samples, 8 images
    .venv/bin/python bench/placement.py --tasks 24 --images 24 --samples 8 --capacity 8   # SWE-bench shape
    .venv/bin/python bench/placement.py --pull-s 300 --seeds 9 --locality-wait-s 120

No registry answers on this machine, and three nodes here would share one docker daemon (one image store),
so fetches are simulated; the decisions are not. A discrete-event loop on a simulated clock calls the
server's own `scheduler.place` and `scheduler.prefetch` exactly as `Dispatcher.tick` does, once per
`--tick-s`, with node views as the last heartbeat (every `--heartbeat-s`) reported them:

- *load only* (before): `place(queue, nodes)`, no prefetch; a session placed where its image is missing
  makes the node pull it (as `docker run` does) and holds its slot until the image is there.
- *image-aware* (now): `place(queue, nodes, needs, placed)` and `prefetch(queued images, nodes)`, the
  requests delivered with the next heartbeat's answer, as the node's `ImageInventory` takes them.

A node pulls one image at a time (a pull competes for its disk and network), each taking `--pull-s` times
a per-image size factor (0.5-2.0); sessions run a lognormal time (median `--session-s`). Each node starts
holding `--held` random images (2). The figures are medians over `--seeds` workloads; both policies see the same
workload per seed. What this leaves out: image layers shared between images, registry rate limits,
sessions' own start-up (the same under both).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from polar.rollout.server.scheduler import Image, Need, NodeView, place, prefetch, with_arrivals  # noqa: E402


@dataclass
class Session:
    sid: str
    group: str
    image: Image
    duration: float
    node: str | None = None
    started: float | None = None  # the agent runs (its image is there)
    ended: float | None = None


@dataclass
class SimNode:
    node_id: str
    capacity: int
    held: set[Image]
    pulls: deque[Image] = field(default_factory=deque)  # waiting to be pulled, in order
    pulling: tuple[Image, float] | None = None  # (image, done at)
    fetches: int = 0
    seen: NodeView | None = None  # what its last heartbeat told the server

    def want(self, image: Image) -> None:
        if (
            image not in self.held
            and image not in self.pulls
            and (self.pulling is None or self.pulling[0] != image)
        ):
            self.pulls.append(image)

    def fetching(self) -> set[Image]:
        return set(self.pulls) | ({self.pulling[0]} if self.pulling else set())


@dataclass(frozen=True)
class Workload:
    sessions: list[Session]
    held: list[set[Image]]
    pull_s: dict[Image, float]


def workload(seed: int, args: argparse.Namespace) -> Workload:
    rng = random.Random(seed)
    images = [("docker", f"swe/instance-{i}:1") for i in range(args.images)]
    sessions = []
    for t in range(args.tasks):
        image = rng.choice(images)
        for k in range(args.samples):
            duration = args.session_s * rng.lognormvariate(0.0, 0.5)
            sessions.append(Session(f"t{t}-{k}", f"t{t}", image, duration))
    held = [set(rng.sample(images, min(args.held, len(images)))) for _ in range(args.nodes)]
    pull_s = {i: args.pull_s * rng.uniform(0.5, 2.0) for i in images}
    return Workload(sessions, held, pull_s)


def simulate(w: Workload, args: argparse.Namespace, aware: bool) -> dict[str, float | list[int]]:
    sessions = [Session(s.sid, s.group, s.image, s.duration) for s in w.sessions]
    nodes = [SimNode(f"n{i}", args.capacity, set(h)) for i, h in enumerate(w.held)]
    by_id = {n.node_id: n for n in nodes}
    queue = deque(sessions)
    asked: dict[str, list[Image]] = {}
    passed_over: dict[str, float] = {}  # session -> when placement first passed it over for locality
    now, next_beat, busy = 0.0, 0.0, 0.0
    while any(s.ended is None for s in sessions):
        for n in nodes:  # pulls finish, waiting sessions start
            if n.pulling and n.pulling[1] <= now:
                n.held.add(n.pulling[0])
                n.pulling = None
            if n.pulling is None and n.pulls:
                image = n.pulls.popleft()
                n.pulling = (image, now + w.pull_s[image])
                n.fetches += 1
        for s in sessions:
            if s.node and s.started is None and s.image in by_id[s.node].held:
                s.started = now
            if s.started is not None and s.ended is None and s.started + s.duration <= now:
                s.ended = now
                busy += s.duration
        if now >= next_beat:  # heartbeats: the server's view, and the prefetch requests it answers with
            for n in nodes:
                for image in asked.get(n.node_id, []) if aware else []:
                    n.want(image)
                load = sum(1 for s in sessions if s.node == n.node_id and s.ended is None)
                n.seen = NodeView(
                    n.node_id, "", n.capacity, load, True, False,
                    images=frozenset(n.held), fetching=frozenset(n.fetching()), engines=frozenset({"docker"}),
                )  # fmt: skip
            next_beat += args.heartbeat_s
        views = []
        for n in nodes:  # the server counts its own placements exactly; images as last reported
            assert n.seen is not None
            load = sum(1 for s in sessions if s.node == n.node_id and s.ended is None)
            views.append(NodeView(n.node_id, "", n.capacity, load, True, False, images=n.seen.images,
                                  fetching=n.seen.fetching, engines=n.seen.engines))  # fmt: skip
        free = sum(v.capacity - v.load for v in views)
        # As Dispatcher.tick: the head of the queue (the free slots, and as many again to look past
        # sessions waiting for their image's node), placed; the images of what still waits, prefetched.
        head = list(queue)[: free + (sum(v.capacity for v in views) if aware else 0)]
        needs = {s.sid: Need(s.image, s.group) for s in head} if aware else None
        placed: dict[str, Counter[str]] = {}
        for s in sessions:
            if s.node and s.ended is None:
                placed.setdefault(s.group, Counter())[s.node] += 1
        if aware:
            views = with_arrivals(views, [(s.node, s.image) for s in sessions if s.node and s.ended is None])
        skipped: set[str] = set()
        waited = {sid: now - t for sid, t in passed_over.items()}
        chosen = dict(
            place([s.sid for s in head], views, needs, placed, waited=waited,
                  locality_wait_s=args.locality_wait_s, skipped=skipped)
            if aware
            else place([s.sid for s in head], views)
        )  # fmt: skip
        for sid in skipped:
            passed_over.setdefault(sid, now)
        for s in head:
            if s.sid in chosen:
                s.node = chosen[s.sid]
                queue.remove(s)
                by_id[s.node].want(s.image)  # a container start pulls what is missing
        if aware:
            arrived = with_arrivals(
                views, [(node, needs[sid].image) for sid, node in chosen.items()] if needs else []
            )
            asked = prefetch([s.image for s in head if s.sid not in chosen], arrived)
        now += args.tick_s
    makespan = max(s.ended or 0.0 for s in sessions)
    return {
        "fetches": [n.fetches for n in nodes],
        "first": min(s.started or makespan for s in sessions),
        "busy": busy / (makespan * args.nodes * args.capacity),
        "makespan": makespan,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--capacity", type=int, default=4)
    ap.add_argument("--tasks", type=int, default=30)
    ap.add_argument("--samples", type=int, default=4, help="Sessions per task (the GRPO group).")
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--held", type=int, default=2, help="Images each node holds at the start (random).")
    ap.add_argument("--pull-s", type=float, default=90.0, help="Seconds a pull of an average image takes.")
    ap.add_argument("--session-s", type=float, default=60.0, help="Median seconds an agent runs.")
    ap.add_argument("--tick-s", type=float, default=1.0)
    ap.add_argument("--heartbeat-s", type=float, default=5.0)
    ap.add_argument(
        "--locality-wait-s",
        type=float,
        default=60.0,
        help="How long a session waits for a node holding its image (the server's setting).",
    )
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()

    runs: dict[str, list[dict[str, float | list[int]]]] = {"load only": [], "image-aware": []}
    for seed in range(args.seeds):
        w = workload(seed, args)
        runs["load only"].append(simulate(w, args, aware=False))
        runs["image-aware"].append(simulate(w, args, aware=True))

    def med(policy: str, key: str) -> float:
        return statistics.median(float(r[key]) for r in runs[policy])  # type: ignore[arg-type]

    def fetch_line(policy: str) -> str:
        per_node = [sorted(r["fetches"]) for r in runs[policy]]  # type: ignore[type-var]
        med_nodes = [statistics.median(f[i] for f in per_node) for i in range(args.nodes)]
        return " / ".join(f"{x:g}" for x in med_nodes)

    print(
        f"{args.nodes} nodes x {args.capacity} slots, {args.tasks} tasks x {args.samples} samples over "
        f"{args.images} images, pull {args.pull_s:g} s (x0.5-2.0), sessions {args.session_s:g} s median, "
        f"medians of {args.seeds} seeds"
    )
    print("| | load only (before) | image-aware (now) | ratio |")
    print("|---|---|---|---|")
    totals = {p: statistics.median(sum(r["fetches"]) for r in runs[p]) for p in runs}  # type: ignore[arg-type]
    print(f"| image fetches in all | {totals['load only']:g} | {totals['image-aware']:g} | "
          f"{totals['image-aware'] / totals['load only']:.2f}x |")  # fmt: skip
    print(f"| fetches per node (sorted) | {fetch_line('load only')} | {fetch_line('image-aware')} | |")
    for key, label, unit in (
        ("first", "time to first session", " s"),
        ("busy", "pipeline busy fraction", ""),
        ("makespan", "makespan", " s"),
    ):
        a, b = med("load only", key), med("image-aware", key)
        fmt = (lambda x: f"{x:.2f}") if key == "busy" else (lambda x: f"{x:.0f}")
        print(
            f"| {label} | {fmt(a)}{unit} | {fmt(b)}{unit} | {b / a:.2f}x |"
            if a
            else f"| {label} | {a} | {b} | |"
        )


if __name__ == "__main__":
    main()
