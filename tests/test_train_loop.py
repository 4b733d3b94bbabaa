"""The async training loop on one machine: the embedded engine (tiny model), the rollout server, a node,
the shell harness calling the gateway, one training step and the weight sync; and the sync clients."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from polar.auth import bearer, new_token
from polar.client import RolloutClient
from polar.engine.weights import load_checkpoint
from polar.rollout.protocol import SessionResult, SessionStatus
from polar.stack import PolicyServer, embedded_engine, local_stack
from polar.store.sqlite import SQLiteStore
from polar.task import Task
from polar.train.evaluation import EvalPlan
from polar.train.filters import GroupFilter, Overlong, cut
from polar.train.loop import Group, LoopConfig, TrainLoop, staleness, task_order
from polar.train.metrics import Metrics
from polar.train.sync import EngineSync, GatewayGate, SyncError, VLLMSync
from polar.train.trainer import OptimizerConfig, Trainer, TrainerConfig
from tests.conftest import start_gateway
from tests.fakes.server import serve
from tests.node_support import fake_policy

# One chat call with the standard library (fast to start), 6 sampled tokens; the answer goes to reply.txt.
CALLER = """
import json, os, urllib.request as u
body = {"model": os.environ["OPENAI_MODEL"], "max_tokens": 6, "temperature": 1.0,
        "messages": [{"role": "user", "content": "say something"}]}
