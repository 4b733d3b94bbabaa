"""The `claude_code` preset: Anthropic's Claude Code CLI, unmodified, against the gateway.

    agent: {harness: claude_code, settings: {allowed_tools: [Bash, Edit, Write, Read], small_model: null}}
    agent: {harness: claude_code, settings: {skip_permissions: true}}  # every tool, no permission checks

Claude Code 2.1.197 speaks Anthropic Messages (`HEAD /`, then `POST /v1/messages?beta=true`, always SSE) to
`ANTHROPIC_BASE_URL` with `ANTHROPIC_API_KEY` as `x-api-key`. Every model tier it may ask for (main, the
small/fast "haiku" tier its Explore subagent and title calls use, sonnet/opus/fable aliases) is pointed at
the served model name; `settings.small_model` gives the small tier its own name instead, so its calls can be
routed or filtered by model. The config goes into `<home>/.claude` (`CLAUDE_CONFIG_DIR`), never the user's.

Settings: `allowed_tools` (tool names the run may use without asking; `-p` denies the rest),
`skip_permissions` (`--dangerously-skip-permissions` instead: every tool, no checks; as root 2.1.197
refuses the flag unless `IS_SANDBOX=1`, which the preset then sets, so use it in a sandboxed runtime),
`small_model` (see above), `binary` (a preinstalled `claude` to run instead of installing the pinned one).
A task's `agent.mcp_servers` go in `<config>/mcp.json`, loaded alone (`--mcp-config`, `--strict-mcp-config`)
with their tools allowed; its `agent.skills` in `<config>/skills`, with the Skill tool allowed.
"""

from __future__ import annotations

import shlex
from typing import Any

from polar.harness.base import Extensions, HarnessContext, gateway_env
from polar.harness.cli_common import texts, under, write_json
from polar.harness.extensions import stdio_entries, write_skills
from polar.harness.install import npm_bin_async
from polar.jsontypes import JSON
from polar.runtime.base import Runtime
from polar.store.records import CompletionRecord

PACKAGE = "@anthropic-ai/claude-code"
VERSION = "2.1.197"
BINARY = "claude"
DIALECT = "anthropic"
CONFIGURES = (
    "CLAUDE_CONFIG_DIR=<home>/.claude with settings.json (model, every model tier, allowed tools, env); "
    "ANTHROPIC_BASE_URL/API_KEY/MODEL and the small/fast, haiku, sonnet, opus, fable models; "
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC, DISABLE_AUTOUPDATER, DISABLE_TELEMETRY, DISABLE_ERROR_REPORTING; "
    "claude -p --allowedTools ... -- <instruction>"
)
LIMITS = (
    "only `allowed_tools` run unless `skip_permissions` (which sets IS_SANDBOX=1: as root 2.1.197 refuses "
    "--dangerously-skip-permissions otherwise); tool search "
    "(ENABLE_TOOL_SEARCH, off by default for non-Anthropic hosts) works but each ToolSearch changes `tools`, "
    "splitting the main loop into a new trace; the title side call (only with non-essential traffic on) "
    "asks for JSON output the gateway does not constrain; with a task's MCP servers it waits up to 60 s for "
    "them before its first call (MCP_CONNECTION_NONBLOCKING=0) and goes on without one that does not start "
    "(a server whose program is missing ends the session at setup instead)"
)

EXTENSIONS = Extensions(
    mcp="<config>/mcp.json, `--mcp-config` with `--strict-mcp-config` (no other server is loaded); each "
    "server's tools allowed (`mcp__<server>`)",
    tool_name="mcp__{server}__{tool}",
    skills="<config>/skills/<name>/SKILL.md (CLAUDE_CONFIG_DIR's), the Skill tool allowed",
)

DEFAULT_TOOLS = ("Bash", "Edit", "Write", "Read")
CONFIG_DIR = ".claude"  # under ctx.home
MCP_CONFIG = "mcp.json"  # under the config dir: the task's servers, given with --mcp-config
# 2.1.197 under `-p` connects MCP servers in the background and sends its first calls without their tools,
# adding them mid-session (measured: a server taking 4 s to start was missing from the first two calls), so
# a session's tools would depend on how fast its server started. These make it wait for them first, up to
# MCP_CONNECT_TIMEOUT_MS (its default, 5 s, is short for a Python server in a sandbox on a busy node).
MCP_WAIT = {"MCP_CONNECTION_NONBLOCKING": "0", "MCP_CONNECT_TIMEOUT_MS": "60000"}
SKILL_TOOL = "Skill"  # 2.1.197's tool that loads a skill by name
PROJECTS = "claude-projects"  # under ctx.artifacts: Claude Code's own session transcripts
DEBUG_LOG = "claude-debug.log"  # under ctx.artifacts

