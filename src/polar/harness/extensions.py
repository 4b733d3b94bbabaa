"""A task's MCP servers and skills (`agent.mcp_servers`, `agent.skills`), for the harnesses that have them.

Each CLI preset states in its `EXTENSIONS` (`polar.harness.base.Extensions`, also its class's `extensions`)
where it puts them, or why its program has none; its `setup` translates `ctx.mcp_servers` into the
program's own MCP configuration and writes `ctx.skills` with `write_skills`. `check` refuses a task that
gives either to a harness whose program has none when the task is submitted (a field silently ignored would
train a policy on sessions without the tools the task meant to give it).

The servers are stdio commands the program itself starts, so they run inside the session's runtime with the
program's own user, files and network: nothing but the sandbox, and only the gateway beyond it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from polar.harness.base import Extensions, extensions_of
from polar.harness.cli_common import under, write_file
from polar.runtime.base import Runtime, RuntimeFailure
from polar.task import SKILL_FILE, McpServer, Skill

_EXECUTABLE = 'chmod +x -- "$@"'


class Refused(ValueError):
    """A task field the harness cannot honour, with the field (`agent.mcp_servers`, `agent.skills`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def check(
    harness_name: str, harness: object, mcp_servers: Mapping[str, McpServer], skills: Sequence[Skill]
) -> None:
    """`Refused` when the task gives MCP servers or skills to a harness whose program has none."""
    ext = extensions_of(harness)
    declared = isinstance(getattr(harness, "extensions", None), Extensions)
    why = f" ({ext.missing})" if ext.missing else ""
    if not declared:
        why = " (its class declares no `extensions`: polar.harness.base.Extensions)"
    where = "; docs/harnesses.md (MCP servers and skills) lists the presets that can"
    if mcp_servers and ext.mcp is None:
        raise Refused("agent.mcp_servers", f"the {harness_name} harness cannot start MCP servers{why}{where}")
    if skills and ext.skills is None:
        raise Refused("agent.skills", f"the {harness_name} harness reads no skills{why}{where}")


def stdio_entries(servers: Mapping[str, McpServer]) -> dict[str, dict[str, Any]]:
    """`{name: {command, args, env}}`: how Claude Code, Gemini CLI and Qwen Code write a stdio server in
    their `mcpServers`."""
    return {
        name: {"command": s.command, "args": list(s.args), "env": dict(s.env)} for name, s in servers.items()
    }


def tool_name(template: str, server: str, tool: str) -> str:
    """The name a program gives `server`'s `tool` (an `Extensions.tool_name` template filled in)."""
    return template.format(server=server, tool=tool)


async def write_skills(runtime: Runtime, root: str, skills: Sequence[Skill]) -> None:
    """Each skill as `<root>/<name>/SKILL.md` with its files beside it, written through the runtime (so
    inside its sandbox); a file whose text starts with `#!` is made executable, as a skill's scripts are
    meant to be run."""
    scripts: list[str] = []
    for skill in skills:
        folder = under(root, skill.name)
        await write_file(runtime, under(folder, SKILL_FILE), skill.content)
        for path, text in skill.files.items():
            await write_file(runtime, under(folder, path), text)
            if text.startswith("#!"):
                scripts.append(under(folder, path))
    if scripts:
        result = await runtime.exec(["sh", "-c", _EXECUTABLE, "sh", *scripts], timeout_s=60)
        if result.exit_code != 0:
            raise RuntimeFailure(f"could not make the skills' scripts executable: {result.stderr.strip()}")
