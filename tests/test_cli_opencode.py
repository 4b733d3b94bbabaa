"""The `opencode` preset runs the real OpenCode (opencode-ai, pinned) on a node, in each selectable dialect.

The fake vLLM plays the model: it answers OpenCode's title call with a title, then makes the agent call its
own `bash` tool (found by name in the request's tools) to write hello.txt, then finishes with text. The
gateway, the runtime (local, and bwrap with only the gateway reachable), the CLI and the store are real.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from polar.harness.base import HarnessContext
from polar.harness.presets import opencode
from polar.harness.registry import get_harness
from polar.runtime import LocalRuntime, RuntimeSpec, make_runtime
from polar.store.records import CompletionRecord
from tests import extension_support as ext
from tests import mcp_weather
from tests.conftest import FakeBackend, Gateway
from tests.fakes.fake_vllm import Reply
from tests.preset_run_support import PresetRun, check_capture, run_preset, traced_connections

HELLO = "hello from opencode"
INSTRUCTION = "Create the file hello.txt."  # what run_preset's task says
# Compact JSON: OpenCode re-serializes arguments without spaces when it sends the history back.
WRITE = json.dumps(
    {"command": f"printf '{HELLO}' > hello.txt", "description": "Write hello.txt"}, separators=(",", ":")
)
needs_npm = pytest.mark.skipif(shutil.which("npm") is None, reason="npm is needed to install OpenCode")


def script(body: dict[str, Any]) -> Reply:
    tools = [t["function"]["name"] for t in body.get("tools") or []]
    if not tools:
        return Reply(content="Create hello file")  # the title call
    assert "bash" in tools, tools
    if any(m["role"] == "tool" for m in body["messages"]):
        return Reply(content="Done: hello.txt is written.")
    return Reply(tool_calls=[("bash", WRITE)])


def _parts(message: dict[str, Any]) -> list[Any]:
    content = message["content"]
    return [content] if isinstance(content, str) else [p for p in content if p.get("type") == "text"]


def check_run(run: PresetRun, settings: dict[str, Any], dialect: str, *, title_call: bool = True) -> None:
    main = check_capture(run, "opencode", settings, dialect)
    harness = get_harness("opencode", settings)
    side = [r for r in run.records if harness.classify(r)]
    assert [harness.classify(r) for r in side] == ([("side_call", "title")] if title_call else [])
    assert len(main) == 2 and all(r.tools for r in main)  # the tool call, then the answer after its result
    assert all(r.request.get("stream") is True for r in run.records)  # OpenCode streams in every dialect
    assert {r.model_requested for r in run.records} == {"fake-policy"}
    # The instruction arrives verbatim (on stdin; an argument would arrive wrapped in literal quotes).
    user = [m for m in main[0].upstream_request["messages"] if m["role"] == "user"]
    assert "".join(p["text"] if isinstance(p, dict) else p for p in _parts(user[-1])) == INSTRUCTION
    meta = run.result.metadata["harness"]
    assert meta["tool_calls"] == 1 and meta["steps"] == 2 and "errors" not in meta
    events = (run.artifacts / opencode.EVENTS).read_text().splitlines()
    tool = next(json.loads(e) for e in events if json.loads(e)["type"] == "tool_use")
    assert tool["part"]["tool"] == "bash" and tool["part"]["state"]["status"] == "completed"
    assert list((run.artifacts / "opencode-log").glob("*.log"))  # OpenCode's own log, collected


@pytest.mark.cli
@needs_npm
@pytest.mark.parametrize("dialect", ["chat", "responses", "anthropic"])
async def test_opencode_local_in_each_dialect(tmp_path: Path, dialect: str) -> None:
    settings = {"dialect": dialect}
    run = await run_preset(tmp_path, "opencode", settings, script, expect=HELLO)
    check_run(run, settings, dialect)


@pytest.mark.cli
@needs_npm
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
async def test_opencode_in_bwrap_reaches_only_the_gateway(tmp_path: Path) -> None:
    """No network but the gateway (bwrap): the run completes and OpenCode logged no error. The strace test
    below shows it does not even try to reach anything else."""
    run = await run_preset(tmp_path, "opencode", {}, script, expect=HELLO, backend="bwrap")
    check_run(run, {}, "chat")
    log = "\n".join(p.read_text() for p in (run.artifacts / "opencode-log").glob("*.log"))
    assert "level=ERROR" not in log


@pytest.mark.cli
@needs_npm
async def test_opencode_with_a_title_makes_no_title_call(tmp_path: Path) -> None:
    settings = {"title": "hello task"}
    run = await run_preset(tmp_path, "opencode", settings, script, expect=HELLO)
    check_run(run, settings, "chat", title_call=False)


def ctx(tmp_path: Path) -> HarnessContext:
    return HarnessContext(
        session_id="polar-key",
        gateway_url="http://127.0.0.1:8000/",
        model="m",
        instruction="x",
        home=str(tmp_path / "home"),
        workdir=str(tmp_path / "w"),
        artifacts=str(tmp_path / "a"),
        env={"OPENCODE_DISABLE_PROJECT_CONFIG": "1"},
    )


def test_config_points_every_role_at_the_gateway(tmp_path: Path) -> None:
    harness = opencode.OpenCodeHarness(
        {"dialect": "anthropic", "context_window": 8192, "max_output_tokens": 1024}
    )
    config = harness.config(ctx(tmp_path))
    provider = config["provider"]["polar"]
    assert provider["npm"] == "@ai-sdk/anthropic"
    assert provider["options"] == {"baseURL": "http://127.0.0.1:8000/v1", "apiKey": "polar-key"}
    assert provider["models"] == {"m": {"name": "m", "limit": {"context": 8192, "output": 1024}}}
    assert config["model"] == config["small_model"] == "polar/m"
    assert config["enabled_providers"] == ["polar"] and config["autoupdate"] is False
    env = harness.env(ctx(tmp_path))
    assert json.loads(env["OPENCODE_CONFIG_CONTENT"]) == config
    assert env["XDG_CONFIG_HOME"] == f"{tmp_path}/home/.config" and env["HOME"] == f"{tmp_path}/home"
    assert env["OPENCODE_DISABLE_AUTOUPDATE"] == env["OPENCODE_DISABLE_MODELS_FETCH"] == "1"
    assert env["OPENCODE_DISABLE_PROJECT_CONFIG"] == "1"  # the task's env comes last
    command = harness.command(ctx(tmp_path))
    assert "--auto" in command and "--title" not in command and "< " in command


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"dialect": "gemini"}, "settings.dialect must be one of"),
        ({"model": "x"}, "unknown settings ['model']"),
        ({"title": ""}, "settings.title must be a non-empty string"),
        ({"context_window": 8192}, "go together"),
        ({"context_window": 8192, "max_output_tokens": True}, "max_output_tokens must be a positive integer"),
        ({"context_window": 1024, "max_output_tokens": 1024}, "must be below context_window"),
    ],
)
def test_bad_settings_name_the_setting(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="opencode harness") as info:
        get_harness("opencode", settings)
    assert message in str(info.value)


def record(tools: list[dict[str, Any]] | None, system: str) -> CompletionRecord:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    return CompletionRecord(
        session_id="s",
        seq=0,
        completion_id="c",
        dialect="chat",
        created_at=0.0,
        request={},
        upstream_request={"messages": messages},
        prompt_ids=[1],
        response_ids=[2],
        response_logprobs=[-0.1],
        finish_reason="stop",
        response_message={"role": "assistant", "content": "t"},
        tools=tools,
        usage={},
        model_requested="m",
        model_served="m",
    )


def test_classify_tags_tool_less_calls() -> None:
    harness = get_harness("opencode")
    tool = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]
    assert harness.classify(record(tool, "You are opencode")) == ()
    assert harness.classify(record(None, "You are a title generator. Output a title.")) == (
        "side_call",
        "title",
    )
    assert harness.classify(record([], "Summarize the conversation")) == ("side_call",)


def test_summarize_counts_events_and_keeps_errors() -> None:
    lines = [
        '{"type":"step_finish","sessionID":"ses_1"}',
        '{"type":"tool_use","sessionID":"ses_1"}',
        '{"type":"error","sessionID":"ses_1","error":{"name":"APIError"}}',
        "not json",
        "[1]",
    ]
    out = opencode.summarize(lines)
    assert out == {
        "opencode_session": "ses_1",
        "steps": 1,
        "tool_calls": 1,
        "errors": ['{"name": "APIError"}'],
    }


@pytest.mark.cli
@needs_npm
@pytest.mark.skipif(shutil.which("strace") is None, reason="strace not installed")
async def test_opencode_connects_to_nothing_but_the_gateway(
    tmp_path: Path, gateway: Gateway, fake_backend: FakeBackend
) -> None:
    """Every connect/sendto of OpenCode and its children, traced: only the gateway's address, no DNS."""
    fake_backend.app.reset(script)
    sid = gateway.new_session()
    result, addresses = await traced_connections("opencode", {}, gateway.url, sid, tmp_path)
    assert result.exit_code == 0, result.stderr[-2000:]
    port = int(gateway.url.rsplit(":", 1)[1])
    assert addresses == {("127.0.0.1", port)}
    assert len(gateway.completions(sid)) == 3  # title, tool call, answer