# Claude Code 2.1.197 starts every system prompt with a billing line; a subagent's (Agent tool: Explore,
# general-purpose, ...) ends in `cc_is_subagent=true;`. The gateway strips the line upstream (quirk
# `claude_code_billing_header`), but the record keeps the harness's original request, so it is readable.
_SUBAGENT_MARK = "cc_is_subagent=true"
_BILLING_MARK = "x-anthropic-billing-header:"
# 2.1.197's session-title call (querySource generate_session_title): no tools, this system prompt, a JSON
# schema in `output_config.format`. Sent only with non-essential traffic on (this preset turns it off).
_TITLE_MARK = "Generate a concise, sentence-case title"
# 2.1.197's auto-compaction (CLAUDE_CODE_AUTO_COMPACT_WINDOW & co) asks for the summary with the main
# loop's system prompt and tools, over the history before the last turn, and this ask as the last user
# message's text: a fork of the conversation, tagged so it is not read as the main loop rewriting itself.
_COMPACT_MARK = "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools."
_SETTINGS = ("allowed_tools", "skip_permissions", "small_model", "binary")


def _name_list(value: JSON) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v.strip() for v in value):
        raise ValueError("claude_code harness: settings.allowed_tools must be a non-empty list of tool names")
    if any("," in v for v in value):
        raise ValueError("claude_code harness: settings.allowed_tools: one tool name per entry, no commas")
    return [v.strip() for v in value]


def _optional_str(settings: dict[str, Any], name: str) -> str | None:
    value = settings.get(name)
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ValueError(f"claude_code harness: settings.{name} must be a non-empty string")
    return value


