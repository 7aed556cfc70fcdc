"""The learning rate through a run: a linear warmup, then constant, linear or cosine decay to a
floor. Torch-free, so that the trainer's settings build it without importing torch.

The clock is the optimizer steps taken, which AdamW keeps with its state (``step``) and every
checkpoint saves: a resumed or replayed trainer is at the same point of the schedule as the run
it continues, with no state of its own to save (policy/train.py, :func:`scheduled_lr`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Decay = Literal["constant", "linear", "cosine"]


@dataclass(frozen=True)
class LrSchedule:
    """``lr`` after ``warmup_steps`` steps rising linearly from ``lr / warmup_steps``; then
    ``decay`` over ``decay_steps`` steps down to ``lr * min_ratio``, where it stays.
    ``LrSchedule(lr)`` is a constant ``lr``."""

    lr: float
    warmup_steps: int = 0
    decay: Decay = "constant"
    decay_steps: int = 0
    min_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.lr < 0 or self.warmup_steps < 0 or self.decay_steps < 0:
            raise ValueError(f"a learning rate schedule takes no negative values: {self}")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"min_ratio {self.min_ratio} is not within [0, 1]")
        if self.decay != "constant" and self.decay_steps == 0:
            raise ValueError(f"a {self.decay} decay needs decay_steps > 0")

    @property
    def constant(self) -> bool:
        return self.warmup_steps == 0 and self.decay == "constant"

    def at(self, step: int) -> float:
        """The learning rate of the optimizer step that ``step`` steps precede (0: the first)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return self.lr
        done = min((step - self.warmup_steps) / self.decay_steps, 1.0)
        left = 1.0 - done if self.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
        return self.lr * (self.min_ratio + (1.0 - self.min_ratio) * left)
