"""The group phase of a task whose rewards are relative (`judge_group`: `polar.evaluate.judge_group`).

Its sessions' results are stored as they arrive but held back (`ServerStore.finish(hold=True)`: no
long-poll answer, no `results.jsonl` line, no trainer callback) until every session of the task has ended.
Then one node judges the COMPLETED outcomes together (`POST /node/judge_group`), each pending result is
settled (rewarded, or masked with the reason when the judging failed: fail-closed) and the whole group is
released in one transaction, before the task is done.

The server decides nothing about scores here: it picks a node, relays the outcomes the nodes rendered, and
checks the answer covers every pending session with a reward in [0, 1]. A server that stops mid-phase
resumes it at start (the held results, outcomes included, are in its store; orderings a node had already
asked come back from that node's judge cache). A group no node judges within its evaluator's
`timeout_seconds` is released masked as ERROR, with the reason.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from polar.evaluate.group_judging import GroupRequest, Outcome
from polar.evaluate.judge_group import group_evaluator, pending, settle
from polar.rollout.protocol import SessionResult, SessionStatus
from polar.rollout.rewards import REWARD_PENDING, settle_group
from polar.rollout.server.nodelink import NodeLink
from polar.rollout.server.store import NodeRow
from polar.task import Task
from polar.trajectory.models import Trajectory, TrajectoryStatus

log = logging.getLogger("polar.server")

RETRY_S = 5.0  # between rounds over the nodes when none could judge


def relative(task: Task) -> bool:
    """Whether the task's results wait for its group to be judged."""
    return group_evaluator(task) is not None


@dataclass(frozen=True)
class GroupAnswer:
    """A node's judgement of a group: a reward per pending session, or why there is none."""

    rewards: dict[str, float] = field(default_factory=dict)
    scores: dict[str, float] = field(default_factory=dict)
    orderings: int = 0
    calls: list[dict[str, Any]] = field(default_factory=list)  # per ordering: the judge call's details
    node_id: str | None = None
    failed: str | None = None


def outcomes(held: list[SessionResult]) -> list[Outcome]:
    """The pending outcomes of a group (COMPLETED sessions whose evaluation rendered one)."""
    out = []
    for r in held:
        evaluation = r.metadata.get("evaluation")
        details = evaluation.get("details") if isinstance(evaluation, dict) else None
        text = pending(details) if isinstance(details, dict) else None
        if r.status is SessionStatus.COMPLETED and text is not None:
            out.append(Outcome(session_id=r.session_id, text=text))
    return out


def _request(task: Task, group: list[Outcome]) -> bytes:
    found = group_evaluator(task)
    assert found is not None
    _, ev = found
    instruction = task.instruction if ev.config.get("instruction", True) else None
    req = GroupRequest(config=dict(ev.config), instruction=instruction, task_id=task.task_id, outcomes=group)
    return req.model_dump_json().encode()


def read_answer(answer: dict[str, Any], group: list[Outcome], node_id: str) -> GroupAnswer:
    """The node's answer, checked: a reward in [0, 1] for every session of the group, or a failure."""
    if "failed" in answer:
        return GroupAnswer(failed=f"judge_group: {answer['failed']}", node_id=node_id)
    rewards, scores = answer.get("rewards"), answer.get("scores")
    ids = [o.session_id for o in group]
    ok = (
        isinstance(rewards, dict)
        and isinstance(scores, dict)
        and all(
            isinstance(rewards.get(s), int | float) and 0.0 <= rewards[s] <= 1.0 and math.isfinite(rewards[s])
            for s in ids
        )
    )
    if not ok:
        return GroupAnswer(failed=f"judge_group: node {node_id} answered no reward for every session")
    assert isinstance(rewards, dict) and isinstance(scores, dict)
    details = answer.get("details")
    calls = [d.get("judge") for d in details if isinstance(d, dict)] if isinstance(details, list) else []
    return GroupAnswer(
        rewards={s: float(rewards[s]) for s in ids},
        scores={s: float(scores.get(s, 0.0)) for s in ids},
        orderings=len(answer.get("orderings") or []),
        calls=[c for c in calls if isinstance(c, dict)],
        node_id=node_id,
    )


async def judge(
    link: NodeLink, nodes: Callable[[], list[NodeRow]], task: Task, held: list[SessionResult]
) -> GroupAnswer:
    """Ask the nodes, those that ran the group first, until one judges it or the evaluator's timeout
    passes. A node that cannot be reached or fails is passed over; one that refuses the request itself (a
    config it cannot read) or answers that the judgement failed ends the phase: another would say the same."""
    group = outcomes(held)
    if not group:
        return GroupAnswer()
    found = group_evaluator(task)
    assert found is not None
    timeout = found[1].timeout_seconds
    body, ran = _request(task, group), {r.node_id for r in held}
    deadline = time.monotonic() + timeout
    last = "no live node"
    while True:
        live = [n for n in nodes() if not n.lost]
        live.sort(key=lambda n: (n.node_id not in ran, n.draining, n.node_id))
        for node in live:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            answer, error = await link.judge_group(node.url, body, left)
            if answer is not None:
                return read_answer(answer, group, node.node_id)
            last = f"node {node.node_id}: {error}"
            if error is not None and error.startswith("refused:"):
                return GroupAnswer(failed=f"judge_group: {last}", node_id=node.node_id)
            log.warning("group of task %s: %s", task.task_id, last)
        left = deadline - time.monotonic()
        if left <= 0:
            return GroupAnswer(failed=f"judge_group: no node judged the group within {timeout:g} s ({last})")
        await asyncio.sleep(min(RETRY_S, left))


def settled(result: SessionResult, answer: GroupAnswer) -> SessionResult:
    """A held result as it is released: a pending one rewarded from the answer, or masked as ERROR with
    its failure; anything else (a session that did not complete) as it was."""
    if result.trajectory is None or not result.trajectory.get("metadata", {}).get(REWARD_PENDING):
        return result
    trajectory = Trajectory.model_validate(result.trajectory)
    reward = answer.rewards.get(result.session_id)
    why = answer.failed or "judge_group: the session's outcome was not judged"
    if reward is None:
        final = settle_group(trajectory, None, why)
    else:
        evaluation = trajectory.metadata["evaluation"]
        group = {
            "score": answer.scores.get(result.session_id),
            "orderings": answer.orderings,
            # as `judge` names its call, so the dashboard's evaluation tab shows these calls too
            "judges": [{"judge": {**call, "node_id": answer.node_id}} for call in answer.calls],
            "node_id": answer.node_id,
            "group": sorted(answer.rewards),
        }
        final = settle_group(trajectory, settle(evaluation["details"], reward, group, len(trajectory.traces)))
    completed = final.status is TrajectoryStatus.COMPLETED
    meta = final.metadata
    return result.model_copy(
        update={
            "status": SessionStatus.COMPLETED if completed else SessionStatus.ERROR,
            "reason": result.reason if completed else meta.get("reward_reason"),
            "reward": None if meta.get("masked") else meta.get("reward"),
            "trajectory": final.model_dump(mode="json"),
            "metadata": {
                **result.metadata,
                "evaluation": meta.get("evaluation", {"passed": None, "details": {"failed": why}}),
            },
        }
    )