class ClaudeCodeHarness:
    """Runs `claude -p` headless; see the module docstring."""

    name = "claude_code"
    extensions = EXTENSIONS

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        settings = dict(settings or {})
        unknown = sorted(set(settings) - set(_SETTINGS))
        if unknown:
            raise ValueError(
                f"claude_code harness: unknown settings {unknown}; known: {', '.join(_SETTINGS)}"
            )
        self.allowed_tools = _name_list(settings.get("allowed_tools", list(DEFAULT_TOOLS)))
        self.skip_permissions = settings.get("skip_permissions", False)
        if not isinstance(self.skip_permissions, bool):
            raise ValueError("claude_code harness: settings.skip_permissions must be true or false")
        if self.skip_permissions and "allowed_tools" in settings:
            raise ValueError(
                "claude_code harness: settings.allowed_tools has no effect with skip_permissions"
            )
        self.small_model = _optional_str(settings, "small_model")
        self.binary = _optional_str(settings, "binary")
        self._program = self.binary  # the `claude` to run, once setup has installed it
        self._model: str | None = None  # the session's main model, once setup has seen the context

    def config_dir(self, ctx: HarnessContext) -> str:
        return under(ctx.home, CONFIG_DIR)

    def _cli_env(self, ctx: HarnessContext) -> dict[str, str]:
        """Claude Code's own switches: every model tier at the gateway's model, no other traffic."""
        small = self.small_model or ctx.model
        return {
            "CLAUDE_CONFIG_DIR": self.config_dir(ctx),
            "ANTHROPIC_MODEL": ctx.model,
            "ANTHROPIC_SMALL_FAST_MODEL": small,
            # 2.1.197's Explore subagent asks for `claude-haiku-4-5-20251001` unless the haiku tier is set:
            # ANTHROPIC_SMALL_FAST_MODEL alone does not cover it (seen on the wire).
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": small,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": ctx.model,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": ctx.model,
            "ANTHROPIC_DEFAULT_FABLE_MODEL": ctx.model,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            **({"IS_SANDBOX": "1"} if self.skip_permissions else {}),
            **(MCP_WAIT if ctx.mcp_servers else {}),
        }

    async def setup(self, runtime: Runtime, ctx: HarnessContext) -> None:
        self._model = ctx.model
        if self._program is None:
            self._program = str(await npm_bin_async(PACKAGE, VERSION, BINARY))
        settings = {
            "model": ctx.model,
            "env": {
                "ANTHROPIC_BASE_URL": ctx.gateway_url.rstrip("/"),
                "ANTHROPIC_API_KEY": ctx.session_id,
                **self._cli_env(ctx),
                **ctx.env,  # settings.json's env wins over the process's: the task's keeps the last word
            },
            "permissions": (
                {"defaultMode": "bypassPermissions"}
                if self.skip_permissions
                else {"allow": self.allowed(ctx)}
            ),
        }
        await write_json(runtime, f"{self.config_dir(ctx)}/settings.json", settings)
        if ctx.mcp_servers:
            await write_json(runtime, self.mcp_config(ctx), mcp_config(ctx))
        await write_skills(runtime, f"{self.config_dir(ctx)}/skills", ctx.skills)

    def allowed(self, ctx: HarnessContext) -> list[str]:
        """`allowed_tools`, every tool of the task's MCP servers (the rule `mcp__<server>`) and, with
        skills, the Skill tool: under `-p` a tool not allowed is denied, so a server or skill the task gives
        would be there and unusable."""
        extra = [f"mcp__{name}" for name in ctx.mcp_servers] + ([SKILL_TOOL] if ctx.skills else [])
        return [*self.allowed_tools, *(t for t in extra if t not in self.allowed_tools)]

    def mcp_config(self, ctx: HarnessContext) -> str:
        return f"{self.config_dir(ctx)}/{MCP_CONFIG}"

    def command(self, ctx: HarnessContext) -> list[str]:
        # `--allowedTools` takes a variadic list: `--` ends it and lets an instruction that starts with
        # "-" arrive as the prompt (2.1.197's option parser honours it).
        if self.skip_permissions:
            permissions = ["--dangerously-skip-permissions"]
        else:
            permissions = ["--allowedTools", ",".join(self.allowed(ctx))]
        # `--mcp-config` is variadic too; `--strict-mcp-config` (a flag) ends it, and keeps out any server
        # the task's repository (.mcp.json) or the user's config names.
        servers = ["--mcp-config", self.mcp_config(ctx), "--strict-mcp-config"] if ctx.mcp_servers else []
        return [
            self._program or BINARY,
            "-p",
            *permissions,
            *servers,
            "--debug-file",
            under(ctx.artifacts, DEBUG_LOG),
            "--",
            ctx.instruction,
        ]

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        return {**gateway_env(ctx), **self._cli_env(ctx), **ctx.env}

    async def post_run(self, runtime: Runtime, ctx: HarnessContext) -> dict[str, Any]:
        """Copy Claude Code's session transcripts (`<config>/projects/<cwd>/<session>.jsonl`, subagents
        under `<session>/subagents/`) into the artifacts; list the ones copied."""
        src = f"{self.config_dir(ctx)}/projects"
        dst = under(ctx.artifacts, PROJECTS)
        script = (
            '[ -d "$1" ] || exit 0; mkdir -p -- "$2" && cp -r -- "$1"/. "$2"/ && '
            "cd -- \"$2\" && find . -name '*.jsonl' -type f | sort"
        )
        result = await runtime.exec(["sh", "-c", script, "sh", src, dst], timeout_s=120)
        if result.exit_code != 0:
            return {"transcripts": [], "error": f"copying {shlex.quote(src)}: {result.stderr.strip()}"}
        transcripts = [line.removeprefix("./") for line in result.stdout.splitlines() if line.strip()]
        return {"transcripts": transcripts}

    def classify(self, record: CompletionRecord) -> tuple[str, ...]:
        """("side_call", kind) for calls that are not the main loop, read from the request as sent:
        a subagent (its billing line says so), a call without tools (the session title, or other
        small-model work), the compaction summary (its ask), or any call for `settings.small_model` when it
        has its own name."""
        request = record.request if isinstance(record.request, dict) else {}
        system = texts(request.get("system"))  # a string or text blocks, any shape tolerated
        billing = next((t for t in system if t.startswith(_BILLING_MARK)), "")
        if _SUBAGENT_MARK in billing:
            return ("side_call", "subagent")
        if not request.get("tools"):
            title = any(_TITLE_MARK in t for t in system)
            return ("side_call", "title" if title else "small_model")
        messages = request.get("messages")
        last = messages[-1] if isinstance(messages, list) and messages else None
        if isinstance(last, dict) and any(_COMPACT_MARK in t for t in texts(last.get("content"))):
            return ("side_call", "compaction")
        small = self.small_model
        if small is not None and small != self._model and record.model_requested == small:
            return ("side_call", "small_model")
        return ()


def mcp_config(ctx: HarnessContext) -> dict[str, Any]:
    """The `--mcp-config` file: the task's servers as stdio entries of `mcpServers`."""
    return {"mcpServers": {n: {"type": "stdio", **e} for n, e in stdio_entries(ctx.mcp_servers).items()}}


PRESET = ClaudeCodeHarness
