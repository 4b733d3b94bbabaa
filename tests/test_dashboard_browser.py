"""The dashboard as a person uses it, in headless Chromium: open the link a real `polar run` prints, watch
sessions move through their stages live, open one (timeline, conversation, completions, token view),
cancel a task, and load a training run's curves. Each page's screenshot goes to docs/dashboard/.

No timing assertions: every wait is for text or an element to appear (with a bound for a hung test)."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from polar.train.metrics import JsonlSink, StepMetrics
from tests.browser_support import BackgroundRun, browser_page, need_browser, screenshot
from tests.conftest import SERVED_MODEL
from tests.fakes.fake_vllm import Reply
from tests.node_support import CALL_GATEWAY, fake_policy

pytestmark = pytest.mark.browser


def _taskfile(tmp_path: Path, go: Path) -> Path:
    (tmp_path / "call.py").write_text(CALL_GATEWAY)
    # Two model calls, then wait for the test's signal: the sessions stay RUNNING until the test has
    # seen them so, then finish and are rewarded: 1 for the sample the policy told "yes" (`_yes_then_no`),
    # 0 for the other (its command exits 1), so the two have something to compare.
    wait = f"while [ ! -e {go} ]; do sleep 0.1; done"
    tasks = {
        "tasks": [
            {
                "task_id": "talk",
                "instruction": "say something twice",
                "num_samples": 2,
                "timeout_seconds": 300,
                # local: the sessions wait on a host file of the test's (`go`)
                "runtime": {
                    "backend": "local",
                    "prepare": [{"type": "upload", "src": "call.py", "dst": "call.py"}],
                },
                "agent": {
                    "harness": "shell",
                    "settings": {
                        "command": f"{sys.executable} call.py 2 > said && {wait} && grep -q yes said"
                    },
                },
                "evaluator": {"strategy": "session_completed"},
            },
            {
                "task_id": "stuck",
                "instruction": "never finishes",
                "timeout_seconds": 300,
                "agent": {"harness": "shell", "settings": {"command": "sleep 600"}},
                "evaluator": {"strategy": "session_completed"},
            },
        ]
    }
    path = tmp_path / "tasks.yaml"
    path.write_text(yaml.safe_dump(tasks))
    return path


def _yes_then_no() -> Any:
    """A policy that answers the first session to ask "yes" and the next "no", and repeats itself after."""
    first_calls = itertools.count()

    def reply(body: dict[str, Any]) -> Reply:
        said = [m.get("content") or "" for m in body["messages"] if m.get("role") == "assistant"]
        if not said:
            word = "yes" if next(first_calls) % 2 == 0 else "no"
            return Reply(content=f"Let me think. The word is {word}.")
        return Reply(content=f"As I said: {said[0].rsplit(' ', 1)[-1]}")

    return reply


def expect(locator: Any) -> Any:
    """Playwright's web-first assertion, waiting up to a minute (a bound for a hung test)."""
    from playwright.sync_api import expect as pw_expect

    pw_expect.set_options(timeout=60_000)
    return pw_expect(locator)


def _open_session(page: Any, base: str) -> str:
    """From the task page, the first session's page; its id."""
    link = page.locator("table.sessions a").first
    sid = link.inner_text().strip()
    link.click()
    page.wait_for_selector(f"h1:has-text('{sid}')")
    return sid


