"""The `gemini_cli` preset: Google's Gemini CLI, unmodified, speaking the Gemini API to the gateway.

    agent: {harness: gemini_cli, settings: {extra_args: [], config: {model: {maxSessionTurns: 40}}}}

Setup writes `$HOME/.gemini/settings.json` in the session's home; `config` is deep-merged over what the preset
writes (the CLI's own settings schema), as over a task's `agent.mcp_servers` (its `mcpServers`); a task's
`agent.skills` go in `~/.gemini/skills`. The CLI's session transcripts and logs (`.gemini/tmp`) are copied
into the artifacts after the run.
"""

from __future__ import annotations

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

PACKAGE = "@google/gemini-cli"
VERSION = "0.61.0"
BINARY = "gemini"
DIALECT = "gemini"
CONFIGURES = (
    "~/.gemini/settings.json (API-key auth, every model alias routed to the served model, no usage "
    "statistics/telemetry/auto-update); GOOGLE_GEMINI_BASE_URL, GEMINI_API_KEY; `-m M --yolo -p`"
)
LIMITS = (
    "utility side calls are routed to the served model and tagged (observed: the tool-output summarizer); "
    "subagents are tagged `subagent`; after an answer with no text 0.61.0 resends the request with a nudge "
    "appended, up to 3 times"
)
EXTENSIONS = Extensions(
    mcp="~/.gemini/settings.json `mcpServers` (command, args, env); --yolo runs their tools unasked",
    tool_name="mcp_{server}_{tool}",
    skills="~/.gemini/skills/<name>/SKILL.md (listed in the system instruction, loaded with activate_skill)",
)

# 0.61.0: the main loop's system instruction starts so; a call with tools and another system text is a
# subagent (codebase_investigator & co, started through `invoke_agent`).
MAIN_PROMPT = "You are Gemini CLI, an autonomous CLI agent"
# 0.61.0: side calls carry no tools; known ones are named by a marker in their last user message.
SIDE_CALLS = {"Summarize the following tool output": "summarizer"}
# 0.61.0: every utility alias of `modelConfigs` (summarizer, loop detection, classifier, edit corrector, web
# fetch, ...) extends `base` and names its own model (`flash-lite`, `gemini-3-flash-preview`); compression
# aliases set a model without extending anything. An override at each root sends all of them to the served
# model instead (verified: the summarizer asked for `gemini-3.5-flash-lite` before, the served model after).
ALIAS_ROOTS = (
    "base",
    "chat-compression-3-pro",
    "chat-compression-3-flash",
    "chat-compression-3.1-flash-lite",
    "chat-compression-2.5-pro",
    "chat-compression-2.5-flash",
    "chat-compression-2.5-flash-lite",
    "chat-compression-default",
    "agent-history-provider-summarizer",
)


def _texts(parts: JSON) -> str:
    return "".join(texts(parts)) if isinstance(parts, list) else ""


def cli_settings(model: str) -> dict[str, Any]:
    """The preset's `settings.json` for 0.61.0."""
    return {
        # Without it the CLI exits 41 "Invalid auth method selected" in headless mode.
        "security": {"auth": {"selectedType": "gemini-api-key"}},
        "privacy": {"usageStatisticsEnabled": False},  # Clearcut usage statistics
        "telemetry": {"enabled": False},
        "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False},
        "modelConfigs": {
            "customOverrides": [{"match": {"model": a}, "modelConfig": {"model": model}} for a in ALIAS_ROOTS]
        },
    }


def mcp_settings(ctx: HarnessContext) -> dict[str, Any]:
    """The task's MCP servers as settings.json's `mcpServers` (nothing when it gives none)."""
    return {"mcpServers": stdio_entries(ctx.mcp_servers)} if ctx.mcp_servers else {}


class GeminiCliHarness:
    name = "gemini_cli"
    extensions = EXTENSIONS

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        self.extra_args, self.config = extra_args_and_config(self.name, settings)
        self.binary: Path | None = None

    async def setup(self, runtime: Runtime, ctx: HarnessContext) -> None:
        self.binary = Path(await node_cli(runtime, self.name, PACKAGE, VERSION, BINARY))
        config = deep_merge(cli_settings(ctx.model) | mcp_settings(ctx), self.config)
        await write_json(runtime, under(ctx.home, ".gemini/settings.json"), config)
        await write_skills(runtime, under(ctx.home, ".gemini/skills"), ctx.skills)

    def command(self, ctx: HarnessContext) -> list[str]:
        # Always `-m`: without it 0.61.0 first asks a router model which model to use (an extra call).
        if self.binary is None:
            raise RuntimeError(f"{self.name} harness: command() before setup() installed the CLI")
        return [str(self.binary), "-m", ctx.model, "--yolo", *self.extra_args, "-p", ctx.instruction]

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        # GEMINI_CLI_TRUST_WORKSPACE: 0.61.0 refuses to run headless in an untrusted folder otherwise.
        return {**gateway_env(ctx), "GEMINI_CLI_TRUST_WORKSPACE": "true", **ctx.env}

    async def post_run(self, runtime: Runtime, ctx: HarnessContext) -> dict[str, Any]:
        return await collect(runtime, ctx, "gemini", [".gemini/tmp"])

    def classify(self, record: CompletionRecord) -> tuple[str, ...]:
        body = record.request if isinstance(record.request, dict) else {}
        if record.tools:
            system = body.get("systemInstruction")
            text = _texts(system.get("parts")) if isinstance(system, dict) else ""
            return () if text.startswith(MAIN_PROMPT) else ("subagent",)
        contents = body.get("contents")
        last = contents[-1] if isinstance(contents, list) and contents else None
        said = _texts(last.get("parts")) if isinstance(last, dict) else ""
        kind = next((k for marker, k in SIDE_CALLS.items() if marker in said), "no_tools")
        return ("side_call", kind)


PRESET = GeminiCliHarness
