"""The exit statuses every command shares (`polar.cli`: 0 ok, 1 a bug, 2 a user's mistake, 3 work that ran
and partly failed, 130 interrupted), the distribution's name and version, and the checks `polar run` makes
before its first session (each problem one line, exit 2, nothing created)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import polar.cli
from polar.cli import main
from tests.conftest import SERVED_MODEL
from tests.node_support import fake_policy


def polar_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "polar", "run", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env or {**os.environ, "PYTHONUNBUFFERED": "1"},  # as the fixtures left it (DOCKER_HOST)
    )


def test_the_distribution_is_polar_rl_and_says_its_version() -> None:
    """Was: `pip install polar` installs an unrelated project of that name from the package index."""
    dist = importlib.metadata.distribution("polar-rl")
    assert dist.read_text("top_level.txt") is None or "polar" in (dist.read_text("top_level.txt") or "")
    r = CliRunner().invoke(main, ["--version"], prog_name="polar")
    assert r.exit_code == 0 and r.output == f"polar, version {dist.version}\n"


@pytest.mark.parametrize(
    ("argv", "status"),
    [
        (["run", "no-such-file.yaml"], 2),  # a file that is not there
        (["run", "--no-such-option"], 2),  # click's usage error
        (["train", "no-such-config.yaml"], 2),
        (["traces", "show", "--store", "/nonexistent/x.db"], 2),
    ],
)
def test_a_users_mistake_exits_2(argv: list[str], status: int) -> None:
    """Was: task-file and config mistakes exited 1 (click's default) and option mistakes 2."""
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == status, r.output
    assert "Traceback" not in r.output
    assert (polar.cli.OK, polar.cli.BUG, polar.cli.USER_ERROR, polar.cli.FAILURES) == (0, 1, 2, 3)
    assert polar.cli.INTERRUPTED == 130


def test_a_missing_upload_is_its_line_before_anything_starts(tmp_path: Path) -> None:
    """Was: not checked; every session ended ERROR at its start and the run exited 0."""
    taskfile = tmp_path / "tasks.yaml"
    taskfile.write_text(
        "task_id: a\ninstruction: x\nruntime:\n  prepare:\n    - {type: upload, src: repo, dst: repo}\n"
    )
    proc = polar_run(str(taskfile), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (
        f"Error: {taskfile}:5: runtime.prepare[0].src: 'repo': no such file or folder in {tmp_path}"
    )
    assert not (tmp_path / "out").exists()


def test_a_model_the_backend_does_not_serve_is_one_line(tmp_path: Path) -> None:
    """Was: every call a 404 from the server, every session ERROR, exit 0."""
    taskfile = tmp_path / "tasks.yaml"
    taskfile.write_text("task_id: a\ninstruction: x\nagent: {harness: shell, settings: {command: 'true'}}\n")
    with fake_policy() as (url, backend):
        proc = polar_run(
            str(taskfile), "--backend", url, "--model", "Qwen/Qwen3-8B", "--out", str(tmp_path / "o")
        )
        assert backend.requests == []  # no session started, no call made
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        f"polar run: --model Qwen/Qwen3-8B: not served by {url} (it serves {SERVED_MODEL})"
    ]
    assert proc.stdout == "" and not (tmp_path / "o").exists()


@pytest.mark.containers
def test_images_a_task_needs_are_checked_before_sessions_and_made_on_request(
    docker_engine: str, tmp_path: Path
) -> None:
    """Was: each session failed late on docker's registry error (`Unable to find image ... locally`), exit 0.
    Now one line per missing image, with the command that makes it; the image that is there passes.
    `--images build` builds what has a runtime.build, `--images pull` pulls the rest (a real registry on
    loopback)."""
    from tests.container_support import local_registry

    def docker(*argv: str, stdin: str | None = None) -> None:
        done = subprocess.run(["docker", *argv], input=stdin, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr

    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM polar-base:bookworm\nLABEL polar.test=unbuilt\n")
    with local_registry(tmp_path) as registry, fake_policy() as (url, _):
        absent = f"{registry}/polar-test-absent:1"
        docker("build", "-q", "-t", absent, "-f", "-", str(ctx), stdin="FROM scratch\nLABEL polar.test=a\n")
        docker("push", "-q", absent)
        subprocess.run(
            ["docker", "rmi", "-f", absent, "polar-test-unbuilt:1"], capture_output=True, check=False
        )
        taskfile = tmp_path / "tasks.yaml"
        taskfile.write_text(
            "tasks:\n"
            f"  - {{task_id: a, instruction: x, runtime: {{backend: docker, image: '{absent}'}}}}\n"
            "  - {task_id: b, instruction: x, runtime: {backend: docker, image: 'polar-test-unbuilt:1',"
            " build: {context: ctx}}}\n"
            "  - {task_id: c, instruction: x, runtime: {backend: docker, image: 'polar-test-unbuilt:1',"
            " build: {context: ctx}}}\n"
            "  - {task_id: d, instruction: x, runtime: {backend: docker, image: 'polar-base:bookworm'}}\n"
        )
        try:
            proc = polar_run(str(taskfile), "--backend", url, "--out", str(tmp_path / "o"))
            assert proc.returncode == 2, proc.stdout + proc.stderr
            missing_a = (
                f"polar run: task a: docker image {absent}: not on this machine; "
                f"pull or build it: docker pull {absent} (or run with --images pull)"
            )
            assert proc.stderr.splitlines() == [
                missing_a,
                "polar run: tasks b and 1 more: docker image polar-test-unbuilt:1: not on this machine; "
                f"build it: polar images build {taskfile} --engine docker (or run with --images build)",
            ]
            assert not (tmp_path / "o").exists()

            built = polar_run(str(taskfile), "--backend", url, "--images", "build", "--check")
            assert built.returncode == 2, built.stdout + built.stderr
            assert "polar-test-unbuilt:1 (docker, 2 tasks): built" in built.stdout
            assert built.stderr.splitlines() == [missing_a]  # no runtime.build: not built, still missing

            pulled = polar_run(str(taskfile), "--backend", url, "--images", "pull", "--check")
            assert pulled.returncode == 0, pulled.stdout + pulled.stderr
            assert f"{absent} (docker, task a): pulled in" in pulled.stdout
            assert "polar-test-unbuilt:1 (docker, 2 tasks): present" in pulled.stdout
            assert pulled.stdout.endswith("ready to run against " + url + "\n")
        finally:
            subprocess.run(
                ["docker", "rmi", "-f", absent, "polar-test-unbuilt:1"], capture_output=True, check=False
            )


def test_shell_completion_completes_commands() -> None:
    """docs/cli.md's completion line: click's, through the installed `polar` command."""
    polar = Path(sys.executable).with_name("polar")
    env = {**os.environ, "COMP_WORDS": "polar tr", "COMP_CWORD": "1", "_POLAR_COMPLETE": "bash_complete"}
    done = subprocess.run([str(polar)], capture_output=True, text=True, env=env, timeout=60)
    assert done.stdout.split() == ["plain,traces", "plain,train"]


def test_check_only_checks_and_starts_nothing(tmp_path: Path) -> None:
    """Was: no way to validate a task file and its set-up without running it."""
    taskfile = tmp_path / "tasks.yaml"
    taskfile.write_text(
        "task_id: a\ninstruction: x\nnum_samples: 3\nagent: {harness: shell, settings: {command: 'true'}}\n"
    )
    with fake_policy() as (url, backend):
        ok = polar_run(str(taskfile), "--backend", url, "--out", str(tmp_path / "o"), "--check")
        bad = polar_run(str(taskfile), "--backend", url, "--model", "nope", "--check")
        assert backend.requests == []
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout == f"{taskfile}: 1 task(s), 3 session(s): ready to run against {url}\n"
    assert not (tmp_path / "o").exists()
    assert bad.returncode == 2 and bad.stderr.startswith("polar run: --model nope: not served by")


@pytest.mark.parametrize("command", sorted(polar.cli._COMMANDS))
def test_every_command_has_help_with_examples_and_exits_2_on_a_bad_option(command: str) -> None:
    helped = CliRunner().invoke(main, [command, "--help"], prog_name="polar")
    assert helped.exit_code == 0, helped.output
    assert "Example" in helped.output or "Commands:" in helped.output, helped.output  # a group lists its own
    bad = CliRunner().invoke(main, [command, "--no-such-option"], prog_name="polar")
    assert bad.exit_code == 2 and "No such option '--no-such-option'" in bad.output, bad.output
