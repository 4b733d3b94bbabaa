"""The `opencode` preset: OpenCode (`opencode-ai`), headless, through one custom provider at the gateway.

    agent: {harness: opencode, settings: {dialect: chat}}   # chat | responses | anthropic

Settings: `dialect` picks the AI SDK provider package OpenCode talks through (Chat by default; OpenAI
Responses; Anthropic Messages); `title` names the session so OpenCode skips its title-generation call;
`context_window` and `max_output_tokens` (together) bound what OpenCode asks for (it sends
`max_tokens: 32000` by default, too much for a small policy's context). A task's `agent.mcp_servers` are
local servers in the config (`mcp`), its `agent.skills` folders of `~/.config/opencode/skills`.

Facts this preset relies on, measured on opencode-ai 1.18.33:
- The three provider packages are bundled in the binary; only packages it does not bundle are fetched.
- At start it installs `@opencode-ai/plugin` into every config dir (`~/.config/opencode`) in the background
  unless that dir has `node_modules` and a lock file naming it; setup links a cached install there, so no
  run touches the npm registry (in a sandbox the install would fail, and it is traffic all the same).
- A quoted multi-word argument arrives wrapped in literal quotes: the prompt goes on stdin.
- Each run makes a title-generation call (no tools, system prompt "You are a title generator") before the
  agent loop; `classify` tags it ("side_call", "title"). Tool-less calls are never the agent loop.
"""

from __future__ import annotations

import asyncio
import json
import shlex
from pathlib import Path
from typing import Any

from polar.harness.base import Extensions, HarnessContext, gateway_env
from polar.harness.cli_common import positive_int, refuse_unknown, stdin_from_instruction, under
from polar.harness.extensions import write_skills
from polar.harness.install import npm_bin_async, npm_prefix
from polar.harness.shell import write_instruction
from polar.runtime.base import Runtime, RuntimeFailure
from polar.store.records import CompletionRecord

PACKAGE = "opencode-ai"
VERSION = "1.18.33"
BINARY = "opencode"
PLUGIN_PACKAGE = "@opencode-ai/plugin"  # what OpenCode installs into its config dir, same version
DIALECT = ("chat", "responses", "anthropic")
CONFIGURES = (
    "~/.config/opencode/opencode.json (also as OPENCODE_CONFIG_CONTENT): provider `polar` at <gw>/v1 with "
    "the session key, model and small_model; no autoupdate, sharing, models.dev fetch or plugin install"
)
LIMITS = (
    "one title-generation side call per run (skipped with settings.title); sends max_tokens 32000 unless "
    "context_window/max_output_tokens are set"
)
EXTENSIONS = Extensions(
    mcp="opencode.json `mcp.<name>` (type local, command, environment)",
    tool_name="{server}_{tool}",
    skills="~/.config/opencode/skills/<name>/SKILL.md (listed in the skill tool's description)",
)

PROVIDER = "polar"
_PACKAGES = {
    "chat": "@ai-sdk/openai-compatible",
    "responses": "@ai-sdk/openai",
    "anthropic": "@ai-sdk/anthropic",  # posts to <baseURL>/messages
}
_SETTINGS = ("dialect", "title", "context_window", "max_output_tokens")
EVENTS = "opencode-events.jsonl"  # `run --format json` output, kept in the artifacts
TITLE_PROMPT = "You are a title generator"  # the system prompt of OpenCode's title call (1.18.33)
# 1.18.33's auto-compaction (usage >= limit.context - output limit): the history as one text, no tools.
COMPACT_PROMPT = "You are a context summarization agent"
# OpenCode's switches: no self-update, no model list from models.dev, no LSP downloads, no share links.
SWITCHES = {
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_SHARE": "1",
}


