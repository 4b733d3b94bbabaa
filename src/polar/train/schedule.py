"""The learning rate of each optimizer step: linear warm-up, then constant, linear or cosine decay.

A pure function of the step index, so a resumed run (its `step_count` comes back with the checkpoint) and
every rank of a torchrun job take the same rate without a scheduler state to save. Warm-up is what
long-context RL runs use to keep the first, largest-variance steps from wrecking a pretrained policy; the
decay ends at `min_lr_ratio` of the base rate at the run's last step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Schedule = Literal["constant", "linear", "cosine"]


@dataclass(frozen=True, slots=True)
class LRSchedule:
    schedule: Schedule = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # the decayed rate at the last step, as a fraction of the base rate
    total_steps: int | None = None  # the decay's horizon (the run's `steps`); None: no decay

    def factor(self, step: int) -> float:
        """The multiplier of the base rate for 0-based optimizer step `step`."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant" or self.total_steps is None:
            return 1.0
        span = self.total_steps - self.warmup_steps - 1  # the steps after warm-up, first to last
        done = 1.0 if span <= 0 else min(1.0, (step - self.warmup_steps) / span)
        shape = 1.0 - done if self.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape
