"""The `openhands` preset: the OpenHands CLI (PyPI `openhands`), headless, through the OpenHands SDK's
LiteLLM client at the gateway.

    agent: {harness: openhands, settings: {condenser_max_size: 120}}

Settings: `python` (a Python 3.12 on the node, by absolute path; default: the first that runs of
`python3.12` on PATH, pyenv's and uv's installs), `condenser_max_size` (events in the agent's view before
its condenser summarises the older ones, a side call; OpenHands' default 240, at least 8), `llm` (more
fields of the SDK's LLM settings, e.g. `temperature`, `max_output_tokens`, `num_retries`,
`reasoning_effort`, set on the agent's and the condenser's model alike; not the model, its URL or key).

OpenHands 1.16.0 requires Python ==3.12.* (its SDK is written in 3.12 syntax). The preset copies the node's
3.12 (binary, standard library, libpython) into the tool cache with OpenHands installed into the copy's
own site-packages (`polar.harness.install.python_prefix`): sandboxes see the tool cache, and no PYTHONPATH
leaks into the commands the agent runs.

The rest is OpenHands' own files and environment under the session's home, written by `setup`. Facts this
preset relies on, read in openhands 1.16.0 and openhands-sdk/-tools 1.21.0 (`openhands_cli/entrypoint.py`,
`utils.py`, `locations.py`, `stores/agent_store.py`, `tui/textual_app.py`, `version_check.py`;
`sdk/skills/skill.py`, `sdk/utils/command.py`, `sdk/context/condenser/`, `tools/task/manager.py`) and
measured against the fake policy:
- `--headless --task=T` runs T as the first user message, verbatim (`--file` would wrap it in a preamble
  naming the file), approves every action and exits when the agent answers without a tool call. A
  launcher (`LAUNCH`) reads the instruction file into `--task=` (a value even when it starts with "-"; no
  shell, no argument-size limit of its own).
- Headless needs a saved agent, `$OPENHANDS_PERSISTENCE_DIR/agent_settings.json` (the SDK's serialized
  Agent): its `llm` (model `openai/<M>`, LiteLLM's OpenAI Chat client; `base_url` <gw>/v1; the session
  key) and its condenser's `llm` (the same, usage `condenser`). One it cannot load makes headless exit 0
  having done nothing: `post_run` fails the session when no conversation was made. Without
  `--override-with-envs` the LLM_* variables are ignored, so neither the node's nor those of a `.env` in the
  workdir (loaded at start, never over a variable already set) move the model elsewhere.
- The CLI picks the tools (terminal, file_editor, task_tracker, task; finish and think come with the
  agent; no browser) and always sets its LLM security analyzer: every tool but finish and think requires
  a `security_risk` argument, and a call without one comes back as an error observation. It reads the
  workdir's own skills and hooks (AGENTS.md, .openhands/) as it always does.
- A task's MCP servers go in `$OPENHANDS_PERSISTENCE_DIR/mcp.json` (`{"mcpServers": {...}}`, which the CLI
  reads at each start, `mcp/mcp_utils.py`); the agent starts them and lists their tools while it builds
  its tool list, before its first call (`sdk/agent/base.py`: `create_mcp_tools(config, 30)`; measured
  with a server starting 3 s late). A server that cannot start (a command that does not exist) leaves
  headless hanging before its first call, until the session's deadline (measured): the node looks every
  server's program up before the CLI starts (`polar.harness.extensions.check_commands`). One server's tools keep their own names; with two or more, fastmcp mounts
  them as `<server>_<tool>`. Like every tool but finish and think, an MCP tool not marked read-only takes
  a `security_risk` argument.
- A task's skills go in `~/.agents/skills/<name>/` (first of the SDK's user skill folders, read with
  `load_user_skills`): each one's name and description in the system prompt, its text through the
  `invoke_skill` tool. The public skills are loaded apart (their failed clone is logged and skipped).
- Sent with every call: `reasoning_effort: high` (the SDK's default; `llm: {reasoning_effort: null}` drops
  it) and `prompt_cache_key` (the conversation's id); never streamed.
- Public skills: each start git-clones github.com/OpenHands/extensions into ~/.openhands/cache (no switch;
  their text would change the system prompt with that repository). Git's own environment (`GIT_CONFIG_*`,
  `url.<nowhere>.insteadOf`) turns that one URL into a path that does not exist: the clone fails at once.
- Off: the SDK's banner (`OPENHANDS_SUPPRESS_BANNER`), LiteLLM's price-list download
  (`LITELLM_LOCAL_MODEL_COST_MAP`), the critic (an All-Hands service; off in headless mode). No telemetry
  is sent (Laminar tracing needs its own key). Not off: each start GETs pypi.org/pypi/openhands/json for
  the splash screen's update notice (2 s timeout, no switch); where only the gateway is reachable its
  lookup fails at once (`tests/test_cli_openhands.py` traces it).
- Conversations (the events: the transcript) go into the artifacts (`OPENHANDS_CONVERSATIONS_DIR`).
- The copy's libpython folder (a shared build finds its library by an absolute path into the original)
  is on LD_LIBRARY_PATH for the interpreter only: the launcher puts the task's own value back before
  OpenHands starts, because the terminal tool's tmux server inherits the whole environment (its
  `sanitized_env`, which would restore LD_LIBRARY_PATH_ORIG, is not what tmux starts from: measured).
- Side calls: the condenser's summary (no tools, its prompt's first words), tagged `side_call`,
  `condenser`. The task tool's sub-agents share the agent's model and offer no `task` tool: tagged
  `subagent`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from polar.harness.base import Extensions, HarnessContext, gateway_env
from polar.harness.cli_common import positive_int, refuse_unknown, texts, under, write_json
from polar.harness.extensions import stdio_entries, write_skills
from polar.harness.install import InstallError, find_python, python_binary, python_env, python_prefix
from polar.harness.shell import instruction_path, write_instruction
from polar.runtime.base import Runtime, RuntimeFailure
from polar.store.records import CompletionRecord

PACKAGE = "openhands"
VERSION = "1.16.0"
BINARY = "openhands"  # run as module openhands_cli.entrypoint, the one behind the `openhands` script
PYTHON = "3.12"  # openhands 1.16.0: Requires-Python ==3.12.*
DIALECT = "chat"
CONFIGURES = (
    "a private copy of the node's Python 3.12 with OpenHands in the tool cache; OPENHANDS_PERSISTENCE_DIR="
    "~/.openhands, its agent_settings.json: agent and condenser LLM openai/<M> at <gw>/v1 with the session "
    "key; conversations in the artifacts; no banner or price-list download; the public-skills clone sent "
    "nowhere (git's GIT_CONFIG_*); `--headless --task=` with the instruction file's text"
)
LIMITS = (
    "needs Python 3.12 on the node (settings.python, or found on PATH, pyenv, uv); each start asks pypi.org "
    "for its newest release (no switch: where only the gateway is reachable it fails at once); every tool "
    "call needs a `security_risk` argument; a condensation rewrites the history, so the call after it "
    "starts a new trace; an MCP server that cannot start makes it hang before its first call until the "
    "session's deadline (a server whose program is missing ends the session at setup instead); one server's tools keep their bare names (two or more: `<server>_<tool>`)"
)
EXTENSIONS = Extensions(
    mcp="$OPENHANDS_PERSISTENCE_DIR/mcp.json `mcpServers` (command, args, the task's agent.env under the "
    "server's env); the agent starts them and lists their tools before its first call",
    tool_name="{tool}",
    skills="~/.agents/skills/<name>/SKILL.md (listed in the system prompt, loaded with invoke_skill)",
)

PERSISTENCE = ".openhands"  # under the session's home
MCP_CONFIG = "mcp.json"  # openhands_cli/locations.py MCP_CONFIG_FILE, in the persistence folder
SKILLS = ".agents/skills"  # under the session's home: the first of the SDK's USER_SKILLS_DIRS
CONVERSATIONS = "openhands-conversations"  # under the artifacts
PUBLIC_SKILLS = "https://github.com/OpenHands/extensions"  # sdk/skills/skill.py PUBLIC_SKILLS_REPO
NOWHERE = "/nonexistent/openhands-public-skills"
# The first words of the condenser's prompt (sdk/context/condenser/prompts/summarizing_prompt.j2).
CONDENSER_PROMPT = "You are maintaining a context-aware state summary for an interactive agent."
TASK_TOOL = "task"  # the agent's sub-agent tool; sub-agents have none (tools/preset/subagents/*.md)
TOOLS = ("terminal", "file_editor", "task_tracker", "task_tool_set")  # openhands_cli.utils, the CLI's own
# The condenser keeps the first 2 events and refuses a max_size with max_size // 2 - 3 <= 0.
MIN_CONDENSER_SIZE = 8
# `openhands --headless --task=<the instruction file's text>`, run as the `openhands` script would, once
# the copy's libpython is loaded: LD_LIBRARY_PATH goes back to the task's own (LD_LIBRARY_PATH_ORIG, empty:
# none) so that nothing OpenHands starts inherits the copy's folder.
LAUNCH = "\n".join(
    [
        "import os, runpy, sys",
        "orig = os.environ.pop('LD_LIBRARY_PATH_ORIG', '')",
        "os.environ.pop('LD_LIBRARY_PATH', None)",
        "if orig: os.environ['LD_LIBRARY_PATH'] = orig",
        "task = open(sys.argv[1], encoding='utf-8').read()",
        "sys.argv = ['openhands', '--headless', '--task=' + task]",
        "runpy.run_module('openhands_cli.entrypoint', run_name='__main__')",
    ]
)
_GATEWAY_FIELDS = {"model", "base_url", "api_key", "usage_id"}
_SETTINGS = ("python", "condenser_max_size", "llm")
# Lists the conversations OpenHands made (one folder each, holding base_state.json).
_CONVERSATIONS = 'ls -1 -- "$1"/*/base_state.json 2>/dev/null | wc -l'


def mcp_config(ctx: HarnessContext) -> dict[str, Any]:
    """mcp.json: the task's servers as fastmcp's `MCPConfig` (what the CLI loads). OpenHands starts a stdio
    server with only HOME, LOGNAME, PATH, SHELL, TERM and USER of its own environment (the mcp SDK's
    `get_default_environment`) plus the server's `env`: the task's `agent.env` goes under it, so a server
    sees the task's variables as under the other presets (and never the copy's LD_LIBRARY_PATH)."""
    servers = stdio_entries(ctx.mcp_servers)
    for entry in servers.values():
        entry["env"] = {**ctx.env, **entry["env"]}
    return {"mcpServers": servers}


class OpenHandsHarness:
    name = "openhands"
    extensions = EXTENSIONS

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        settings = dict(settings or {})
        refuse_unknown(self.name, settings, _SETTINGS)
        python = settings.get("python")
        if python is not None and (not isinstance(python, str) or not python.startswith("/")):
            raise ValueError(f"openhands harness: settings.python must be an absolute path, not {python!r}")
        self.python: str | None = python
        size = positive_int(self.name, "condenser_max_size", settings.get("condenser_max_size", 240))
        if size < MIN_CONDENSER_SIZE:
            raise ValueError(
                f"openhands harness: settings.condenser_max_size must be at least {MIN_CONDENSER_SIZE} "
                f"(OpenHands keeps the first 2 events and refuses a smaller one), not {size}"
            )
        self.condenser_max_size = size
        llm = settings.get("llm", {})
        if not isinstance(llm, dict):
            raise ValueError(f"openhands harness: settings.llm must be a mapping of LLM fields, not {llm!r}")
        clash = sorted(_GATEWAY_FIELDS & set(llm))
        if clash:
            raise ValueError(f"openhands harness: settings.llm may not set {clash} (the gateway's)")
        self.llm_extra: dict[str, Any] = llm
        self.prefix: Path | None = None

    def llm(self, ctx: HarnessContext, usage: str) -> dict[str, Any]:
        return {
            **self.llm_extra,
            "model": f"openai/{ctx.model}",  # LiteLLM's OpenAI-compatible Chat client
            "base_url": f"{ctx.gateway_url.rstrip('/')}/v1",
            "api_key": ctx.session_id,
            "usage_id": usage,
        }

    def agent_settings(self, ctx: HarnessContext) -> dict[str, Any]:
        """The SDK's serialized Agent that `--headless` loads (the CLI sets tools, skills and MCP itself,
        from its own files)."""
        return {
            "kind": "Agent",
            "llm": self.llm(ctx, "agent"),
            "tools": [{"name": name, "params": {}} for name in TOOLS],
            "condenser": {
                "kind": "LLMSummarizingCondenser",
                "llm": self.llm(ctx, "condenser"),
                "max_size": self.condenser_max_size,
                "keep_first": 2,
            },
        }

    async def setup(self, runtime: Runtime, ctx: HarnessContext) -> None:
        try:
            python = await asyncio.to_thread(find_python, PYTHON, self.python)
        except InstallError as exc:
            raise RuntimeFailure(
                f"openhands harness: {PACKAGE} {VERSION} needs Python {PYTHON}: {exc}; install one (uv, "
                "pyenv, a distribution's python3.12) or name it in settings.python"
            ) from None
        self.prefix = await asyncio.to_thread(python_prefix, PACKAGE, VERSION, python)
        await write_instruction(runtime, ctx)
        path = under(ctx.home, f"{PERSISTENCE}/agent_settings.json")
        await write_json(runtime, path, self.agent_settings(ctx))
        if ctx.mcp_servers:
            await write_json(runtime, under(ctx.home, f"{PERSISTENCE}/{MCP_CONFIG}"), mcp_config(ctx))
        await write_skills(runtime, under(ctx.home, SKILLS), ctx.skills)

    def command(self, ctx: HarnessContext) -> list[str]:
        binary = str(python_binary(self.prefix)) if self.prefix else f"python{PYTHON}"
        return [binary, "-s", "-u", "-c", LAUNCH, instruction_path(ctx)]

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        theirs = ctx.env.get("LD_LIBRARY_PATH", "")
        switches = {
            "LD_LIBRARY_PATH_ORIG": theirs,  # LAUNCH puts it back once the interpreter is loaded
            "OPENHANDS_PERSISTENCE_DIR": under(ctx.home, PERSISTENCE),
            "OPENHANDS_CONVERSATIONS_DIR": under(ctx.artifacts, CONVERSATIONS),
            "OPENHANDS_WORK_DIR": ctx.workdir,
            "OPENHANDS_SUPPRESS_BANNER": "1",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "GIT_CONFIG_COUNT": "1",
            "GIT_CONFIG_KEY_0": f"url.{NOWHERE}.insteadOf",
            "GIT_CONFIG_VALUE_0": PUBLIC_SKILLS,
        }
        env = {**gateway_env(ctx), **switches, **ctx.env}
        library = python_env(self.prefix).get("LD_LIBRARY_PATH") if self.prefix else None
        if library:  # the copy's libpython first, then the task's own folders
            env["LD_LIBRARY_PATH"] = f"{library}:{theirs}" if theirs else library
        return env

    async def post_run(self, runtime: Runtime, ctx: HarnessContext) -> dict[str, Any]:
        """The conversations OpenHands made (already in the artifacts); none is an error: headless exits 0
        without a word of it when it cannot load the agent settings."""
        folder = under(ctx.artifacts, CONVERSATIONS)
        result = await runtime.exec(["sh", "-c", _CONVERSATIONS, "sh", folder], timeout_s=60)
        made = int(result.stdout.strip() or 0) if result.exit_code == 0 else 0
        if made == 0:
            raise RuntimeFailure(
                "openhands harness: OpenHands made no conversation: it never started the agent (it exits 0 "
                f"without one when it cannot load {PERSISTENCE}/agent_settings.json, e.g. a settings.llm "
                "field its LLM refuses; its own output says why)"
            )
        return {"conversations": made}

    def classify(self, record: CompletionRecord) -> tuple[str, ...]:
        """The condenser's summaries (by their prompt) and the task tool's sub-agents (no `task` tool)."""
        if not record.tools:
            messages = record.request.get("messages") or []
            text = "".join(t for m in messages if isinstance(m, dict) for t in texts(m.get("content")))
            return ("side_call", "condenser") if CONDENSER_PROMPT in text else ()
        names = {t.get("function", {}).get("name") for t in record.tools if isinstance(t, dict)}
        return () if TASK_TOOL in names else ("subagent",)


PRESET = OpenHandsHarness
