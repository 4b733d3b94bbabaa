"""The `qwen_code` preset: Qwen Code, unmodified, speaking OpenAI Chat (streamed) to the gateway.

    agent: {harness: qwen_code, settings: {extra_args: [], config: {memory: {enableManagedAutoMemory: true}}}}

Qwen Code reads its provider from OPENAI_BASE_URL / OPENAI_API_KEY / OPENAI_MODEL (set by `gateway_env`), and
every background agent (memory extraction, dream, title, recap) uses the main model unless `fastModel` is set,
which the preset leaves empty. Setup writes `$HOME/.qwen/settings.json` in the session's home (a task's
`agent.mcp_servers` as its `mcpServers`; its `agent.skills` in `~/.qwen/skills`); `config` is deep-merged
over it. The CLI's chat transcripts and debug logs are copied into the artifacts after the run.

Qwen re-serializes tool-call arguments compactly and sends tool results as arrays of text parts when it
replays history, so its history is not the model's text token for token: trajectories rely on the server's
prompt ids and the recorded sampled ids, never on re-rendering these messages.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from polar.harness.base import Extensions, HarnessContext, gateway_env
from polar.harness.cli_common import (
    collect,
    deep_merge,
    extra_args_and_config,
    node_cli,
    texts,
    under,
    write_json,
)
from polar.harness.extensions import stdio_entries, write_skills
from polar.jsontypes import JSON
from polar.runtime.base import Runtime
from polar.store.records import CompletionRecord

PACKAGE = "@qwen-code/qwen-code"
VERSION = "0.24.4"
BINARY = "qwen"
DIALECT = "chat"
CONFIGURES = (
    "~/.qwen/settings.json (no usage statistics/telemetry/auto-update, managed auto-memory off); "
    "OPENAI_BASE_URL=<gateway>/v1, OPENAI_API_KEY, OPENAI_MODEL; `--yolo -p`"
)
LIMITS = (
    "background agents (memory extraction if re-enabled, dream, title, recap) use the served model, tagged; "
    "subagents and forks (`agent`) are tagged subagent, JSON side queries (the next-speaker check, off by "
    "default) side_call; after finish_reason=length it resends the same prompt with max_tokens=64000 (0.24.4 "
    "asks 32000 first; cut by the gateway to what the server's context holds, flagged max_tokens_clamped; the "
    "cut answer is tagged dead_branch, builder_options.dead_branches masks or drops it), then adds 'Output "
    "token limit hit' recovery turns; MCP tools are deferred: the model calls them through `tool_call` by the "
    "name a reminder lists"
)
EXTENSIONS = Extensions(
    mcp="~/.qwen/settings.json `mcpServers` (command, args, env); 0.24.4 defers their tools: a reminder "
    "names them and the model calls them through `tool_call`",
    tool_name="mcp__{server}__{tool}",
    skills="~/.qwen/skills/<name>/SKILL.md",
)

# The main loop's system prompt opens "You are Qwen Code, <role> developed by Alibaba Group, ...": 0.15.10's role
# is "an interactive CLI agent" in every mode; 0.24 says "a non-interactive CLI agent" under `-p` ("an
# interactive CLI agent" in its UI, "a CLI agent operating through an ACP host" under ACP). Recorded 0.24.4
# calls carry the same headers and body fields whoever makes them, and the tool set is no sign either (a
# general-purpose subagent gets `agent` too), so the prompt is the signal; a system prompt replaced through
# QWEN_SYSTEM_MD loses it. A call with tools and another system prompt is a subagent (the `agent` tool),
# unless it is one of the background agents below.
MAIN_PROMPT = re.compile(r"You are Qwen Code, [^.\n]{1,80} developed by Alibaba Group\b")
# 0.24: `agent` with subagent_type "fork" runs a worker on the main loop's own system prompt and history,
# told apart only by the user message that starts its task (FORK_BOILERPLATE_TAG in the CLI's fork-subagent.ts).
FORK_TASK = "<fork-boilerplate>"
# 0.24.4 first compacts on the main loop's own prompt and tools ("cache sharing", with an OpenAI-compatible
# provider: `supportsCompressionCacheSharing`), the history plus one user message of the summarizer's prompt and
# this sentence; only when that answer has no <state_snapshot> does it fall back to the tool-less summarizer.
COMPACTION_FORK = "Do not call tools; tool execution is disabled for this request."
# Both: a JSON side query (next-speaker check, permission classifier, memory recall) offers only this tool and
# forces a call of it; the next-speaker check sends no system prompt at all.
JSON_TOOL = "respond_in_schema"
# 0.15.10 and 0.24: the system prompts of its background calls. Memory extraction runs after a turn that ends
# without tool calls, with tools (read_file, write_file, ...), so tools alone do not tell it from the main loop.
SIDE_CALLS = {
    "You are now acting as the managed memory extraction subagent": "memory_extraction",
    "You are performing a managed memory dream": "memory_dream",
    "You are selecting memories that will be useful": "memory_recall",
    "You are reviewing this conversation to extract reusable skills": "skill_review",
    "Generate a concise, sentence-case title": "title",
    "You generate session recaps": "recap",
    "Write a short summary label describing what these tool calls accomplished": "tool_summary",
    # Auto-compression, no tools: 0.15.10 (model.chatCompression.contextPercentageThreshold of the window)...
    "You are the component that summarizes internal chat history": "compaction",
    # ...and 0.24 (context.autoCompactThreshold; the history, then "First, reason in your <analysis> block").
    "You are the component that summarizes a conversation when its context window": "compaction",
}


def cli_settings() -> dict[str, Any]:
    """The preset's `settings.json` (Qwen Code adds `$version` itself on first start)."""
    return {
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "general": {"enableAutoUpdate": False},
        # Else a background "memory extraction" agent call follows every turn that ends the run.
        "memory": {"enableManagedAutoMemory": False},
    }


