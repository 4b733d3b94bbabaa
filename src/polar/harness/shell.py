"""The `shell` preset: any command line, with the instruction substituted shell-quoted.

    agent: {harness: shell, settings: {command: "my-agent --prompt {instruction}", collect: ["logs"]}}

Placeholders: `{instruction}`, `{instruction_file}` (setup writes the instruction there, for programs that
read a file or for instructions too long for one argument), `{workdir}`, `{home}`, `{artifacts}`, `{model}`,
`{session_id}`. Each is replaced in one pass by its value quoted with `shlex.quote`, so quotes, `$(...)`,
backticks and newlines in an instruction reach the program literally and are never run by the shell. Write
placeholders bare: inside quotes the quoting would be doubled, so `'{instruction}'` is refused.
Other braces (`${VAR}`, awk's `{print}`) are left alone.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from polar.harness.base import Extensions, HarnessContext, gateway_env
from polar.runtime.base import Runtime, RuntimeFailure
from polar.store.records import CompletionRecord

_PLACEHOLDER = re.compile(r"\{(instruction|instruction_file|workdir|home|artifacts|model|session_id)\}")
_QUOTED = re.compile(r"""['"]\{(instruction|instruction_file|workdir|home|artifacts|model|session_id)\}""")
INSTRUCTION_FILE = ".polar/instruction.md"  # relative to the session's home


def instruction_path(ctx: HarnessContext) -> str:
    return f"{ctx.home.rstrip('/')}/{INSTRUCTION_FILE}"


async def write_instruction(runtime: Runtime, ctx: HarnessContext) -> str:
    """Write `ctx.instruction` into the runtime's home (through the runtime, so it works in any sandbox)."""
    path = instruction_path(ctx)
    script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
    result = await runtime.exec(
        ["sh", "-c", script, "sh", path], stdin=ctx.instruction.encode(), timeout_s=60
    )
    if result.exit_code != 0:
        raise RuntimeFailure(f"could not write the instruction to {path}: {result.stderr.strip()}")
    return path


def substitute(template: str, ctx: HarnessContext) -> str:
    values = {
        "instruction": ctx.instruction,
        "instruction_file": instruction_path(ctx),
        "workdir": ctx.workdir,
        "home": ctx.home,
        "artifacts": ctx.artifacts,
        "model": ctx.model,
        "session_id": ctx.session_id,
    }
    return _PLACEHOLDER.sub(lambda m: shlex.quote(values[m.group(1)]), template)


class ShellHarness:
    """Runs `settings.command` through `bash -lc`; `settings.collect` lists paths (relative to the workdir)
    copied into the artifacts after the run (nothing by default)."""

    name = "shell"
    extensions = Extensions(missing="the shell preset configures nothing of the program it runs")

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        settings = dict(settings or {})
        command = settings.pop("command", None)
        collect = settings.pop("collect", [])
        if settings:
            raise ValueError(f"shell harness: unknown settings {sorted(settings)}; known: command, collect")
        if not isinstance(command, str) or not command.strip():
            raise ValueError("shell harness: settings.command must be a non-empty command line")
        quoted = _QUOTED.search(command)
        if quoted:
            raise ValueError(
                f"shell harness: settings.command quotes {quoted.group(0)[1:]}; write placeholders bare, "
                "they are substituted already shell-quoted"
            )
        if not isinstance(collect, list) or not all(isinstance(p, str) and p for p in collect):
            raise ValueError("shell harness: settings.collect must be a list of paths")
        self.template: str = command
        self.collect: list[str] = collect

    async def setup(self, runtime: Runtime, ctx: HarnessContext) -> None:
        await write_instruction(runtime, ctx)

    def command(self, ctx: HarnessContext) -> str:
        return substitute(self.template, ctx)

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        return {**gateway_env(ctx), "POLAR_INSTRUCTION_FILE": instruction_path(ctx), **ctx.env}

    async def post_run(self, runtime: Runtime, ctx: HarnessContext) -> dict[str, Any]:
        if not self.collect:
            return {}
        collected: list[str] = []
        missing: list[str] = []
        script = 'mkdir -p -- "$1" && cp -r -- "$2" "$1/"'
        for path in self.collect:
            result = await runtime.exec(["sh", "-c", script, "sh", ctx.artifacts, path], timeout_s=120)
            (collected if result.exit_code == 0 else missing).append(path)
        return {"collected": collected, "missing": missing}

    def classify(self, record: CompletionRecord) -> tuple[str, ...]:
        return ()
