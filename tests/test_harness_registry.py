"""Harness lookup and settings validation: every mistake is a ValueError at build (submit) time."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from polar.harness import BuiltinHarness, HarnessContext, ShellHarness, get_harness, harness_names
from polar.harness.builtin import POLAR_SRC, summarize
from polar.runtime.base import Runtime
from polar.store.records import CompletionRecord

CTX = HarnessContext(
    session_id="sess-1",
    gateway_url="http://127.0.0.1:9/",
    model="m",
    instruction="do it",
    home="/s/home",
    workdir="/s/work",
    artifacts="/s/artifacts",
    env={"OPENAI_MODEL": "override", "EXTRA": "1"},
)


class EchoHarness:
    """A custom harness loaded by import path: runs `echo <word>`."""

    name = "echo"

    def __init__(self, settings: dict[str, Any]) -> None:
        if not isinstance(settings.get("word"), str):
            raise ValueError("echo harness: settings.word must be a string")
        self.word = settings["word"]

    async def setup(self, runtime: Runtime, ctx: HarnessContext) -> None:
        return None

    def command(self, ctx: HarnessContext) -> list[str]:
        return ["echo", self.word]

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        return dict(ctx.env)

    async def post_run(self, runtime: Runtime, ctx: HarnessContext) -> dict[str, Any]:
        return {}

    def classify(self, record: CompletionRecord) -> tuple[str, ...]:
        return ()


class Incomplete:
    name = "incomplete"

    def __init__(self, settings: dict[str, Any]) -> None:
        pass

    def command(self, ctx: HarnessContext) -> str:
        return "true"


def make_text(settings: dict[str, Any]) -> str:
    """A callable that builds something that is not a harness."""
    return "text"


class Exploding:
    def __init__(self, settings: dict[str, Any]) -> None:
        raise KeyError("boom")


def test_names_and_presets() -> None:
    names = harness_names()
    assert {"builtin", "shell"} <= set(names) and names == sorted(names)
    # Every CLI preset module is listed by its name and loads.
    import pkgutil

    from polar.harness import presets

    assert {m.name for m in pkgutil.iter_modules(presets.__path__)} <= set(names)
    assert isinstance(get_harness("builtin", {}), BuiltinHarness)
    assert isinstance(get_harness("shell", {"command": "true"}), ShellHarness)


def test_import_path() -> None:
    harness = get_harness("tests.test_harness_registry:EchoHarness", {"word": "hi"})
    assert harness.name == "echo" and harness.command(CTX) == ["echo", "hi"]
    with pytest.raises(ValueError, match=r"settings\.word must be a string"):
        get_harness("tests.test_harness_registry:EchoHarness", {})


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "codex-cli",
            r"unknown harness 'codex-cli' \(did you mean 'codex'\?\); registered: (.*, )?builtin, .*shell",
        ),
        ("no.such.module:Harness", "import paths are not accepted from the network"),
        ("tests.no_such_module:Harness", "cannot import tests.no_such_module"),
        ("tests.test_harness_registry:Missing", "has no attribute 'Missing'"),
        ("tests.test_harness_registry:CTX", "is not a class"),
        (
            "tests.test_harness_registry:Incomplete",
            r"lacks methods \['setup', 'env', 'post_run', 'classify'\]",
        ),
        ("tests.test_harness_registry:Exploding", "refused its settings: 'boom'"),
        ("json:dumps", "import paths are not accepted from the network"),
        ("tests.test_harness_registry:make_text", "lacks methods"),
    ],
)
def test_unknown_or_broken_harness(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_harness(name, {})


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_turn": 3}, r"unknown settings \['max_turn'\]; known: \['bash_timeout', "),
        ({"max_turns": "5"}, "settings.max_turns must be an integer, not '5'"),
        ({"max_turns": True}, "settings.max_turns must be an integer, not True"),
        ({"stream": "yes"}, "settings.stream must be true or false"),
        ({"temperature": "hot"}, "settings.temperature must be a number"),
        ({"max_turns": 0}, "settings.max_turns must be positive"),
        ({"bash_timeout": -1.0}, "settings.bash_timeout must be positive"),
        ({"max_retries": -1}, "settings.max_retries must be positive"),
        ({"python": ""}, "settings.python must be an interpreter path"),
    ],
)
def test_builtin_settings_are_checked(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_harness("builtin", settings)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({}, "settings.command must be a non-empty command line"),
        ({"command": "  "}, "settings.command must be a non-empty command line"),
        ({"command": "run '{instruction}'"}, r"quotes \{instruction\}; write placeholders bare"),
        ({"command": 'run --file="{instruction_file}"'}, r"quotes \{instruction_file\}"),
        ({"command": "run", "collect": "logs"}, "settings.collect must be a list of paths"),
        ({"command": "run", "cmd": "x"}, r"unknown settings \['cmd'\]"),
    ],
)
def test_shell_settings_are_checked(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_harness("shell", settings)


def test_builtin_command_and_env() -> None:
    harness = get_harness(
        "builtin", {"max_turns": 7, "stream": True, "temperature": 0, "system_prompt": "Hi"}
    )
    assert harness.command(CTX) == [
        sys.executable, "-m", "polar.harness.agent",
        "--instruction-file", "/s/home/.polar/instruction.md",
        "--workdir", "/s/work",
        "--transcript", "/s/artifacts/transcript.jsonl",
        "--max-turns", "7", "--stream", "--temperature", "0", "--system-prompt", "Hi",
    ]  # fmt: skip
    assert get_harness("builtin", {"stream": False}).command(CTX)[-1] == "/s/artifacts/transcript.jsonl"
    env = harness.env(CTX)
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:9/v1" and env["OPENAI_API_KEY"] == "sess-1"
    assert env["OPENAI_MODEL"] == "override" and env["EXTRA"] == "1"  # the task's env wins
    assert env["PYTHONPATH"] == POLAR_SRC and harness.classify(None) == ()  # type: ignore[arg-type]


def test_shell_env() -> None:
    env = get_harness("shell", {"command": "true"}).env(CTX)
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9" and env["GEMINI_API_KEY"] == "sess-1"
    assert env["POLAR_INSTRUCTION_FILE"] == "/s/home/.polar/instruction.md"
    assert env["OPENAI_MODEL"] == "override" and env["HOME"] == "/s/home"


def test_summarize_transcripts() -> None:
    done = [
        '{"type": "start"}',
        '{"type": "assistant", "turn": 1}',
        '{"type": "end", "finished": true, "reason": "finish", "turns": 1, "summary": "ok"}',
    ]
    assert summarize(done) == {"finished": True, "turns": 1, "stop_reason": "finish", "summary": "ok"}
    killed = [
        '{"type": "start"}',
        '{"type": "assistant"}',
        '{"type": "tool"}',
        '{"type": "assistant"}',
        '{"type": "too',
    ]
    assert summarize(killed) == {"finished": False, "turns": 2, "stop_reason": "interrupted"}
    failed = ['{"type": "end", "finished": false, "reason": "api_error", "turns": 0, "error": "401"}']
    assert summarize(failed) == {"finished": False, "turns": 0, "stop_reason": "api_error", "error": "401"}
