"""SWE-bench-format and Harbor tasks run the whole way. SWE-bench: the dataset in examples/swe becomes tasks, a node starts each
session in a docker container of the instance's image (network: gateway only), the unmodified Claude Code
CLI works in /testbed against the scripted policy behind the gateway, and the `swebench` evaluator grades
the agent's diff in a fresh container with the official package. Harbor: the example task directory
becomes a task whose image `polar images build`'s function makes from its environment/, Claude Code fixes
/app in it, and the task's own tests/test.sh decides the reward.

The policy is scripted: for the instance it fixes, its one Bash call applies the instance's gold patch; for
the other it only looks around. What is proven is the plumbing a real policy's rollouts go through, and that
the reward is the grading's: 1 for the fix, 0 for no change.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from polar.rollout.protocol import SessionStatus
from polar.rollout.taskfile import load_tasks
from polar.store.sqlite import SQLiteStore
from polar.trajectory import audit, build
from tests.fakes.fake_vllm import Reply
from tests.node_support import fake_policy, running_node, spec

ROOT = Path(__file__).resolve().parent.parent
SWE = ROOT / "examples" / "swe"
INSTANCES = {d["instance_id"]: d for d in map(json.loads, (SWE / "instances.jsonl").read_text().splitlines())}
FIXED, UNTOUCHED = "polar-swe__textstats-1", "polar-swe__textstats-2"


def bash(command: str) -> str:
    return json.dumps({"command": command, "description": "work"}, separators=(",", ":"))


def script(body: dict[str, Any]) -> Reply:
    """Claude Code's main loop gets one Bash call (the gold patch for FIXED, `git status` otherwise), then a
    final answer; a call without tools (a side call) gets a plain answer."""
    tools = [t["function"]["name"] for t in body.get("tools") or []]
    messages = body["messages"]
    if "Bash" not in tools:
        return Reply(content="Fine.")
    if any(m["role"] == "tool" for m in messages):
        return Reply(content="Done.")
    prompt = json.dumps(messages)
    if INSTANCES[FIXED]["problem_statement"][:40] in prompt:
        command = f"cd /testbed && git apply - <<'EOF'\n{INSTANCES[FIXED]['patch']}EOF"
    else:
        command = "cd /testbed && git status --short"
    return Reply(content="Working on it.", tool_calls=[("Bash", bash(command))])


@pytest.fixture(scope="module")
def swe_image(docker_engine: str) -> Iterator[str]:
    """The instances' image, built by `polar images build`'s function from the dataset's own `build`."""
    from polar.runtime.images import build_image, ensure_base_image
    from tests.test_swebench import IMAGE, SWE_BASE

    ensure_base_image(docker_engine, SWE_BASE)
    build = load_tasks(SWE / "swe.yaml")[0].runtime.build
    assert build is not None
    build_image(docker_engine, IMAGE, Path(build.context), build.dockerfile)
    yield IMAGE


@pytest.mark.containers
@pytest.mark.cli
async def test_claude_code_in_the_instance_image_is_graded_by_swebench(
    tmp_path: Path, swe_image: str
) -> None:
    tasks = {t.task_id: t for t in load_tasks(SWE / "swe.yaml")}
    agent = {"harness": "claude_code", "settings": {"allowed_tools": ["Bash", "Read", "Edit"]}}
    runs = {}
    with fake_policy(script) as (url, fake):
        async with running_node(url, tmp_path, keep="artifacts") as node:
            for iid in (FIXED, UNTOUCHED):
                task = tasks[iid].model_copy(
                    update={"agent": tasks[iid].agent.model_validate(agent), "num_samples": 1}
                )
                assert task.runtime.backend == "docker" and task.runtime.image == swe_image
                await node.submit(spec(task, f"sess-{iid}"))
            for iid in (FIXED, UNTOUCHED):
                runs[iid] = await node.wait(f"sess-{iid}")
    assert fake.requests  # the policy was asked, through the gateway
    fixed, untouched = runs[FIXED], runs[UNTOUCHED]
    assert fixed.status == SessionStatus.COMPLETED, (fixed.reason, fixed.metadata)
    evaluation = fixed.metadata["evaluation"]
    assert fixed.reward == 1.0, evaluation
    assert (
        evaluation["details"]["tests_status"]["FAIL_TO_PASS"]["success"] == INSTANCES[FIXED]["FAIL_TO_PASS"]
    )
    assert untouched.status == SessionStatus.COMPLETED and untouched.reward == 0.0
    assert untouched.metadata["evaluation"]["details"]["reason"] == "no changes"
    with SQLiteStore(tmp_path / "node.db") as store:
        records = store.completions(f"sess-{FIXED}")
    assert records and all(r.trainable and r.prompt_ids and r.response_ids for r in records)
    trajectory = build(records, strategy="prefix_merging")
    assert audit(trajectory, records).ok


HARBOR_FIX = "cd /app && sed -i 's/text.split(\" \")/text.split()/' wordcount.py"


def harbor_script(body: dict[str, Any]) -> Reply:
    """One Bash call (the task's reference fix when the instruction is about count_words), then an answer."""
    tools = [t["function"]["name"] for t in body.get("tools") or []]
    if "Bash" not in tools:
        return Reply(content="Fine.")
    if any(m["role"] == "tool" for m in body["messages"]):
        return Reply(content="Done.")
    return Reply(content="Fixing it.", tool_calls=[("Bash", bash(HARBOR_FIX))])


@pytest.mark.containers
@pytest.mark.cli
async def test_claude_code_on_a_harbor_task_is_graded_by_its_tests(
    tmp_path: Path, docker_engine: str
) -> None:
    from polar.runtime.images import build_image, ensure_base_image
    from tests.test_swebench import SWE_BASE

    (task,) = load_tasks(SWE / "harbor.yaml")
    assert task.runtime.build is not None and task.runtime.image is not None
    ensure_base_image(docker_engine, SWE_BASE)
    build_image(
        docker_engine, task.runtime.image, Path(task.runtime.build.context), task.runtime.build.dockerfile
    )
    assert task.agent.harness == "claude_code" and task.evaluator.strategy == "harbor"
    with fake_policy(harbor_script) as (url, fake):
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(task.model_copy(update={"num_samples": 1}), "sess-harbor"))
            result = await node.wait("sess-harbor")
    assert fake.requests
    assert result.status == SessionStatus.COMPLETED, (result.reason, result.metadata)
    assert result.reward == 1.0, result.metadata["evaluation"]
