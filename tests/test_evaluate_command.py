# ruff: noqa: F811  (`make_repo` is a fixture imported from tests.evaluate_support)
"""The `command` evaluator against real local runtimes: the agent's diff replayed in a fresh runtime."""

from __future__ import annotations

import dataclasses
import shutil
import sys

import pytest

from polar.evaluate import CommandEvaluator, EvaluatorError, get_evaluator
from polar.evaluate.base import AgentFault
from polar.runtime.base import RuntimeFailure
from tests.evaluate_support import (  # noqa: F401  (make_repo is a fixture)
    CALC,
    FIX_ADD,
    FIX_MUL,
    GIT_COMMIT,
    context,
    edit,
    make_repo,
    must,
)

PY = sys.executable  # has pytest; a bare `python3` in the runtime may not
UNITTEST = f"{PY} -m unittest"
PYTEST = f"{PY} -m pytest -q -p no:cacheprovider"


def command(**config: object) -> CommandEvaluator:
    ev = get_evaluator("command", {"test_command": UNITTEST, **config})
    assert isinstance(ev, CommandEvaluator) and ev.needs_fresh_runtime
    return ev


async def test_correct_fix_passes(make_repo) -> None:
    agent, fresh = await make_repo(), await make_repo()
    await edit(agent, "calc.py", *FIX_ADD)
    await edit(agent, "calc.py", *FIX_MUL)
    res = await command().evaluate(context(agent, fresh))
    assert res.reward == 1.0 and res.passed is True, res.details
    assert res.details["exit_code"] == 0 and res.details["diff_bytes"] > 0
    # The tests ran in the fresh runtime, on the replayed diff.
    assert "return a + b" in (fresh.workdir / "calc.py").read_text()


async def test_wrong_fix_fails(make_repo) -> None:
    agent, fresh = await make_repo(), await make_repo()
    await edit(agent, "calc.py", *FIX_ADD)  # only one of the two bugs
    res = await command().evaluate(context(agent, fresh))
    assert res.reward == 0.0 and res.passed is False
    assert res.details["reason"].startswith("tests failed")
    assert "test_mul" in res.details["output"]


async def test_no_change_is_zero(make_repo) -> None:
    agent, fresh = await make_repo(), await make_repo()
    res = await command().evaluate(context(agent, fresh))
    assert res.reward == 0.0 and res.details == {"reason": "no changes"}


async def test_ignored_files_are_no_change(make_repo) -> None:
    agent, fresh = await make_repo(), await make_repo()
    await must(agent, f"{UNITTEST} 2>/dev/null || true")  # leaves __pycache__/ behind (ignored)
    assert (agent.workdir / "__pycache__").exists()
    res = await command().evaluate(context(agent, fresh))
    assert res.details == {"reason": "no changes"}


async def test_unapplicable_diff_is_zero(make_repo) -> None:
    agent = await make_repo()
    # The fresh runtime's base differs where the agent's diff has its context.
    fresh = await make_repo({**CALC, "calc.py": CALC["calc.py"].replace("return a - b", "return b - a")})
    await edit(agent, "calc.py", *FIX_ADD)
    res = await command().evaluate(context(agent, fresh))
    assert res.reward == 0.0 and res.passed is False
    assert res.details["reason"] == "the diff does not apply"
    assert "calc.py" in res.details["apply_output"]


async def test_new_binary_and_non_utf8_files_travel_byte_exact(make_repo) -> None:
    agent, fresh = await make_repo(), await make_repo()
    blob = bytes(range(256))
    (agent.workdir / "data").mkdir()
    (agent.workdir / "data" / "blob.bin").write_bytes(blob)
    (agent.workdir / "latin1.txt").write_bytes("café".encode("latin-1"))
    (agent.workdir / "helper.py").write_text("VALUE = 42\n")
    check = (
        f'{PY} -c "import helper, pathlib; '
        "assert helper.VALUE == 42; "
        "assert pathlib.Path('data/blob.bin').read_bytes() == bytes(range(256)); "
        "assert pathlib.Path('latin1.txt').read_bytes() == 'café'.encode('latin-1')\""
    )
    res = await command(test_command=check).evaluate(context(agent, fresh))
    assert res.reward == 1.0, res.details
    assert (fresh.workdir / "data" / "blob.bin").read_bytes() == blob


async def test_deleted_file_is_replayed(make_repo) -> None:
    agent, fresh = await make_repo(), await make_repo()
    await must(agent, "rm calc.py")
    res = await command(test_command="test ! -e calc.py").evaluate(context(agent, fresh))
    assert res.reward == 1.0, res.details


