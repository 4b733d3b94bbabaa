"""TRL's GRPOTrainer (1.16, `rollout_func`) trained on polar rollouts, on CPU.

Everything but the policy's inference server is real: a node's gateway, the rollout server, the built-in
agent as the harness, `polar.client.RolloutClient` inside the bridge, TRL's own trainer and loss. The
policy is the embedded engine serving the same tiny Qwen3 TRL trains (on-policy, with weight sync), or the
fake vLLM scripted to make the agent use a tool (a multi-turn trace whose tool output must stay masked).
Each test reads back the batch TRL built and compares it, token by token, with trajectories rebuilt
independently from the node's store.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import itertools
import json
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")

import asyncio  # noqa: E402

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from polar.engine import create_engine_app  # noqa: E402
from polar.engine.tiny import default_model_dir  # noqa: E402
from polar.gateway.backends.base import BackendOptions  # noqa: E402
from polar.gateway.config import GatewayConfig  # noqa: E402
from polar.rollout.node import Node, NodeConfig  # noqa: E402
from polar.rollout.protocol import SessionResult  # noqa: E402
from polar.store.sqlite import SQLiteStore  # noqa: E402
from polar.task import AgentConfig, Task  # noqa: E402
from polar.train.bridges.trl import (  # noqa: E402
    PolarRollout,
    completion_of,
    engine_weight_sync,
    instruction_of,
    polar_reward,
)
from polar.train.export import main_trace  # noqa: E402
from polar.train.packing import pack, response_logprobs  # noqa: E402
from polar.trajectory import Trace, build  # noqa: E402
from tests.engine_support import load_tiny  # noqa: E402
from tests.fakes.fake_vllm import Reply, make_fake_backend  # noqa: E402
from tests.fakes.server import serve  # noqa: E402
from tests.node_support import eventually  # noqa: E402
from tests.server_support import AUTH, TOKEN, start_server  # noqa: E402
from tests.trl_support import GRPO_STEP, ONE_CALL_AGENT, TOOL_AGENT, grpo_step  # noqa: E402

GROUP = 4
MODEL_DIR = default_model_dir()
ROOT = Path(__file__).resolve().parent.parent


def _task(**settings: Any) -> Task:
    return Task.model_validate(
        {
            "task_id": "template",
            "instruction": "",
            "timeout_seconds": 120,
            "runtime": {"backend": "local"},  # the agents are host files of the test's (trusted code)
            "agent": {"harness": "builtin", "settings": {"max_retries": 0, **settings}},
            "evaluator": {"strategy": "tests.trl_support:MeanLogprobReward"},
        }
    )


@contextlib.asynccontextmanager
async def _rollout_service(policy_url: str, served_model: str, tmp_path: Path) -> AsyncIterator[str]:
    """A rollout server with one node whose gateway fronts `policy_url`; yields the server's URL."""
    server = start_server(tmp_path / "server.db")
    gateway = GatewayConfig(
        backend_url=policy_url,
        served_model=served_model,
        store_path=tmp_path / "node.db",
        backend=BackendOptions(retries=0, timeout_s=60.0),
        port=0,
        control_token=TOKEN,
    )
    config = NodeConfig(
        gateway=gateway,
        node_id="node-trl",
        server_url=server.url,
        heartbeat_s=0.05,
        capacity=GROUP,
        runtime_root=tmp_path / "runtimes",
    )
    node = Node(config)
    await node.start()
    try:
        await eventually(lambda: _healthy(server.url), "the node")
        yield server.url
    finally:
        await node.stop()
        server.stop()


async def _healthy(url: str) -> bool:
    async with httpx.AsyncClient(headers=AUTH) as http:
        nodes = (await http.get(f"{url}/nodes")).json()["nodes"]
    return bool(nodes) and bool(nodes[0]["healthy"])


