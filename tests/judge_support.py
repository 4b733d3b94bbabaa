"""For the judge tests: a scripted judge (the fake inference server of tests/fakes, answering verdicts a test
chooses), an evaluation context over a real node's gateway, and a trajectory whose last answer is known."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

from polar.evaluate.base import EvalContext
from polar.rollout.node import Node
from polar.runtime.base import ExecResult, Runtime
from polar.task import Task
from polar.trajectory.models import Trace, Trajectory
from tests.fakes.fake_vllm import FakeInferenceServer, Reply, make_fake_backend
from tests.fakes.server import serve

JUDGE_MODEL = "judge-model"
RUBRIC = "The answer names the capital of France."


def verdict(score: Any, reasoning: str = "because") -> Reply:
    return Reply(content=json.dumps({"reasoning": reasoning, "score": score}))


@contextlib.contextmanager
def scripted_judge(
    script: Callable[[dict[str, Any]], Reply] | list[Reply] | None = None, **faults: Any
) -> Iterator[tuple[str, FakeInferenceServer]]:
    """A judge server serving JUDGE_MODEL only (vLLM's wire shape, token ids included) that answers what
    `script` says: the fake of tests/fakes, whose sampling follows the script and ignores
    `response_format` (a real vLLM constrains its sampling to it: tests/test_judge_vllm.py)."""
    app = make_fake_backend("vllm", script or (lambda body: verdict(7)), model=JUDGE_MODEL, **faults)
    with serve(app) as srv:
        yield srv.url, app


def judge_config(url: str, **over: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "rubric": RUBRIC,
        "backend": {"url": url, "kind": "vllm", "model": JUDGE_MODEL},
        "diff": False,
    }
    return config | over


def answered(text: str, seq: int = 0) -> Trajectory:
    """A trajectory of one call whose assistant message is `text`."""
    trace = Trace.trusted(
        prompt_ids=[1, 2],
        response_ids=[3],
        loss_mask=[1],
        response_logprobs=[-0.1],
        prompt_messages=[{"role": "user", "content": "What is the capital of France?"}],
        response_messages=[{"role": "assistant", "content": text}],
        metadata={"seqs": [seq], "completion_ids": [f"cmpl-x-{seq}"]},
    )
    return Trajectory(traces=[trace], metadata={"session_id": "s-judged"})


def context(
    node: Node, runtime: Runtime, trajectory: Trajectory, task: Task | None = None, sid: str = "s-judged"
) -> EvalContext:
    return EvalContext(
        task=task,
        session_id=sid,
        runtime=runtime,
        fresh=None,
        agent=ExecResult(0, "", ""),
        trajectory=trajectory,
        models=node.models(),
    )


def judge_prompt(body: dict[str, Any]) -> str:
    """The judge request's messages as one text."""
    return "\n".join(str(m.get("content")) for m in body["messages"])
