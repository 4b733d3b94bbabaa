"""The compare view: two samples of a task side by side, over real HTTP against a real rollout server whose
sessions were reported by a stand-in node (results with trajectories, as a real node reports them); and
the alignment it is built on, on plain conversations."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar.dashboard import DashboardOptions, server_app
from polar.dashboard.compare import align, final_answer, first_divergence
from polar.dashboard.views import message
from polar.rollout.server import ServerConfig
from polar.serving import ServerThread
from polar.trajectory.models import Trace, Trajectory
from tests.server_support import AUTH, FAST, TOKEN, StandInNode, task

SYSTEM = {"role": "system", "content": "You are a careful engineer."}
USER = {"role": "user", "content": "What is 2 + 2? Answer with the calculator."}


def call(call_id: str, expr: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "calc", "arguments": expr}}],
    }


def tool(call_id: str, out: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": out}


# Both samples call the calculator the same way (with different call ids, as harnesses make them), then
# one answers 4 and the other 5: the conversations first differ at message 4.
GOOD = [SYSTEM, USER, call("call_a1", '{"expr": "2+2"}'), tool("call_a1", "4"),
        {"role": "assistant", "content": "The answer is 4."}]  # fmt: skip
BAD = [SYSTEM, USER, call("call_b7", '{"expr": "2+2"}'), tool("call_b7", "4"),
       {"role": "assistant", "content": "The answer is 5."}]  # fmt: skip


def trajectory(messages: list[dict[str, Any]], reward: float, trainable: int) -> dict[str, Any]:
    trace = Trace(
        prompt_ids=[1, 2, 3, 4],
        response_ids=list(range(10, 10 + trainable + 2)),
        loss_mask=[1] * trainable + [0, 0],
        response_logprobs=[-0.1] * (trainable + 2),
        prompt_messages=messages[:2],
        response_messages=messages[2:],
        reward=reward,
        metadata={"completion_ids": ["c1", "c2"]},
    )
    return Trajectory(traces=[trace]).model_dump(mode="json")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    config = ServerConfig(db_path=tmp_path / "server.db", token=TOKEN, **FAST)
    srv = ServerThread(server_app(config, DashboardOptions())).start()
    try:
        yield srv.url
    finally:
        srv.stop()


@pytest.fixture
def two_samples(server: str) -> Iterator[tuple[str, str, str]]:
    """The server, and the sessions of task `sum` that got reward 1 and reward 0."""
    with httpx.Client() as client:
        node = StandInNode().register(client, server)
        try:
            r = client.post(f"{server}/rollout/task/submit", json=task("sum", num_samples=2), headers=AUTH)
            assert r.status_code == 201, r.text
            sessions = client.get(f"{server}/rollout/task/sum", headers=AUTH).json()["sessions"]
            good, bad = sorted(s["session_id"] for s in sessions)
            for sid, msgs, reward, trainable, reason in (
                (good, GOOD, 1.0, 6, None),
                (bad, BAD, 0.0, 4, "the answer is wrong"),
            ):
                body = {
                    "session_id": sid, "task_id": "sum", "status": "COMPLETED", "reason": reason,
                    "reward": reward, "trajectory": trajectory(msgs, reward, trainable),
                    "timings": {"queued_s": 0.5, "init_s": 1.0, "run_s": 2.0 + reward, "post_s": 0.25,
                                "total_s": 3.75 + reward},
                    "metadata": {"evaluation": {"passed": reward == 1.0,
                                                "details": {"reason": f"expected 4, reward {reward}"}}},
                }  # fmt: skip
                assert node.report(client, server, body).status_code == 200
        finally:
            node.stop()
        yield server, good, bad


def test_the_conversations_first_differ_where_the_answers_do() -> None:
    good, bad = [message(m) for m in GOOD], [message(m) for m in BAD]
    assert first_divergence([good, bad]) == 4  # the tool-call ids differ, the calls do not
    assert first_divergence([good, good]) is None
    assert first_divergence([good, good[:3]]) == 3  # one ended: that is a difference
    assert first_divergence([[message(USER)], good]) == 0
    assert first_divergence([good, good, bad]) == 4
    rows = align([good, bad[:3]])
    assert [r.same for r in rows] == [True, True, True, False, False]
    assert rows[4].cells[1] is None
    assert final_answer(good) == "The answer is 4."
    assert final_answer(good[:3]) == 'calc({"expr": "2+2"})'


def test_compare_needs_a_login(two_samples: tuple[str, str, str]) -> None:
    server, good, bad = two_samples
    url = f"{server}/ui/compare?s={good}&s={bad}"
    for accept in ("text/html", "application/json"):
        r = httpx.get(url, headers={"accept": accept})
        assert r.status_code == 401 and good not in r.text and "answer is" not in r.text
    assert httpx.get(url, headers={"authorization": "Bearer " + "x" * 43}).status_code == 401
    with httpx.Client() as client:  # a browser's login cookie opens it, as any other page
        assert client.post(f"{server}/ui/login", headers=AUTH).status_code == 200
        assert client.get(url, headers={"accept": "text/html"}).status_code == 200


def test_two_samples_side_by_side(two_samples: tuple[str, str, str]) -> None:
    server, good, bad = two_samples
    r = httpx.get(f"{server}/ui/compare?s={good}&s={bad}", headers=AUTH)
    assert r.status_code == 200, r.text
    page = r.text
    # Both sessions, their outcome and why, in the order of the URL.
    assert page.index(f'data-compare-session="{good}"') < page.index(f'data-compare-session="{bad}"')
    assert "the answer is wrong" in page and "<b>1.00</b>" in page and "<b>0.00</b>" in page
    assert re.findall(r'eval-reason">([^<]*)<', page) == ["expected 4, reward 1.0", "expected 4, reward 0.0"]
    # Token counts per session: 6 and 4 trainable tokens.
    assert re.findall(r'data-count="trainable tokens">(\d+)<', page) == ["6", "4"]
    assert re.findall(r'data-count="calls">(\d+)<', page) == ["2", "2"]
    # Timings: the run stage of each (3.000 s and 2.000 s) and the totals.
    assert "3.000 s" in page and "2.000 s" in page and "4.750 s" in page
    # The divergence point: messages 0-3 are the shared prefix, 4 is marked.
    assert 'id="first-divergence"' in page and "they first differ at" in page
    assert re.search(r'id="first-divergence">\s*<div class="cmp-index">4<', page)
    assert "messages 0 to 3: the same in every session" in page and "Messages 0 to 3 are the same" in page
    # The final answers' diff.
    answers = page[page.index('id="answer-diffs"') : page.index('id="call-diffs"')]
    assert '<span class="del">-The answer is 4.</span>' in answers
    assert '<span class="add">+The answer is 5.</span>' in answers
    calls = page[page.index('id="call-diffs"') :]
    assert "(the same tool calls)" in calls


def test_an_unknown_session_is_a_clear_404(two_samples: tuple[str, str, str]) -> None:
    server, good, _ = two_samples
    r = httpx.get(f"{server}/ui/compare?s={good}&s=polar-nosuchsession", headers=AUTH)
    assert r.status_code == 404
    assert "There is no session polar-nosuchsession on this server." in r.text
    assert good not in r.text.split("There is no")[1]  # names the missing one only
    one = httpx.get(f"{server}/ui/compare?s={good}&s={good}", headers=AUTH)  # the same session twice
    assert one.status_code == 400 and "pick 2 to 6 sessions to compare (got 1)" in one.text
    assert httpx.get(f"{server}/ui/compare", headers=AUTH).status_code == 400


def test_the_task_page_leads_to_compare(two_samples: tuple[str, str, str]) -> None:
    server, good, bad = two_samples
    page = httpx.get(f"{server}/ui/tasks/sum", headers=AUTH).text
    assert 'form id="compare-form"' in page and 'action="/ui/compare"' in page
    for sid in (good, bad):
        assert f'name="s" value="{sid}" form="compare-form"' in page
    # A link straight to the most telling pair: the highest reward against the lowest.
    assert f'href="/ui/compare?s={good}&amp;s={bad}"' in page
