"""The harness contract.

A harness preset knows how to point one agent program at the gateway and run it headless: `setup` writes
the program's own configuration into the session's home (never the user's), `command` is the headless
command line for an instruction, `env` the variables it runs with (the gateway URL and the session key in
every dialect's spelling), and `post_run` collects its logs into the session's artifacts. `classify` tags
side calls (title generation, memory extraction, a small/fast model) on the records. A preset whose
program has an MCP client or reads Agent Skills says so in `extensions` and writes the task's
`agent.mcp_servers` and `agent.skills` (in `ctx`) into the program's own configuration at setup.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from polar.runtime.base import Runtime
from polar.store.records import CompletionRecord
from polar.task import McpServer, Skill


@dataclass(frozen=True)
class HarnessContext:
    session_id: str  # also the API key the harness is given
    gateway_url: str  # as reachable from inside the runtime, no trailing slash, no /v1
    model: str  # the model name the harness should ask for
    instruction: str
    home: str  # HOME inside the runtime; configs go here
    workdir: str  # cwd inside the runtime
    artifacts: str  # directory (inside the runtime) for logs and transcripts
    settings: dict[str, Any] = field(default_factory=dict)  # the task's agent.settings
    env: dict[str, str] = field(default_factory=dict)  # the task's agent.env
    mcp_servers: dict[str, McpServer] = field(default_factory=dict)  # the task's agent.mcp_servers
    skills: list[Skill] = field(default_factory=list)  # the task's agent.skills


@dataclass(frozen=True)
class Extensions:
    """What a harness does with a task's `agent.mcp_servers` and `agent.skills`: its class attribute
    `extensions` (a preset module's `EXTENSIONS`, which docs/harnesses.md's table shows). None where its
    program has no such thing: a task giving one is then refused when it is submitted, never ignored."""

    # Where the preset writes the servers (its program's config file, a flag).
    mcp: str | None = None
    # How the program names server S's tool T to the model, as a template: "mcp__{server}__{tool}".
    tool_name: str | None = None
    # Where the preset writes the skills: "<config dir>/skills/<name>/SKILL.md".
    skills: str | None = None
    # Why what is None is not there, for the refusal and the docs.
    missing: str = ""


def extensions_of(harness: object) -> Extensions:
    """The harness's `extensions`; none for a harness that declares none (a third-party class, say)."""
    value = getattr(harness, "extensions", None)
    return value if isinstance(value, Extensions) else Extensions()


def gateway_env(ctx: HarnessContext) -> dict[str, str]:
    """The variables every SDK reads for its base URL and key, all pointing at this session."""
    gw = ctx.gateway_url.rstrip("/")
    return {
        "HOME": ctx.home,
        "OPENAI_BASE_URL": f"{gw}/v1",
        "OPENAI_API_KEY": ctx.session_id,
        "OPENAI_MODEL": ctx.model,
        "ANTHROPIC_BASE_URL": gw,
        "ANTHROPIC_API_KEY": ctx.session_id,
        "ANTHROPIC_MODEL": ctx.model,
        "GOOGLE_GEMINI_BASE_URL": gw,
        "GEMINI_API_KEY": ctx.session_id,
        "GOOGLE_API_KEY": ctx.session_id,
        "POLAR_SESSION_ID": ctx.session_id,
        "POLAR_GATEWAY_URL": gw,
        "POLAR_MODEL": ctx.model,
    }


class Harness(Protocol):
    name: str

    async def setup(self, runtime: Runtime, ctx: HarnessContext) -> None:
        """Write configuration (and install the program if the runtime lacks it)."""
        ...

    def command(self, ctx: HarnessContext) -> list[str] | str:
        """The headless command that runs the agent on `ctx.instruction` in `ctx.workdir`."""
        ...

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        """Environment for the command: `gateway_env(ctx)`, the preset's own switches, then `ctx.env`."""
        ...

    async def post_run(self, runtime: Runtime, ctx: HarnessContext) -> dict[str, Any]:
        """Collect logs/transcripts into `ctx.artifacts`; returns anything worth keeping in metadata."""
        ...

    def classify(self, record: CompletionRecord) -> tuple[str, ...]:
        """Tags for a captured call (e.g. ("side_call", "title")); () for the main loop."""
        ...