async def test_a_diff_touching_protected_paths_is_refused(make_repo) -> None:
    agent, fresh = await make_repo(), await make_repo()
    # Reward hacking: make the tests assert the bugs instead of fixing them.
    await edit(agent, "tests/test_calc.py", "add(2, 3), 5", "add(2, 3), -1")
    await edit(agent, "tests/test_calc.py", "mul(2, 3), 6", "mul(2, 3), 5")
    assert (await command().evaluate(context(agent, fresh))).reward == 1.0  # unprotected: hacked
    res = await command(protect=["tests"]).evaluate(context(agent, await make_repo()))
    assert res.reward == 0.0 and res.passed is False
    assert res.details["reason"] == "refused: tests/test_calc.py: touches a protected path"
    assert res.details["refused"] == [{"path": "tests/test_calc.py", "why": "touches a protected path"}]
    # A real fix next to the edit is refused too; the fix alone passes, with the tests the task had.
    await edit(agent, "calc.py", *FIX_ADD)
    await edit(agent, "calc.py", *FIX_MUL)
    res = await command(protect=["tests"]).evaluate(context(agent, await make_repo()))
    assert res.details["reason"].startswith("refused:")
    await must(agent, "git checkout HEAD -- tests")  # (the evaluator staged the edits)
    fresh3 = await make_repo()
    res = await command(protect=["tests"]).evaluate(context(agent, fresh3))
    assert res.reward == 1.0, res.details
    assert "add(2, 3), 5" in (fresh3.workdir / "tests" / "test_calc.py").read_text()


async def test_build_products_never_travel(make_repo) -> None:
    """A stale, unchecked-hash .pyc of a fixed calc.py, beside the buggy source: Python would load it."""
    files = {k: v for k, v in CALC.items() if k != ".gitignore"}  # nothing ignores __pycache__
    agent, fresh = await make_repo(files), await make_repo(files)
    fixed = CALC["calc.py"].replace(*FIX_ADD).replace(*FIX_MUL)
    await must(
        agent,
        f"{PY} -c 'import py_compile, sys; py_compile.compile(sys.argv[1], cfile=sys.argv[2], "
        "invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)' /dev/stdin "
        f"__pycache__/calc.cpython-{sys.version_info.major}{sys.version_info.minor}.pyc <<'EOF'\n{fixed}EOF",
    )
    await must(
        agent, f"cp __pycache__/calc.cpython-{sys.version_info.major}{sys.version_info.minor}.pyc calc.pyc"
    )
    assert (await agent.exec(UNITTEST, timeout_s=60)).exit_code == 0  # the hack works where it was made
    res = await command().evaluate(context(agent, fresh))
    assert res.details == {"reason": "no changes"}


async def test_agent_commits_count_from_base_ref(make_repo) -> None:
    agent, fresh = await make_repo(), await make_repo()
    await edit(agent, "calc.py", *FIX_ADD)
    await edit(agent, "calc.py", *FIX_MUL)
    await must(agent, GIT_COMMIT)
    # Against HEAD the committed fix is invisible; against the tag the prepare step made, it counts.
    assert (await command().evaluate(context(agent, fresh))).details == {"reason": "no changes"}
    res = await command(base_ref="polar-base").evaluate(context(agent, fresh))
    assert res.reward == 1.0, res.details


@pytest.mark.parametrize(
    ("runner", "parse"),
    [(PYTEST, "pytest"), (UNITTEST, "unittest")],
)
async def test_pass_fraction(make_repo, runner: str, parse: str) -> None:
    agent, fresh = await make_repo(), await make_repo()
    await edit(agent, "calc.py", *FIX_ADD)  # 2 of 3 tests pass
    res = await command(test_command=runner, parse=parse).evaluate(context(agent, fresh))
    assert res.reward == pytest.approx(2 / 3), res.details
    assert res.passed is False
    assert (res.details["tests_passed"], res.details["tests_failed"]) == (2, 1)


async def test_pass_fraction_full(make_repo) -> None:
    agent, fresh = await make_repo(), await make_repo()
    await edit(agent, "calc.py", *FIX_ADD)
    await edit(agent, "calc.py", *FIX_MUL)
    res = await command(test_command=PYTEST, parse="pytest").evaluate(context(agent, fresh))
    assert res.reward == 1.0 and res.passed is True


async def test_collection_error_is_zero(make_repo) -> None:
    agent, fresh = await make_repo(), await make_repo()
    await edit(agent, "calc.py", "def add(a, b):", "def add(a, b)")  # syntax error
    res = await command(test_command=PYTEST, parse="pytest").evaluate(context(agent, fresh))
    assert res.reward == 0.0 and res.details["tests_failed"] == 1


async def test_parse_without_summary(make_repo) -> None:
    agent, fresh = await make_repo(), await make_repo()
    await edit(agent, "calc.py", *FIX_ADD)
    res = await command(test_command="echo nope; exit 1", parse="pytest").evaluate(context(agent, fresh))
    assert res.reward == 0.0 and res.details["reason"] == "no pytest summary in the output"
    # Exit 0 without the summary is a misconfigured task, not a pass.
    with pytest.raises(EvaluatorError, match="no pytest summary"):
        await command(test_command="true", parse="pytest").evaluate(context(agent, await make_repo()))


