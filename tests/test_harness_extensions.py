"""A task's `agent.mcp_servers` and `agent.skills`: the schema's checks, each preset's translation into its
CLI's own configuration, the refusal by harnesses whose program has neither, and skills read from a task
file's folder. No CLI runs here; each preset's `tests/test_cli_<name>.py` runs its CLI with them."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from polar.harness import HarnessContext, get_harness
from polar.harness.base import extensions_of
from polar.harness.extensions import check_commands, write_skills
from polar.harness.presets import claude_code, codex, gemini_cli, opencode, openhands, pi, qwen_code
from polar.rollout.resolve import TaskProblem, resolve_task
from polar.rollout.taskfile import TaskFileError, load_tasks
from polar.runtime import RuntimeSpec, make_runtime
from polar.runtime.base import RuntimeFailure
from polar.task import McpServer, Skill, Task

SKILL = "---\nname: tide-reading\ndescription: How to read a tide table.\n---\nRead the table.\n"
SERVER = McpServer(command="python3", args=["weather.py", "--fast"], env={"UNITS": "metric"})


def ctx(tmp_path: Path, **kw: Any) -> HarnessContext:
    fields: dict[str, Any] = {
        "session_id": "sess-x",
        "gateway_url": "http://127.0.0.1:9999",
        "model": "served-model",
        "instruction": "do it",
        "home": str(tmp_path / "home"),
        "workdir": str(tmp_path / "work"),
        "artifacts": str(tmp_path / "art"),
        "mcp_servers": {"weather": SERVER},
        "skills": [
            Skill(name="tide-reading", content=SKILL, files={"scripts/run.sh": "#!/bin/sh\necho hi\n"})
        ],
    }
    return HarnessContext(**{**fields, **kw})


def task(harness: str, **agent: Any) -> Task:
    return Task.model_validate({"task_id": "t", "instruction": "x", "agent": {"harness": harness, **agent}})


# -- the schema --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("agent", "problem"),
    [
        ({"mcp_servers": {"my_server": {"command": "x"}}}, "a server name is a letter, then letters"),
        ({"mcp_servers": {"w": {"command": ""}}}, "at least 1 character"),
        (
            {"mcp_servers": {"w": {"command": "x", "env": {"A-B": "1"}}}},
            "'A-B' is not an environment variable",
        ),
        ({"skills": [{"name": "Tides", "content": SKILL}]}, "a skill name is lowercase letters"),
        ({"skills": [{"name": "tides", "content": SKILL}]}, "front matter names 'tide-reading'"),
        ({"skills": [{"name": "tides", "content": "Read the table."}]}, "must start with front matter"),
        ({"skills": [{"name": "t", "content": "---\nname: t\n---\n"}]}, "needs a `description`"),
        ({"skills": [{"name": "t", "content": "---\nname: [t\n---\n"}]}, "front matter is not YAML"),
        (
            {"skills": [{"name": "tide-reading", "content": SKILL, "files": {"../x": ""}}]},
            "a relative path inside its folder",
        ),
        (
            {"skills": [{"name": "tide-reading", "content": SKILL, "files": {"SKILL.md": ""}}]},
            "SKILL.md is the skill's `content`",
        ),
        ({"skills": [{"name": "tide-reading", "content": SKILL}] * 2}, "'tide-reading' is given twice"),
    ],
)
def test_the_schema_refuses(agent: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        task("codex", **agent)


def test_a_bad_field_is_refused_at_its_line(tmp_path: Path) -> None:
    path = tmp_path / "tasks.yaml"
    path.write_text(
        "task_id: t\ninstruction: x\nagent:\n  harness: codex\n  mcp_servers:\n    my_server: {command: x}\n"
    )
    with pytest.raises(TaskFileError) as info:
        load_tasks(path)
    assert str(info.value).startswith(f"{path}:6: agent.mcp_servers: 'my_server': a server name is a letter")


# -- refused where the program has none ----------------------------------------------------------------------

SUPPORT = {  # preset -> (MCP, skills), as each pinned CLI's code and tests/test_cli_<name>.py show
    "codex": (True, True),
    "claude_code": (True, True),
    "gemini_cli": (True, True),
    "qwen_code": (True, True),
    "opencode": (True, True),
    "hermes_agent": (True, True),
    "openhands": (True, True),
    "pi": (False, True),
    "aider": (False, False),
    "mini_swe_agent": (False, False),
    "builtin": (False, False),
    "shell": (False, False),
}


@pytest.mark.parametrize(("name", "support"), sorted(SUPPORT.items()))
def test_each_harness_takes_what_its_program_has_and_refuses_the_rest(
    name: str, support: tuple[bool, bool]
) -> None:
    settings = {"command": "true"} if name == "shell" else {}
    mcp, skills = support
    for field, value, supported in (
        ("mcp_servers", {"weather": {"command": "python3"}}, mcp),
        ("skills", [{"name": "tide-reading", "content": SKILL}], skills),
    ):
        t = task(name, settings=settings, **{field: value})
        if supported:
            resolve_task(t)
            continue
        with pytest.raises(TaskProblem) as info:
            resolve_task(t)
        assert info.value.field == f"agent.{field}"
        assert f"the {name} harness " in info.value.message
        assert extensions_of(get_harness(name, settings)).missing in info.value.message


class NoExtensions:
    """A harness class of the user's own that declares no `extensions`."""

    name = "mine"

    def __init__(self, settings: dict[str, Any]) -> None: ...
    async def setup(self, runtime: Any, ctx: Any) -> None: ...
    def command(self, ctx: Any) -> list[str]:
        return ["true"]

    def env(self, ctx: Any) -> dict[str, str]:
        return {}

    async def post_run(self, runtime: Any, ctx: Any) -> dict[str, Any]:
        return {}

    def classify(self, record: Any) -> tuple[str, ...]:
        return ()


