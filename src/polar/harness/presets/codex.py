"""The `codex` preset: OpenAI's Codex CLI, headless (`codex exec`), against the gateway's Responses API.

    agent: {harness: codex, settings: {context_window: 32768}}

Codex 0.171.0 speaks only OpenAI Responses to a custom provider: `OPENAI_BASE_URL` is ignored and
`wire_api = "chat"` is refused, so the preset writes `$CODEX_HOME/config.toml` (in the session's home) with
a `polar` provider whose key is read from `POLAR_SESSION_ID`. Every model Codex uses (the main loop,
sub-agents, compaction) goes through that one provider, so a sub-agent's calls land in the session too.
Settings: `binary` (an installed `codex` to use instead of the pinned npm package), `context_window` (Codex
has no metadata for our model names and otherwise falls back to its defaults, which decide when it
compacts), `reasoning_effort` (sent as `reasoning.effort`; without it Codex asks only for a reasoning
summary), `max_retries` (the provider's `request_max_retries` and `stream_max_retries`; Codex retries a
failed call 5 times by default), `config` (a mapping merged into config.toml, as Gemini CLI's and Qwen Code's
`config`: MCP servers, feature flags; its `model` is the name Codex asks for and looks up in its own
catalog, which decides features such as tool search; the provider is the preset's and cannot be replaced).
A task's `agent.mcp_servers` become `[mcp_servers.<name>]` tables (`required`: Codex waits for them) and its
`agent.skills` folders of `$CODEX_HOME/skills`; `config` is merged over them as over the rest.

    agent:
      harness: codex
      settings:
        config:
          model: gpt-5.5          # a catalog model with `supports_search_tool`
          features: {tool_search: true, tool_search_always_defer_mcp_tools: true}
          mcp_servers: {weather: {command: python3, args: [weather_server.py]}}
"""

from __future__ import annotations

import asyncio
import platform
import sys
from pathlib import Path
from typing import Any

import tomli_w

from polar.harness.base import Extensions, HarnessContext, gateway_env
from polar.harness.cli_common import (
    absolute_binary,
    deep_merge,
    node_cli,
    one_of,
    optional_count,
    optional_positive_int,
    refuse_unknown,
    stdin_from_instruction,
    texts,
    under,
    write_file,
)
from polar.harness.extensions import write_skills
from polar.harness.install import npm_prefix
from polar.harness.shell import write_instruction
from polar.runtime.base import Runtime
from polar.store.records import CompletionRecord

PACKAGE = "@openai/codex"
VERSION = "0.171.0"
BINARY = "codex"
DIALECT = "responses"
CONFIGURES = (
    "$CODEX_HOME/config.toml: a `polar` provider (wire_api=responses, base_url=<gateway>/v1, key from "
    "POLAR_SESSION_ID) and the model; analytics, plugins, web search, OTel export and update checks off; "
    "settings.config merged in (MCP servers, features)"
)
LIMITS = (
    "sub-agents (the `multi_agent_v1` namespace tools, called upstream as `multi_agent_v1__spawn_agent` "
    "& co) run in the same session and are tagged `side_call`, `subagent`; a sub-agent cannot spawn its own; "
    "tool search over deferred MCP tools (a catalog model such as gpt-5.5 in settings.config) answers as "
    "`tool_search_call`, the loaded tools reach the policy in the tool message; a task's MCP server that "
    "cannot start ends the run before any call (it is `required`); its servers get only HOME, PATH and a "
    "few more of the environment, plus their `env`"
)

EXTENSIONS = Extensions(
    mcp="config.toml `[mcp_servers.<name>]` (command, args, env), under settings.config's",
    tool_name="mcp__{server}__{tool}",
    skills="$CODEX_HOME/skills/<name>/SKILL.md",
)

# How long Codex waits for a task's MCP server to start (0.171.0's default, 10 s, is short for a Python
# server in a sandbox on a busy node).
MCP_STARTUP_S = 60

PROVIDER = "polar"
KEY_VARIABLE = "POLAR_SESSION_ID"  # set by gateway_env; Codex reads the provider's key from `env_key`
CODEX_DIR = ".codex"
LAST_MESSAGE = "codex-last-message.md"
SESSIONS_COPY = "codex-sessions"
# Codex 0.171.0 compacts a long history by asking the model for a hand-off summary with this prompt.
COMPACTION_MARKER = "CONTEXT CHECKPOINT COMPACTION"
# 0.171.0 sends a sub-agent's calls (spawned with `multi_agent_v1.spawn_agent`) under the parent's provider,
# hence the same session key, with this key in the body's `client_metadata` (and as an HTTP header):
# `collab_spawn`, where the parent thread's calls have none. Its `x-codex-turn-metadata` says the same
# (`"thread_source": "subagent"`, `parent_thread_id`).
SUBAGENT_KEY = "x-openai-subagent"
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # Codex 0.171.0's model_reasoning_effort
_SETTINGS = ("binary", "context_window", "reasoning_effort", "max_retries", "config")
# The gateway wiring a `config` overlay may not replace: every call must reach the session's gateway.
_WIRING = ("model_provider", "model_providers")