async def test_post_run_reads_events_without_logs(tmp_path: Path) -> None:
    """A run that died before OpenCode wrote its log still has its events summarized; none at all: zeros."""
    runtime = make_runtime(RuntimeSpec(backend="local", root=tmp_path), "oc-post")
    assert isinstance(runtime, LocalRuntime)
    await runtime.start()
    try:
        context = HarnessContext(
            session_id="s",
            gateway_url="http://127.0.0.1:9",
            model="m",
            instruction="x",
            home=str(runtime.home),
            workdir=str(runtime.workdir),
            artifacts=str(runtime.artifacts),
        )
        harness = get_harness("opencode")
        assert await harness.post_run(runtime, context) == {
            "opencode_session": None,
            "steps": 0,
            "tool_calls": 0,
        }
        (runtime.artifacts / opencode.EVENTS).write_text(
            '{"type":"error","sessionID":"ses_2","error":"boom"}\n'
        )
        meta = await harness.post_run(runtime, context)
        assert meta == {"opencode_session": "ses_2", "steps": 0, "tool_calls": 0, "errors": ['"boom"']}
    finally:
        await runtime.stop()


@pytest.mark.cli
@needs_npm
async def test_opencode_runs_the_tasks_mcp_server_and_reads_its_skill(tmp_path: Path) -> None:
    """`agent.mcp_servers` and `agent.skills`: the policy calls `weather_forecast` (1.18.33's name for the
    server's tool) and the forecast comes back in the next request; the skill is listed in its skill tool's
    description."""
    await asyncio.to_thread(mcp_weather.install)
    run = await run_preset(
        tmp_path,
        "opencode",
        {},
        ext.weather_script("weather_forecast"),
        expect=None,
        agent=ext.agent_fields(),
    )
    ext.check_weather_run(run, "opencode", "chat", "weather_forecast")
