"""`polar gateway --workers N` (polar.cli.workers): each session served by its owner whatever port the
call reached, control requests routed or applied everywhere, the same records as one process, and no answered
call lost when a worker, or everything, is killed -9. Runs the real CLI against the fake vLLM."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from click.testing import CliRunner

from polar.auth import bearer, new_token
from polar.cli import main
from polar.gateway.forward import owner
from polar.store.sqlite import SQLiteStore
from tests.fakes.server import free_port
from tests.test_gateway_durability import _load, _wait_up

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
ANTHROPIC = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


def test_workers_flag_is_documented_and_checked() -> None:
    helped = CliRunner().invoke(main, ["gateway", "--help"], prog_name="polar")
    assert helped.exit_code == 0
    assert "--workers" in helped.output and "--workers 4" in helped.output  # the option and an example
    for bad, says in (("0", "0 is not in the range 1<=x<=256"), ("two", "'two' is not a valid integer")):
        r = CliRunner().invoke(main, ["gateway", "--backend", "http://127.0.0.1:9", "--workers", bad])
        assert r.exit_code == 2, r.output
        assert f"Invalid value for '--workers': {says}" in r.output
        assert "Traceback" not in r.output


@contextlib.contextmanager
def gateway(
    store: Path, workers: int, *fake_args: str, stderr: Path | None = None
) -> Iterator[tuple[subprocess.Popen[bytes], str, str, str]]:
    """The fake vLLM (`fake_args`: more of its options) and `polar gateway --workers N` on `store` (its
    stderr to `stderr`, if given): (the supervisor, shared model API URL, control URL, control token);
    everything killed after."""
    bport, port, cport = free_port(), free_port(), free_port()
    token = new_token()
    env = {**os.environ, "POLAR_TOKEN": token, "PYTHONUNBUFFERED": "1"}
    fake = [sys.executable, "-m", "tests.fakes.fake_vllm", "--port", str(bport), *fake_args]
    backend = subprocess.Popen(fake, env=env)
    argv = [
        sys.executable,
        "-m",
        "polar",
        "gateway",
        "--backend",
        f"http://127.0.0.1:{bport}",
        "--model",
        "m",
    ]
    argv += [
        "--port",
        str(port),
        "--control-port",
        str(cport),
        "--store",
        str(store),
        "--workers",
        str(workers),
    ]
    _wait_up(f"http://127.0.0.1:{bport}", backend)
    err = stderr.open("wb") if stderr is not None else None
    sup = subprocess.Popen([*argv, "--log-level", "warning"], env=env, stderr=err)
    url, control = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{cport}"
    try:
        _wait_up(url, sup)
        deadline = time.monotonic() + 60
        while len(httpx.get(f"{control}/health").json().get("workers", [None])) < workers:
            assert time.monotonic() < deadline, "not every worker started"
            time.sleep(0.1)
        yield sup, url, control, token
    finally:
        for pid in [*worker_pids(control), sup.pid]:
            with contextlib.suppress(ProcessLookupError, httpx.TransportError):
                os.kill(pid, signal.SIGKILL)
        sup.wait()
        backend.kill()
        backend.wait()
        if err is not None:
            err.close()


def worker_pids(control: str) -> list[int]:
    try:
        return [w["pid"] for w in httpx.get(f"{control}/health", timeout=5).json().get("workers", [])]
    except httpx.TransportError:
        return []


def test_each_session_is_served_by_its_worker_whatever_port_the_call_reached(tmp_path: Path) -> None:
    with gateway(tmp_path / "gw.db", 2) as (_, url, control, token):
        admin = bearer(token)
        spread = [f"spread-{i:04d}" for i in range(6)]
        assert {owner(sid, 2) for sid in spread} == {0, 1}
        made = [
            httpx.post(f"{control}/sessions", headers=admin, json={"session_id": sid}).json()
            for sid in spread
        ]
        by_owner = {owner(m["session_id"], 2): m["base_url"] for m in made}
        assert all(m["base_url"] == by_owner[owner(m["session_id"], 2)] for m in made)  # one URL a worker
        urls = sorted(set(by_owner.values()))
        assert len(urls) == 2
        # An id the gateway chooses is chosen where the request landed, and the session made on its owner.
        chosen = httpx.post(f"{control}/sessions", headers=admin, json={"task_id": "t"}).json()
        assert chosen["base_url"] == by_owner[owner(chosen["session_id"], 2)]
        assert chosen["metadata"] == {"task_id": "t"}
        made.append(chosen)
        for m in made:
            sid = m["session_id"]
            other = next(u for u in urls if u != m["base_url"])
            key = {"authorization": f"Bearer {sid}"}
            # Its own URL, the shared port (either worker), the other worker's own URL (passed on): one order.
            for where in (m["base_url"], url, other, url):
                assert httpx.post(f"{where}/v1/chat/completions", json=CHAT, headers=key).status_code == 200
            streamed = httpx.post(f"{other}/v1/chat/completions", json={**CHAT, "stream": True}, headers=key)
            assert streamed.status_code == 200 and streamed.content.endswith(b"data: [DONE]\n\n")
            anth = {"x-api-key": sid, "anthropic-version": "2023-06-01"}
            assert (
                httpx.post(f"{other}/v1/messages", json=ANTHROPIC, headers=anth).json()["type"] == "message"
            )
            bad = httpx.post(f"{other}/v1/chat/completions", content=b"{", headers=key)
            assert bad.status_code == 400  # refused by the owner, and recorded there as the session's failure
            got = httpx.get(f"{control}/sessions/{sid}", headers=admin).json()
            assert (got["calls"], got["completions"], got["failures"]) == (7, 6, 1)
            recs = httpx.get(f"{control}/sessions/{sid}/completions", headers=admin).json()["completions"]
            fails = httpx.get(f"{control}/sessions/{sid}/failures", headers=admin).json()["failures"]
            assert sorted([r["seq"] for r in recs] + [f["seq"] for f in fails]) == list(range(7))
        unknown = httpx.post(
            f"{url}/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer nope-123"}
        )
        assert unknown.status_code == 401
        # Control: state applied on every worker, counts summed over them.
        paused = httpx.post(f"{control}/admin/pause?timeout=5", headers=admin).json()
        assert paused == {"paused": True, "drained": True, "in_flight": 0}
        assert "\npolar_gateway_paused 1.0\n" in httpx.get(f"{control}/metrics", headers=admin).text
        health = httpx.get(f"{control}/health").json()
        assert [w["paused"] for w in health["workers"]] == [True, True]
        assert (
            httpx.post(f"{control}/admin/resume?policy_version=7", headers=admin).json()["policy_version"]
            == 7
        )
        assert [w["paused"] for w in httpx.get(f"{control}/health").json()["workers"]] == [False, False]
        metrics = httpx.get(f"{control}/metrics", headers=admin).text
        assert 'polar_gateway_calls_total{dialect="chat",status="200"} 35.0' in metrics  # summed
        assert "\npolar_gateway_paused 0.0\n" in metrics  # a state: not 0 + 0 but "no worker paused"
        assert "\npolar_gateway_backend_up{" in metrics and 'backend_up{backend="http' in metrics
        assert httpx.delete(f"{control}/sessions/{made[0]['session_id']}", headers=admin).status_code == 200
        closed = httpx.post(
            f"{url}/v1/chat/completions",
            json=CHAT,
            headers={"authorization": f"Bearer {made[0]['session_id']}"},
        )
        assert closed.status_code == 401 and "closed" in closed.text


def _comparable(rec: Any) -> dict[str, Any]:
    """A record without what differs between any two runs (times, the random part of the id)."""
    data: dict[str, Any] = rec.to_json()
    for key in ("created_at", "upstream_latency_ms", "gateway_overhead_ms", "upstream_id"):
        data.pop(key, None)
    data["completion_id"] = data["completion_id"].rsplit("-", 1)[1]
    return data


def _stored_rows(store: Path, sid: str) -> list[tuple[Any, ...]]:
    """How the records are stored: prompt deltas and body skeletons (each extends the previous record)."""
    with SQLiteStore(store) as s:
        return s.conn.execute(
            "SELECT seq, request, upstream, prompt_len, prompt_base, prompt_shared, prompt_tail, response_ids "
            "FROM completions WHERE session_id = ? ORDER BY seq",
            (sid,),
        ).fetchall()


def test_a_session_is_recorded_alike_by_one_worker_and_by_two(tmp_path: Path) -> None:
    """A growing conversation per session, each call on a new connection to the shared port (so with two
    workers about half are passed on): the same records, stored the same way."""
    sids = [f"same-session-{i:02d}" for i in range(4)]
    recorded: list[dict[str, list[Any]]] = []
    for workers in (1, 2):
        store = tmp_path / f"gw{workers}.db"
        with gateway(store, workers) as (sup, url, control, token):
            for sid in sids:
                httpx.post(
                    f"{control}/sessions", headers=bearer(token), json={"session_id": sid, "task_id": "t"}
                )
            for sid in sids:
                messages: list[dict[str, Any]] = [{"role": "user", "content": f"start {sid}"}]
                for turn in range(5):
                    body = {"model": "m", "messages": messages, "stream": turn % 2 == 1}
                    r = httpx.post(
                        f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {sid}"}
                    )
                    assert r.status_code == 200
                    messages += [
                        {"role": "assistant", "content": f"answer {turn}"},
                        {"role": "user", "content": f"go on {turn}"},
                    ]
            os.kill(sup.pid, signal.SIGTERM)  # a clean stop: every worker closes its connection
            sup.wait(60)
        with SQLiteStore(store) as s:
            recorded.append({sid: [_comparable(r) for r in s.completions(sid)] for sid in sids})
        recorded.append({sid: _stored_rows(store, sid) for sid in sids})
    assert all(len(recorded[0][sid]) == 5 for sid in sids)
    assert recorded[0] == recorded[2]
    assert recorded[1] == recorded[3]


def test_kill_9_of_a_worker_then_of_everything_loses_no_answered_call(tmp_path: Path) -> None:
    store = tmp_path / "gw.db"
    with gateway(store, 2) as (sup, url, control, token):
        keys = [f"durable-{i:04d}" for i in range(6)]
        assert {owner(sid, 2) for sid in keys} == {0, 1}
        for sid in keys:
            httpx.post(
                f"{control}/sessions", headers=bearer(token), json={"session_id": sid}
            ).raise_for_status()
        acked: dict[str, list[str]] = {k: [] for k in keys}
        before = worker_pids(control)
        victim = before[owner(keys[0], 2)]

        async def scenario() -> None:
            async def until(n: int) -> None:
                deadline = time.monotonic() + 180
                while sum(len(v) for v in acked.values()) < n:
                    assert time.monotonic() < deadline, f"only {acked} acknowledged calls"
                    await asyncio.sleep(0.05)

            stop = asyncio.Event()
            load = asyncio.create_task(_load(url, keys, acked, stop))  # the shared port: some calls passed on
            await until(200)
            os.kill(victim, signal.SIGKILL)  # a worker, with calls of its own and passed-on ones in flight
            deadline = time.monotonic() + 60
            while victim in (pids := worker_pids(control)) or len(pids) < 2:
                assert time.monotonic() < deadline, "the worker was not started again"
                await asyncio.sleep(0.1)
            stop.set()  # its clients saw their connections go; the others kept calling until now
            await asyncio.wait_for(load, 60)
            stop = asyncio.Event()
            load = asyncio.create_task(_load(url, keys, acked, stop))
            await until(sum(len(v) for v in acked.values()) + 200)  # the restarted worker serves its sessions
            for pid in [*worker_pids(control), sup.pid]:
                os.kill(pid, signal.SIGKILL)
            await asyncio.wait_for(load, 60)

        asyncio.run(scenario())
        sup.wait(10)
    with SQLiteStore(store) as s:
        for key in keys:
            seqs = [r.seq for r in s.completions(key)]
            assert len(seqs) >= len(acked[key]), (key, len(seqs), len(acked[key]))
            assert len(set(seqs)) == len(seqs)
    assert sum(len(v) for v in acked.values()) >= 400


def test_a_second_signal_while_the_workers_drain_kills_them_at_once(tmp_path: Path) -> None:
    """Ctrl-C, then SIGTERM (or Ctrl-C again) while a worker still drains a slow stream: the supervisor kills
    what is left and exits without a traceback, the stream cut rather than waited for. Before, the second
    signal raised out of the supervisor's stop: a traceback, and the worker left draining under init."""
    log = tmp_path / "stderr.txt"
    with gateway(tmp_path / "gw.db", 2, "--token-delay-ms", "2000", stderr=log) as (sup, url, control, token):
        pids = worker_pids(control)
        made = httpx.post(
            f"{control}/sessions", headers=bearer(token), json={"session_id": "slow-one", "task_id": "t"}
        )
        assert made.status_code == 201, made.text
        body = {**CHAT, "stream": True}
        received = b""
        with (
            httpx.Client(timeout=60) as http,
            http.stream(
                "POST", f"{url}/v1/chat/completions", json=body, headers=bearer("slow-one")
            ) as stream,
        ):
            assert stream.status_code == 200, stream.read()
            chunks = stream.iter_raw()
            received += next(chunks)  # the stream is under way: a token every 2 s
            os.kill(sup.pid, signal.SIGINT)
            time.sleep(0.5)
            assert sup.poll() is None, log.read_text()  # the stream's worker drains: it waits for the stream
            os.kill(sup.pid, signal.SIGTERM)
            sup.wait(60)
            with contextlib.suppress(httpx.TransportError):  # the worker was killed: its connection is gone
                for chunk in chunks:
                    received += chunk
        assert b"[DONE]" not in received  # cut, not drained to its end
        for pid in pids:
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    assert "Traceback" not in log.read_text(), log.read_text()


def test_a_worker_that_cannot_start_stops_the_gateway_with_one_line(tmp_path: Path) -> None:
    """No backend to ask for its model: every worker fails its start-up; the supervisor stops them and
    says why once, exit status 2, as one gateway does."""
    port, cport = free_port(), free_port()
    argv = [sys.executable, "-m", "polar", "gateway", "--backend", f"http://127.0.0.1:{free_port()}"]
    argv += ["--port", str(port), "--control-port", str(cport), "--store", str(tmp_path / "gw.db")]
    env = {**os.environ, "POLAR_TOKEN": new_token()}
    r = subprocess.run([*argv, "--workers", "2"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("polar gateway:")]
    assert len(lines) == 1 and "could not list the backend's models" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