async def test_hanging_tests_are_zero(make_repo) -> None:
    agent, fresh = await make_repo(), await make_repo()
    await edit(agent, "calc.py", *FIX_ADD)
    res = await command(test_command="sleep 30", timeout_seconds=0.5).evaluate(context(agent, fresh))
    assert res.reward == 0.0 and res.details["reason"] == "tests timed out"


async def test_env_reaches_the_test_command(make_repo) -> None:
    agent, fresh = await make_repo(), await make_repo()
    await edit(agent, "calc.py", *FIX_ADD)
    ev = command(test_command='test "$MODE" = strict', env={"MODE": "strict"})
    assert (await ev.evaluate(context(agent, fresh))).reward == 1.0


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (apt-get install bubblewrap)")
async def test_in_bwrap_sandboxes(make_repo) -> None:
    agent, fresh = await make_repo(backend="bwrap"), await make_repo(backend="bwrap")
    await edit(agent, "calc.py", *FIX_ADD)
    await edit(agent, "calc.py", *FIX_MUL)
    res = await command(test_command="python3 -m unittest").evaluate(context(agent, fresh))
    assert res.reward == 1.0, res.details
    fresh2 = await make_repo(backend="bwrap")
    await edit(agent, "calc.py", "return a * b", "return a ** b")
    res = await command(test_command="python3 -m unittest").evaluate(context(agent, fresh2))
    assert res.reward == 0.0 and "test_mul" in res.details["output"]


# -- not the agent's fault: raise (ERROR, fully masked) --------------------------------------------


async def test_without_fresh_runtime_refuses(make_repo) -> None:
    agent = await make_repo()
    await edit(agent, "calc.py", *FIX_ADD)
    with pytest.raises(EvaluatorError, match="needs a fresh runtime"):
        await command().evaluate(context(agent, None))


async def test_fresh_runtime_not_a_git_repo_raises(make_repo) -> None:
    agent, fresh = await make_repo(), await make_repo(git=False)
    await edit(agent, "calc.py", *FIX_ADD)
    with pytest.raises(EvaluatorError, match="not a git repository"):
        await command().evaluate(context(agent, fresh))


async def test_fresh_runtime_without_git_raises(make_repo) -> None:
    agent, fresh = await make_repo(), await make_repo()
    await edit(agent, "calc.py", *FIX_ADD)
    fresh.spec = dataclasses.replace(fresh.spec, env={"PATH": "/nonexistent"})  # an image without git
    with pytest.raises(EvaluatorError, match="git could not run"):
        await command().evaluate(context(agent, fresh))


async def test_stopped_fresh_runtime_raises(make_repo) -> None:
    agent, fresh = await make_repo(), await make_repo()
    await edit(agent, "calc.py", *FIX_ADD)
    await fresh.stop()
    with pytest.raises(RuntimeFailure, match="stopped"):
        await command().evaluate(context(agent, fresh))


async def test_missing_test_runner_raises(make_repo) -> None:
    agent, fresh = await make_repo(), await make_repo()
    await edit(agent, "calc.py", *FIX_ADD)
    with pytest.raises(EvaluatorError, match="could not run"):
        await command(test_command="no-such-test-runner --all").evaluate(context(agent, fresh))


async def test_an_agent_workdir_without_git_is_the_agents_fault(make_repo) -> None:
    """The agent removed its .git: no diff, reward 0 from the node (AgentFault), never a masked ERROR."""
    agent, fresh = await make_repo(git=False), await make_repo()
    with pytest.raises(AgentFault, match="the agent's workdir gives no diff"):
        await command().evaluate(context(agent, fresh))


async def test_an_agent_workdir_that_lost_base_ref_is_the_agents_fault(make_repo) -> None:
    agent, fresh = await make_repo(), await make_repo()
    await edit(agent, "calc.py", *FIX_ADD)
    await agent.exec(["git", "tag", "v0"], timeout_s=30)
    await fresh.exec(["git", "tag", "v0"], timeout_s=30)
    await agent.exec(["git", "tag", "-d", "v0"], timeout_s=30)
    with pytest.raises(AgentFault, match="gives no diff"):
        await command(base_ref="v0").evaluate(context(agent, fresh))


async def test_a_base_ref_the_task_lacks_raises(make_repo) -> None:
    agent, fresh = await make_repo(), await make_repo()
    await edit(agent, "calc.py", *FIX_ADD)
    with pytest.raises(EvaluatorError, match="base_ref 'no-such-tag'"):
        await command(base_ref="no-such-tag").evaluate(context(agent, fresh))
