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
