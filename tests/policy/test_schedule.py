"""The learning rate's schedule: its shape, the settings that make it, and its clock (AdamW's
step count) surviving the optimizer's saved state."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from pydantic import ValidationError

from jetrl.consumers.trainer.settings import TrainerSettings
from jetrl.policy.schedule import LrSchedule
from jetrl.policy.train import scheduled_lr


def test_constant_is_the_rate_at_every_step() -> None:
    s = LrSchedule(3e-4)
    assert s.constant and {s.at(n) for n in (0, 1, 10, 10_000)} == {3e-4}


def test_warmup_rises_linearly_to_the_rate() -> None:
    s = LrSchedule(1.0, warmup_steps=4)
    assert not s.constant
    assert [s.at(n) for n in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("decay", ["linear", "cosine"])
def test_decay_runs_from_the_rate_to_its_floor_and_stays(decay: str) -> None:
    s = LrSchedule(2.0, warmup_steps=2, decay=decay, decay_steps=100, min_ratio=0.1)  # type: ignore[arg-type]
    assert s.at(1) == 2.0 and s.at(2) == 2.0  # the warmup's last step, then the decay's first
    assert s.at(2 + 50) == pytest.approx(2.0 * (0.1 + 0.9 * 0.5))  # halfway: linear and cosine meet
    assert s.at(2 + 100) == pytest.approx(0.2) and s.at(5_000) == pytest.approx(0.2)
    rates = [s.at(n) for n in range(2, 103)]
    assert all(a >= b for a, b in itertools.pairwise(rates))  # never rises
    # A quarter in, cosine has come down less than linear.
    q = s.at(2 + 25)
    want = 1 - 0.25 if decay == "linear" else 0.5 * (1 + math.cos(math.pi * 0.25))
    assert q == pytest.approx(2.0 * (0.1 + 0.9 * want))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": -1.0},
        {"lr": 1.0, "warmup_steps": -1},
        {"lr": 1.0, "decay": "cosine"},  # no decay_steps
        {"lr": 1.0, "decay": "linear", "decay_steps": 10, "min_ratio": 1.5},
    ],
)
def test_a_schedule_that_cannot_be_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        LrSchedule(**kwargs)  # type: ignore[arg-type]


def test_the_settings_make_the_schedule_and_refuse_a_decay_shape_without_a_decay() -> None:
    assert TrainerSettings(lr=1e-3).lr_schedule() == LrSchedule(1e-3)
    s = TrainerSettings(lr=1e-3, max_steps=500, lr_warmup_steps=20, lr_decay="cosine", lr_min_ratio=0.1)
    # Decay over the rest of max_steps unless told, resolved into the settings a run records:
    # a resume that raises max_steps keeps the schedule its steps were taken with.
    assert s.lr_decay_steps == 480 and s.lr_schedule() == LrSchedule(1e-3, 20, "cosine", 480, 0.1)
    resumed = TrainerSettings.model_validate({**s.model_dump(), "max_steps": 2000})
    assert resumed.lr_schedule() == s.lr_schedule()
    s = TrainerSettings(lr=1e-3, lr_decay="linear", lr_decay_steps=50)
    assert s.lr_schedule() == LrSchedule(1e-3, 0, "linear", 50, 0.0)
    for bad in ({"lr_decay_steps": 50}, {"lr_min_ratio": 0.1}):
        with pytest.raises(ValidationError, match="lr_decay"):
            TrainerSettings(**bad)


def test_the_clock_is_adamw_s_step_count_and_survives_its_saved_state() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    s = LrSchedule(1.0, warmup_steps=2, decay="linear", decay_steps=4)
    seen = []
    for _ in range(3):
        model(torch.ones(1, 3)).sum().backward()
        seen.append(scheduled_lr(opt, s))
        opt.step()
    assert seen == [s.at(0), s.at(1), s.at(2)] == [0.5, 1.0, 1.0]
    # A fresh optimizer loaded with the saved state is at the same point of the schedule.
    other = torch.optim.AdamW(model.parameters(), lr=1.0)
    other.load_state_dict(opt.state_dict())
    assert scheduled_lr(other, s) == scheduled_lr(opt, s) == s.at(3) == 0.75
    assert other.param_groups[0]["lr"] == 0.75
