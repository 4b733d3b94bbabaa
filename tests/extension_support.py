"""A task's MCP server and skill as the CLI tests give them to every preset that supports them, the scripted
policy that calls the server's tool by the name the CLI gives it, and the checks on the run.

The server is tests/mcp_weather.py (the official `mcp` SDK, from the tool cache), started by the CLI inside the
session's runtime. `delay_s` makes it start that much later, as a server on a busy node does: a preset must have
its CLI wait for it, or the first calls go out without its tools.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

from polar.harness.base import extensions_of
from polar.harness.extensions import tool_name
from polar.harness.install import tools_home
from polar.store.records import CompletionRecord
from tests import mcp_weather
from tests.fakes.fake_vllm import Reply, Script
from tests.preset_run_support import FINAL, SIDE_ANSWER, PresetRun, check_capture

SCRIPT = Path(mcp_weather.__file__).resolve()
# The skill's description is all a CLI shows the model of a skill until it loads it: seen in a request,
# the skill was found where the preset put it.
SKILL_MARK = "tide tables of any harbour"
SKILL = {
    "name": "tide-reading",
    "content": f"---\nname: tide-reading\ndescription: Reads the {SKILL_MARK}.\n---\nOpen tides.md.\n",
    "files": {"tides.md": "High water at 06:12.\n"},
}
ANSWER = "sunny in Oslo"  # what the forecast tool returns for {"city": "Oslo"}
ARGUMENTS = '{"city":"Oslo"}'


def server(delay_s: float = 0, unseen: Path | None = None) -> dict[str, Any]:
    """`agent.mcp_servers.weather`: the weather server, run by this Python (which every runtime but a
    container's sees). With `unseen`, it starts only where that host path is not visible: in a sandbox."""
    command = f"exec {shlex.quote(sys.executable)} {shlex.quote(str(SCRIPT))}"
    if delay_s:
        command = f"sleep {delay_s:g}; {command}"
    if unseen is not None:
        command = f"[ ! -e {shlex.quote(str(unseen))} ] || exit 3; {command}"
    # The CLIs start it with their own HOME (the session's): POLAR_HOME names the tool cache with the SDK.
    return {"command": "sh", "args": ["-c", command], "env": {"POLAR_HOME": str(tools_home().parent)}}


def agent_fields(delay_s: float = 0, unseen: Path | None = None, *, mcp: bool = True) -> dict[str, Any]:
    """The task's `agent.mcp_servers` (unless not `mcp`) and `agent.skills`."""
    servers = {"mcp_servers": {"weather": server(delay_s, unseen)}} if mcp else {}
    return {**servers, "skills": [SKILL]}


def weather_script(tool: str, arguments: str = ARGUMENTS) -> Script:
    """The policy: call `tool` (the name the CLI gives the forecast tool) with `arguments`, then answer once
    the forecast came back; side calls (no tools) get a plain answer. A CLI that does not offer `tool` gets a
    text naming what it offered, and the test fails on the records."""

    def script(body: dict[str, Any]) -> Reply:
        names = sorted(t["function"]["name"] for t in body.get("tools") or [])
        if not names:
            return Reply(content=SIDE_ANSWER)
        results = [json.dumps(m.get("content")) for m in body["messages"] if m.get("role") == "tool"]
        if any(ANSWER in r for r in results):
            return Reply(content=FINAL)
        if tool in names and not results:
            return Reply(content="Asking for the forecast.", tool_calls=[(tool, arguments)])
        return Reply(content=f"no {tool} among {names}")

    return script


def check_weather_run(
    run: PresetRun, harness: str, dialect: str, tool: str, *, arguments: str = ARGUMENTS, named: str = ""
) -> list[CompletionRecord]:
    """The policy's call reached the server through the CLI, whose next request carries its answer; the
    server's tools were there from the first call and the skill's description too; the main loop is one
    trace (`check_capture`). `named`: the forecast tool's name where the policy calls it through another
    tool (`tool`); the preset's `Extensions.tool_name` must give it. Returns the main loop's records."""
    template = extensions_of(run.preset).tool_name
    assert template is not None and tool_name(template, "weather", "forecast") == (named or tool)
    main = [r for r in run.records if not run.preset.classify(r)]
    assert main, (run.result.status, run.result.reason)
    offered = sorted(t["function"]["name"] for t in main[0].tools or [])
    assert tool in offered, f"the first call offers no {tool}, only {offered}"
    assert SKILL_MARK in json.dumps(main[0].request), "the skill's description is not in the first request"
    assert check_capture(run, harness, {}, dialect) == main
    (called,) = [i for i, r in enumerate(main) if r.response_message.get("tool_calls")]
    call = main[called].response_message["tool_calls"][0]["function"]
    assert (call["name"], call["arguments"]) == (tool, arguments)
    after = main[called + 1].upstream_request["messages"]
    assert any(m["role"] == "tool" and ANSWER in json.dumps(m.get("content")) for m in after), after[-2:]
    return main