def test_a_harness_that_declares_nothing_is_given_nothing(tmp_path: Path) -> None:
    path = tmp_path / "tasks.yaml"
    path.write_text(
        "task_id: t\ninstruction: x\nruntime: {backend: local}\nagent:\n"
        "  harness: tests.test_harness_extensions:NoExtensions\n"
        '  skills:\n    - {name: tide-reading, content: "' + SKILL.replace("\n", "\\n") + '"}\n'
    )
    with pytest.raises(TaskFileError) as info:
        load_tasks(path)
    assert str(info.value).startswith(
        f"{path}:7: agent.skills: the tests.test_harness_extensions:NoExtensions harness reads no skills "
        "(its class declares no `extensions`: polar.harness.base.Extensions)"
    )


# -- each preset's translation ---------------------------------------------------------------------------------


def test_codex_writes_required_servers_under_its_config_setting(tmp_path: Path) -> None:
    overlay = {"mcp_servers": {"weather": {"tool_timeout_sec": 5}, "other": {"command": "o"}}}
    config = tomllib.loads(codex.config_toml(ctx(tmp_path), overlay=overlay))
    assert config["mcp_servers"] == {
        "weather": {
            "command": "python3",
            "args": ["weather.py", "--fast"],
            "env": {"UNITS": "metric"},
            "required": True,
            "startup_timeout_sec": codex.MCP_STARTUP_S,
            "tool_timeout_sec": 5,
        },
        "other": {"command": "o"},
    }
    assert "mcp_servers" not in tomllib.loads(codex.config_toml(ctx(tmp_path, mcp_servers={})))


