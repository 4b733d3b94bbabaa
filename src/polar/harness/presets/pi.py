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
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from polar.harness.base import HarnessContext, gateway_env
from polar.harness.install import npm_bin_async
from polar.harness.shell import instruction_path, write_instruction
from polar.runtime.base import Runtime, RuntimeFailure
from polar.store.records import CompletionRecord

PACKAGE = "@mariozechner/pi-coding-agent"
VERSION = "0.73.1"
BINARY = "pi"
DIALECT = ("chat", "responses", "anthropic", "gemini")  # settings.dialect; chat by default
CONFIGURES = (
    "~/.pi/agent/models.json: a `polar` provider in the chosen dialect (base URL, key from POLAR_SESSION_ID, "
    "the served model); settings.json with install telemetry off; PI_OFFLINE=1 (no update checks)"
)
LIMITS = "the binary runs from the host's tool cache (local and bwrap runtimes); Pi has no subagents"

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


def _positive(name: str, value: Any) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"pi harness: settings.{name} must be a positive integer, not {value!r}")
    return value


def _texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return []


async def write_file(runtime: Runtime, path: str, text: str) -> None:
    """Write `text` at `path` inside the runtime (through exec, so it works in any sandbox)."""
    script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
    result = await runtime.exec(["sh", "-c", script, "sh", path], stdin=text.encode(), timeout_s=60)
    if result.exit_code != 0:
        raise RuntimeFailure(f"could not write {path}: {result.stderr.strip()}")


class PiHarness:
    name = "pi"

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        settings = dict(settings or {})
        unknown = sorted(set(settings) - set(_SETTINGS))
        if unknown:
            raise ValueError(f"pi harness: unknown settings {unknown}; known: {list(_SETTINGS)}")
        dialect = settings.get("dialect", "chat")
        if dialect not in APIS:
            raise ValueError(f"pi harness: settings.dialect must be one of {list(APIS)}, not {dialect!r}")
        binary = settings.get("binary")
        if binary is not None and (not isinstance(binary, str) or not binary.startswith("/")):
            raise ValueError(f"pi harness: settings.binary must be an absolute path, not {binary!r}")
        thinking = settings.get("thinking")
        if thinking is not None and thinking not in THINKING:
            raise ValueError(
                f"pi harness: settings.thinking must be one of {list(THINKING)}, not {thinking!r}"
            )
        self.dialect: str = dialect
        self.thinking: str | None = thinking
        self.binary: str | None = binary
        self.context_window = _positive("context_window", settings.get("context_window"))
        self.max_tokens = _positive("max_tokens", settings.get("max_tokens"))
        retries = settings.get("max_retries")
        if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int) or retries < 0):
            raise ValueError(f"pi harness: settings.max_retries must be an integer >= 0, not {retries!r}")
        self.max_retries: int | None = retries

    def agent_dir(self, ctx: HarnessContext) -> str:
        return f"{ctx.home.rstrip('/')}/{AGENT_DIR}"

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
            self.binary = str(await npm_bin_async(PACKAGE, VERSION, BINARY))
        base = self.agent_dir(ctx)
        await write_file(runtime, f"{base}/models.json", json.dumps(self.models_json(ctx), indent=2))
        settings: dict[str, Any] = {"enableInstallTelemetry": False, "quietStartup": True}
        if self.max_retries is not None:
            settings["retry"] = {"enabled": self.max_retries > 0, "maxRetries": self.max_retries}
        await write_file(runtime, f"{base}/settings.json", json.dumps(settings, indent=2))
        await write_instruction(runtime, ctx)

    def command(self, ctx: HarnessContext) -> str:
        if self.binary is None:
            raise RuntimeError("pi harness: command() before setup() (the binary is not installed yet)")
        sessions = f"{ctx.artifacts.rstrip('/')}/{SESSIONS}"
        argv = [self.binary, "--provider", PROVIDER, "--model", ctx.model, "--session-dir", sessions]
        if self.thinking is not None:
            argv += ["--thinking", self.thinking]
        argv.append("-p")
        # Pi 0.73.1 takes an argument starting with "@" as a file to attach and one starting with "-" as a
        # flag; piped stdin becomes the prompt as it is (trimmed), so any instruction arrives intact.
        return f"{shlex.join(argv)} < {shlex.quote(instruction_path(ctx))}"

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
        sessions = f"{ctx.artifacts.rstrip('/')}/{SESSIONS}"
        result = await runtime.exec(
            ["sh", "-c", 'find "$1" -name "*.jsonl" 2>/dev/null | wc -l', "sh", sessions], timeout_s=60
        )
        transcripts = int(result.stdout.strip() or 0) if result.exit_code == 0 else 0
        return {"transcripts": transcripts, "dialect": self.dialect}

    def classify(self, record: CompletionRecord) -> tuple[str, ...]:
        messages = record.upstream_request.get("messages") or []
        system = [t for m in messages if m.get("role") == "system" for t in _texts(m.get("content"))]
        if any(t.startswith(COMPACTION_MARKER) for t in system):
            return ("side_call", "compaction")
        return () if record.tools else ("side_call",)


PRESET = PiHarness
