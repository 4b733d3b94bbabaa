"""The `aider` preset runs the real Aider (PyPI `aider-chat`, pinned) on a node.

The fake vLLM plays the model in Aider's `whole` edit format (what Aider 0.86.2 picks for a model name it
does not know): its first answer is a file listing without a file name, which Aider cannot apply and sends
back as an error (its reflection loop); the second names hello.txt, which Aider writes. With `git` and
`auto_commits` Aider also asks the model for a commit message (a side call). The gateway, the runtime
(local, and bwrap with only the gateway reachable), Aider with LiteLLM, and the store are real.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from polar.harness.base import HarnessContext
from polar.harness.presets import aider
from polar.harness.registry import get_harness
from tests.conftest import FakeBackend, Gateway
from tests.fakes.fake_vllm import Reply
from tests.preset_run_support import (
    HELLO_TASK,
    PresetRun,
    captured_record,
    check_capture,
    run_preset,
    traced_connections,
)

HELLO = "hello from aider"
NO_NAME = "No filename provided before ``` in file listing"  # Aider 0.86.2's error for a listing without one
COMMIT = "Add hello.txt"
needs_strace = pytest.mark.skipif(shutil.which("strace") is None, reason="strace not installed")
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")


def script(body: dict[str, Any]) -> Reply:
    messages = body["messages"]
    assert not body.get("tools")  # Aider edits through its answers' text, never through tools
    system = str(messages[0]["content"])
    if "Git commit messages" in system:
        return Reply(content=COMMIT)
    last = str(messages[-1]["content"])
    if NO_NAME in last:  # the reflection: the listing again, named this time
        return Reply(content=f"hello.txt\n```\n{HELLO}\n```")
    # No file name: Aider cannot apply it. (No whitespace at the end: Aider strips the answer it keeps.)
    return Reply(content=f"```\n{HELLO}\n```")


def check_run(run: PresetRun, settings: dict[str, Any]) -> list[Any]:
    main = check_capture(run, "aider", settings, "chat", main_has_tools=False)
    assert len(main) == 2  # the answer Aider could not apply and the one it applied: one trace
    assert all(r.request.get("stream") is True for r in main)  # the loop streams (side calls do not)
    assert {r.model_requested for r in run.records} == {"fake-policy"}  # openai/<M>, the prefix stripped
    users = [m for m in main[0].request["messages"] if m["role"] == "user"]
    assert users[-1]["content"] == HELLO_TASK  # the instruction, verbatim, with no reminder appended
    assert NO_NAME in str(main[1].request["messages"][-1]["content"])
    asked = {s.path for s in run.seen}
    assert asked <= {"/v1/chat/completions"}, asked  # no /v1/models or anything else
    history = (run.artifacts / aider.HISTORIES["chat-history-file"]).read_text()
    assert HELLO_TASK in history
    return main


@pytest.mark.cli
async def test_aider_local(tmp_path: Path) -> None:
    run = await run_preset(tmp_path, "aider", {}, script, expect=HELLO + "\n")
    check_run(run, {})
    assert len(run.records) == 2  # no side calls without git
    home = run.artifacts / "aider-home" / ".aider"
    assert json.loads((home / "analytics.json").read_text())["permanently_disable"] is True


@pytest.mark.cli
@needs_bwrap
async def test_aider_in_bwrap(tmp_path: Path) -> None:
    run = await run_preset(tmp_path, "aider", {}, script, expect=HELLO + "\n", backend="bwrap")
    check_run(run, {})


@pytest.mark.cli
@needs_bwrap
async def test_aider_commits_with_a_side_call_in_bwrap(tmp_path: Path) -> None:
    """`git` and `auto_commits`: Aider makes the workdir a repository, commits the edit and asks the model
    for the message; that call is tagged a side call and stays out of the main trace."""
    settings = {"git": True, "auto_commits": True}
    check = "cat hello.txt && git log --format=%s"
    run = await run_preset(
        tmp_path, "aider", settings, script, expect=f"{HELLO}\n{COMMIT}\n", backend="bwrap", check=check
    )
    main = check_run(run, settings)
    side = [r for r in run.records if r not in main]
    assert [run.preset.classify(r) for r in side] == [("side_call", "commit")]
    assert not side[0].request.get("stream")
    assert "hello.txt" in str(side[0].request["messages"][-1]["content"])  # the diff it describes


@pytest.mark.cli
@needs_strace
async def test_aider_connects_to_nothing_but_the_gateway(
    tmp_path: Path, gateway: Gateway, fake_backend: FakeBackend
) -> None:
    """Every connect/sendto of Aider, traced: the gateway only (no PyPI version check, no analytics, no
    price list from GitHub)."""
    fake_backend.app.reset(script)
    sid = gateway.new_session()
    result, addresses = await traced_connections("aider", {}, gateway.url, sid, tmp_path)
    assert result.exit_code == 0, result.stderr[-2000:]
    assert addresses == {("127.0.0.1", int(gateway.url.rsplit(":", 1)[1]))}
    assert len(gateway.completions(sid)) == 2


def ctx(tmp_path: Path) -> HarnessContext:
    return HarnessContext(
        session_id="polar-key",
        gateway_url="http://127.0.0.1:8000/",
        model="m",
        instruction="-fix it; $(rm -rf /)",
        home=str(tmp_path / "home"),
        workdir=str(tmp_path / "w"),
        artifacts=str(tmp_path / "a"),
        env={"LITELLM_LOCAL_MODEL_COST_MAP": "False"},
    )


def test_config_command_and_env(tmp_path: Path) -> None:
    harness = aider.AiderHarness({"edit_format": "diff", "config": {"map-tokens": 0}})
    c = ctx(tmp_path)
    config = harness.config(c)
    assert config["model"] == config["weak-model"] == config["editor-model"] == "openai/m"
    assert config["openai-api-base"] == "http://127.0.0.1:8000/v1" and config["openai-api-key"] == "polar-key"
    assert config["analytics"] is False and config["check-update"] is False and config["yes-always"] is True
    assert config["git"] is False and config["auto-commits"] is False and config["edit-format"] == "diff"
    assert config["map-tokens"] == 0  # settings.config merged over
    assert config["message-file"] == f"{tmp_path}/home/.polar/instruction.md"
    assert config["chat-history-file"].startswith(f"{tmp_path}/a/")
    (entry,) = harness.model_settings(c)
    assert entry["name"] == "openai/m" and entry["reminder"] is None and entry["edit_format"] == "diff"
    assert harness.model_metadata(c)["openai/m"]["max_input_tokens"] == 32768
    command = harness.command(c)
    assert command[-2:] == ["--config", f"{tmp_path}/home/.aider.conf.yml"]
    assert "-fix it" not in " ".join(command)  # the instruction is in a file, never an argument
    env = harness.env(c)
    assert env["HOME"] == f"{tmp_path}/home"
    assert env["LITELLM_LOCAL_MODEL_COST_MAP"] == "False"  # the task's env comes last


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"edit_fromat": "diff"}, "unknown settings ['edit_fromat']"),
        ({"git": "yes"}, "settings.git must be true or false"),
        ({"auto_commits": True}, "settings.auto_commits needs settings.git"),
        ({"reminder": "always"}, "settings.reminder must be one of"),
        ({"context_window": 0}, "settings.context_window must be a positive integer"),
        ({"files": "a.py"}, "settings.files must be a list of paths"),
        ({"config": {"openai-api-base": "http://elsewhere"}}, "may not set ['openai-api-base']"),
    ],
)
def test_bad_settings_name_the_setting(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="aider harness") as info:
        get_harness("aider", settings)
    assert message in str(info.value)


def test_classify_tags_commit_messages_and_summaries() -> None:
    harness = aider.AiderHarness({})
    loop = {"messages": [{"role": "system", "content": "Act as an expert software developer."}]}
    assert harness.classify(captured_record("chat", loop, tools=False)) == ()
    for opening, kind in aider.SIDE_PROMPTS.items():
        request = {
            "messages": [{"role": "system", "content": f"{opening}\nmore"}, {"role": "user", "content": "x"}]
        }
        assert harness.classify(captured_record("chat", request, tools=False)) == ("side_call", kind)