def _text(content: JSON) -> str:
    return "".join(texts(content))  # Qwen Code sends user and tool text as arrays of parts


def _system_text(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    first = messages[0] if isinstance(messages, list) and messages else None
    if not isinstance(first, dict) or first.get("role") != "system":
        return ""
    return _text(first.get("content"))


def _is_fork(body: dict[str, Any]) -> bool:
    messages = body.get("messages")
    return isinstance(messages, list) and any(
        isinstance(m, dict) and m.get("role") == "user" and _text(m.get("content")).startswith(FORK_TASK)
        for m in messages
    )


def mcp_settings(ctx: HarnessContext) -> dict[str, Any]:
    """The task's MCP servers as settings.json's `mcpServers` (nothing when it gives none)."""
    return {"mcpServers": stdio_entries(ctx.mcp_servers)} if ctx.mcp_servers else {}


class QwenCodeHarness:
    name = "qwen_code"
    extensions = EXTENSIONS

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        self.extra_args, self.config = extra_args_and_config(self.name, settings)
        self.binary: Path | None = None

    async def setup(self, runtime: Runtime, ctx: HarnessContext) -> None:
        self.binary = Path(await node_cli(runtime, self.name, PACKAGE, VERSION, BINARY))
        config = deep_merge(cli_settings() | mcp_settings(ctx), self.config)
        await write_json(runtime, under(ctx.home, ".qwen/settings.json"), config)
        await write_skills(runtime, under(ctx.home, ".qwen/skills"), ctx.skills)

    def command(self, ctx: HarnessContext) -> list[str]:
        if self.binary is None:
            raise RuntimeError(f"{self.name} harness: command() before setup() installed the CLI")
        # --yolo: headless Qwen Code has no one to approve its shell and write tools.
        return [str(self.binary), "--yolo", *self.extra_args, "-p", ctx.instruction]

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        return {**gateway_env(ctx), **ctx.env}

    async def post_run(self, runtime: Runtime, ctx: HarnessContext) -> dict[str, Any]:
        return await collect(runtime, ctx, "qwen", [".qwen/projects", ".qwen/debug"])

    def classify(self, record: CompletionRecord) -> tuple[str, ...]:
        body = record.request if isinstance(record.request, dict) else {}
        system = _system_text(body)
        kind = next((k for marker, k in SIDE_CALLS.items() if marker in system[:400]), None)
        if kind is not None:
            return ("side_call", kind)
        if not record.tools:
            return ("side_call", "no_tools")
        if [t.get("function", {}).get("name") for t in record.tools] == [JSON_TOOL]:
            return ("side_call", "json_query")
        if _last_user_has(body, COMPACTION_FORK):
            return ("side_call", "compaction")
        if not MAIN_PROMPT.match(system) or _is_fork(body):
            return ("subagent",)
        return ()


def _last_user_has(body: dict[str, Any], marker: str) -> bool:
    """Whether the request's last message is a user message whose text holds `marker`."""
    messages = body.get("messages") or []
    last = messages[-1] if messages else None
    return (
        isinstance(last, dict)
        and last.get("role") == "user"
        and any(marker in t for t in texts(last.get("content")))
    )


PRESET = QwenCodeHarness