def config_toml(
    ctx: HarnessContext,
    context_window: int | None = None,
    reasoning_effort: str | None = None,
    max_retries: int | None = None,
    overlay: dict[str, Any] | None = None,
) -> str:
    """`$CODEX_HOME/config.toml` for this session, with the `config` setting's `overlay` merged in."""
    top: dict[str, str | int | bool] = {
        "model": ctx.model,
        "model_provider": PROVIDER,
        "check_for_update_on_startup": False,
        # 0.171.0 sends a hosted `web_search` tool by default; the policy cannot run it.
        "web_search": "disabled",
    }
    if context_window is not None:
        top["model_context_window"] = context_window
    if reasoning_effort is not None:
        top["model_reasoning_effort"] = reasoning_effort
    provider: dict[str, str | int | bool] = {
        "name": PROVIDER,
        "base_url": f"{ctx.gateway_url.rstrip('/')}/v1",
        "env_key": KEY_VARIABLE,
        "wire_api": "responses",
    }
    if max_retries is not None:
        provider |= {"request_max_retries": max_retries, "stream_max_retries": max_retries}
    config: dict[str, Any] = {
        **top,
        "model_providers": {PROVIDER: provider},
        # 0.171.0: these two are all its other traffic (the facts sheet measured it in an empty netns).
        "analytics": {"enabled": False},
        "features": {"plugins": False},
        "otel": {"exporter": "none"},
    }
    if ctx.mcp_servers:
        config["mcp_servers"] = mcp_servers(ctx)
    return tomli_w.dumps(deep_merge(config, overlay or {}))


def mcp_servers(ctx: HarnessContext) -> dict[str, dict[str, Any]]:
    """The task's servers as 0.171.0's `[mcp_servers.<name>]` tables (stdio: `command`, `args`, `env`).
    Each is `required`: 0.171.0 otherwise sends its first calls before a server is up and adds the
    server's tools mid-session (measured: a server taking 4 s to start was missing from the first two
    calls), so a session's tools would depend on how fast its server started; required, Codex waits for it
    (up to `startup_timeout_sec`) and exits with an error when it cannot start."""
    out: dict[str, dict[str, Any]] = {}
    for name, server in ctx.mcp_servers.items():
        table: dict[str, Any] = {
            "command": server.command,
            "args": list(server.args),
            "required": True,
            "startup_timeout_sec": MCP_STARTUP_S,
        }
        if server.env:
            table["env"] = dict(server.env)
        out[name] = table
    return out


# The npm package's launcher (`bin/codex.js`, a node script) picks the platform package's static binary and
# execve()s it with two variables set. Doing the same here runs the identical binary with the identical
# environment, without node: a task image (a SWE-bench one, say) needs nothing of Codex's.
_TRIPLES = {"x86_64": "x86_64-unknown-linux-musl", "aarch64": "aarch64-unknown-linux-musl"}
_PLATFORM_PACKAGES = {"x86_64": "codex-linux-x64", "aarch64": "codex-linux-arm64"}


def native_binary(prefix: Path) -> Path | None:
    """The static binary 0.171.0's launcher would run from the npm prefix; None off Linux x86_64/arm64."""
    machine = platform.machine()
    if sys.platform != "linux" or machine not in _TRIPLES:
        return None
    vendor = prefix / "node_modules" / "@openai" / _PLATFORM_PACKAGES[machine] / "vendor"
    path = vendor / _TRIPLES[machine] / "bin" / "codex"
    return path if path.is_file() else None


def launcher_env(prefix: Path) -> dict[str, str]:
    """The variables 0.171.0's launcher adds for an npm install (it decides how Codex offers updates)."""
    root = (prefix / "node_modules" / "@openai" / "codex").resolve()
    return {"CODEX_MANAGED_PACKAGE_ROOT": str(root), "CODEX_MANAGED_BY_NPM": "1"}


