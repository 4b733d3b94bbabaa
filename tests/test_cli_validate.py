"""One validation path for `polar run`, `generate`, `train` and `submit`: every mistake in a file a user
wrote is `file:line: field: message`, found before anything heavy starts, with the closest known name
for a near miss; a bug in polar is a short traceback and one line asking to report it.

Each test reproduces a finding measured on an earlier version: an unknown harness in a task file surfaced
only after the engine had loaded, as a traceback; an unknown field said "Extra inputs are not permitted"
and nothing more; an unclosed quote was reported at the end of the file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from polar.cli import _COMMANDS, main
from polar.rollout.taskfile import TaskFileError, load_tasks
from polar.train.config import ConfigError, load_config
from tests.server_support import TOKEN, start_server

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}

CLAUDE_DASH = """\
tasks:
  - task_id: ok
    instruction: fine
  - task_id: typo
    instruction: x
    agent:
      harness: claude-code
"""
HINT = "tasks[1].agent.harness: unknown harness 'claude-code' (did you mean 'claude_code'?)"


def polar(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "polar", *args], capture_output=True, text=True, timeout=300, env=ENV, cwd=cwd
    )


def assert_refused_before_start(proc: subprocess.CompletedProcess[str], expected: str) -> None:
    """The command stopped on the file: its line in the message, no traceback, nothing started."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr
    # What each command prints once the engine is loaded or the run has begun.
    for started in ("served by the embedded engine", "training ", "sessions finished", "loading the policy"):
        assert started not in proc.stdout + proc.stderr


# -- run, generate, train: names checked at the line, before the engine loads -------------------------------


@pytest.mark.parametrize("command", ["run", "generate"])
def test_an_unknown_harness_is_refused_at_its_line_before_the_engine_loads(
    command: str, tmp_path: Path
) -> None:
    """Was: the engine loaded (~10 s), then a traceback from the in-process server without file:line."""
    taskfile = tmp_path / "tasks.yaml"
    taskfile.write_text(CLAUDE_DASH)
    proc = polar(command, str(taskfile), "--out", str(tmp_path / "out"))  # no --backend: the engine
    assert_refused_before_start(proc, f"{taskfile}:7: {HINT}")
    assert not (tmp_path / "out").exists()


def test_train_checks_the_tasks_of_its_task_file_and_inline(tmp_path: Path) -> None:
    (tmp_path / "tasks.yaml").write_text(CLAUDE_DASH)
    config = tmp_path / "train.yaml"
    config.write_text(f"tasks: tasks.yaml\nsteps: 1\nout: {tmp_path / 'run'}\n")
    proc = polar("train", str(config))
    assert_refused_before_start(proc, f"{tmp_path / 'tasks.yaml'}:7: {HINT}")

    config.write_text(
        "steps: 1\n"
        "tasks:\n"
        "  - task_id: a\n"
        "    instruction: x\n"
        "    evaluator:\n"
        "      strategy: sessoin_completed\n"
    )
    proc = polar("train", str(config))
    assert_refused_before_start(
        proc,
        f"{config}:6: tasks[0].evaluator.strategy: unknown evaluator 'sessoin_completed' "
        "(did you mean 'session_completed'?)",
    )
    assert not (tmp_path / "run").exists()


def test_import_paths_resolve_beside_the_file_that_names_them(tmp_path: Path) -> None:
    """`polar train`'s inline tasks and its task file: `validate_reward:Judge` is validate_reward.py beside
    that file, from any working directory; a name it lacks is an error at its line."""
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "validate_reward.py").write_text("class Judge:\n    pass\n")
    inline = conf / "train.yaml"
    inline.write_text(
        "tasks:\n  - task_id: a\n    instruction: x\n    evaluator: {strategy: 'validate_reward:Judgement'}\n"
    )
    with pytest.raises(ConfigError, match=r"train\.yaml:4: tasks\[0\]\.evaluator\.strategy: .*no attribute"):
        load_config(inline)
    (conf / "tasks.yaml").write_text("- task_id: a\n  instruction: x\n  builder: 'validate_reward:Missing'\n")
    by_file = conf / "by_file.yaml"
    by_file.write_text("tasks: tasks.yaml\n")
    with pytest.raises(ConfigError, match=r"tasks\.yaml:3: \[0\]\.builder: .*no attribute 'Missing'"):
        load_config(by_file)