req = u.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", json.dumps(body).encode(),
                {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
open("reply.txt", "w").write(json.load(u.urlopen(req, timeout=120))["choices"][0]["message"]["content"] or "")
"""
# Reward 1 for answers of even length: about half the samples, so groups carry a learning signal.
EVEN = "python3 -c 'import sys; sys.exit(len(open(\"reply.txt\").read()) % 2)'"


def task(tmp_path: Path, task_id: str = "say", samples: int = 2, grade: str = EVEN) -> Task:
    caller = tmp_path / "caller.py"
    caller.write_text(CALLER)
    return Task.model_validate(
        {
            "task_id": task_id,
            "instruction": "say something",
            "num_samples": samples,
            "timeout_seconds": 120,
            "runtime": {"backend": "local"},  # the caller is a host file of the test's (trusted code)
            "agent": {"harness": "shell", "settings": {"command": f"python3 {caller}"}},
            "evaluator": {"strategy": "test_on_output", "config": {"command": grade}},
        }
    )


@pytest.fixture(scope="module")
def base_trainer() -> Iterator[Trainer]:
    yield Trainer.load(TrainerConfig(device="cpu"))


def new_trainer(base: Trainer) -> Trainer:
    # Weight decay moves every weight even when all groups have equal rewards (zero advantages), so a
    # sync always has new weights to show.
    cfg = TrainerConfig(device="cpu", optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.1))
    return Trainer(copy.deepcopy(base.model), base.tokenizer, cfg)


class ProbingSync:
    """The real engine sync, plus a look at the gateway's /health while the weights move."""

    push_before_rollouts = False

    def __init__(self, engine: Any, control_url: str, token: str) -> None:
        self.inner = EngineSync(engine)
        self.control_url = control_url
        self.token = token
        self.seen: list[dict[str, Any]] = []

    async def push(self, trainer: Trainer, version: int) -> None:
        async with httpx.AsyncClient(headers=bearer(self.token)) as http:
            self.seen.append((await http.get(f"{self.control_url}/health")).json())
        await self.inner.push(trainer, version)

    async def aclose(self) -> None:
        return None


def records_of(store: Path, results: list[SessionResult]) -> list[Any]:
    with SQLiteStore(store) as s:
        return [rec for r in results for rec in s.completions(r.session_id)]


@pytest.mark.slow  # loads the tiny model and runs the whole stack
async def test_one_step_syncs_and_the_next_rollout_carries_the_new_version(
    base_trainer: Trainer, tmp_path: Path
) -> None:
    trainer = new_trainer(base_trainer)
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    out = tmp_path / "out"
    with embedded_engine(None, device="cpu") as (engine, server):
        assert engine.policy_version == 0
        async with local_stack(out, PolicyServer((server.url,), model=engine.name), capacity=4) as stack:
            sync = ProbingSync(engine, stack.control_url, stack.token)
            gate = GatewayGate(stack.control_url, control_token=stack.token, timeout_s=60)
            metrics = Metrics.create(out, steps=2)
            config = LoopConfig(steps=1, batch_groups=2, max_in_flight=2, max_staleness=0, out=out)
            async with RolloutClient(stack.server_url, token=stack.token) as client:
                # A group sampled by version 0 and kept aside: stale once the policy moved on.
                before = [r async for r in client.run([task(tmp_path, "before", samples=2)])]
                loop = TrainLoop([task(tmp_path)], trainer, client, gate, sync, metrics, config)
                history = await loop.run()

                # The step: trained on two groups sampled by version 0, synced as version 1.
                assert len(history) == 1 and history[0].step == 1 and history[0].policy_version == 1
                assert history[0].groups == 2 and history[0].samples == 4 and history[0].staleness_max == 0
                assert history[0].traces == 4 and history[0].trainable_tokens == 4 * 6
                assert engine.policy_version == 1 and loop.version == 1
                # The gateway was paused while the weights moved, and open again afterwards.
                assert [h["paused"] for h in sync.seen] == [True]
                # the node serves on this loop: never block it
                async with httpx.AsyncClient(headers=bearer(stack.token)) as http:
                    health = (await http.get(f"{stack.control_url}/health")).json()
                assert health["paused"] is False and health["in_flight"] == 0
                # The engine serves exactly the trainer's new weights.
                served = engine.model.state_dict()
                changed = False
                for name, value in trainer.model.state_dict().items():
                    assert torch.allclose(served[name], value), name
                    changed |= not torch.equal(value, initial[name])
                assert changed

                # The next rollout is answered, and recorded, by version 1.
                after = [r async for r in client.run([task(tmp_path, "next", samples=2)])]
                assert all(r.status == SessionStatus.COMPLETED for r in after)
                records = records_of(out / "gateway.db", after)
                assert len(records) == 2 and {rec.policy_version for rec in records} == {1}
                trajectories = [r.trajectory for r in after if r.trajectory is not None]
                assert len(trajectories) == 2
                versions = {tr["metadata"]["policy_version"] for t in trajectories for tr in t["traces"]}
                assert versions == {1}

                # Staleness comes from the records (not the submission version). With max_staleness 0,
                # a step offered the version-0 group first drops it and trains on the version-1 one.
                stale, fresh = Group("before", tuple(before), 0), Group("next", tuple(after), 0)
                assert (stale.sampled_version, fresh.sampled_version) == (0, 1)
                loop.config = dataclasses.replace(config, steps=2, batch_groups=1)
                loop._ready.put_nowait(stale)
                loop._ready.put_nowait(fresh)
                second = await loop.step()
                await loop.close()
            metrics.close()
            assert second.step == 2 and second.policy_version == 2 and engine.policy_version == 2
            assert second.dropped_stale_groups == 1 and second.groups == 1 and second.staleness_max == 0
            assert loop.dropped_total == 1 and [h["paused"] for h in sync.seen] == [True, True]

    lines = [orjson.loads(line) for line in (out / "metrics.jsonl").read_bytes().splitlines()]
    assert [(m["step"], m["policy_version"], m["dropped_stale_groups"]) for m in lines] == [
        (1, 1, 0),
        (2, 2, 1),
    ]
    assert {
        "reward_mean",
        "reward_std",
        "pass_rate",
        "tokens",
        "staleness_mean",
        "clip_fraction",
        "kl",
        "loss",
    } <= set(lines[0])
    assert lines[0]["rollout_wait_s"] >= 0 and lines[0]["train_s"] > 0 and lines[0]["sync_s"] > 0
    assert lines[0]["sync_drained"] == 1.0 and lines[0]["masked"] == 0.0
    # The last step is checkpointed: the trainer's weights, loadable as a checkpoint.
    checkpoint = load_checkpoint(out / "checkpoints" / "step-2")
    assert torch.equal(checkpoint["model.norm.weight"], trainer.model.model.norm.weight)


@contextlib.asynccontextmanager
async def loop_parts(out: Path) -> AsyncIterator[tuple[Any, GatewayGate, RolloutClient]]:
    """What a loop runs on: the tiny engine, a local stack writing to `out`, its gateway gate, a client."""
    with embedded_engine(None, device="cpu") as (engine, server):
        async with local_stack(out, PolicyServer((server.url,), model=engine.name), capacity=4) as stack:
            gate = GatewayGate(stack.control_url, control_token=stack.token, timeout_s=60)
            async with RolloutClient(stack.server_url, token=stack.token) as client:
                yield engine, gate, client


@pytest.mark.slow  # loads the tiny model and runs the whole stack
async def test_a_step_leaves_out_groups_without_signal_and_takes_the_next_one(
    base_trainer: Trainer, tmp_path: Path
) -> None:
    trainer = new_trainer(base_trainer)
    out = tmp_path / "out"
    async with loop_parts(out) as (engine, gate, client):
        metrics = Metrics.create(out, steps=3)
        # Two real groups: every sample passes (reward 1, 1: no signal), and only the first sample
        # graded passes (the grader's mkdir succeeds once: reward 1, 0).
        same = [r async for r in client.run([task(tmp_path, "same", grade="true")])]
        won = tmp_path / "won"
        mixed = [r async for r in client.run([task(tmp_path, "mixed", grade=f"mkdir {won}")])]
        assert sorted(r.reward for r in same) == [1.0, 1.0] and sorted(r.reward for r in mixed) == [
            0,
            1,
        ]

        def queue(loop: TrainLoop, *groups: tuple[str, list[SessionResult]]) -> None:
            """Groups taken before any the loop submits (its own are cancelled first)."""
            for name, results in groups:
                loop._ready.put_nowait(Group(name, tuple(results), 0))

        zero = GroupFilter(zero_variance=True, all_masked=True, max_groups=2)
        config = LoopConfig(steps=3, batch_groups=1, max_in_flight=1, filter=zero)
        loop = TrainLoop([task(tmp_path)], trainer, client, gate, EngineSync(engine), metrics, config)
        # The zero-variance group is left out and counted; the step trains on the next one.
        queue(loop, ("same-1", same), ("mixed-1", mixed))
        first = await loop.step()
        assert first.groups == 1 and first.samples == 2 and first.zero_variance_groups == 0
        assert first.extra["filtered_zero_variance_groups"] == 1.0
        assert first.extra["filter_cap_reached"] == 0.0 and first.reward_mean == 0.5

        # Two groups without signal reach the cap of 2: the last one fills the batch, said so.
        await loop.close()
        queue(loop, ("same-2", same), ("same-3", same))
        second = await loop.step()
        assert second.groups == 1 and second.zero_variance_groups == 1 and second.reward_mean == 1.0
        assert second.extra["filtered_zero_variance_groups"] == 1.0
        assert second.extra["filter_cap_reached"] == 1.0

        # Overlong masking: the caller asks for 6 tokens and the tiny model never stops before,
        # so every answer is cut; masked, the group has no live sample and is left out.
        assert all(cut(t) for t in Group("x", tuple(same), 0).trajectories())
        loop.config = dataclasses.replace(config, overlong=Overlong("mask"))
        await loop.close()
        queue(loop, ("same-4", same), ("mixed-2", mixed))
        third = await loop.step()
        assert third.extra["filtered_masked_groups"] == 1.0 and third.extra["filter_cap_reached"] == 1.0
        assert third.extra["overlong_samples"] == 2.0 and third.extra["masked"] == 2.0
        assert third.samples == 0 and third.trainable_tokens == 0
        await loop.close()
        metrics.close()
    lines = [orjson.loads(line) for line in (out / "metrics.jsonl").read_bytes().splitlines()]
    assert [(m["filtered_zero_variance_groups"], m["filtered_masked_groups"]) for m in lines] == [
        (1.0, 0.0),
        (1.0, 0.0),
        (0.0, 1.0),
    ]


@pytest.mark.slow  # loads the tiny model and runs the whole stack
async def test_held_out_tasks_are_evaluated_by_one_policy_version_at_a_time(
    base_trainer: Trainer, tmp_path: Path
) -> None:
    trainer = new_trainer(base_trainer)
    out = tmp_path / "out"
    # Two held-out tasks: one every sample passes, one none does (accuracy 0.5; resampling the two tasks
    # gives the interval [0, 1]). The training task is another.
    held_out = (task(tmp_path, "pass", grade="true"), task(tmp_path, "fail", grade="false"))
    plan = EvalPlan(held_out, every=2, before_training=True)
    async with loop_parts(out) as (engine, gate, client):
        metrics = Metrics.create(out, steps=3)
        config = LoopConfig(steps=3, batch_groups=1, max_in_flight=1, eval=plan)
        loop = TrainLoop([task(tmp_path)], trainer, client, gate, EngineSync(engine), metrics, config)
        history = await loop.run()
        metrics.close()
    # Before training, after step 2 (every 2) and after the last step (3).
    evals = [orjson.loads(line) for line in (out / "eval.jsonl").read_bytes().splitlines()]
    assert [(e["step"], e["policy_version"]) for e in evals] == [(0, 0), (2, 2), (3, 3)]
    for e in evals:
        assert e["by_task"] == {"pass": [1.0, 1.0], "fail": [0.0, 0.0]}
        assert (e["eval_accuracy"], e["eval_accuracy_low"], e["eval_accuracy_high"]) == (0.5, 0.0, 1.0)
        assert e["eval_samples"] == 4.0 and e["eval_errors"] == 0.0
    lines = [orjson.loads(line) for line in (out / "metrics.jsonl").read_bytes().splitlines()]
    assert ["eval_accuracy" in m for m in lines] == [False, True, True]
    assert history[1].extra["eval_accuracy"] == 0.5
    # Each evaluation's sessions were answered by exactly the version it names, and none was trained on.
    with SQLiteStore(out / "gateway.db") as store:
        for e in evals:
            suffix = f"-eval{e['step']:05d}"
            sessions = [s for s in store.sessions() if str(s.metadata.get("task_id")).endswith(suffix)]
            records = [rec for s in sessions for rec in store.completions(s.session_id)]
            assert len(sessions) == 4 and len(records) == 4
            assert {rec.policy_version for rec in records} == {e["policy_version"]}


@pytest.mark.slow  # loads the tiny model and runs the whole stack
async def test_paced_rollouts_are_never_too_old_to_train_on(base_trainer: Trainer, tmp_path: Path) -> None:
    trainer = new_trainer(base_trainer)
    out = tmp_path / "out"
    async with loop_parts(out) as (engine, gate, client):
        # On-policy (max_staleness 0) with room for 4 groups in flight: paced, the loop starts one
        # group per step, after each sync, so nothing it samples is dropped.
        config = LoopConfig(steps=3, batch_groups=1, max_in_flight=4, max_staleness=0)
        loop = TrainLoop([task(tmp_path)], trainer, client, gate, EngineSync(engine), Metrics([]), config)
        history = await loop.run()
    assert [m.staleness_max for m in history] == [0, 0, 0] and loop.dropped_total == 0
    assert loop._submitted == 3  # no rollout ran ahead to be thrown away


@pytest.mark.slow  # loads the tiny model and runs the whole stack
async def test_paced_rollouts_replace_the_groups_the_filter_leaves_out(
    base_trainer: Trainer, tmp_path: Path
) -> None:
    # Found on the real-LM run: with pacing, a group left out did not free its place until the step had its
    # batch, so once every admitted group was left out nothing ran and the step waited forever.
    trainer = new_trainer(base_trainer)
    out = tmp_path / "out"
    async with loop_parts(out) as (engine, gate, client):
        # Every sample passes: every group has zero variance. On-policy pacing admits one group at a time.
        zero = GroupFilter(zero_variance=True, max_groups=3)
        config = LoopConfig(steps=1, batch_groups=1, max_in_flight=4, max_staleness=0, filter=zero)
        loop = TrainLoop(
            [task(tmp_path, grade="true")],
            trainer,
            client,
            gate,
            EngineSync(engine),
            Metrics([]),
            config,
        )
        (step,) = await asyncio.wait_for(loop.run(), timeout=300)
    assert step.extra["filtered_zero_variance_groups"] == 2.0 and step.extra["filter_cap_reached"] == 1.0
    assert loop._submitted == 3 and loop._wasted == 2 and loop.dropped_total == 0


def test_pacing_admits_groups_by_steps_taken_and_never_starves_a_step() -> None:
    class Stub:
        step_count = 5  # a resumed trainer: pacing counts from where the loop started

    config = LoopConfig(steps=10, batch_groups=2, max_staleness=1)
    loop = TrainLoop([Task(task_id="t", instruction="x")], Stub(), None, None, None, Metrics([]), config)  # type: ignore[arg-type]
    assert loop._admissible()
    loop._submitted = 4  # (0 steps + 1 + 1) x 2 groups
    assert not loop._admissible()
    loop.version = 6  # one step later: two more
    assert loop._admissible()
    loop._submitted, loop._wasted = 6, 0
    assert not loop._admissible()
    loop._wasted = 1  # a group dropped or left out frees its place
    assert loop._admissible()
    assert TrainLoop(
        [Task(task_id="t", instruction="x")],
        Stub(),
        None,
        None,
        None,
        Metrics([]),  # type: ignore[arg-type]
        dataclasses.replace(config, pace=False),
    )._admissible()


def test_groups_without_records_fall_back_to_their_submission_version() -> None:
    lost = SessionResult(session_id="s1", task_id="t-r00001", status=SessionStatus.ERROR, reason="node died")
    group = Group("t-r00001", (lost,), submitted_version=5)
    assert group.sampled_version == 5 and staleness(group, 8) == 3 and staleness(group, 2) == 0
    assert group.trajectories() == []  # nothing to train on, nothing invented


def vllm_control(
    calls: list[tuple[str, dict[str, Any], dict[str, Any]]], fail: str | None = None
) -> Starlette:
    """A stand-in for vLLM's RL routes (VLLM_SERVER_DEV_MODE=1): records each call; `fail` answers 500."""

    async def handle(request: Request) -> JSONResponse:
        body = orjson.loads(await request.body()) if await request.body() else {}
        calls.append((request.url.path, dict(request.query_params), body))
        if request.url.path == fail:
            return JSONResponse({"error": "worker failed to load weights"}, status_code=500)
        return JSONResponse({"status": "ok"})

    paths = ["/pause", "/resume", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version"]
    paths.append("/v1/load_lora_adapter")  # runtime LoRA (vLLM with --enable-lora)
    return Starlette(routes=[Route(p, handle, methods=["POST"]) for p in paths])


async def test_vllm_sync_pauses_reloads_a_checkpoint_and_resumes(
    base_trainer: Trainer, tmp_path: Path
) -> None:
    calls: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    trainer = new_trainer(base_trainer)
    with serve(vllm_control(calls)) as srv:
        sync = VLLMSync(srv.url, tmp_path / "sync", verify=False)
        await sync.push(trainer, 1)
        await sync.push(trainer, 2)
        await sync.aclose()
    routes = [c[0] for c in calls]
    assert (
        routes
        == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume"] * 2
    )
    assert calls[0][1] == {"mode": "wait"}
    rpc = calls[6][2]
    assert rpc["method"] == "reload_weights"
    folder = Path(rpc["kwargs"]["weights_path"])
    assert folder == (tmp_path / "sync" / "v2").resolve()
    assert calls[8][2] == {"new_version": "2"}
    weights = load_checkpoint(folder)  # a checkpoint the server can load, with the trainer's tensors
    assert torch.equal(weights["model.norm.weight"], trainer.model.model.norm.weight)
    assert [p.name for p in (tmp_path / "sync").iterdir()] == ["v2"]  # only the served version is kept


async def test_vllm_sync_of_a_lora_adapter_loads_only_the_adapter_in_place(tmp_path: Path) -> None:
    from polar.train.lora import LoraSpec

    calls: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    trainer = Trainer.load(TrainerConfig(device="cpu", lora=LoraSpec(r=4, alpha=8.0)))
    with serve(vllm_control(calls)) as srv:
        sync = VLLMSync(srv.url, tmp_path / "sync", verify=False, adapter="polar-policy")
        assert sync.push_before_rollouts  # rollouts ask for the adapter by name: it must exist first
        await sync.push(trainer, 0)
        await sync.aclose()
    routes = [c[0] for c in calls]
    assert routes == [
        "/pause",
        "/v1/load_lora_adapter",
        "/reset_prefix_cache",
        "/update_weight_version",
        "/resume",
    ]
    body = calls[1][2]
    assert body["lora_name"] == "polar-policy" and body["load_inplace"] is True
    folder = Path(body["lora_path"])
    assert sorted(p.name for p in folder.iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    full = sum(p.numel() for p in trainer.model.parameters()) * 4
    assert (folder / "adapter_model.safetensors").stat().st_size < full / 50  # the adapter, not the model


async def test_vllm_sync_failure_names_the_route_and_does_not_resume(
    base_trainer: Trainer, tmp_path: Path
) -> None:
    calls: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    with serve(vllm_control(calls, fail="/collective_rpc")) as srv:
        sync = VLLMSync(srv.url, tmp_path / "sync", verify=False)
        with pytest.raises(SyncError, match=r"/collective_rpc: HTTP 500: .*failed to load"):
            await sync.push(new_trainer(base_trainer), 1)
        await sync.aclose()
    assert [c[0] for c in calls] == ["/pause", "/collective_rpc"]  # half-loaded weights never serve


async def test_gateway_gate_pauses_and_always_resumes(tmp_path: Path) -> None:
    with fake_policy() as (url, _):
        gateway = start_gateway(url, tmp_path)
        try:
            gate = GatewayGate(gateway.control_url, control_token=gateway.control_token, timeout_s=5)
            with pytest.raises(RuntimeError, match="boom"):
                async with gate.paused() as report:
                    assert report.drained and report.in_flight == 0
                    health = await asyncio.to_thread(gateway.control, "GET", "/health")
                    assert health.json()["paused"] is True
                    raise RuntimeError("boom")
            assert gateway.control("GET", "/health").json()["paused"] is False
            await gate.aclose()
        finally:
            gateway.server.stop()
    unreachable = GatewayGate("http://127.0.0.1:9", control_token=new_token(), timeout_s=1)
    with pytest.raises(SyncError, match="/admin/pause"):
        async with unreachable.paused():
            pass
    await unreachable.aclose()


@pytest.mark.slow  # loads the tiny model and runs the whole stack
def test_train_against_a_vllm_server_syncs_through_its_rl_routes(tmp_path: Path) -> None:
    """`train()` with `backend: URL`: rollouts through the gateway to the server, weights by checkpoint."""
    from polar.train.config import TrainConfig
    from polar.train.loop import train
    from tests.conftest import SERVED_MODEL
    from tests.fakes.fake_vllm import make_fake_backend

    calls: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    policy = make_fake_backend("vllm")
    control = vllm_control(calls)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        routed = scope["type"] == "http" and scope["path"] in (
            "/pause",
            "/resume",
            "/collective_rpc",
            "/reset_prefix_cache",
            "/update_weight_version",
        )
        await (control if routed else policy)(scope, receive, send)

    t = task(tmp_path).model_dump(mode="json")
    with serve(app) as srv:
        config = TrainConfig(
            tasks=[t], backend=srv.url, served_model=SERVED_MODEL, steps=1, group_size=2, batch_groups=1,
            device="cpu", out=str(tmp_path / "run"),
            verify_weight_sync=False,  # the stand-in serves no logprobs to check (tests/test_vllm_sync.py does)
        )  # fmt: skip
        history = train(config, [Task.model_validate(t)])
    assert len(history) == 1 and history[0].policy_version == 1 and history[0].samples == 2
    # The trained group's calls reached the server through the gateway (the next group, submitted while
    # training, may have called too before it was cancelled).
    assert len(policy.requests) >= 2
    assert [c[0] for c in calls] == [
        "/pause",
        "/collective_rpc",
        "/reset_prefix_cache",
        "/update_weight_version",
        "/resume",
    ]
    folder = Path(calls[1][2]["kwargs"]["weights_path"])
    assert folder == (tmp_path / "run" / "sync" / "v1").resolve() and load_checkpoint(folder)
    line = orjson.loads((tmp_path / "run" / "metrics.jsonl").read_bytes().splitlines()[0])
    assert line["step"] == 1 and line["policy_version"] == 1
    assert (tmp_path / "run" / "checkpoints" / "step-1" / "model.safetensors").is_file()


def test_task_order_shuffles_each_pass_with_its_seed() -> None:
    n = 50
    draw = task_order(n, True, 7)
    passes = [[next(draw) for _ in range(n)] for _ in range(3)]
    assert all(sorted(p) == list(range(n)) for p in passes)  # every task once per pass
    assert passes[0] != list(range(n)) and passes[0] != passes[1]  # not the file's order, new each pass
    again = task_order(n, True, 7)
    assert [next(again) for _ in range(n)] == passes[0]  # seeded
    other = task_order(n, True, 8)
    assert [next(other) for _ in range(n)] != passes[0]
    plain = task_order(n, False, 7)
    assert [next(plain) for _ in range(2 * n)] == list(range(n)) * 2


def test_a_resumed_runs_progress_bar_counts_from_its_checkpoint(tmp_path: Path) -> None:
    """Was: a run resumed at step 10 of 12 ended its bar at "2/12"."""
    import io

    from rich.console import Console

    from polar.train.metrics import ConsoleSink, Metrics

    console = Console(file=io.StringIO(), force_terminal=False, width=100)
    metrics = Metrics.create(tmp_path, steps=12, console=console)
    metrics.resumed_at(10)
    (bar,) = [s for s in metrics.sinks if isinstance(s, ConsoleSink)]
    task = bar.progress.tasks[0]
    assert (task.completed, task.total) == (10, 12)
    metrics.close()
