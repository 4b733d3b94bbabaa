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
# Prints the PATH it searches (the first argument, else its own), then each further argument that names no
# program there: a path that is not an executable file, or a name not on PATH (`command -v` also prints a
# path it does not check, hence the test for paths); NUL after each. The shell is found on its own PATH.
_MISSING = """[ -z "$1" ] || PATH=$1
shift
printf '%s\\0' "$PATH"
for c do
  case $c in
    */*) [ -f "$c" ] && [ -x "$c" ] ;;
    *) command -v -- "$c" >/dev/null 2>&1 ;;
  esac || printf '%s\\0' "$c"
done"""


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


async def check_commands(runtime: Runtime, servers: Mapping[str, McpServer], env: dict[str, str]) -> None:
    """`RuntimeFailure` naming each server whose `command` the runtime does not have, looked up as the
    harness will start it: on the PATH of the harness's environment `env` (or the server's own `env.PATH`),
    from the working directory.

    Why before the program starts: the programs differ on a server that cannot start, and some of them
    badly. OpenHands 1.16 waits for it before its first call until the session's deadline; Claude Code
    2.1.197 goes on without it, so the policy is trained on sessions without the tools the task gave it;
    Codex and Hermes end the run. A missing program is the task's or the image's error: it ends the
    session at once, naming the server, whatever the harness."""
    by_path: dict[str, list[tuple[str, str]]] = {}
    for name, server in servers.items():
        path = server.env.get("PATH", env.get("PATH", ""))
        by_path.setdefault(path, []).append((name, server.command))
    missing: list[str] = []
    for path, named in by_path.items():
        argv = ["sh", "-c", _MISSING, "sh", path, *(command for _, command in named)]
        result = await runtime.exec(argv, env=env, timeout_s=60)
        if result.exit_code != 0:
            raise RuntimeFailure(f"could not look the MCP servers' commands up: {result.stderr.strip()}")
        searched, *absent = result.stdout.split("\0")
        missing += [
            f"{name} ({command!r} not found on PATH={searched})"
            for name, command in named
            if command in absent
        ]
    if missing:
        raise RuntimeFailure(f"agent.mcp_servers: the runtime has no program for {', '.join(missing)}")


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