# -- did you mean -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (  # a misspelt field: the closest field beside it
            "tasks:\n  - task_id: a\n    instruction: x\n    num_sample: 2\n",
            ":4: tasks[0].num_sample: Extra inputs are not permitted (did you mean num_samples?)",
        ),
        (  # a field in the wrong section: where it belongs
            "- task_id: a\n  instruction: x\n  harness: shell\n",
            ":3: [0].harness: Extra inputs are not permitted (did you mean agent.harness?)",
        ),
        (  # inside a list of actions, through the union of action kinds
            "- task_id: a\n  instruction: x\n  runtime:\n    prepare:\n      - {type: upload, srcc: a}\n",
            ":5: [0].runtime.prepare[0].srcc: Extra inputs are not permitted (did you mean src?)",
        ),
        (  # a choice
            "- task_id: a\n  instruction: x\n  runtime:\n    backend: dokcer\n",
            ":4: [0].runtime.backend: Input should be 'bwrap', 'docker', 'podman', 'apptainer' or 'local' "
            "(did you mean 'docker'?)",
        ),
        (
            "- task_id: a\n  instruction: x\n  builder: prefix_merge\n",
            ":3: [0].builder: unknown builder 'prefix_merge' (did you mean 'prefix_merging'?)",
        ),
        (
            "- task_id: a\n  instruction: x\n  evaluator:\n    strategy: command\n    config: {test_cmd: t}\n",
            ":5: [0].evaluator.config: evaluator 'command': evaluator.config.test_cmd: Extra inputs are not "
            "permitted (did you mean test_command?)",
        ),
        (
            "- task_id: a\n  instruction: x\n  runtime:\n    prepare:\n      - {src: a}\n",
            ":5: [0].runtime.prepare[0]: needs `type:` (exec or upload)",
        ),
    ],
)
def test_near_misses_get_the_closest_name(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "tasks.yaml"
    path.write_text(text)
    with pytest.raises(TaskFileError) as info:
        load_tasks(path)
    assert str(info.value).startswith(f"{path}{expected}")


def test_polar_run_says_did_you_mean_for_a_field(tmp_path: Path) -> None:
    taskfile = tmp_path / "tasks.yaml"
    taskfile.write_text("tasks:\n  - task_id: a\n    instruction: x\n    num_sample: 2\n")
    proc = polar("run", str(taskfile), "--out", str(tmp_path / "out"))
    assert_refused_before_start(proc, f"{taskfile}:4: tasks[0].num_sample: Extra inputs are not permitted")
    assert "(did you mean num_samples?)" in proc.stderr


def test_train_config_choices_get_the_closest_value(tmp_path: Path) -> None:
    path = tmp_path / "train.yaml"
    path.write_text("tasks: [{task_id: a, instruction: x}]\nestimator: rlo\n")
    with pytest.raises(ConfigError, match=r"train\.yaml:2: estimator: .*\(did you mean 'rloo'\?\)"):
        load_config(path)


def test_submit_maps_the_servers_did_you_mean_to_the_line(tmp_path: Path) -> None:
    """`polar submit` leaves the names to the server (its installation decides); its refusal, with the
    closest registered name, is mapped back to the file's line."""
    taskfile = tmp_path / "tasks.yaml"
    taskfile.write_text(CLAUDE_DASH)
    server = start_server(tmp_path / "server.db")
    try:
        r = CliRunner().invoke(
            main, ["submit", str(taskfile), "--server", server.url], env={"POLAR_TOKEN": TOKEN}
        )
    finally:
        server.stop()
    assert r.exit_code == 2
    assert (
        f"{taskfile}:7: HTTP 400: agent.harness: unknown harness 'claude-code' (did you mean 'claude_code'?)"
        in (r.output)
    )


# -- YAML syntax at the right line --------------------------------------------------------------------------

UNCLOSED = """\
tasks:
  - task_id: a
    instruction: "fix the bug
  - task_id: b
    instruction: y
    num_samples: 2
"""


def test_an_unclosed_quote_is_reported_where_it_opens(tmp_path: Path) -> None:
    """Was: `tasks.yaml:7` (the end of the file, where PyYAML gave up)."""
    path = tmp_path / "tasks.yaml"
    path.write_text(UNCLOSED)
    with pytest.raises(TaskFileError) as info:
        load_tasks(path)
    assert str(info.value) == (
        f"{path}:3: not valid YAML/JSON: a quote opened here is never closed (found unexpected end of stream)"
    )
    proc = polar("run", str(path), "--out", str(tmp_path / "out"))
    assert_refused_before_start(proc, f"{path}:3: not valid YAML/JSON: a quote opened here is never closed")


def test_a_quote_closed_by_a_later_one_and_an_open_bracket(tmp_path: Path) -> None:
    path = tmp_path / "train.yaml"
    # The quote on line 2 runs on to line 4, where the next quote closes it and the parse breaks.
    path.write_text("steps: 1\nout: 'polar-train\ntasks: t.yaml\nmodel: 'x'\n")
    with pytest.raises(
        ConfigError, match=r"train\.yaml:2: not valid YAML: a quote opened here runs on to line 4"
    ):
        load_config(path)
    path.write_text("steps: 1\ntasks: [\n  {task_id: a, instruction: x},\n")
    with pytest.raises(
        ConfigError, match=r"train\.yaml:2: not valid YAML: a '\[' opened here is never closed"
    ):
        load_config(path)


# -- a bug is a short traceback and a request to report it --------------------------------------------------


@click.command("boom")
def boom() -> None:
    """A command with a bug."""
    settings: dict[str, int] = {}
    click.echo(settings["missing"])  # the bug


@click.command("mistake")
def mistake() -> None:
    raise click.ClickException("tasks.yaml:3: a user's mistake")


def test_an_internal_error_asks_to_be_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: the bare traceback of whatever escaped, indistinguishable from a user's mistake."""
    monkeypatch.setitem(_COMMANDS, "boom", (__name__, "boom", "A command with a bug."))
    monkeypatch.setitem(_COMMANDS, "mistake", (__name__, "mistake", "A user's mistake."))
    r = CliRunner().invoke(main, ["boom"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit)
    lines = r.output.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):" and "KeyError: 'missing'" in r.output
    assert lines[-1].startswith("polar: internal error (KeyError): this is a bug in polar")
    assert "Please report it" in lines[-1]
    assert len(lines) < 20  # short: the innermost frames, not click's
    # A user's mistake stays one message, without a traceback or the request.
    r = CliRunner().invoke(main, ["mistake"])
    assert r.exit_code == 2 and r.output == "Error: tasks.yaml:3: a user's mistake\n"


def test_train_checks_its_model_before_loading(tmp_path: Path) -> None:
    (tmp_path / "tasks.yaml").write_text("task_id: a\ninstruction: x\n")
    config = tmp_path / "train.yaml"
    config.write_text(f"tasks: tasks.yaml\nmodel: {tmp_path / 'no-model'}\n")
    proc = polar("train", str(config))
    assert_refused_before_start(proc, f"{config}: model: {tmp_path / 'no-model'}: no such file or folder")


def test_an_image_build_context_is_taken_relative_to_the_task_file(tmp_path: Path) -> None:
    """`runtime.build.context` works from any cwd, as upload sources do; an absolute one stays as given."""
    (tmp_path / "tasks.yaml").write_text(
        "tasks:\n"
        "  - {task_id: a, instruction: x, runtime: {backend: docker, image: 'a:1', build: {context: env}}}\n"
        "  - task_id: b\n    instruction: x\n"
        "    runtime: {backend: docker, image: 'b:1', build: {context: /srv/b, dockerfile: D}}\n"
        "  - {task_id: c, instruction: x, runtime: {backend: docker, image: 'c:1', build: {contxt: e}}}\n"
    )
    with pytest.raises(
        TaskFileError, match=r"tasks.yaml:6: tasks\[2\].runtime.build.contxt: .*did you mean context"
    ):
        load_tasks(tmp_path / "tasks.yaml")
    (tmp_path / "tasks.yaml").write_text("\n".join((tmp_path / "tasks.yaml").read_text().splitlines()[:-1]))
    a, b = load_tasks(tmp_path / "tasks.yaml")
    assert a.runtime.build is not None and a.runtime.build.context == str(tmp_path / "env")
    assert a.runtime.build.dockerfile == "Dockerfile"
    assert b.runtime.build is not None and (b.runtime.build.context, b.runtime.build.dockerfile) == (
        "/srv/b",
        "D",
    )
