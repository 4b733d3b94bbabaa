"""The `mini_swe_agent` preset: mini-SWE-agent (PyPI `mini-swe-agent`), headless, through LiteLLM's OpenAI
Chat client at the gateway.

    agent: {harness: mini_swe_agent, settings: {mode: tool_calls, step_limit: 30}}

Settings: `mode` picks the agent's own config: `tool_calls` (its default `mini.yaml`: one `bash` tool) or
`text` (`mini_textbased.yaml`: one command per reply in a ```mswea_bash_command block, observations
as user messages); `step_limit`
caps model calls (0: none; the task's budget bounds the time anyway); `model_kwargs` are extra request
fields (temperature, max_tokens, ...) merged over the preset's.

Facts this preset relies on, measured on mini-swe-agent 2.4.6 (LiteLLM as it pins):
- It finishes when a command's first output line is `COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`; `-y` and
  `--exit-immediately` make it run with no confirmation and no final prompt, and `MSWEA_CONFIGURED` skips
  its first-run setup questions (which would wait on stdin).
- LiteLLM cannot price a model it does not know: `cost_tracking: ignore_errors` (else the run aborts), and
  `LITELLM_LOCAL_MODEL_COST_MAP` keeps it from downloading its price list at import.
- It never streams (`litellm.completion` without `stream`), and makes no call besides the agent loop.
- Installed with pip into a cached `--target` prefix for this interpreter; it runs with `sys.executable`
  and that prefix first on PYTHONPATH (its pinned dependencies shadow the node's).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from polar.harness.base import Extensions, HarnessContext, gateway_env
from polar.harness.cli_common import count, one_of, pip_cli_env, refuse_unknown, under
from polar.harness.install import pip_prefix
from polar.runtime.base import Runtime, RuntimeFailure
from polar.store.records import CompletionRecord

PACKAGE = "mini-swe-agent"
VERSION = "2.4.6"
BINARY = "mini"  # run as `python -m minisweagent.run.mini`, the module behind the `mini` script
DIALECT = "chat"
CONFIGURES = (
    "~/.config/mini-swe-agent/polar.yaml merged over its mini.yaml: LiteLLM model openai/<M> at <gw>/v1 "
    "with the session key, yolo mode, no exit prompt, no cost tracking; no first-run setup, no price list fetch"
)
LIMITS = "never streams (LiteLLM completion without stream); text mode sends no tools; no side calls"

EXTENSIONS = Extensions(missing="mini-swe-agent 2.4.6 has one bash tool: no MCP client, no skills")

MODES = {
    "tool_calls": ("mini.yaml", "litellm"),
    "text": ("mini_textbased.yaml", "litellm_textbased"),
}
_SETTINGS = ("mode", "step_limit", "model_kwargs")
TEXT_BLOCK = "mswea_bash_command"  # the fence tag text mode parses actions from (2.4.6), not ```bash
TRAJECTORY = "mini.traj.json"  # mini-swe-agent's own trajectory, written into the artifacts
CONFIG_DIR = ".config/mini-swe-agent"  # under the session's home (MSWEA_GLOBAL_CONFIG_DIR)


class MiniSweAgentHarness:
    name = "mini_swe_agent"
    extensions = EXTENSIONS

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        settings = dict(settings or {})
        refuse_unknown(self.name, settings, _SETTINGS)
        mode = one_of(self.name, "mode", settings.get("mode", "tool_calls"), MODES)
        steps = count(self.name, "step_limit", settings.get("step_limit", 0))
        kwargs = settings.get("model_kwargs", {})
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise ValueError(
                "mini_swe_agent harness: settings.model_kwargs must be a mapping of request fields"
            )
        clash = sorted({"api_base", "api_key", "base_url"} & set(kwargs))
        if clash:
            raise ValueError(
                f"mini_swe_agent harness: settings.model_kwargs may not set {clash} (the gateway's)"
            )
        self.mode: str = mode
        self.step_limit: int = steps
        self.model_kwargs: dict[str, Any] = kwargs
        self.prefix: Path | None = None

    def config(self, ctx: HarnessContext) -> dict[str, Any]:
        """The overlay merged over mini-swe-agent's own config for the mode."""
        return {
            # The task in the config, not `-t`: no argument-length limit, and not visible in `ps`.
            "run": {"task": ctx.instruction},
            "model": {
                "model_name": f"openai/{ctx.model}",  # LiteLLM's OpenAI-compatible Chat client
                "model_class": MODES[self.mode][1],
                "cost_tracking": "ignore_errors",
                "model_kwargs": {
                    "api_base": f"{ctx.gateway_url.rstrip('/')}/v1",
                    "api_key": ctx.session_id,
                    "drop_params": True,
                    **self.model_kwargs,
                },
            },
            "agent": {"mode": "yolo", "confirm_exit": False, "cost_limit": 0, "step_limit": self.step_limit},
            "environment": {"environment_class": "local", "cwd": ctx.workdir},
        }

    def config_path(self, ctx: HarnessContext) -> str:
        return under(ctx.home, f"{CONFIG_DIR}/polar.yaml")

    async def setup(self, runtime: Runtime, ctx: HarnessContext) -> None:
        self.prefix = await asyncio.to_thread(pip_prefix, PACKAGE, VERSION)
        path = self.config_path(ctx)
        script = 'set -e; mkdir -p -- "$(dirname -- "$1")" "$2"; cat > "$1"'
        body = json.dumps(self.config(ctx), indent=2).encode()  # JSON is YAML: its loader reads it
        result = await runtime.exec(["sh", "-c", script, "sh", path, ctx.artifacts], stdin=body, timeout_s=60)
        if result.exit_code != 0:
            raise RuntimeFailure(f"could not write mini-swe-agent's config {path}: {result.stderr.strip()}")

    def command(self, ctx: HarnessContext) -> list[str]:
        argv = [sys.executable, "-m", "minisweagent.run.mini", "-c", MODES[self.mode][0]]
        argv += ["-c", self.config_path(ctx), "-y", "--exit-immediately"]
        return [*argv, "-o", under(ctx.artifacts, TRAJECTORY)]

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        switches = {
            "MSWEA_GLOBAL_CONFIG_DIR": under(ctx.home, CONFIG_DIR),
            "MSWEA_CONFIGURED": "true",
            "MSWEA_COST_TRACKING": "ignore_errors",
        }
        return {**gateway_env(ctx), **pip_cli_env(self.prefix), **switches, **ctx.env}

    async def post_run(self, runtime: Runtime, ctx: HarnessContext) -> dict[str, Any]:
        """The outcome from mini-swe-agent's own trajectory file (already in the artifacts)."""
        path = under(ctx.artifacts, TRAJECTORY)
        result = await runtime.exec(["cat", "--", path], timeout_s=60)
        if result.exit_code != 0:
            return {"exit_status": "no_trajectory"}
        return summarize(result.stdout)

    def classify(self, record: CompletionRecord) -> tuple[str, ...]:
        return ()  # one loop, no side calls (text mode sends no tools, yet every call is the loop)


def summarize(text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
        info = data["info"]
        return {
            "exit_status": str(info.get("exit_status", "")),
            "submission": str(info.get("submission", ""))[:2000],
            "api_calls": int(info.get("model_stats", {}).get("api_calls", 0)),
            "messages": len(data.get("messages", [])),
        }
    except (ValueError, KeyError, TypeError, AttributeError):
        return {"exit_status": "unreadable_trajectory"}


PRESET = MiniSweAgentHarness