async def test_claude_code_loads_only_the_tasks_servers_and_allows_their_tools(tmp_path: Path) -> None:
    runtime = make_runtime(RuntimeSpec(backend="local", root=tmp_path / "rt"), "sess-x")
    await runtime.start()
    try:
        harness = get_harness("claude_code", {"binary": "/opt/claude"})
        c = ctx(tmp_path)
        await harness.setup(runtime, c)
        conf = Path(c.home) / ".claude"
        assert json.loads((conf / "mcp.json").read_text()) == {
            "mcpServers": {
                "weather": {
                    "type": "stdio",
                    "command": "python3",
                    "args": ["weather.py", "--fast"],
                    "env": {"UNITS": "metric"},
                }
            }
        }
        settings = json.loads((conf / "settings.json").read_text())
        assert settings["permissions"]["allow"] == [*claude_code.DEFAULT_TOOLS, "mcp__weather", "Skill"]
        assert settings["env"]["MCP_CONNECTION_NONBLOCKING"] == "0"
        assert (conf / "skills/tide-reading/SKILL.md").read_text() == SKILL
        argv = harness.command(c)
        at = argv.index("--mcp-config")
        assert argv[at : at + 3] == ["--mcp-config", str(conf / "mcp.json"), "--strict-mcp-config"]
        assert at < argv.index("--")
        bare = ctx(tmp_path, mcp_servers={}, skills=[])
        assert "--mcp-config" not in harness.command(bare)
        assert "MCP_CONNECTION_NONBLOCKING" not in harness.env(bare)
    finally:
        await runtime.stop()


@pytest.mark.parametrize("module", [gemini_cli, qwen_code])
def test_gemini_and_qwen_write_mcp_servers_into_settings(tmp_path: Path, module: Any) -> None:
    assert module.mcp_settings(ctx(tmp_path)) == {
        "mcpServers": {
            "weather": {"command": "python3", "args": ["weather.py", "--fast"], "env": {"UNITS": "metric"}}
        }
    }
    assert module.mcp_settings(ctx(tmp_path, mcp_servers={})) == {}


def test_hermes_agent_writes_servers_into_its_config_and_names_them_to_its_launcher(tmp_path: Path) -> None:
    overlay = {"mcp_servers": {"weather": {"timeout": 30}}}
    harness = get_harness("hermes_agent", {"config": overlay})
    c = ctx(tmp_path)
    assert harness.config(c)["mcp_servers"] == {  # type: ignore[attr-defined]
        "weather": {
            "command": "python3",
            "args": ["weather.py", "--fast"],
            "env": {"UNITS": "metric"},
            "connect_timeout": 60,
            "timeout": 30,  # settings.config merged over
        }
    }
    assert harness.command(c)[-1] == "weather"  # the launcher waits for it
    bare = ctx(tmp_path, mcp_servers={})
    assert "mcp_servers" not in get_harness("hermes_agent").config(bare)  # type: ignore[attr-defined]
    assert harness.command(bare)[-1].endswith("hermes-mcp-failed.txt")  # no server after it
    assert str(extensions_of(harness).skills).startswith("$HERMES_HOME/skills/")
    assert harness.env(c)["HERMES_HOME"] == f"{c.home}/.hermes"  # where setup writes the skills


@pytest.mark.parametrize(
    ("toolsets", "field", "why"),
    [
        (["terminal", "file"], "skills", "settings.toolsets has no `skills`"),
        (["terminal", "skills", "no_mcp"], "mcp_servers", "settings.toolsets has `no_mcp`"),
    ],
)
def test_hermes_agent_refuses_what_its_toolsets_turn_off(toolsets: list[str], field: str, why: str) -> None:
    value: Any = (
        {"weather": {"command": "python3"}}
        if field == "mcp_servers"
        else [{"name": "tide-reading", "content": SKILL}]
    )
    with pytest.raises(TaskProblem) as info:
        resolve_task(task("hermes_agent", settings={"toolsets": toolsets}, **{field: value}))
    assert info.value.field == f"agent.{field}" and why in info.value.message


def test_opencode_writes_local_servers_into_its_config(tmp_path: Path) -> None:
    harness = get_harness("opencode")
    c = ctx(tmp_path)
    expected = {
        "weather": {
            "type": "local",
            "command": ["python3", "weather.py", "--fast"],
            "environment": {"UNITS": "metric"},
            "enabled": True,
        }
    }
    assert harness.config(c)["mcp"] == expected  # type: ignore[attr-defined]
    assert json.loads(harness.env(c)["OPENCODE_CONFIG_CONTENT"])["mcp"] == expected
    assert "mcp" not in harness.config(ctx(tmp_path, mcp_servers={}))  # type: ignore[attr-defined]


