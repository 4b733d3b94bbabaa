"""The `pi` preset: the Pi coding agent (`pi -p`), in any of the gateway's four dialects.

    agent: {harness: pi, settings: {dialect: anthropic}}

Pi 0.73.1 reads custom providers from `~/.pi/agent/models.json`; the preset writes one provider, `polar`,
whose `api` is the chosen dialect's (`openai-completions` for chat, the default; `openai-responses`,
`anthropic-messages`, `google-generative-ai`), whose key is read from `POLAR_SESSION_ID`, and whose one
model is the served model. Pi has no small or title model: every call (the loop, compaction) uses it.
Settings: `dialect`, `binary` (an installed `pi` instead of the pinned npm package), `context_window` and
`max_tokens` (Pi's defaults for unknown models are 128000 and 16384; the window decides when it compacts),
`max_retries` (Pi's own retries of a failed call, 3 by default with 2 s, 4 s, 8 s back-off),
`thinking` (one of Pi's levels: marks the model as reasoning and passes `--thinking`; each dialect then asks
in its own way: `reasoning_effort`, `reasoning.effort`, `thinking.budget_tokens`, `thinkingConfig`).
A task's `agent.skills` go in `~/.pi/agent/skills`; Pi has no MCP client, so `agent.mcp_servers` is refused.
"""

from __future__ import annotations

from typing import Any

from polar.harness.base import Extensions, HarnessContext, gateway_env
from polar.harness.cli_common import (
    absolute_binary,
    node_cli,
    one_of,
    optional_count,
    optional_positive_int,
    refuse_unknown,
    stdin_from_instruction,
    texts,
    under,
    write_json,
)
from polar.harness.extensions import write_skills
from polar.harness.shell import write_instruction
from polar.runtime.base import Runtime
from polar.store.records import CompletionRecord

PACKAGE = "@mariozechner/pi-coding-agent"
VERSION = "0.73.1"
BINARY = "pi"
DIALECT = ("chat", "responses", "anthropic", "gemini")  # settings.dialect; chat by default
CONFIGURES = (
    "~/.pi/agent/models.json: a `polar` provider in the chosen dialect (base URL, key from POLAR_SESSION_ID, "
    "the served model); settings.json with install telemetry off; PI_OFFLINE=1 (no update checks)"
)
LIMITS = "a node script: a container image needs Node.js; Pi has no subagents"
EXTENSIONS = Extensions(
    skills="~/.pi/agent/skills/<name>/SKILL.md (listed in the system prompt, read with its read tool)",
    missing="Pi 0.73.1 has no MCP client, by design: its README's 'No MCP'",
)

PROVIDER = "polar"
KEY_VARIABLE = (
    "POLAR_SESSION_ID"  # Pi 0.73.1 resolves an `apiKey` naming an environment variable to its value
)
AGENT_DIR = ".pi/agent"
SESSIONS = "pi-sessions"  # under the artifacts: Pi writes its own transcript there (--session-dir)
# dialect -> (Pi's `api`, the path under the gateway its SDK appends routes to)
APIS = {
    "chat": ("openai-completions", "/v1"),
    "responses": ("openai-responses", "/v1"),
    "anthropic": ("anthropic-messages", ""),  # the Anthropic SDK adds /v1/messages itself
    "gemini": ("google-generative-ai", "/v1beta"),
}
# Pi 0.73.1 compacts (and summarizes branches) with this system prompt and no tools.
COMPACTION_MARKER = "You are a context summarization assistant"
THINKING = ("off", "minimal", "low", "medium", "high", "xhigh")  # Pi 0.73.1's --thinking levels
_SETTINGS = ("dialect", "binary", "context_window", "max_tokens", "thinking", "max_retries")