class OpenCodeHarness:
    name = "opencode"
    extensions = EXTENSIONS

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        settings = dict(settings or {})
        refuse_unknown(self.name, settings, _SETTINGS)
        dialect = settings.get("dialect", "chat")
        if dialect not in _PACKAGES:
            raise ValueError(f"opencode harness: settings.dialect must be one of {DIALECT}, not {dialect!r}")
        title = settings.get("title")
        if title is not None and (not isinstance(title, str) or not title.strip()):
            raise ValueError("opencode harness: settings.title must be a non-empty string")
        limits = [k for k in ("context_window", "max_output_tokens") if k in settings]
        if len(limits) == 1:
            raise ValueError(
                "opencode harness: settings.context_window and settings.max_output_tokens go together "
                f"(OpenCode's model limit needs both); only {limits[0]} was given"
            )
        self.limit: dict[str, int] | None = None
        if limits:
            context = positive_int(self.name, "context_window", settings["context_window"])
            output = positive_int(self.name, "max_output_tokens", settings["max_output_tokens"])
            if output >= context:
                raise ValueError("opencode harness: settings.max_output_tokens must be below context_window")
            self.limit = {"context": context, "output": output}
        self.dialect: str = dialect
        self.title: str | None = title
        self.binary: Path | None = None

    # -- configuration ---------------------------------------------------------------------------------
    def config(self, ctx: HarnessContext) -> dict[str, Any]:
        """OpenCode's config: one provider at the gateway serving `ctx.model` for every role."""
        model: dict[str, Any] = {"name": ctx.model}
        if self.limit is not None:
            model["limit"] = dict(self.limit)
        ref = f"{PROVIDER}/{ctx.model}"
        mcp = {"mcp": mcp_config(ctx)} if ctx.mcp_servers else {}
        return {
            "$schema": "https://opencode.ai/config.json",
            "provider": {
                PROVIDER: {
                    "npm": _PACKAGES[self.dialect],
                    "name": "polar gateway",
                    "options": {"baseURL": f"{ctx.gateway_url.rstrip('/')}/v1", "apiKey": ctx.session_id},
                    "models": {ctx.model: model},
                }
            },
            "model": ref,
            "small_model": ref,  # titles and summaries: the gateway too, tagged by classify
            "enabled_providers": [PROVIDER],  # no other provider is loaded, even if its key is in the env
            "autoupdate": False,
            "share": "disabled",
            **mcp,
        }

    def config_dir(self, ctx: HarnessContext) -> str:
        return under(ctx.home, ".config/opencode")

    async def setup(self, runtime: Runtime, ctx: HarnessContext) -> None:
        self.binary = await npm_bin_async(PACKAGE, VERSION, BINARY)
        plugin = await asyncio.to_thread(npm_prefix, PLUGIN_PACKAGE, VERSION)  # cached per node
        await write_instruction(runtime, ctx)
        conf = self.config_dir(ctx)
        # The cached plugin install, linked (read-only is fine: OpenCode only checks the lock names it).
        script = (
            'set -e; mkdir -p -- "$1"; cat > "$1/opencode.json"; ln -sfn -- "$2/node_modules" '
            '"$1/node_modules"; cp -- "$2/package.json" "$2/package-lock.json" "$1/"; mkdir -p -- "$3"'
        )
        argv = ["sh", "-c", script, "sh", conf, str(plugin), ctx.artifacts]
        body = json.dumps(self.config(ctx), indent=2).encode()
        result = await runtime.exec(argv, stdin=body, timeout_s=60)
        if result.exit_code != 0:
            raise RuntimeFailure(f"could not write OpenCode's config in {conf}: {result.stderr.strip()}")
        await write_skills(runtime, f"{conf}/skills", ctx.skills)

    def command(self, ctx: HarnessContext) -> str:
        binary = str(self.binary) if self.binary is not None else BINARY
        argv = [binary, "run", "--format", "json", "--auto"]  # --auto: approve any permission that asks
        if self.title is not None:
            argv += ["--title", self.title]  # a titled session makes no title-generation call
        events = under(ctx.artifacts, EVENTS)
        # The prompt on stdin (an argument would arrive wrapped in quotes); the JSON events to the artifacts.
        return f"set -o pipefail; {stdin_from_instruction(argv, ctx)} | tee {shlex.quote(events)}"

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        home = ctx.home.rstrip("/")
        xdg = {
            "XDG_CONFIG_HOME": f"{home}/.config",
            "XDG_DATA_HOME": f"{home}/.local/share",
            "XDG_STATE_HOME": f"{home}/.local/state",
            "XDG_CACHE_HOME": f"{home}/.cache",
        }
        # OPENCODE_CONFIG_CONTENT outranks a project opencode.json the task's repository may carry.
        content = {"OPENCODE_CONFIG_CONTENT": json.dumps(self.config(ctx))}
        return {**gateway_env(ctx), **xdg, **SWITCHES, **content, **ctx.env}

    async def post_run(self, runtime: Runtime, ctx: HarnessContext) -> dict[str, Any]:
        """Copy OpenCode's own logs; summarize the JSON event stream (steps, tool calls, errors)."""
        logs = under(ctx.home, ".local/share/opencode/log")
        # Each step on its own: a CLI that died before logging still has its events read.
        script = 'mkdir -p -- "$2/opencode-log"; cp -r -- "$1"/. "$2/opencode-log/" 2>/dev/null; cat -- "$3"'
        events = under(ctx.artifacts, EVENTS)
        result = await runtime.exec(["sh", "-c", script, "sh", logs, ctx.artifacts, events], timeout_s=120)
        return summarize(result.stdout.splitlines())

    def classify(self, record: CompletionRecord) -> tuple[str, ...]:
        if record.tools:
            return ()
        messages = record.upstream_request.get("messages") or []
        system = " ".join(str(m.get("content")) for m in messages if m.get("role") == "system")
        if TITLE_PROMPT in system:
            return ("side_call", "title")
        return ("side_call", "compaction") if COMPACT_PROMPT in system else ("side_call",)


def mcp_config(ctx: HarnessContext) -> dict[str, Any]:
    """The task's servers as 1.18.33's local MCP servers (`command` is the program and its arguments)."""
    return {
        name: {"type": "local", "command": [s.command, *s.args], "environment": dict(s.env), "enabled": True}
        for name, s in ctx.mcp_servers.items()
    }


def summarize(lines: list[str]) -> dict[str, Any]:
    """Counts from `opencode run --format json` events (one JSON object a line)."""
    steps = tools = 0
    errors: list[str] = []
    session = None
    for line in lines:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(event, dict):
            continue
        session = event.get("sessionID", session)
        kind = event.get("type")
        steps += kind == "step_finish"
        tools += kind == "tool_use"
        if kind == "error":
            errors.append(json.dumps(event.get("error"))[:500])
    out: dict[str, Any] = {"opencode_session": session, "steps": steps, "tool_calls": tools}
    if errors:
        out["errors"] = errors
    return out


PRESET = OpenCodeHarness
