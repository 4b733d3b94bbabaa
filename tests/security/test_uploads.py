"""An upload prepare action copies a host path into the sandbox, so the task's author chooses what the node
reads. A task file may only name paths inside its own directory (absolute paths, `..` and symlinks that
lead out are refused at load, at the line); a node only reads inside its upload roots (none by default),
refusing anything else at admission with a 422 that names the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from polar.rollout.node.node import AdmissionError
from polar.rollout.protocol import SessionStatus
from polar.rollout.taskfile import TaskFileError, load_tasks
from polar.train.config import ConfigError, parse_config
from tests.node_support import fake_policy, running_node, shell_task, spec

_TASK = """\
tasks:
  - task_id: t
    instruction: do it
    runtime:
      prepare:
        - type: exec
          cmd: "true"
        - type: upload
          src: {src}
"""


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A host file outside the task's directory (what an escaping upload would copy into the sandbox)."""
    path = tmp_path / "secret.txt"
    path.write_text("host secret")
    return path


def _task_file(tmp_path: Path, src: str) -> Path:
    folder = tmp_path / "tasks"
    folder.mkdir(exist_ok=True)
    (folder / "repo").mkdir(exist_ok=True)
    path = folder / "tasks.yaml"
    path.write_text(_TASK.format(src=src))
    return path


def test_task_file_uploads_stay_in_its_directory(tmp_path: Path, secret: Path) -> None:
    ok = load_tasks(_task_file(tmp_path, "repo"))
    assert ok[0].runtime.prepare[1].src == str(tmp_path / "tasks" / "repo")  # type: ignore[union-attr]
    (tmp_path / "tasks" / "link").symlink_to(secret)
    for src, why in [
        (str(secret), "is absolute"),
        ("../secret.txt", "leads outside"),
        ("link", "leads outside"),
    ]:
        path = _task_file(tmp_path, src)
        with pytest.raises(TaskFileError) as err:
            load_tasks(path)
        assert str(err.value).startswith(f"{path}:9: tasks[0].runtime.prepare[1].src: "), err.value
        assert why in str(err.value)


def test_inline_tasks_of_a_training_config_stay_in_its_directory(tmp_path: Path) -> None:
    from polar.train.config import upload_roots

    config = "tasks:\n  - task_id: u\n    instruction: x\n    runtime:\n      prepare:\n        - {type: upload, src: ../x}\n"
    with pytest.raises(
        ConfigError, match=r"cfg.yaml:6: tasks\[0\]\.runtime\.prepare\[0\]\.src: '\.\./x' leads outside"
    ):
        parse_config(config, "cfg.yaml", tmp_path)
    (tmp_path / "x").write_text("an upload")
    cfg, _ = parse_config(config.replace("../x", "x"), "cfg.yaml", tmp_path)
    assert upload_roots(cfg, tmp_path / "cfg.yaml") == (tmp_path.resolve(),)


def test_confinement_resolves_symlinks_and_dots(tmp_path: Path, secret: Path) -> None:
    from polar.rollout.uploads import confine_upload

    root = tmp_path / "root"
    root.mkdir()
    (root / "inside").write_text("x")
    (root / "out").symlink_to(secret)
    assert confine_upload(root / "inside", [root]) == (root / "inside").resolve()
    for src in (root / "out", root / ".." / "secret.txt", secret):
        with pytest.raises(ValueError, match="outside the allowed upload roots"):
            confine_upload(src, [root])
    with pytest.raises(ValueError, match=r"reads no host files for uploads .*--upload-root"):
        confine_upload(root / "inside", [])


@pytest.mark.parametrize("backend", ["local", "bwrap"])
async def test_node_refuses_uploads_outside_its_roots(tmp_path: Path, secret: Path, backend: str) -> None:
    """The finding: a host file named by absolute path was copied into a bwrap sandbox."""
    allowed, second = tmp_path / "allowed", tmp_path / "second-node"
    allowed.mkdir()
    second.mkdir()
    (allowed / "data.txt").write_text("shared")
    (allowed / "escape").symlink_to(secret)

    def task(src: Path) -> object:
        check = {"strategy": "test_on_output", "config": {"command": "cat data.txt", "expect": "shared"}}
        upload = {"type": "upload", "src": str(src), "dst": "data.txt"}
        return shell_task("true", runtime={"backend": backend, "prepare": [upload]}, evaluator=check)

    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node:  # no upload roots: no host files at all
            with pytest.raises(AdmissionError) as refused:
                await node.submit(spec(task(allowed / "data.txt"), "no-roots"))  # type: ignore[arg-type]
            assert refused.value.status == 422 and refused.value.field == "task.runtime.prepare[0].src"
        async with running_node(url, second, upload_roots=(allowed,)) as node:
            for i, src in enumerate([secret, allowed / "escape", allowed / ".." / "secret.txt"]):
                with pytest.raises(AdmissionError) as refused:
                    await node.submit(spec(task(src), f"outside-{i}"))  # type: ignore[arg-type]
                assert refused.value.status == 422, src
                assert refused.value.message.startswith("task.runtime.prepare[0].src: ")
            await node.submit(spec(task(allowed / "data.txt"), "inside"))  # type: ignore[arg-type]
            result = await node.wait("inside")
    assert result.status == SessionStatus.COMPLETED and result.reward == 1.0, result.metadata
