"""Training cost of one GRPO step: the same sessions as per_request vs prefix_merging traces, side by side.

Sessions come from the trajectory benchmark's generator (`bench/trajectory.py`: ChatML-shaped coding
sessions with subagents, side calls, retries and drift), with every text length scaled down so a step fits
a CPU (default: 8 sessions of 10-20 calls, contexts up to ~2k tokens). Both strategies then train the same
randomly initialized Qwen3-architecture model, from the same weights, with the project's own pieces:
`polar.train.packing` (traces packed into rows with per-trace attention, logits only at response positions)
and `polar.train.loss` (PPO-clip with TIS, token_mean over the step's trainable tokens, gradient
accumulation over micro-batches), then one AdamW step. Steps alternate between the strategies so that
whatever else the machine does weighs on both alike.

Token ids are folded into the model's vocabulary (id mod vocab): which token sits at a position changes
nothing in the cost, and a 152k vocabulary would make a model this small spend nearly all its time in the
output layer, unlike a real one (Qwen3-4B: about a tenth of its parameters).

    .venv/bin/python bench/train.py [--sessions 8] [--steps 2] [--scale 0.08] [--hidden 128] [--layers 4]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from polar.store.records import CompletionRecord
from polar.train.loss import LossConfig, policy_loss
from polar.train.packing import PackedBatch, pack, response_logprobs
from polar.trajectory import Trace, build
from trajectory import PROFILES, SessionMaker, _Tokens

STRATEGIES = ("per_request", "prefix_merging")


class ScaledTokens(_Tokens):
    """The generator's text spans, `scale` times as long (at least one token)."""

    def __init__(self, rng: random.Random, scale: float) -> None:
        super().__init__(rng)
        self.scale = scale

    def text(self, lo: int, hi: int) -> list[int]:
        return super().text(max(1, round(lo * self.scale)), max(1, round(hi * self.scale)))


def make_sessions(n: int, calls: tuple[int, int], scale: float, seed: int) -> list[list[CompletionRecord]]:
    rng = random.Random(seed)
    profile = dataclasses.replace(PROFILES["paper"], calls=calls)
    sessions = []
    for i in range(n):
        maker = SessionMaker(rng, profile, f"s{i}")
        maker.t = ScaledTokens(rng, scale)
        sessions.append(maker.make())
    return sessions


@dataclasses.dataclass
class Step:
    """What one strategy's training step processed, and how long each took."""

    traces: int = 0
    tokens: int = 0  # prompt + response tokens through the model
    padded: int = 0  # row slots including padding
    rows: int = 0
    logits: int = 0  # positions projected onto the vocabulary (every response token)
    trainable: int = 0
    seconds: list[float] = dataclasses.field(default_factory=list)
    cpu: list[float] = dataclasses.field(default_factory=list)  # process CPU time: less sensitive to load
    losses: list[float] = dataclasses.field(default_factory=list)