class PiHarness:
    name = "pi"
    extensions = EXTENSIONS

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        settings = dict(settings or {})
        refuse_unknown(self.name, settings, _SETTINGS)
        dialect = one_of(self.name, "dialect", settings.get("dialect", "chat"), APIS)
        binary = absolute_binary(self.name, settings.get("binary"))
        thinking = one_of(self.name, "thinking", settings.get("thinking"), THINKING, optional=True)
        self.dialect: str = dialect
        self.thinking: str | None = thinking
        self.binary: str | None = binary
        self.context_window = optional_positive_int(
            self.name, "context_window", settings.get("context_window")
        )
        self.max_tokens = optional_positive_int(self.name, "max_tokens", settings.get("max_tokens"))
        self.max_retries: int | None = optional_count(self.name, "max_retries", settings.get("max_retries"))

    def agent_dir(self, ctx: HarnessContext) -> str:
        return under(ctx.home, AGENT_DIR)

    def models_json(self, ctx: HarnessContext) -> dict[str, Any]:
        api, path = APIS[self.dialect]
        model: dict[str, Any] = {"id": ctx.model}
        if self.context_window is not None:
            model["contextWindow"] = self.context_window
        if self.max_tokens is not None:
            model["maxTokens"] = self.max_tokens
        if self.thinking is not None:
            model["reasoning"] = True  # without it Pi 0.73.1 ignores --thinking for a custom model
        provider = {
            "baseUrl": ctx.gateway_url.rstrip("/") + path,
            "api": api,
            "apiKey": KEY_VARIABLE,
            "models": [model],
        }
        return {"providers": {PROVIDER: provider}}

    async def setup(self, runtime: Runtime, ctx: HarnessContext) -> None:
        if self.binary is None:
            self.binary = await node_cli(runtime, self.name, PACKAGE, VERSION, BINARY)
        base = self.agent_dir(ctx)
        await write_json(runtime, f"{base}/models.json", self.models_json(ctx))
        settings: dict[str, Any] = {"enableInstallTelemetry": False, "quietStartup": True}
        if self.max_retries is not None:
            settings["retry"] = {"enabled": self.max_retries > 0, "maxRetries": self.max_retries}
        await write_json(runtime, f"{base}/settings.json", settings)
        await write_skills(runtime, f"{base}/skills", ctx.skills)
        await write_instruction(runtime, ctx)

    def command(self, ctx: HarnessContext) -> str:
        if self.binary is None:
            raise RuntimeError("pi harness: command() before setup() (the binary is not installed yet)")
        sessions = under(ctx.artifacts, SESSIONS)
        argv = [self.binary, "--provider", PROVIDER, "--model", ctx.model, "--session-dir", sessions]
        if self.thinking is not None:
            argv += ["--thinking", self.thinking]
        argv.append("-p")
        # Pi 0.73.1 takes an argument starting with "@" as a file to attach and one starting with "-" as a
        # flag; piped stdin becomes the prompt as it is (trimmed), so any instruction arrives intact.
        return stdin_from_instruction(argv, ctx)

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        switches = {
            "PI_CODING_AGENT_DIR": self.agent_dir(ctx),
            "PI_OFFLINE": "1",  # 0.73.1: no update, package or telemetry calls at startup
            "PI_SKIP_VERSION_CHECK": "1",
            "PI_TELEMETRY": "0",
            "NO_COLOR": "1",
        }
        return {**gateway_env(ctx), **switches, **ctx.env}

    async def post_run(self, runtime: Runtime, ctx: HarnessContext) -> dict[str, Any]:
        """Pi wrote its transcript into the artifacts already; count it and note the dialect."""
        sessions = under(ctx.artifacts, SESSIONS)
        result = await runtime.exec(
            ["sh", "-c", 'find "$1" -name "*.jsonl" 2>/dev/null | wc -l', "sh", sessions], timeout_s=60
        )
        transcripts = int(result.stdout.strip() or 0) if result.exit_code == 0 else 0
        return {"transcripts": transcripts, "dialect": self.dialect}

    def classify(self, record: CompletionRecord) -> tuple[str, ...]:
        messages = record.upstream_request.get("messages") or []
        system = [t for m in messages if m.get("role") == "system" for t in texts(m.get("content"))]
        if any(t.startswith(COMPACTION_MARKER) for t in system):
            return ("side_call", "compaction")
        return () if record.tools else ("side_call",)


PRESET = PiHarness
