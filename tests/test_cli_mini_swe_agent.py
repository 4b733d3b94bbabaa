"""The `mini_swe_agent` preset runs the real mini-SWE-agent (PyPI, pinned) on a node, in both of its modes.

The fake vLLM plays the model: the first turn runs a command that writes hello.txt (a `bash` tool call, or a
```mswea_bash_command block in text mode), the second submits with `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`, the
agent's own completion protocol. The gateway, the runtime (local, and bwrap with only the gateway
reachable), the agent with LiteLLM, and the store are real.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from polar.harness.base import HarnessContext
from polar.harness.presets import mini_swe_agent
from polar.harness.registry import get_harness
from tests.conftest import FakeBackend, Gateway
from tests.fakes.fake_vllm import Reply
from tests.preset_run_support import PresetRun, check_capture, run_preset, traced_connections

HELLO = "hello from mini"
WRITE = f"printf '{HELLO}' > hello.txt"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
needs_strace = pytest.mark.skipif(shutil.which("strace") is None, reason="strace not installed")


def script(body: dict[str, Any]) -> Reply:
    messages = body["messages"]
    if body.get("tools"):
        assert [t["function"]["name"] for t in body["tools"]] == ["bash"]
        done = any(m["role"] == "tool" for m in messages)
        command = json.dumps({"command": SUBMIT if done else WRITE}, separators=(",", ":"))
        return Reply(content="Submitting." if done else "Writing the file.", tool_calls=[("bash", command)])
    done = sum(m["role"] == "user" for m in messages) > 1  # the observation came back as a user message
    block = f"```{mini_swe_agent.TEXT_BLOCK}\n{SUBMIT if done else WRITE}\n```"
    return Reply(content=f"THOUGHT: {'submit' if done else 'write the file'}.\n\n{block}")


def check_run(run: PresetRun, settings: dict[str, Any]) -> None:
    main = check_capture(run, "mini_swe_agent", settings, "chat", main_has_tools=False)  # text mode: none
    assert len(main) == len(run.records) == 2  # every call is the agent loop
    text = settings.get("mode") == "text"
    assert all(bool(r.tools) != text for r in run.records)
    # mini-swe-agent never streams: LiteLLM's completion() is called without `stream`.
    assert all(not r.request.get("stream") for r in run.records)
    assert {r.model_requested for r in run.records} == {"fake-policy"}
    first_user = next(m for m in run.records[0].request["messages"] if m["role"] == "user")
    assert "Please solve this issue: Create the file hello.txt.\n" in str(first_user["content"])
    meta = run.result.metadata["harness"]
    assert meta["exit_status"] == "Submitted" and meta["api_calls"] == 2
    trajectory = json.loads((run.artifacts / mini_swe_agent.TRAJECTORY).read_text())
    assert trajectory["info"]["mini_version"] == mini_swe_agent.VERSION


@pytest.mark.cli
@pytest.mark.parametrize("mode", ["tool_calls", "text"])
async def test_mini_swe_agent_local(tmp_path: Path, mode: str) -> None:
    settings = {"mode": mode, "step_limit": 5}
    run = await run_preset(tmp_path, "mini_swe_agent", settings, script, expect=HELLO)
    check_run(run, settings)


@pytest.mark.cli
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
async def test_mini_swe_agent_in_bwrap(tmp_path: Path) -> None:
    run = await run_preset(tmp_path, "mini_swe_agent", {}, script, expect=HELLO, backend="bwrap")
    check_run(run, {})


@pytest.mark.cli
@needs_strace
async def test_mini_swe_agent_connects_to_nothing_but_the_gateway(
    tmp_path: Path, gateway: Gateway, fake_backend: FakeBackend
) -> None:
    """Every connect/sendto of the agent and its commands, traced: the gateway only (no LiteLLM price list)."""
    fake_backend.app.reset(script)
    sid = gateway.new_session()
    result, addresses = await traced_connections("mini_swe_agent", {}, gateway.url, sid, tmp_path)
    assert result.exit_code == 0, result.stderr[-2000:]
    assert addresses == {("127.0.0.1", int(gateway.url.rsplit(":", 1)[1]))}
    assert len(gateway.completions(sid)) == 2


def ctx(tmp_path: Path) -> HarnessContext:
    return HarnessContext(
        session_id="polar-key",
        gateway_url="http://127.0.0.1:8000/",
        model="m",
        instruction="fix it; $(rm -rf /)",
        home=str(tmp_path / "home"),
        workdir=str(tmp_path / "w"),
        artifacts=str(tmp_path / "a"),
        env={"MSWEA_COST_TRACKING": "default"},
    )


def test_config_command_and_env(tmp_path: Path) -> None:
    harness = mini_swe_agent.MiniSweAgentHarness({"mode": "text", "model_kwargs": {"temperature": 0.5}})
    config = harness.config(ctx(tmp_path))
    assert (
        config["model"]["model_name"] == "openai/m" and config["model"]["model_class"] == "litellm_textbased"
    )
    kwargs = config["model"]["model_kwargs"]
    assert kwargs["api_base"] == "http://127.0.0.1:8000/v1" and kwargs["api_key"] == "polar-key"
    assert kwargs["temperature"] == 0.5
    assert config["agent"]["mode"] == "yolo" and config["agent"]["confirm_exit"] is False
    command = harness.command(ctx(tmp_path))
    assert config["run"]["task"] == "fix it; $(rm -rf /)" and "-t" not in command  # in the file, verbatim
    assert command[command.index("-c") + 1] == "mini_textbased.yaml"
    env = harness.env(ctx(tmp_path))
    assert env["MSWEA_CONFIGURED"] == "true" and env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    assert env["MSWEA_GLOBAL_CONFIG_DIR"] == f"{tmp_path}/home/.config/mini-swe-agent"
    assert env["MSWEA_COST_TRACKING"] == "default"  # the task's env comes last


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"mode": "json"}, "settings.mode must be one of"),
        ({"steps": 3}, "unknown settings ['steps']"),
        ({"step_limit": -1}, "settings.step_limit must be an integer >= 0"),
        ({"step_limit": True}, "settings.step_limit must be an integer >= 0"),
        ({"model_kwargs": []}, "settings.model_kwargs must be a mapping"),
        ({"model_kwargs": {"api_base": "http://elsewhere"}}, "may not set ['api_base']"),
    ],
)
def test_bad_settings_name_the_setting(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="mini_swe_agent harness") as info:
        get_harness("mini_swe_agent", settings)
    assert message in str(info.value)


def test_summarize_reads_the_trajectory() -> None:
    data = {"info": {"exit_status": "LimitsExceeded", "submission": "", "model_stats": {"api_calls": 3}}}
    out = mini_swe_agent.summarize(json.dumps({**data, "messages": [{}, {}]}))
    assert out == {"exit_status": "LimitsExceeded", "submission": "", "api_calls": 3, "messages": 2}
    assert mini_swe_agent.summarize("{") == {"exit_status": "unreadable_trajectory"}
    assert mini_swe_agent.summarize("[]") == {"exit_status": "unreadable_trajectory"}