def test_watch_a_run_open_a_session_and_cancel_a_task(tmp_path: Path) -> None:
    need_browser()
    go = tmp_path / "go"
    taskfile = _taskfile(tmp_path, go)
    with fake_policy(_yes_then_no()) as (backend, _), browser_page() as page:
        run = BackgroundRun(str(taskfile), "--backend", backend, "--model", SERVED_MODEL,
                            "--out", str(tmp_path / "out"), "--capacity", "4")  # fmt: skip
        try:
            url = run.wait_for_line("dashboard: ")
            assert re.fullmatch(r"http://127\.0\.0\.1:\d+/ui/#token=\S+", url), url
            base = url.split("#")[0]
            page.goto(url)
            # Logged in: the token is gone from the address bar, the overview lists the tasks.
            page.wait_for_selector("tr[data-task='talk']")
            assert "token" not in page.url
            page.wait_for_selector("#live.on")  # the event stream is connected
            page.wait_for_selector(".box.node.ok")  # the node is healthy, with its backend
            assert backend in page.inner_text(".topo")
            # The stage pools' sizes, as the node reports them in its heartbeats.
            page.wait_for_selector(".box.node .workers:has-text('workers: init')")
            page.wait_for_selector("tr[data-task='talk'] .status.s-RUNNING")
            screenshot(page, "overview")

            page.click("a[href='/ui/tasks/talk']")
            page.wait_for_selector("h1:has-text('talk')")
            # Both sessions reach RUNNING (the page follows without a reload)...
            expect(page.locator("table.sessions .status.s-RUNNING")).to_have_count(2)
            sid = _open_session(page, base)
            # ...and while one runs, its conversation is built live from the node's records.
            page.click("nav.tabs a:has-text('conversation')")
            page.wait_for_selector(".msg.role-assistant")
            page.wait_for_selector("text=not finished: the trajectory is built from the calls so far")

            go.touch()  # let the sessions finish
            page.goto(f"{base}tasks/talk")
            expect(page.locator("table.sessions .status.s-COMPLETED")).to_have_count(2)
            page.wait_for_selector(".chart .uplot")  # the reward chart
            screenshot(page, "task")
            reward = page.inner_text(f"tr[data-session='{sid}'] td.reward")
            assert sorted(page.locator("table.sessions td.reward").all_inner_texts()) == ["0.00", "1.00"]

            # Compare the two samples: tick both, compare; the URL can be shared.
            ids = [t.strip() for t in page.locator("table.sessions td.sid").all_inner_texts()]
            for other in ids:
                page.check(f"#pick-{other}")
            page.click("#compare")
            page.wait_for_selector("h1:has-text('Compare 2 sessions')")
            assert "/ui/compare?" in page.url and all(f"s={i}" in page.url for i in ids)
            for other in ids:
                expect(page.locator(f"[data-compare-session='{other}']")).to_have_count(1)
            assert sorted(page.locator("table.compare td.reward").all_inner_texts()) == ["0.00", "1.00"]
            # They share the user's message and part ways at the policy's first answer.
            page.wait_for_selector("#first-divergence .cmp-index:has-text('1')")
            assert (
                page.locator("#first-divergence .msg.role-assistant:has-text('The word is yes')").count() == 1
            )
            assert (
                page.locator("#first-divergence .msg.role-assistant:has-text('The word is no')").count() == 1
            )
            answers = page.inner_text("#answer-diffs")
            assert "As I said: yes" in answers and "As I said: no" in answers
            screenshot(page, "compare")
            page.evaluate(
                "window.scrollBy(0, document.getElementById('divergence').getBoundingClientRect().top - 8)"
            )
            screenshot(page, "compare-conversation")

            page.goto(f"{base}sessions/{sid}")
            page.wait_for_selector(".timeline .lane:has-text('run')")
            screenshot(page, "session-timeline")

            page.click("nav.tabs a:has-text('conversation')")
            page.wait_for_selector(".side-by-side .msg.role-user:has-text('say something')")
            assert page.locator(".side-by-side .msg.role-assistant").count() >= 2
            screenshot(page, "session-conversation")

            page.click("nav.tabs a:has-text('completions')")
            page.wait_for_selector("pre.diff")
            assert page.locator("details.record").count() == 2
            screenshot(page, "session-completions")

            page.click("nav.tabs a:has-text('tokens')")
            page.wait_for_selector(".tokens .tok.trainable")
            assert page.locator(".tokens .tok.prompt").count() > 0
            assert page.locator(".tokens .tok.masked").count() > 0  # the user turn between the calls
            token = page.locator(".tokens .tok.trainable").first
            assert "logprob" in (token.get_attribute("title") or "")
            assert re.search(r"lp[0-4]", token.get_attribute("class") or "")
            assert page.locator(".tokens .turnmark").count() == 2  # two sampled turns
            assert "Showing token ids" in page.inner_text(".legend")  # a --backend run, no --tokenizer

            page.click("nav.tabs a:has-text('evaluation')")
            page.wait_for_selector(f"#eval-reward:has-text('{reward}')")
            page.click("nav.tabs a:has-text('raw')")
            page.wait_for_selector(f"pre.raw:has-text('{sid}')")

            # Search by the first characters of a session id leads to it.
            page.fill("header input[name=q]", sid[:14])
            page.press("header input[name=q]", "Enter")
            page.wait_for_selector(f"h1:has-text('{sid}')")

            # Filters live in the URL: a shared link shows the same list. (Before the cancel below: once
            # the last task ends, the run exits and its dashboard with it.)
            page.goto(f"{base}?state=DONE")
            page.wait_for_selector("tr[data-task='talk']")
            assert page.locator("tr[data-task='stuck']").count() == 0

            # Cancel the task that never finishes.
            page.goto(f"{base}tasks/stuck")
            page.wait_for_selector("table.sessions .status.s-RUNNING")
            page.click("#cancel")
            page.wait_for_selector("#cancel-outcome:has-text('cancelled')")
            page.wait_for_selector("#task-state:has-text('CANCELLED')")
            page.wait_for_selector("table.sessions .status.s-CANCELLED")
            screenshot(page, "task-cancelled")

            assert run.wait() == 0, "".join(run.output)  # every task ended: the run finishes
        finally:
            run.stop()