def test_openhands_writes_its_mcp_json_with_the_tasks_env_under_each_servers(tmp_path: Path) -> None:
    c = ctx(tmp_path, env={"UNITS": "imperial", "LD_LIBRARY_PATH": "/opt/lib"})
    assert openhands.mcp_config(c) == {
        "mcpServers": {
            "weather": {
                "command": "python3",
                "args": ["weather.py", "--fast"],
                "env": {"UNITS": "metric", "LD_LIBRARY_PATH": "/opt/lib"},  # the server's own wins
            }
        }
    }
    assert (openhands.PERSISTENCE, openhands.MCP_CONFIG) == (".openhands", "mcp.json")


async def test_pi_writes_skills_into_its_agent_dir(tmp_path: Path) -> None:
    runtime = make_runtime(RuntimeSpec(backend="local", root=tmp_path / "rt"), "sess-x")
    await runtime.start()
    try:
        c = ctx(tmp_path, mcp_servers={})
        await get_harness("pi", {"binary": "/opt/pi"}).setup(runtime, c)
        skill = Path(c.home) / ".pi/agent/skills/tide-reading"
        assert (skill / "SKILL.md").read_text() == SKILL
        assert os.access(skill / "scripts/run.sh", os.X_OK)  # a script (#!) is made executable
    finally:
        await runtime.stop()


async def test_skills_are_written_through_the_runtime(tmp_path: Path) -> None:
    runtime = make_runtime(RuntimeSpec(backend="local", root=tmp_path / "rt"), "sess-x")
    await runtime.start()
    try:
        skills = [
            Skill(
                name="a", content="---\nname: a\ndescription: A.\n---\n", files={"ref/notes.md": "# notes\n"}
            ),
            Skill(name="b", content="---\nname: b\ndescription: B.\n---\n"),
        ]
        await write_skills(runtime, str(tmp_path / "skills"), skills)
        files = sorted(str(p.relative_to(tmp_path / "skills")) for p in (tmp_path / "skills").rglob("*.md"))
        assert files == ["a/SKILL.md", "a/ref/notes.md", "b/SKILL.md"]
        assert not os.access(tmp_path / "skills/a/ref/notes.md", os.X_OK)
    finally:
        await runtime.stop()


@pytest.mark.parametrize(
    ("module", "where"),
    [
        (codex, "$CODEX_HOME/skills/"),
        (claude_code, "<config>/skills/"),
        (gemini_cli, "~/.gemini/skills/"),
        (qwen_code, "~/.qwen/skills/"),
        (opencode, "~/.config/opencode/skills/"),
        (openhands, f"~/{openhands.SKILLS}/"),
        (pi, "~/.pi/agent/skills/"),
    ],
)
def test_the_stated_skill_folders(module: Any, where: str) -> None:
    assert module.EXTENSIONS.skills.startswith(where)


# -- skills read from the task file's folder --------------------------------------------------------------------


def skill_folder(root: Path) -> Path:
    folder = root / "skills" / "tide-reading"
    (folder / "scripts").mkdir(parents=True)
    (folder / "SKILL.md").write_text(SKILL)
    (folder / "scripts" / "run.sh").write_text("#!/bin/sh\necho hi\n")
    return folder


def taskfile(tmp_path: Path, skills: str) -> Path:
    path = tmp_path / "tasks.yaml"
    path.write_text(
        f"task_id: t\ninstruction: x\nruntime: {{backend: local}}\nagent:\n  harness: pi\n  skills:\n{skills}"
    )
    return path