def micro_batches(
    traces: Sequence[Trace], max_len: int, budget: int, vocab: int
) -> list[tuple[PackedBatch, list[Trace]]]:
    """Consecutive traces packed into micro-batches of at most `budget` tokens (rows of `max_len`)."""
    out: list[tuple[PackedBatch, list[Trace]]] = []
    group: list[Trace] = []
    size = 0
    for t in [*traces, None]:
        n = 0 if t is None else len(t.prompt_ids) + len(t.response_ids)
        if group and (t is None or size + n > budget):
            seqs = [([i % vocab for i in g.prompt_ids], [i % vocab for i in g.response_ids]) for g in group]
            out.append((pack(seqs, max_len), group))
            group, size = [], 0
        if t is not None:
            group.append(t)
            size += n
    return out


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple[PackedBatch, list[Trace]]],
    advantages: dict[int, float],
    config: LossConfig,
) -> tuple[float, float, float]:
    """One optimizer step over all micro-batches (gradient accumulation); returns (wall s, CPU s, loss)."""
    trainable = sum(sum(t.loss_mask) for _, group in batches for t in group)
    total = 0.0
    t0, c0 = time.perf_counter(), time.process_time()
    optimizer.zero_grad(set_to_none=True)
    for batch, group in batches:
        logprobs = response_logprobs(model, batch)
        loss, _ = policy_loss(
            logprobs,
            batch.flat([t.response_logprobs or [0.0] * len(t.response_ids) for t in group], torch.float32),
            batch.flat([advantages[id(t)] for t in group], torch.float32),
            batch.flat([t.loss_mask for t in group], torch.float32),
            config,
            old_logprobs=logprobs.detach(),
            denominator=float(trainable),
        )
        loss.backward()
        total += float(loss.detach())
    optimizer.step()
    return time.perf_counter() - t0, time.process_time() - c0, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--calls", type=int, nargs=2, default=(10, 20), metavar=("MIN", "MAX"))
    ap.add_argument("--scale", type=float, default=0.08, help="text length factor on bench/trajectory.py's")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per strategy")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=8192, help="tokens per micro-batch")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    sessions = make_sessions(args.sessions, tuple(args.calls), args.scale, args.seed)
    rng = random.Random(args.seed)
    session_adv = [rng.choice((-1.0, 1.0)) * rng.uniform(0.5, 1.5) for _ in sessions]
    traces: dict[str, list[Trace]] = {}
    advantages: dict[int, float] = {}
    for strategy in STRATEGIES:
        traces[strategy] = []
        for records, adv in zip(sessions, session_adv, strict=True):
            for t in build(records, strategy).traces:
                if any(t.loss_mask):
                    traces[strategy].append(t)
                    advantages[id(t)] = adv  # a trajectory's traces share its advantage
    longest = max(len(t.prompt_ids) + len(t.response_ids) for ts in traces.values() for t in ts)
    max_len = -(-longest // 64) * 64

    torch.manual_seed(args.seed)
    heads = max(1, args.hidden // 64)
    config = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
    )
    base = Qwen3ForCausalLM(config).float()
    base.config._attn_implementation = "sdpa"
    models = {s: copy.deepcopy(base) for s in STRATEGIES}
    optimizers = {s: torch.optim.AdamW(models[s].parameters(), lr=1e-4) for s in STRATEGIES}
    loss_config = LossConfig()

    steps: dict[str, Step] = {}
    batches = {}
    for s in STRATEGIES:
        batches[s] = micro_batches(traces[s], max_len, max(args.budget, max_len), args.vocab)
        st = steps[s] = Step(traces=len(traces[s]))
        for b, group in batches[s]:
            st.rows += b.input_ids.shape[0]
            st.padded += b.input_ids.numel()
            st.tokens += sum(len(t.prompt_ids) + len(t.response_ids) for t in group)
            st.logits += sum(len(t.response_ids) for t in group)
            st.trainable += sum(sum(t.loss_mask) for t in group)
    for k in range(args.steps):
        for s in STRATEGIES if k % 2 == 0 else reversed(STRATEGIES):
            seconds, cpu, loss = train_step(models[s], optimizers[s], batches[s], advantages, loss_config)
            steps[s].losses.append(loss)
            steps[s].seconds.append(seconds)
            steps[s].cpu.append(cpu)
            print(
                f"  step {k + 1} {s:15} {seconds:7.2f} s  {cpu:7.2f} CPU s  loss {loss:+.6f}", file=sys.stderr
            )

    calls = [len(r) for r in sessions]
    params = sum(p.numel() for p in base.parameters())
    pr, pm = steps["per_request"], steps["prefix_merging"]
    print(
        f"{args.sessions} sessions (seed {args.seed}): {sum(calls)} calls, {min(calls)}-{max(calls)} per session, "
        f"longest trace {longest:,} tokens; Qwen3 architecture, hidden {args.hidden}, {args.layers} layers, "
        f"vocab {args.vocab} ({params / 1e6:.1f} M parameters), fp32, {torch.get_num_threads()} CPU threads, "
        f"rows of {max_len}, micro-batches of <= {max(args.budget, max_len):,} tokens"
    )
    print()

    def line(label: str, a: float, b: float, fmt: str, ratio: bool = True) -> None:
        r = f"{a / b:>9.2f}x" if ratio and b else ""
        print(f"{label:40}{a:>16{fmt}}{b:>16{fmt}}{r}")

    print(f"{'':40}{'per_request':>16}{'prefix_merging':>16}{'ratio':>10}")
    line("traces (trainer samples) per step", pr.traces, pm.traces, ",.0f")
    line("tokens processed per step", pr.tokens, pm.tokens, ",.0f")
    line("row slots incl. padding", pr.padded, pm.padded, ",.0f")
    line("logit positions (response tokens)", pr.logits, pm.logits, ",.0f")
    line("trainable tokens", pr.trainable, pm.trainable, ",.0f", ratio=False)
    n = args.steps
    # Best of n, as in bench/trajectory.py: on a shared machine other jobs only ever add time.
    wall = min(pr.seconds), min(pm.seconds)
    cpu_s = min(pr.cpu), min(pm.cpu)
    line(f"wall-clock per step, s (best of {n})", *wall, ".2f")
    line(f"CPU time per step, s (best of {n})", *cpu_s, ".2f")
    line("tokens per wall-clock second", pr.tokens / wall[0], pm.tokens / wall[1], ",.0f", ratio=False)
    print(f"{'wall-clock of each step, s':40}{_each(pr.seconds):>16}{_each(pm.seconds):>16}")
    print(f"{'loss at the first step (same weights)':40}{pr.losses[0]:>+16.6f}{pm.losses[0]:>+16.6f}")


def _each(values: Sequence[float]) -> str:
    return " ".join(f"{v:.1f}" for v in values)


if __name__ == "__main__":
    main()
