"""The `hermes_agent` preset: Nous Research's Hermes Agent (PyPI `hermes-agent`), headless (`hermes -z`),
through its OpenAI Chat client at the gateway.

    agent: {harness: hermes_agent, settings: {toolsets: [terminal, file], max_turns: 50}}

Settings: `toolsets` (Hermes' own toolset names for its CLI platform; default `DEFAULT_TOOLSETS`: its CLI
defaults without the browser, vision and text-to-speech tools, which reach other services), `context_window`
(the served model's context as Hermes is told it, at least 64000, Hermes' minimum; default 131072; it sets
when Hermes compresses its history), `max_tokens` (its per-call output cap; Hermes' own default for a custom
endpoint is 65536), `max_turns` (its tool-loop budget, `agent.max_turns`), `config` (more keys of its
`config.yaml`, merged over the preset's; the model routes are not among them).
A task's `agent.mcp_servers` become `mcp_servers.<name>` entries of `config.yaml` (`config` is merged over
them as over the rest) and its `agent.skills` folders of `$HERMES_HOME/skills`.

Everything is in Hermes' own `config.yaml` under `HERMES_HOME=~/.hermes`, written by `setup`. Facts this
preset relies on, read in hermes-agent 0.19.0's source (`hermes_cli/oneshot.py`, `hermes_cli/config.py`,
`hermes_cli/tools_config.py`, `agent/agent_init.py`, `agent/auxiliary_client.py`, `agent/model_metadata.py`,
`agent/usage_pricing.py`, `tools/approval.py`, `tools/tirith_security.py`, `tools/delegate_tool.py`) and
measured against the fake policy:
- `-z/--oneshot PROMPT` runs one conversation with approvals bypassed and prints only the final answer;
  the prompt is handed over as `--oneshot=<instruction>` by a launcher (`LAUNCH`) that reads the
  instruction file and calls `hermes_cli.main:main` as the `hermes` script does (the instruction is never
  parsed as flags and has no argument-size limit). `--usage-file` writes its token report into the artifacts.
- The model is `provider: custom` with `base_url: <gw>/v1` and `api_key`: the OpenAI SDK's Chat
  Completions, streamed, `max_tokens` always sent. `context_length` is required in practice: without it
  Hermes probes the endpoint and looks the model up on openrouter.ai; below 64000 it refuses to start.
  `ollama_num_ctx: 0` skips its Ollama probe of the endpoint (zero adds no `options` to the request).
- Every auxiliary task (`auxiliary.<task>`: context compression, vision, web extraction, approvals, ...) is
  pointed at the gateway with the session key and the served model; subagents (`delegate_task`) inherit the
  main model's endpoint. `auxiliary.compression.context_length` keeps Hermes from probing for the summary
  model's window.
- Off: title generation (interactive only, off anyway), the skill curator, the background memory and skill
  review (`nudge_interval: 0`), LSP servers (installed on demand), lazy pip installs of tool dependencies,
  the tirith scanner (downloaded from GitHub), the model catalog; approvals `off` (the sandbox is the
  boundary; Hermes' hard-line blocks stay). `-z` makes no update check (only `hermes version` and the
  interactive banner do) and sends no telemetry (its observability plugins are opt-in).
- Still sent to the gateway: after the first answer Hermes prices the call once per process, which for a
  custom endpoint probes it (GET /api/v1/models, /api/tags, /v1/props, /props, /version, /v1/models).
- State under HERMES_HOME: config.yaml, SOUL.md, state.db (SQLite sessions), sessions/*.json (the
  transcript, `write_json_snapshots`), logs/; `post_run` copies the sessions and logs into the artifacts.
- Side calls have no tools: context compression (its summarizer prompt, a lone user message), any other
  auxiliary task; subagents' calls have tools and their own system prompt (tagged `subagent`).
- MCP (`tools/mcp_tool.py`, `hermes_cli/mcp_startup.py`, `hermes_cli/mcp_security.py`): a no-op unless the
  `mcp` package imports, which only the `mcp` extra installs (`INSTALL`). Each stdio server is started with
  PATH, HOME, USER, LANG, LC_ALL, TERM, SHELL, TMPDIR and XDG_* of Hermes' environment plus its `env`, and
  `${VAR}` in its command, args and env is replaced from Hermes' environment; its tools are named
  `mcp__<server>__<tool>` (a hyphen becomes `_`). A server whose command is a shell (sh, bash, ...) running
  a script that names curl, wget, nc, socat or /dev/tcp, or writes SSH keys, PAM, sudoers, cron or shell rc
  files, is skipped as suspicious, with a line in its log only. `-z` connects the servers in a background
  thread and builds its tool list without waiting (only the interactive chat waits, 1.5 s); late tools are
  added only between turns, and -z has one: a server 1 s late gave the session none of its tools
  (measured). So `LAUNCH` starts that same discovery first, waits for it (each server's `connect_timeout`,
  Hermes' 120 s for all) and stops before any model call, naming the server and the reason, when a task's
  server did not connect or was skipped (`post_run` then fails the session); `main` then finds the
  discovery started and the tools registered.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from polar.harness.base import Extensions, HarnessContext, gateway_env
from polar.harness.cli_common import (
    collect,
    deep_merge,
    optional_positive_int,
    pip_cli_env,
    positive_int,
    refuse_unknown,
    texts,
    under,
    write_file,
)
from polar.harness.extensions import stdio_entries, write_skills
from polar.harness.install import pip_prefix, version_of
from polar.harness.shell import instruction_path, write_instruction
from polar.jsontypes import JSON
from polar.runtime.base import Runtime, RuntimeFailure
from polar.store.records import CompletionRecord

PACKAGE = "hermes-agent"
VERSION = "0.19.0"
# Installed with its `mcp` extra (mcp 1.26.0, starlette 1.0.1 and their dependencies: 7 MB more, 210 MB in
# all): without the `mcp` package Hermes' MCP client does nothing, without a word.
INSTALL = f"{PACKAGE}[mcp]"
BINARY = "hermes"  # its script calls `hermes_cli.main:main`, as LAUNCH does
DIALECT = "chat"
CONFIGURES = (
    "HERMES_HOME=~/.hermes, its config.yaml: model provider custom at <gw>/v1 with the session key and the "
    "context length, every auxiliary task (compression, vision, ...) at the gateway too; CLI toolsets "
    "without browser, vision and speech; approvals off; no curator, background review, LSP installs, "
    "lazy pip installs, tirith download or model catalog; session JSON snapshots, copied with its logs; "
    "`hermes -z` (--oneshot) with the instruction file's text, --usage-file in the artifacts; installed with "
    "its `mcp` extra"
)
LIMITS = (
    "context compression (by default once a prompt passes 64000 tokens or 75% of `context_window` less "
    "`max_tokens`, whichever is more) is a tagged side call after which the loop goes on from a rewritten "
    "history: a new trace; subagents (`delegate_task`) share the session, tagged `subagent`; the loop's calls "
    "ask for max_tokens (65536 unless settings.max_tokens); after its first answer Hermes "
    "probes the gateway's routes once to price the call; `context_window` must be at least 64000 "
    "(Hermes refuses smaller); catastrophic commands stay blocked by Hermes itself; a task's MCP server that "
    "does not connect in 60 s, or that Hermes skips as suspicious (a shell command line naming curl, wget, "
    "nc, socat or /dev/tcp, or writing SSH keys, PAM, sudoers, cron or shell rc files), ends the session "
    "in error before any call; its servers get only PATH, HOME and a few more of the environment, plus their `env`, with "
    "`${VAR}` replaced from Hermes' environment"
)
EXTENSIONS = Extensions(
    mcp="config.yaml `mcp_servers.<name>` (command, args, env, connect_timeout 60 s), under settings.config's; "
    "connected before the first call",
    tool_name="mcp__{server}__{tool}",
    skills="$HERMES_HOME/skills/<name>/SKILL.md (listed in the system prompt, loaded with skill_view)",
)

HERMES_DIR = ".hermes"  # HERMES_HOME, under the session's home
MCP_STARTUP_S = 60  # each task server's connect_timeout (Hermes' default, written out)
MCP_FAILED = 3  # the launcher's exit status when a task's MCP server did not connect
MCP_REPORT = "hermes-mcp-failed.txt"  # in the artifacts: which servers did not connect, and why
USAGE = "hermes-usage.json"  # -z --usage-file, in the artifacts
MIN_CONTEXT = 64000  # Hermes 0.19.0's MINIMUM_CONTEXT_LENGTH: it refuses a smaller window
DEFAULT_TOOLSETS = (
    "terminal",
    "file",
    "code_execution",
    "todo",
    "skills",
    "memory",
    "session_search",
    "clarify",
    "delegation",
)
# Hermes 0.19.0's auxiliary tasks (DEFAULT_CONFIG["auxiliary"] in hermes_cli/config.py), all at the gateway.
AUX_TASKS = (
    "vision",
    "web_extract",
    "compression",
    "skills_hub",
    "approval",
    "mcp",
    "title_generation",
    "memory_query_rewrite",
    "tts_audio_tags",
    "triage_specifier",
    "kanban_decomposer",
    "profile_describer",
    "goal_judge",
    "curator",
    "monitor",
    "background_review",
    "moa_reference",
    "moa_aggregator",
)
ROUTE_KEYS = ("provider", "model", "base_url", "api_key", "api_mode")
_FIXED = ("model", "providers", "custom_providers", "fallback_providers")
_SETTINGS = ("toolsets", "context_window", "max_tokens", "max_turns", "config")
SUBAGENT = "You are a focused subagent working on a specific delegated task."  # tools/delegate_tool.py
# Opening words of the auxiliary prompts a one-shot coding session can send (no tools offered).
SIDE_PROMPTS = {"You are a summarization agent creating a context checkpoint.": "compression"}
# Runs Hermes' CLI as its `hermes` script does (`hermes_cli.main:main`), with the instruction file's text as
# its -z prompt and the usage report's path. Given the task's MCP server names, it first runs the discovery
# -z would start in the background, waits for it, and stops (MCP_FAILED) naming each server that did not
# connect: -z builds its tool list without waiting (see the module's docstring).
LAUNCH = """\
import importlib.util, os, sys
prompt = open(sys.argv[1], encoding='utf-8').read()
usage, report, servers = sys.argv[2], sys.argv[3], sys.argv[4:]
sys.argv = ['hermes', '--usage-file', usage, '--oneshot=' + prompt]
import hermes_cli.main as hermes
if servers:
    from hermes_cli import mcp_startup
    from hermes_cli.config import load_config
    from hermes_cli.mcp_security import validate_mcp_server_entry
    from tools.mcp_tool import get_mcp_status
    mcp_startup.start_background_mcp_discovery(logger=hermes.logger, thread_name='cli-mcp-discovery')
    mcp_startup.join_mcp_discovery()
    status = {s['name']: s for s in get_mcp_status()}
    entries = load_config().get('mcp_servers') or {}
    failed = []
    for name in [name for name in servers if not status.get(name, {}).get('connected')]:
        why = validate_mcp_server_entry(name, entries.get(name) or {})
        if importlib.util.find_spec('mcp') is None:
            why.append('the mcp package is not installed')
        why = why or [status.get(name, {}).get('error') or status.get(name, {}).get('status', 'no entry')]
        failed.append(f'MCP server {name!r} did not connect: ' + '; '.join(why))
    if failed:
        text = '; '.join(failed) + ' (their output: logs/mcp-stderr.log of hermes-home in the artifacts)'
        open(report, 'w', encoding='utf-8').write(text)
        print(text, file=sys.stderr, flush=True)
        os._exit(MCP_FAILED)