def test_a_skill_folder_is_read_into_the_task(tmp_path: Path) -> None:
    skill_folder(tmp_path)
    (tmp_path / "skills" / "alone.md").write_text(SKILL)
    path = taskfile(
        tmp_path, "    - path: skills/tide-reading\n    - {name: tide-reading2, path: skills/alone.md}\n"
    )
    with pytest.raises(
        TaskFileError, match=r"tasks.yaml:\d+: agent.skills\[1\].content: SKILL.md's front matter names"
    ):
        load_tasks(
            path
        )  # a file's skill is named by `name` (else its folder's), and must match its front matter
    path = taskfile(tmp_path, "    - path: skills/tide-reading\n")
    (t,) = load_tasks(path)
    (skill,) = t.agent.skills
    assert skill == Skill(
        name="tide-reading", content=SKILL, files={"scripts/run.sh": "#!/bin/sh\necho hi\n"}
    )


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ("{path: ../outside}", "leads outside"),
        ("{path: /etc}", "is absolute"),
        ("{path: skills/none}", "no such file or folder"),
        ("{path: skills}", "holds no SKILL.md"),
        ("{path: skills/tide-reading, content: x}", "give `path` or `content`, not both"),
    ],
)
def test_a_skill_path_is_refused_at_its_line(tmp_path: Path, entry: str, problem: str) -> None:
    skill_folder(tmp_path)
    path = taskfile(tmp_path, f"    - {{name: tide-reading, content: x}}\n    - {entry}\n")
    with pytest.raises(TaskFileError) as info:
        load_tasks(path)
    assert str(info.value).startswith(f"{path}:8: agent.skills[1].path: "), str(info.value)
    assert problem in str(info.value)


def test_a_symlink_out_of_the_folder_is_refused(tmp_path: Path) -> None:
    base = tmp_path / "tasks"
    folder = skill_folder(base)
    (tmp_path / "secret").write_text("secret")
    (folder / "leak.txt").symlink_to(tmp_path / "secret")
    with pytest.raises(TaskFileError, match=r"agent.skills\[0\].path: leak.txt leads outside"):
        load_tasks(taskfile(base, "    - path: skills/tide-reading\n"))


# -- the servers' programs, looked up before the harness starts --------------------------------------------


async def test_a_server_whose_program_the_runtime_lacks_is_named(tmp_path: Path) -> None:
    """Each server is looked up as its harness starts it: a name on the harness's PATH (or the server's own
    env.PATH), a path that must be an executable file."""
    tools = tmp_path / "tools"
    tools.mkdir()
    for name, mode in (("weather-mcp", 0o755), ("notes-mcp", 0o644)):
        (tools / name).write_text("#!/bin/sh\n")
        (tools / name).chmod(mode)
    own = tmp_path / "own"
    own.mkdir()
    (own / "own-mcp").write_text("#!/bin/sh\n")
    (own / "own-mcp").chmod(0o755)
    servers = {
        "shell": McpServer(command="sh"),
        "onpath": McpServer(command="weather-mcp"),
        "absolute": McpServer(command=str(tools / "weather-mcp")),
        "ownpath": McpServer(command="own-mcp", env={"PATH": str(own)}),
        "gone": McpServer(command="no-such-mcp-server"),
        "plainfile": McpServer(command=str(tools / "notes-mcp")),
        "elsewhere": McpServer(command="weather-mcp", env={"PATH": str(own)}),
    }
    env = {"PATH": f"{tools}:{os.environ['PATH']}"}
    runtime = make_runtime(RuntimeSpec(backend="local", root=tmp_path / "rt"), "sess-x")
    await runtime.start()
    try:
        with pytest.raises(RuntimeFailure) as caught:
            await check_commands(runtime, servers, env)
        ok = {k: servers[k] for k in ("shell", "onpath", "absolute", "ownpath")}
        await check_commands(runtime, ok, env)  # nothing missing: no error
        with pytest.raises(RuntimeFailure, match="weather-mcp"):
            await check_commands(runtime, {"onpath": servers["onpath"]}, {})  # not on the runtime's own PATH
    finally:
        await runtime.stop()
    message = str(caught.value)
    assert message.startswith("agent.mcp_servers: the runtime has no program for ")
    named = {name for name in servers if f"{name} (" in message}
    assert named == {"gone", "plainfile", "elsewhere"}
    assert f"'weather-mcp' not found on PATH={own}" in message