class CodexHarness:
    name = "codex"
    extensions = EXTENSIONS

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        settings = dict(settings or {})
        refuse_unknown(self.name, settings, _SETTINGS)
        binary = absolute_binary(self.name, settings.get("binary"))
        window = optional_positive_int(self.name, "context_window", settings.get("context_window"))
        effort = one_of(
            self.name, "reasoning_effort", settings.get("reasoning_effort"), EFFORTS, optional=True
        )
        retries = optional_count(self.name, "max_retries", settings.get("max_retries"))
        self.config: dict[str, Any] = _overlay(settings.get("config"))
        self.binary: str | None = binary
        self.reasoning_effort: str | None = effort
        self.max_retries: int | None = retries
        self.context_window: int | None = window
        self._launcher_env: dict[str, str] = {}  # what the npm launcher would have set (native_binary)

    def codex_home(self, ctx: HarnessContext) -> str:
        return under(ctx.home, CODEX_DIR)

    async def setup(self, runtime: Runtime, ctx: HarnessContext) -> None:
        if self.binary is None:
            prefix = await asyncio.to_thread(npm_prefix, PACKAGE, VERSION)
            native = native_binary(prefix)
            if native is not None:
                self.binary, self._launcher_env = str(native), launcher_env(prefix)
            else:  # a platform without a static build: through the launcher, which needs node
                self.binary = await node_cli(runtime, self.name, PACKAGE, VERSION, BINARY)
        await write_file(
            runtime,
            f"{self.codex_home(ctx)}/config.toml",
            config_toml(ctx, self.context_window, self.reasoning_effort, self.max_retries, self.config),
        )
        await write_skills(runtime, f"{self.codex_home(ctx)}/skills", ctx.skills)
        await write_instruction(runtime, ctx)

    def command(self, ctx: HarnessContext) -> str:
        if self.binary is None:
            raise RuntimeError("codex harness: command() before setup() (the binary is not installed yet)")
        argv = [self.binary, "exec", "--skip-git-repo-check"]
        # 0.171.0: its own sandbox helper fails when CODEX_HOME is under /tmp, and approvals would block a
        # headless run; our runtime is the sandbox.
        argv += ["--dangerously-bypass-approvals-and-sandbox", "--color", "never"]
        model = self.config.get("model", ctx.model)
        argv += ["-C", ctx.workdir, "-m", model, "-o", under(ctx.artifacts, LAST_MESSAGE)]
        # `-` reads the prompt from stdin: any instruction text, even one starting with a dash.
        return stdin_from_instruction([*argv, "-"], ctx)

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        own = {"CODEX_HOME": self.codex_home(ctx), "NO_COLOR": "1", **self._launcher_env}
        return {**gateway_env(ctx), **own, **ctx.env}

    async def post_run(self, runtime: Runtime, ctx: HarnessContext) -> dict[str, Any]:
        """Copy Codex's own rollout transcripts (`$CODEX_HOME/sessions/**/rollout-*.jsonl`) to artifacts."""
        script = 'mkdir -p -- "$2" && cp -r -- "$1/sessions/." "$2/" && find "$2" -name "*.jsonl" | wc -l'
        dst = under(ctx.artifacts, SESSIONS_COPY)
        result = await runtime.exec(["sh", "-c", script, "sh", self.codex_home(ctx), dst], timeout_s=120)
        transcripts = int(result.stdout.strip() or 0) if result.exit_code == 0 else 0
        return {"transcripts": transcripts, "last_message": LAST_MESSAGE}

    def classify(self, record: CompletionRecord) -> tuple[str, ...]:
        """A compaction (its summary prompt is the request's last message), a sub-agent's call (its
        `client_metadata` names it), a call without tools; the main loop otherwise."""
        messages = record.upstream_request.get("messages") or []
        if messages and any(COMPACTION_MARKER in t for t in texts(messages[-1].get("content"))):
            return ("side_call", "compaction")
        request = record.request if isinstance(record.request, dict) else {}
        metadata = request.get("client_metadata")
        if isinstance(metadata, dict) and metadata.get(SUBAGENT_KEY):
            return ("side_call", "subagent")
        return () if record.tools else ("side_call",)


def _overlay(value: Any) -> dict[str, Any]:
    """The `config` setting: a mapping TOML can hold, not touching the gateway wiring."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"codex harness: settings.config must be a mapping, not {value!r}")
    wiring = sorted(set(value) & set(_WIRING))
    if wiring:
        raise ValueError(
            f"codex harness: settings.config.{wiring[0]}: the preset's provider is the session's gateway "
            "and cannot be replaced"
        )
    model = value.get("model")
    if model is not None and not (isinstance(model, str) and model):
        raise ValueError(f"codex harness: settings.config.model must be a model name, not {model!r}")
    try:
        tomli_w.dumps(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"codex harness: settings.config cannot be written as TOML: {exc}") from None
    return dict(value)


PRESET = CodexHarness