sys.exit(hermes.main())
""".replace("MCP_FAILED", str(MCP_FAILED))


def _config_overlay(config: JSON) -> dict[str, Any]:
    """`settings.config`, refusing what would take a model call away from the gateway."""
    if not isinstance(config, dict):
        raise ValueError(f"hermes_agent harness: settings.config must be a mapping, not {config!r}")
    clash = [key for key in _FIXED if key in config]
    aux = config.get("auxiliary", {})
    if isinstance(aux, dict):
        clash += [
            f"auxiliary.{task}.{key}"
            for task, entry in aux.items()
            if isinstance(entry, dict)
            for key in ROUTE_KEYS
            if key in entry
        ]
    delegation = config.get("delegation", {})
    if isinstance(delegation, dict):
        clash += [f"delegation.{key}" for key in ROUTE_KEYS if key in delegation]
    if clash:
        raise ValueError(f"hermes_agent harness: settings.config may not set {clash} (the gateway's)")
    return config


def mcp_servers(ctx: HarnessContext) -> dict[str, dict[str, Any]]:
    """The task's servers as 0.19.0's `mcp_servers.<name>` entries (stdio: command, args, env)."""
    return {
        name: {**entry, "connect_timeout": MCP_STARTUP_S}
        for name, entry in stdio_entries(ctx.mcp_servers).items()
    }


def _extensions(toolsets: list[str]) -> Extensions:
    """EXTENSIONS, less what `settings.toolsets` turns off (so a task giving it is refused, not ignored)."""
    ext, missing = EXTENSIONS, []
    if "no_mcp" in toolsets:
        ext = dataclasses.replace(ext, mcp=None, tool_name=None)
        missing.append("settings.toolsets has `no_mcp`, which leaves out every MCP server's tools")
    if "skills" not in toolsets:
        ext = dataclasses.replace(ext, skills=None)
        missing.append("settings.toolsets has no `skills`, without which Hermes lists no skill")
    return dataclasses.replace(ext, missing="; ".join(missing))


class HermesAgentHarness:
    name = "hermes_agent"
    extensions = EXTENSIONS

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        settings = dict(settings or {})
        refuse_unknown(self.name, settings, _SETTINGS)
        toolsets = settings.get("toolsets", list(DEFAULT_TOOLSETS))
        if (
            not isinstance(toolsets, list)
            or not toolsets
            or not all(isinstance(t, str) and t for t in toolsets)
        ):
            raise ValueError(
                "hermes_agent harness: settings.toolsets must be a non-empty list of toolset names, "
                f"not {toolsets!r}"
            )
        self.toolsets: list[str] = toolsets
        self.extensions = _extensions(toolsets)
        window = positive_int(self.name, "context_window", settings.get("context_window", 131072))
        if window < MIN_CONTEXT:
            raise ValueError(
                f"hermes_agent harness: settings.context_window must be at least {MIN_CONTEXT} "
                f"(Hermes refuses a smaller model), not {window}"
            )
        self.context_window = window
        self.max_tokens = optional_positive_int(self.name, "max_tokens", settings.get("max_tokens"))
        self.max_turns = optional_positive_int(self.name, "max_turns", settings.get("max_turns"))
        self.extra = _config_overlay(settings.get("config", {}))
        self.prefix: Path | None = None

    def route(self, ctx: HarnessContext) -> dict[str, Any]:
        """An endpoint entry (the main model's, or an auxiliary task's): the gateway, the session key."""
        return {
            "provider": "custom",
            "base_url": f"{ctx.gateway_url.rstrip('/')}/v1",
            "api_key": ctx.session_id,
            "model": ctx.model,
        }

    def config(self, ctx: HarnessContext) -> dict[str, Any]:
        """The `config.yaml` the preset writes."""
        model = {
            **self.route(ctx),
            "default": ctx.model,
            "context_length": self.context_window,
            "ollama_num_ctx": 0,
        }
        if self.max_tokens is not None:
            model["max_tokens"] = self.max_tokens
        auxiliary: dict[str, Any] = {task: self.route(ctx) for task in AUX_TASKS}
        auxiliary["compression"]["context_length"] = self.context_window
        auxiliary["title_generation"]["enabled"] = False
        agent: dict[str, Any] = {} if self.max_turns is None else {"max_turns": self.max_turns}
        base: dict[str, Any] = {
            "model": model,
            "fallback_providers": [],
            "platform_toolsets": {"cli": list(self.toolsets)},
            "agent": agent,
            "auxiliary": auxiliary,
            "approvals": {"mode": "off"},
            "security": {"tirith_enabled": False, "allow_lazy_installs": False},
            "lsp": {"enabled": False},
            "model_catalog": {"enabled": False},
            "curator": {"enabled": False},
            "memory": {"nudge_interval": 0},
            "skills": {"creation_nudge_interval": 0},
            "sessions": {"write_json_snapshots": True},
        }
        if ctx.mcp_servers:
            base["mcp_servers"] = mcp_servers(ctx)
        return deep_merge(base, self.extra)

    async def setup(self, runtime: Runtime, ctx: HarnessContext) -> None:
        if not ctx.instruction:
            # `hermes --oneshot=` with nothing after it would start the interactive chat instead.
            raise RuntimeFailure("hermes_agent harness: the instruction is empty (hermes -z needs a prompt)")
        # POLAR_TOOL_VERSIONS names the package, not the package with its extra.
        self.prefix = await asyncio.to_thread(pip_prefix, INSTALL, version_of(PACKAGE, VERSION))
        await write_instruction(runtime, ctx)
        # JSON is YAML: Hermes' YAML loader reads it as written.
        text = json.dumps(self.config(ctx), indent=2)
        await write_file(runtime, under(ctx.home, f"{HERMES_DIR}/config.yaml"), text)
        await write_skills(runtime, under(ctx.home, f"{HERMES_DIR}/skills"), ctx.skills)

    def command(self, ctx: HarnessContext) -> list[str]:
        usage, report = under(ctx.artifacts, USAGE), under(ctx.artifacts, MCP_REPORT)
        return [sys.executable, "-c", LAUNCH, instruction_path(ctx), usage, report, *ctx.mcp_servers]

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        return {
            **gateway_env(ctx),
            **pip_cli_env(self.prefix),
            "HERMES_HOME": under(ctx.home, HERMES_DIR),
            "TERM": "dumb",
            **ctx.env,
        }

    async def post_run(self, runtime: Runtime, ctx: HarnessContext) -> dict[str, Any]:
        """Hermes' session transcripts and logs join its usage report in the artifacts. A task's MCP server
        that did not connect is an error of the session (Hermes never ran), not an outcome of the policy's."""
        meta = await collect(runtime, ctx, "hermes-home", [f"{HERMES_DIR}/sessions", f"{HERMES_DIR}/logs"])
        if ctx.mcp_servers:
            report = await runtime.exec(["cat", under(ctx.artifacts, MCP_REPORT)], timeout_s=60)
            if report.exit_code == 0:
                raise RuntimeFailure(f"hermes_agent harness: {report.stdout.strip()}")
        return meta

    def classify(self, record: CompletionRecord) -> tuple[str, ...]:
        """The loop offers tools; a subagent's loop too, under its own system prompt; a call without tools is
        an auxiliary task (compression, by its prompt)."""
        messages = record.request.get("messages") or []
        first = messages[0] if messages and isinstance(messages[0], dict) else {}
        text = "".join(texts(first.get("content")))
        if record.tools:
            return ("subagent",) if first.get("role") == "system" and SUBAGENT in text else ()
        kind = next((k for opening, k in SIDE_PROMPTS.items() if text.startswith(opening)), "auxiliary")
        return ("side_call", kind)


PRESET = HermesAgentHarness
