"""Trajectory reconstruction benchmark: per_request vs prefix_merging on synthetic coding sessions.

Sessions are shaped like the ones Polar reports (50-200 calls; Polar's offline data averaged 104 messages
and 51 assistant turns per session) with ChatML-like token structure: a system prompt with tool schemas,
a task, then assistant turns (reasoning + a tool call, closed by <|im_end|>) and tool results, the
context growing until the harness compacts it at 32k tokens. Interleaved with the main loop: subagents
(own system prompt, their own tool loop), one-shot side calls (titles, topic checks), retries of an
identical prompt, and the occasional re-rendering that differs from the sampled turn (context drift).

Prints one table, both strategies side by side: traces and tokens a trainer processes (with ratios),
coverage, the audit, and build throughput in captured prompt tokens per second on one core.

    PYTHONPATH=src .venv/bin/python bench/trajectory.py [--sessions 24] [--seed 0] [--profile paper]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from polar.store.records import CompletionRecord
from polar.trajectory import audit, build

IM_START, IM_END, NL, ASSISTANT, USER, SYSTEM = 151644, 151645, 198, 77091, 872, 8948
VOCAB = 150_000
CONTEXT = 32_768


@dataclass(frozen=True)
class Profile:
    calls: tuple[int, int] = (50, 200)
    subagent: float = 0.03  # chance per main turn that a subagent runs next
    subagent_calls: tuple[int, int] = (3, 12)
    side_call: float = 0.04  # one-shot side calls (title generation, topic checks)
    retry: float = 0.02
    drift: float = 0.01  # the harness re-renders a sampled turn differently in the next prompt


PROFILES = {
    "paper": Profile(),
    "harsh": Profile(subagent=0.08, side_call=0.12, retry=0.05, drift=0.05),
}


class _Tokens:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def text(self, lo: int, hi: int) -> list[int]:
        return [self.rng.randrange(1000, VOCAB) for _ in range(self.rng.randint(lo, hi))]


class SessionMaker:
    """One synthetic session's records, in call order."""

    def __init__(self, rng: random.Random, profile: Profile, session_id: str) -> None:
        self.rng, self.p, self.sid = rng, profile, session_id
        self.t = _Tokens(rng)
        self.records: list[CompletionRecord] = []

    def _header(self, role: int) -> list[int]:
        return [IM_START, role, NL]

    def _message(self, role: int, body: list[int]) -> list[int]:
        return [*self._header(role), *body, IM_END, NL]

    def _call(self, prompt: list[int], system: str) -> list[int]:
        """Record one call; returns the sampled turn (reasoning + tool call + <|im_end|>)."""
        turn = [*self.t.text(40, 500), IM_END]
        finish = "tool_calls"
        if self.rng.random() < 0.02:  # truncated at max_tokens
            turn, finish = turn[: self.rng.randint(1, len(turn) - 1)], "length"
        seq = len(self.records)
        self.records.append(
            CompletionRecord(
                session_id=self.sid,
                seq=seq,
                completion_id=f"{self.sid}-{seq}",
                dialect="chat",
                created_at=float(seq),
                request={},
                # Only the system message: reconstruction reads it to tell compaction from a new agent.
                upstream_request={"messages": [{"role": "system", "content": system}]},
                prompt_ids=prompt,
                response_ids=turn,
                response_logprobs=[-self.rng.random() for _ in turn],
                finish_reason=finish,
                response_message={"role": "assistant", "content": None},
                tools=None,
                usage={"prompt_tokens": len(prompt), "completion_tokens": len(turn)},
                model_requested="policy",
                model_served="policy",
            )
        )
        return turn

    def _agent(self, system: list[int], calls: int, main: bool) -> None:
        name = "main" if main else f"subagent-{len(self.records)}"
        task = self._message(USER, self.t.text(100, 600))
        context = [*system, *task]
        while calls > 0:
            prompt = [*context, *self._header(ASSISTANT)]
            turn = self._call(prompt, name)
            calls -= 1
            if calls and self.rng.random() < self.p.retry:
                turn = self._call(prompt, name)  # same prompt again; the harness keeps the second answer
                calls -= 1
            rendered = turn if turn[-1] == IM_END else [*turn, IM_END]
            if self.rng.random() < self.p.drift:  # e.g. the template drops the reasoning from history
                rendered = rendered[len(rendered) // 2 :]
            result = self._message(USER, self.t.text(30, 1500))
            context = [*prompt, *rendered, NL, *result]
            if len(context) > CONTEXT:  # compaction: system prompt + a summary of the work so far
                context = [*system, *self._message(USER, self.t.text(800, 2000))]
            while main and calls > 2 and self.rng.random() < self.p.subagent:
                n = min(calls - 1, self.rng.randint(*self.p.subagent_calls))
                self._agent(self._message(SYSTEM, self.t.text(800, 2500)), n, main=False)
                calls -= n
            if main and calls > 1 and self.rng.random() < self.p.side_call:
                side = [*self._message(SYSTEM, self.t.text(50, 200)), *task, *self._header(ASSISTANT)]
                self._call(side, "side")
                calls -= 1

    def make(self) -> list[CompletionRecord]:
        system = self._message(SYSTEM, self.t.text(3000, 6000))  # instructions + tool schemas
        self._agent(system, self.rng.randint(*self.p.calls), main=True)
        return self.records


def _timed(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="paper")
    ap.add_argument("--repeat", type=int, default=3, help="timing repeats per build (best is kept)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    sessions = [SessionMaker(rng, PROFILES[args.profile], f"s{i}").make() for i in range(args.sessions)]
    rows: dict[str, dict[str, float]] = {}
    for strategy in ("per_request", "prefix_merging"):
        traces = tokens = trainable = sampled = prompt_tokens = 0
        seconds = audit_seconds = 0.0
        audits_ok = True
        breaks: dict[str, int] = {}
        for records in sessions:
            trajectory = build(records, strategy)
            seconds += _timed(lambda r=records, s=strategy: build(r, s), args.repeat)  # type: ignore[misc]
            t0 = time.perf_counter()
            report = audit(trajectory, records)
            audit_seconds += time.perf_counter() - t0
            audits_ok &= report.ok
            m = trajectory.metadata
            traces += m["traces"]
            tokens += m["trainer_tokens"]
            trainable += m["trainable_tokens"]
            sampled += m["sampled_tokens"]
            prompt_tokens += m["prompt_tokens"]
            for cause, n in m.get("breaks", {}).items():
                breaks[cause] = breaks.get(cause, 0) + n
        rows[strategy] = {
            "traces": traces,
            "tokens": tokens,
            "coverage": trainable / sampled,
            "throughput": prompt_tokens / seconds,
            "audit_throughput": prompt_tokens / audit_seconds,
            "audit_ok": audits_ok,
            "prompt_tokens": prompt_tokens,
            "breaks": breaks,  # type: ignore[dict-item]
        }
    calls = [len(s) for s in sessions]
    pr, pm = rows["per_request"], rows["prefix_merging"]
    print(
        f"{args.sessions} sessions ({args.profile} profile, seed {args.seed}): {sum(calls)} calls, "
        f"{min(calls)}-{max(calls)} per session (mean {statistics.mean(calls):.0f}), "
        f"{pr['prompt_tokens'] / 1e6:.1f} M prompt tokens captured"
    )
    print()
    print(f"{'':34}{'per_request':>16}{'prefix_merging':>16}{'ratio':>10}")
    print(
        f"{'traces (trainer samples)':34}{pr['traces']:>16,.0f}{pm['traces']:>16,.0f}{pr['traces'] / pm['traces']:>9.2f}x"
    )
    print(
        f"{'tokens a trainer processes':34}{pr['tokens']:>16,.0f}{pm['tokens']:>16,.0f}{pr['tokens'] / pm['tokens']:>9.2f}x"
    )
    print(f"{'trainable-token coverage':34}{pr['coverage']:>16.6f}{pm['coverage']:>16.6f}")
    print(f"{'audit passes':34}{pr['audit_ok']!s:>16}{pm['audit_ok']!s:>16}")
    print(
        f"{'build, M prompt tokens/s (1 core)':34}{pr['throughput'] / 1e6:>16.1f}{pm['throughput'] / 1e6:>16.1f}"
    )
    print(
        f"{'audit, M prompt tokens/s':34}{pr['audit_throughput'] / 1e6:>16.1f}{pm['audit_throughput'] / 1e6:>16.1f}"
    )
    print(f"prefix_merging chain breaks by cause: {pm['breaks']}")
    print()
    print("linearity: prefix_merging build time against session size (same generator)")
    print(f"{'calls':>8}{'M prompt tokens':>18}{'build ms':>12}{'M tokens/s':>14}")
    for n in (50, 100, 200):
        maker = SessionMaker(random.Random(args.seed + n), PROFILES[args.profile], f"lin{n}")
        maker.p = Profile(**{**PROFILES[args.profile].__dict__, "calls": (n, n)})
        records = maker.make()
        tokens_in = sum(len(r.prompt_ids or ()) for r in records)
        s = _timed(lambda r=records: build(r), args.repeat)  # type: ignore[misc]
        print(f"{n:>8}{tokens_in / 1e6:>18.2f}{s * 1e3:>12.1f}{tokens_in / s / 1e6:>14.1f}")


if __name__ == "__main__":
    main()