def _trainer(tmp_path: Path, rollout: PolarRollout, steps: int, group: int = GROUP) -> Any:
    """TRL's GRPOTrainer, keeping each batch it built from the rollouts (what its loss then consumes) in
    `.batches`. Its class is made here: TRL's trainer module pulls in transformers' and peft (1.6 s of each
    test worker's collection), which only the slow tests below use."""

    class RecordingGRPOTrainer(trl.GRPOTrainer):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.batches: list[dict[str, Any]] = []

        def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
            out = super()._generate_and_score_completions(inputs)
            self.batches.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in out.items()})
            return dict(out)

    import datasets

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        use_cpu=True,
        per_device_train_batch_size=group,
        num_generations=group,
        max_steps=steps,
        learning_rate=1e-3,
        temperature=1.0,  # the engine's sampling temperature: TRL's logprobs are of logits / temperature
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        seed=0,
    )
    return RecordingGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32),
        reward_funcs=[polar_reward],
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": ["write hello.txt containing hi"]}),
        processing_class=AutoTokenizer.from_pretrained(MODEL_DIR),
        rollout_func=rollout,
    )


def _rows(batch: dict[str, Any]) -> list[dict[str, list[Any]]]:
    """Per completion, TRL's tensors with its padding removed."""
    out = []
    for i in range(batch["completion_ids"].shape[0]):
        p, c = batch["prompt_mask"][i].bool(), batch["completion_mask"][i].bool()
        out.append(
            {
                "prompt_ids": batch["prompt_ids"][i][p].tolist(),
                "completion_ids": batch["completion_ids"][i][c].tolist(),
                "tool_mask": batch["tool_mask"][i][c].tolist(),
                "logprobs": batch["sampling_per_token_logps"][i][c].tolist(),
            }
        )
    return out


def _rebuilt(store: Path, result: SessionResult) -> Trace:
    """The session's main trace, rebuilt from the node's store (not from what the bridge was given)."""
    trajectory = build(SQLiteStore(store).completions(result.session_id), strategy="prefix_merging")
    index = main_trace(trajectory)
    assert index is not None
    return trajectory.traces[index]


def _assert_trl_trained_on(row: dict[str, list[Any]], trace: Trace) -> None:
    assert row["prompt_ids"] == trace.prompt_ids
    assert row["completion_ids"] == trace.response_ids
    assert row["tool_mask"] == trace.loss_mask
    assert row["logprobs"] == pytest.approx(trace.response_logprobs, abs=1e-6)


@pytest.mark.slow
async def test_trl_grpo_steps_train_on_the_engines_tokens_and_sync_weights(tmp_path: Path) -> None:
    engine = load_tiny()
    synced: list[dict[str, Any]] = []
    sync = engine_weight_sync(engine)

    def sync_and_keep(model: Any, step: int) -> None:
        synced.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        sync(model, step)

    try:
        with serve(create_engine_app(engine)) as policy:
            async with _rollout_service(policy.url, engine.name, tmp_path) as url:
                rollout = PolarRollout(
                    url, _task(max_turns=2, max_tokens=12), sync_weights=sync_and_keep, token=TOKEN
                )
                first = copy.deepcopy(engine.model)
                trainer = _trainer(tmp_path, rollout, steps=2)
                results: list[list[SessionResult | None]] = []
                trainer.add_callback(_keep_results(rollout, results))
                before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
                await asyncio.to_thread(trainer.train)
    finally:
        engine.stop()

    assert trainer.state.global_step == 2 and len(trainer.batches) == 2 and len(synced) == 1
    store = tmp_path / "node.db"
    second = copy.deepcopy(first)
    second.load_state_dict(synced[0])
    for version, (batch, sessions, model) in enumerate(
        zip(trainer.batches, results, (first, second), strict=True)
    ):
        assert len(sessions) == GROUP and all(r is not None and r.status == "COMPLETED" for r in sessions)
        for row, result in zip(_rows(batch), sessions, strict=True):
            assert result is not None
            trace = _rebuilt(store, result)
            _assert_trl_trained_on(row, trace)
            # Sampled by the weights TRL trained at that step: version 0, then the synced step-1 weights.
            assert {r.policy_version for r in SQLiteStore(store).completions(result.session_id)} == {version}
            packed = pack([(trace.prompt_ids, trace.response_ids)], max_len=4096)
            with torch.no_grad():
                mine = response_logprobs(model, packed).tolist()
            assert mine == pytest.approx(trace.response_logprobs, abs=2e-3)
        # TRL's advantages came from polar's rewards: distinct in the group, so non-zero.
        assert len({r.reward for r in sessions if r is not None}) > 1
        assert batch["advantages"].abs().sum() > 0
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(before[k], after[k].detach()) for k in before)


