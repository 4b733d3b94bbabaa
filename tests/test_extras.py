"""Optional features and the extras that bring them: what the README's main command installs covers what
its commands use by default, and a feature whose package is missing says which extra to install, in one
line, before it starts anything (real `polar` processes where the package cannot be imported)."""

from __future__ import annotations

import re
import shlex
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from polar import extras
from polar.extras import ENGINE, PARQUET, TRAINER, Extra
from tests.extras_support import one_line_error, polar_without, python_without

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EVERY_EXTRA = [v for v in vars(extras).values() if isinstance(v, Extra)]


def install_set(spec: str) -> set[str]:
    """Distribution names `pip install -e '.[spec]'` asks for (extras resolved, polar's own included)."""
    names: set[str] = set()
    todo, seen = [None, *spec.split(",")], set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for text in PYPROJECT["dependencies"] if extra is None else PYPROJECT["optional-dependencies"][extra]:
            req = Requirement(text)
            if req.name == "polar":
                todo.extend(req.extras)
            else:
                names.add(req.name.lower())
    return names


def distribution(module: str) -> str:
    top = module.partition(".")[0]
    return packages_distributions().get(top, [top])[0].lower()


def main_command_extras() -> str:
    """The extras `scripts/demo` (the README's main command) installs: `scripts/bootstrap EXTRAS`."""
    for line in (ROOT / "scripts" / "demo").read_text().splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["scripts/bootstrap"]:
            return words[1]
    raise AssertionError("scripts/demo does not run scripts/bootstrap")


@pytest.mark.parametrize("extra", [PARQUET, ENGINE, TRAINER], ids=lambda e: e.feature)
def test_the_main_command_installs_what_the_readme_uses(extra: Extra) -> None:
    """Parquet export (`polar generate`'s default format, `traces export --out x.parquet`), the embedded
    engine (`polar demo`, `polar run`) and `polar train` work after `scripts/demo`'s install."""
    installed = install_set(main_command_extras())
    assert {distribution(m) for m in extra.modules} <= installed


@pytest.mark.parametrize("extra", EVERY_EXTRA, ids=lambda e: e.feature)
def test_every_message_names_an_extra_that_installs_the_package(extra: Extra) -> None:
    assert extra.extra in PYPROJECT["optional-dependencies"]
    assert {distribution(m) for m in extra.modules} <= install_set(extra.extra)


@pytest.mark.parametrize(
    "args",
    [
        ("run", "examples/tasks.yaml", "--out", "{out}"),
        ("generate", "examples/tasks.yaml", "--format", "jsonl", "--out", "{out}"),
        ("demo", "--out", "{out}"),
        ("serve-model", "--port", "9"),
    ],
    ids=["run", "generate", "demo", "serve-model"],
)
def test_the_embedded_engine_without_torch_is_one_line(tmp_path: Path, args: tuple[str, ...]) -> None:
    out = tmp_path / "out"
    proc = polar_without(("torch",), *(a.replace("{out}", str(out)) for a in args), cwd=ROOT)
    line = one_line_error(proc)
    assert re.search(r"the embedded engine needs torch, .*: pip install 'polar-rl\[engine\]'$", line), line
    assert not out.exists()


def test_the_trl_bridge_without_trl_says_so_at_construction() -> None:
    code = (
        "from polar.extras import MissingExtra\n"
        "from polar.task import Task\n"
        "from polar.train.bridges.trl import PolarRollout\n"
        "try:\n"
        "    PolarRollout('http://127.0.0.1:9', Task(task_id='t', instruction='x'), token='t')\n"
        "except MissingExtra as exc:\n"
        "    print(exc)\n"
    )
    proc = python_without(("trl",), code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("needs trl, which cannot be imported (No module named 'trl'): "
                                         "pip install 'polar-rl[trl]'")  # fmt: skip


def test_polar_train_names_resolve_lazily() -> None:
    import polar.train

    assert all(getattr(polar.train, name) is not None for name in polar.train.__all__)


@pytest.mark.parametrize(
    "args",
    [
        ("run", "examples/tasks.yaml", "--backend", "http://127.0.0.1:9", "--out", "{out}", "--ray"),
        ("serve", "--db", "{out}/server.db", "--port", "0", "--ray", "--backend", "http://127.0.0.1:9"),
    ],
    ids=["run", "serve"],
)
def test_ray_without_ray_is_one_line(tmp_path: Path, args: tuple[str, ...]) -> None:
    out = tmp_path / "out"
    proc = polar_without(("ray",), *(a.replace("{out}", str(out)) for a in args), cwd=ROOT)
    line = one_line_error(proc)
    assert re.search(r"--ray .*needs ray, .*: pip install 'polar-rl\[ray\]'$", line), line
    assert not out.exists()


def test_the_rollout_commands_never_import_ray() -> None:
    """Ray is optional: the server, the node, the local stack and the --ray code itself import without it
    (`import ray` happens only once --ray is given)."""
    proc = python_without(
        ("ray",),
        "import polar.cli.run, polar.cli.serve, polar.stack, polar.rollout.ray.cluster, "
        "polar.rollout.ray.actor; print('ok')",
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
