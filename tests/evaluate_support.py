"""Real local runtimes holding tiny git repositories, for the evaluator tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path

import pytest

from polar.evaluate.base import EvalContext
from polar.runtime.base import ExecResult, Runtime, RuntimeSpec
from polar.runtime.factory import make_runtime
from polar.trajectory.models import Trajectory

GIT_BASE = (
    "git init -q && git add -A && "
    "git -c user.email=polar@localhost -c user.name=polar commit -qm base && git tag polar-base"
)
GIT_COMMIT = "git add -A && git -c user.email=a@localhost -c user.name=a commit -qm agent"

# A calculator with two bugs and three tests: one passes already, one per bug fails.
CALC = {
    "calc.py": "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a + b\n\n\ndef neg(a):\n    return -a\n",
    "tests/__init__.py": "",
    "tests/test_calc.py": (
        "import unittest\n\nfrom calc import add, mul, neg\n\n\n"
        "class CalcTest(unittest.TestCase):\n"
        "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n\n"
        "    def test_mul(self):\n        self.assertEqual(mul(2, 3), 6)\n\n"
        "    def test_neg(self):\n        self.assertEqual(neg(2), -2)\n"
    ),
    ".gitignore": "__pycache__/\n.pytest_cache/\n",
}
FIX_ADD = ("return a - b", "return a + b")
FIX_MUL = ("return a + b\n\n\ndef neg", "return a * b\n\n\ndef neg")

MakeRepo = Callable[..., Awaitable[Runtime]]


def write_tree(root: Path, files: Mapping[str, str | bytes]) -> None:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


async def must(runtime: Runtime, cmd: str) -> ExecResult:
    res = await runtime.exec(cmd, timeout_s=60)
    assert res.exit_code == 0, (cmd, res.stderr)
    return res


async def edit(runtime: Runtime, rel: str, old: str, new: str) -> None:
    path = runtime.workdir / rel
    text = path.read_text()
    assert old in text, (rel, old)
    path.write_text(text.replace(old, new, 1))


@pytest.fixture
async def make_repo(tmp_path: Path) -> AsyncIterator[MakeRepo]:
    """`await make_repo(files, git=True, **spec)`: a started runtime (bwrap, the default) whose workdir holds `files`,
    committed as the base (tag `polar-base`) when `git`; stopped at the end of the test. `spec` fields
    (e.g. `backend="bwrap"`) go to the `RuntimeSpec`."""
    started: list[Runtime] = []
    counter = iter(range(1000))

    async def make(files: Mapping[str, str | bytes] = CALC, *, git: bool = True, **spec: object) -> Runtime:
        n = next(counter)
        src = tmp_path / f"src{n}"
        write_tree(src, files)
        rt = make_runtime(RuntimeSpec(root=tmp_path, **spec), f"eval-test-{n}")  # type: ignore[arg-type]
        started.append(rt)
        await rt.start()
        await rt.upload(src, ".")
        if git:
            await must(rt, GIT_BASE)
        return rt

    yield make
    for rt in started:
        await rt.stop()


def context(
    runtime: Runtime,
    fresh: Runtime | None = None,
    agent: ExecResult | None = ExecResult(0, "", ""),
) -> EvalContext:
    return EvalContext(
        task=None,
        session_id="s-test",
        runtime=runtime,
        fresh=fresh,
        agent=agent,
        trajectory=Trajectory(),
    )