def _keep_results(rollout: PolarRollout, into: list[list[SessionResult | None]]) -> Any:
    """A callback keeping each rollout's session results (the bridge keeps only the last call's)."""
    from transformers import TrainerCallback

    class KeepResults(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            into.append(list(rollout.last_results))

    return KeepResults()


@pytest.mark.slow
async def test_trl_masks_tool_output_and_gives_failed_sessions_no_gradient(tmp_path: Path) -> None:
    """A tool-using agent (a tool call, its output, a final answer): the tool output inside the merged trace
    reaches TRL as env_mask 0. The run's first upstream call fails, so one session ends with nothing to
    train: TRL gets it fully masked with no reward, and its advantage is 0."""
    finishes = itertools.count(1)

    def script(body: dict[str, Any]) -> Reply:
        if any(m.get("role") == "tool" for m in body["messages"]):
            return Reply(content="ok" + "!" * next(finishes))  # distinct per session: rewards differ
        return Reply(tool_calls=[("sh", '{"cmd":"echo hi"}')])

    agent = tmp_path / "tool_agent.py"
    agent.write_text(TOOL_AGENT)
    template = _task().model_copy(
        update={
            "agent": AgentConfig(
                harness="shell", settings={"command": f"{sys.executable} {agent} {{instruction_file}}"}
            )
        }
    )
    fake = make_fake_backend("vllm", script, fail_first_n=1)
    with serve(fake) as policy:
        async with _rollout_service(policy.url, "fake-policy", tmp_path) as url:
            rollout = PolarRollout(url, template, token=TOKEN)
            # Three sessions (one fails): TRL's loss over Qwen3's 152k vocabulary is slow on CPU per token.
            trainer = _trainer(tmp_path, rollout, steps=1, group=3)
            await asyncio.to_thread(trainer.train)

    (batch,) = trainer.batches
    rows, sessions = _rows(batch), rollout.last_results
    assert rollout.last_stats["unusable"] == 1 and rollout.last_stats["sessions"] == 3
    failed = [i for i, r in enumerate(rows) if not any(r["tool_mask"])]
    assert len(failed) == 1
    for i, (row, result) in enumerate(zip(rows, sessions, strict=True)):
        assert result is not None
        if i in failed:
            assert result.status != "COMPLETED" and result.reward is None
            assert float(batch["advantages"][i]) == 0.0
            continue
        trace = _rebuilt(tmp_path / "node.db", result)
        _assert_trl_trained_on(row, trace)
        assert b"hi\n" in bytes(t - 1000 for t in row["completion_ids"] if 1000 <= t < 1256)
        assert 0 in row["tool_mask"] and row["tool_mask"][-1] == 1  # tool output masked, last turn trained
        assert trace.metadata["seqs"] == [0, 1]  # both calls in the one trace TRL trained on
    assert batch["advantages"].abs().sum() > 0


def test_instruction_of_takes_text_or_the_last_user_message() -> None:
    assert instruction_of("fix it") == "fix it"
    convo = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
    ]
    assert instruction_of(convo) == "b"
    for bad in ([], [{"role": "user", "content": [{"type": "text", "text": "x"}]}], 3):
        with pytest.raises(ValueError, match="TRL prompt"):
            instruction_of(bad)