ASK_TWICE = """
import os, openai
client = openai.OpenAI(max_retries=0)
messages = [{"role": "user", "content": "Write a short poem about the sea."}]
for _ in range(2):
    r = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=messages, max_tokens=24)
    messages += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": "Another one, please."}]
"""


def test_the_embedded_engines_token_view_shows_text(tmp_path: Path) -> None:
    """`polar run` on its embedded engine (the offline tiny policy) hands the engine's tokenizer to the
    dashboard: the token view shows text without --tokenizer."""
    need_browser()
    go = tmp_path / "go"
    (tmp_path / "ask.py").write_text(ASK_TWICE)
    wait = f"while [ ! -e {go} ]; do sleep 0.1; done"
    tasks = {"tasks": [{
        "task_id": "poem", "instruction": "write a poem", "timeout_seconds": 600,
        # local: the session waits on a host file of the test's (`go`)
        "runtime": {"backend": "local", "prepare": [{"type": "upload", "src": "ask.py", "dst": "ask.py"}]},
        "agent": {"harness": "shell", "settings": {"command": f"{sys.executable} ask.py && {wait}"}},
        "evaluator": {"strategy": "session_completed"},
    }]}  # fmt: skip
    (tmp_path / "tasks.yaml").write_text(yaml.safe_dump(tasks))
    with browser_page() as page:
        run = BackgroundRun(str(tmp_path / "tasks.yaml"), "--out", str(tmp_path / "out"))
        try:
            url = run.wait_for_line("dashboard: ", timeout=600)  # the engine loads first
            base = url.split("#")[0]
            page.goto(url)
            page.wait_for_selector("tr[data-task='poem']")
            page.goto(f"{base}tasks/poem")
            sid = _open_session(page, base)
            # Both calls made (two sampled turns), while the session waits: built from the calls so far. The
            # session page does not follow a running session's calls on its own: reload until they are in.
            deadline = time.monotonic() + 300  # a bound for a hung test, not a timing assertion
            while True:
                page.goto(f"{base}sessions/{sid}?tab=tokens")
                if page.locator(".tokens .turnmark").count() == 2 or time.monotonic() > deadline:
                    break
                page.wait_for_timeout(500)
            expect(page.locator(".tokens .turnmark")).to_have_count(2)
            legend = page.inner_text(".legend")
            assert "Text from tokenizer" in legend and "embedded engine" in legend, legend
            assert page.locator(".tokens.text").count() >= 1 and page.locator(".tokens.ids").count() == 0
            # The prompts as the policy saw them (a tiny random policy's answers rarely re-render as sampled,
            # so the second call may start a trace of its own: its user turn is prompt or masked).
            prompt = "".join(page.locator(".tokens").first.locator(".tok.prompt").all_inner_texts())
            assert "Write a short poem about the sea." in prompt
            assert "Another one, please." in "".join(page.locator(".tokens .tok").all_inner_texts())
            page.locator(".tokens .tok.trainable").first.hover()
            screenshot(page, "session-tokens")
            go.touch()
            assert run.wait(timeout=300) == 0, "".join(run.output)
        finally:
            run.stop()


