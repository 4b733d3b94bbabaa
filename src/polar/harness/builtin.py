"""The `builtin` preset: runs polar's own reference agent (`polar.harness.agent`) in the runtime.

    agent: {harness: builtin, settings: {max_turns: 20, stream: true, bash_timeout: 60}}

Settings map one to one onto the agent's flags and are checked when the preset is built (at submit time),
so a typo fails before any session starts. The agent runs with this interpreter (`sys.executable`, or
`settings.python` inside an image with its own) and finds polar through PYTHONPATH: in bwrap the host's
Python is visible read-only, but an editable install's import hook may point outside what is mounted.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import polar
from polar.harness.base import Extensions, HarnessContext, gateway_env
from polar.harness.shell import instruction_path, write_instruction
from polar.jsontypes import JSON
from polar.runtime.base import Runtime, RuntimeFailure
from polar.store.records import CompletionRecord

# setting -> (type, the agent's flag); bools are switches
SETTINGS: dict[str, tuple[type, str]] = {
    "max_turns": (int, "--max-turns"),
    "stream": (bool, "--stream"),
    "bash_timeout": (float, "--bash-timeout"),
    "max_output": (int, "--max-output"),
    "temperature": (float, "--temperature"),
    "max_tokens": (int, "--max-tokens"),
    "max_retries": (int, "--max-retries"),
    "request_timeout": (float, "--request-timeout"),
    "system_prompt": (str, "--system-prompt"),
}
_KIND = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
_POSITIVE = {"max_turns", "bash_timeout", "max_output", "max_tokens", "request_timeout"}
TRANSCRIPT = "transcript.jsonl"
POLAR_SRC = str(Path(polar.__file__).resolve().parent.parent)


def _check(name: str, value: JSON) -> None:
    kind = SETTINGS[name][0]
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        raise ValueError(f"builtin harness: settings.{name} must be {_KIND[kind]}, not {value!r}")
    if (name in _POSITIVE and value <= 0) or (name == "max_retries" and value < 0):
        raise ValueError(f"builtin harness: settings.{name} must be positive, not {value!r}")


def summarize(lines: list[str]) -> dict[str, Any]:
    """The run's outcome from its transcript: the last `end` entry, or how far it got when killed."""
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # the last line of a run killed mid-write
            continue
    end = next((e for e in reversed(events) if e.get("type") == "end"), None)
    if end is None:
        turns = sum(e.get("type") == "assistant" for e in events)
        return {"finished": False, "turns": turns, "stop_reason": "interrupted"}
    out = {"finished": end["finished"], "turns": end["turns"], "stop_reason": end["reason"]}
    for key in ("summary", "error"):
        if key in end:
            out[key] = end[key]
    return out


class BuiltinHarness:
    name = "builtin"
    extensions = Extensions(missing="polar's builtin agent has its four tools only")

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        settings = dict(settings or {})
        python = settings.pop("python", sys.executable)
        if not isinstance(python, str) or not python:
            raise ValueError("builtin harness: settings.python must be an interpreter path")
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise ValueError(
                f"builtin harness: unknown settings {unknown}; known: {sorted([*SETTINGS, 'python'])}"
            )
        for name, value in settings.items():
            _check(name, value)
        self.python = python
        self.settings = settings

    def transcript_path(self, ctx: HarnessContext) -> str:
        return f"{ctx.artifacts.rstrip('/')}/{TRANSCRIPT}"

    async def setup(self, runtime: Runtime, ctx: HarnessContext) -> None:
        await write_instruction(runtime, ctx)

    def command(self, ctx: HarnessContext) -> list[str]:
        argv = [self.python, "-m", "polar.harness.agent", "--instruction-file", instruction_path(ctx)]
        argv += ["--workdir", ctx.workdir, "--transcript", self.transcript_path(ctx)]
        for name, value in self.settings.items():
            flag = SETTINGS[name][1]
            if isinstance(value, bool):
                argv += [flag] if value else []
            else:
                argv += [flag, str(value)]
        return argv

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        return {**gateway_env(ctx), "PYTHONPATH": POLAR_SRC, "PYTHONUNBUFFERED": "1", **ctx.env}

    async def post_run(self, runtime: Runtime, ctx: HarnessContext) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="polar-transcript-") as tmp:
            local = Path(tmp) / TRANSCRIPT
            try:
                await runtime.download(self.transcript_path(ctx), local)
                lines = local.read_text().splitlines()
            except (RuntimeFailure, OSError):
                return {"finished": False, "turns": 0, "stop_reason": "no_transcript"}
        return summarize(lines)

    def classify(self, record: CompletionRecord) -> tuple[str, ...]:
        return ()  # one loop, no side calls
