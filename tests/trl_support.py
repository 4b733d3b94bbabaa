"""A real custom evaluator for the TRL bridge test: it scores a session by the mean behaviour logprob of its
sampled tokens, so samples of one group get distinct rewards (non-zero GRPO advantages) deterministically
from what was sampled. Plugged in as `tests.trl_support:MeanLogprobReward`, like any user evaluator."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polar.evaluate.base import EvalContext, EvalResult


class MeanLogprobReward:
    name = "mean_logprob"
    needs_fresh_runtime = False

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        if config:
            raise ValueError(f"mean_logprob takes no config, got {sorted(config)}")

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        values = [
            lp
            for t in ctx.trajectory.traces
            for lp, m in zip(t.response_logprobs or [], t.loss_mask, strict=True)
            if m
        ]
        if not values:
            raise ValueError("no sampled tokens to score")
        return EvalResult(reward=sum(values) / len(values), passed=True)


# A minimal tool-using harness (run by the shell preset): one tool call, its result, a final answer.
# Configured only by the harness contract's environment (OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL);
# argv[1] is the instruction file.
TOOL_AGENT = """
import json, os, subprocess, sys, openai
client = openai.OpenAI(max_retries=0)
tools = [{"type": "function", "function": {"name": "sh", "parameters": {"type": "object",
          "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}]
messages = [{"role": "user", "content": open(sys.argv[1]).read()}]
while True:
    m = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=messages, tools=tools).choices[0].message
    messages.append(m.model_dump(exclude_none=True))
    if not m.tool_calls:
        break
    for call in m.tool_calls:
        cmd = json.loads(call.function.arguments)["cmd"]
        out = subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout
        messages.append({"role": "tool", "tool_call_id": call.id, "content": out})
print(m.content)
"""


# A harness of one chat call (a prompt of a dozen tokens: TRL's step on CPU stays short).
ONE_CALL_AGENT = """
import os, sys, openai
client = openai.OpenAI(max_retries=0)
messages = [{"role": "user", "content": open(sys.argv[1]).read()}]
print(client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=messages).choices[0].message.content)
"""


def grpo_step(url: str, token: str, out: str, per_device: int, task_json: str) -> None:
    """One GRPO step of TRL on polar rollouts (one prompt, a group of 4), run by every rank of `accelerate
    launch` (GRPO_STEP) or in the test's own process. Each rank saves its weights after the step and the
    session ids of the rows it trained on; the main process also the bridge's stats and groups."""
    import json

    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polar.engine.tiny import default_model_dir
    from polar.task import Task
    from polar.train.bridges.trl import PolarRollout, polar_reward

    rollout = PolarRollout(url, Task.model_validate_json(task_json), token=token, poll_wait_s=0.2)
    mine: list[str | None] = []

    def recording(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        rows = rollout(prompts, trainer)
        mine.extend(rows["polar_session_id"])
        return rows

    args = trl.GRPOConfig(
        output_dir=f"{out}/trl",
        use_cpu=True,
        per_device_train_batch_size=per_device,
        num_generations=4,
        max_steps=1,
        learning_rate=0.1,
        optim="sgd",  # see the test
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        seed=0,
        gradient_checkpointing=False,
    )
    model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32)
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=[polar_reward],
        args=args,
        rollout_func=recording,
        train_dataset=datasets.Dataset.from_dict({"prompt": ["say hi"]}),
        processing_class=AutoTokenizer.from_pretrained(default_model_dir()),
    )
    trainer.train()
    rank = trainer.accelerator.process_index
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{out}/weights-{rank}.pt")
    trainer.accelerator.end_training()  # leaves the process group (docs/training.md: at exit, gloo may abort)
    groups = [[r.task_id, r.metadata.get("sample_index")] for r in rollout.last_results if r]
    report = {"sessions": mine, "stats": rollout.last_stats, "groups": groups}
    with open(f"{out}/rank-{rank}.json", "w") as f:
        json.dump(report, f)


# grpo_step on every rank of `accelerate launch SCRIPT URL TOKEN OUT PER_DEVICE TASK_JSON`.
GRPO_STEP = """
import sys
from tests.trl_support import grpo_step
grpo_step(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
"""