def test_polar_reward_passes_rewards_through_and_checks_length() -> None:
    assert polar_reward(["a", "b"], [1.0, None]) == [1.0, None]
    with pytest.raises(ValueError, match="2 completions"):
        polar_reward(["a", "b"], [1.0])


def _result(traces: list[dict[str, Any]], status: str = "COMPLETED") -> SessionResult:
    trajectory = {"status": status, "traces": traces, "metadata": {}}
    return SessionResult(session_id="s1", task_id="t", status=status, reward=1.0, trajectory=trajectory)


def _trace(
    n_messages: int, mask: list[int], logprobs: list[float] | None, reward: float | None = 1.0
) -> dict[str, Any]:
    return {
        "prompt_ids": [1, 2],
        "response_ids": [10 + i for i in range(len(mask))],
        "loss_mask": mask,
        "response_logprobs": logprobs,
        "prompt_messages": [{"role": "user", "content": "x"}] * n_messages,
        "reward": reward,
    }


def test_completion_of_takes_the_main_trace_and_counts_the_others() -> None:
    side, main = _trace(1, [1], [-0.5], 0.5), _trace(3, [1, 0, 1], [-1.0, 0.0, -2.0], 0.25)
    row, others = completion_of(_result([side, main]), filler=7)
    assert (row.prompt_ids, row.completion_ids, row.env_mask) == ([1, 2], [10, 11, 12], [1, 0, 1])
    assert row.logprobs == [-1.0, 0.0, -2.0] and row.reward == 0.25 and others == 1


def test_completion_of_masks_what_cannot_be_trained() -> None:
    missing, _ = completion_of(None, filler=7)
    assert (missing.prompt_ids, missing.completion_ids, missing.env_mask, missing.reward) == (
        [7],
        [7],
        [0],
        None,
    )
    assert missing.status == "MISSING"
    no_traces, _ = completion_of(_result([], status="ERROR"), filler=7)
    assert no_traces.env_mask == [0] and no_traces.reward is None and no_traces.status == "ERROR"
    # Tokens without behaviour logprobs (a train_without_logprobs build) reach TRL, never trained.
    blind, _ = completion_of(_result([_trace(2, [1, 1], None)]), filler=7)
    assert blind.completion_ids == [10, 11] and blind.env_mask == [0, 0] and blind.reward is None
    masked, _ = completion_of(_result([_trace(2, [0, 0], [0.0, 0.0], reward=None)], status="ERROR"), filler=7)
    assert masked.env_mask == [0, 0] and masked.reward is None