def test_a_training_runs_curves(tmp_path: Path) -> None:
    need_browser()
    out = tmp_path / "train"
    sink = JsonlSink(out / "metrics.jsonl")  # the writer `polar train` uses
    for step in range(1, 9):
        sink.log(
            StepMetrics(
                step=step, policy_version=step, reward_mean=0.2 + 0.08 * step, reward_std=0.3 - 0.02 * step,
                pass_rate=0.1 * step,
                groups=2, samples=16, zero_variance_groups=step % 2, dropped_stale_groups=int(step == 4),
                staleness_mean=0.5, staleness_max=1, traces=17, tokens=48000 + 100 * step,
                trainable_tokens=6000 + 50 * step, loss=-0.01 * step, grad_norm=0.8, clip_fraction=0.0, kl=0.0,
                tis_mean=1.0, logprob_diff=0.02, rollout_wait_s=3.0, train_s=40.0, sync_s=2.5,
                extra={"lr": 1e-6 * min(step, 4) / 4},  # as the loop logs it: warm-up, then constant
            )
        )  # fmt: skip
    sink.close()
    proc = subprocess.Popen(
        [sys.executable, "-m", "polar", "dashboard", "--train", str(out), "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
        env={**__import__("os").environ, "POLAR_TOKEN": "t" * 32, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stderr is not None
        url = ""
        for line in proc.stderr:
            if line.startswith("dashboard: "):
                url = line.split(" ", 1)[1].strip()
                break
        assert url.endswith("/ui/training#token=" + "t" * 32), url
        with browser_page() as page:
            page.goto(url)
            page.wait_for_selector("#last-step:has-text('8')")
            expect(page.locator(".chart .uplot")).to_have_count(9)  # no broken-tool-call chart: no such key
            for title in ("gradient norm (before clipping)", "learning rate"):
                assert page.locator(f".chart:has(.u-title:text-is('{title}'))").count() == 1, title
            assert "0.840" in page.inner_text("#last-reward_mean")
            assert "± 0.140" in page.inner_text("#last-reward_std")
            reward = page.locator(".chart:has(.u-title:text-is('reward'))")
            for label in ("reward_mean", "mean + std", "mean - std"):  # the mean and its ± std band
                assert reward.locator(f".u-legend .u-label:text-is('{label}')").count() == 1, label
            assert page.locator("text=have no reward_std").count() == 0
            # The value axes' tick labels (drawn on canvas: the formatter itself). Was: 0.0004 as "0".
            ticks = page.evaluate("[0.0004, 0.0015, 0.25, 2, 1500, 0, -0.002].map(polarDashboard.tick)")
            assert ticks == ["4.0e-4", "0.0015", "0.25", "2", "1500", "0", "-0.002"]
            for title in (
                "reward",
                "pass rate",
                "groups dropped or without signal",
                "tokens per step",
                "policy version",
            ):
                assert page.locator(f".u-title:text-is('{title}')").count() == 1, title
            screenshot(page, "training")
    finally:
        proc.terminate()
        proc.wait(30)
