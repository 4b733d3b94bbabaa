"""The learn_real reward: 1 when the agent's reply starts with the expected word, as a word; else 0.

The reply's first whitespace-separated word, trailing `.,;:!?` and quotes stripped, must equal the task's
`metadata.answer` exactly (case included: `RIVER`, not `River`). "RIVER" and "RIVER\nmore text" pass;
"RIVERside", "RIVERをする" and "The answer is RIVER" do not. The untrained model often starts with the
right letters and runs on without a break (docs/learning.md shows samples), so what it must learn is to
give the answer and stop; a wrong answer never passes.
"""

from __future__ import annotations

from typing import Any

from polar.evaluate.base import EvalContext, EvalResult
from polar.evaluate.support import EvaluatorError, StrictConfig, parse_config

_STRIP = ".,;:!?\"'`"


def first_word(reply: str) -> str:
    words = reply.split()
    return words[0].rstrip(_STRIP).lstrip("\"'`") if words else ""


class FirstWordReward:
    name = "first_word"
    needs_fresh_runtime = False

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        parse_config(self.name, StrictConfig, config)

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        if ctx.task is None or "answer" not in ctx.task.metadata:
            raise EvaluatorError("first_word: the task has no metadata.answer")
        if ctx.agent is None or ctx.agent.exit_code != 0:
            # The agent program failed (the gateway or the server refused the call): not the policy's
            # answer, so not a 0 to train on. Raising makes the session an ERROR, masked.
            code = None if ctx.agent is None else ctx.agent.exit_code
            raise EvaluatorError(f"first_word: the agent program exited with {code}")
        reply = ctx.agent.stdout
        word = first_word(reply)
        ok = word == ctx.task.metadata["answer"]
        return EvalResult(reward=1.0 if ok else 0.0, passed=ok, details={"reply": reply[:200], "word": word})