async def test_sessions_that_do_not_finish_in_time_are_cancelled_and_reach_trl_masked(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server.db")  # no node: nothing ever runs
    try:
        rollout = PolarRollout(server.url, _task(), timeout_s=0.5, poll_wait_s=0.2, token=TOKEN)
        trainer = SimpleNamespace(state=SimpleNamespace(global_step=0), eos_token_ids=[7])
        out = await asyncio.to_thread(rollout, ["a", "a", "b"], trainer)
        async with httpx.AsyncClient(headers=AUTH) as http:
            states = [
                (await http.get(f"{server.url}/rollout/task/trl-{rollout.run_id}-0-{g}")).json()["state"]
                for g in (0, 1)
            ]
    finally:
        server.stop()
    assert out["env_mask"] == [[0], [0], [0]] and out["polar_reward"] == [None, None, None]
    assert out["completion_ids"] == [[7], [7], [7]] and len(out["prompt_ids"]) == 3
    assert rollout.last_stats == {
        "sessions": 3,
        "unusable": 3,
        "other_trainable_traces": 0,
        "status_missing": 3,
    }
    assert states == ["CANCELLED", "CANCELLED"]


def _grpo_step(url: str, task: Task, out: Path, processes: int) -> list[dict[str, Any]]:
    """grpo_step on a global batch of one prompt's group of GROUP: in this process, or under `accelerate
    launch` with `processes` ranks of GROUP / processes entries each. Returns each rank's report."""
    out.mkdir()
    if processes == 1:
        grpo_step(url, TOKEN, str(out), GROUP, task.model_dump_json())
        return [json.loads((out / "rank-0.json").read_text())]
    script = out / "grpo_step.py"
    script.write_text(GRPO_STEP)
    with socket.socket() as s:  # torchrun's rendezvous port, free now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # --multi_gpu picks accelerate's torchrun launcher; GRPOConfig(use_cpu=True) makes it gloo on CPU.
    launch = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "1"]
    launch += ["--num_processes", str(processes), "--main_process_port", str(port)]
    argv = [sys.executable, *launch, "--mixed_precision", "no", "--dynamo_backend", "no", str(script)]
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRL_EXPERIMENTAL_SILENCE": "1",
    }
    done = subprocess.run(
        [*argv, url, TOKEN, str(out), str(GROUP // processes), task.model_dump_json()],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(processes)]


@pytest.mark.slow
async def test_trl_under_accelerate_rolls_each_group_out_once_and_takes_the_single_process_step(
    tmp_path: Path,
) -> None:
    """Two ranks under `accelerate launch` (gloo, CPU), the prompt's group of 4 straddling them: the main
    process rolls the group out once, as one polar task of 4 samples, each rank trains on its 2 rows, and
    the update equals one process's on the same group. The policy is the fake vLLM answering the k-th
    call for an instruction with a text fixed by k mod 4, so both runs roll out the same group (in
    whatever order the sessions run; TRL's loss does not depend on the order within a group). SGD, not
    AdamW: the order changes float sums in the last bits, and Adam's first step (g / |g|) turns that
    into 1e-5 differences for parameters whose gradient is near 0 (seen); SGD keeps it at 1e-8."""
    calls: collections.Counter[str] = collections.Counter()

    def script(body: dict[str, Any]) -> Reply:
        key = json.dumps(body["messages"][-1])
        k, calls[key] = calls[key] % GROUP, calls[key] + 1
        return Reply(content="hi" + "!" * (3 * k))  # rewards (mean logprob) differ within the group

    agent = tmp_path / "one_call_agent.py"
    agent.write_text(ONE_CALL_AGENT)
    command = f"{sys.executable} {agent} {{instruction_file}}"
    task = _task().model_copy(update={"agent": AgentConfig(harness="shell", settings={"command": command})})
    with serve(make_fake_backend("vllm", script)) as policy:
        async with _rollout_service(policy.url, "fake-policy", tmp_path) as url:
            two = await asyncio.to_thread(_grpo_step, url, task, tmp_path / "two", 2)
            one = await asyncio.to_thread(_grpo_step, url, task, tmp_path / "one", 1)

    main, other = two
    assert main["stats"]["sessions"] == GROUP and other["stats"] == {}  # the main process rolled out
    (task_id,) = {g[0] for g in main["groups"]}
    assert sorted(g[1] for g in main["groups"]) == list(range(GROUP))  # one task: the whole group
    assert task_id.startswith("trl-")
    assert one[0]["stats"]["sessions"] == len(one[0]["sessions"]) == GROUP
    assert len(main["sessions"]) == len(other["sessions"]) == GROUP // 2
    assert len(set(main["sessions"]) | set(other["sessions"])) == GROUP  # every session trained once
    weights = [torch.load(tmp_path / "two" / f"weights-{r}.pt") for r in (0, 1)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])  # ranks agree
    single = torch.load(tmp_path / "one" / "weights-0.pt")
    initial = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).state_dict()
    moved = max(float((single[k] - initial[k]).abs().max()) for k in single)
    assert moved > 1e-4  # the step changed the weights, so the comparison below is not vacuous
    worst = max(float((single[k] - weights[0][k]).abs().max()) for k in single)
    assert worst < 1e-6, worst
