"""RunReport: the progress line, summary and reward curve from StepCompleted and
EvaluationReported bodies alone."""

from __future__ import annotations

from pathlib import Path

from jetrl.bus import events as ev
from jetrl.deploy.report import RunReport
from tests.support.report_bodies import evaluation


def step(n: int, mean: float, micro_batches: list[int] | None = None, **parts: float) -> ev.StepCompleted:
    metrics = {
        "reward_mean": mean,
        "reward_max": 1.0,
        "staleness_mean": 1.0,
        "trainer_idle_frac": 0.22,
        "withheld_total": 272.0,
        **{f"reward_{k}": v for k, v in parts.items()},
    }
    return ev.StepCompleted(
        step=n,
        policy_version=n + 1,
        rollout_ids=[],
        metrics=metrics,
        tokens=500,
        micro_batches=micro_batches or [],
    )


def demo_like(n_steps: int = 12) -> RunReport:
    """Steps shaped like the demo's: `positions` is the reward itself, `exact` a part of its own."""
    report = RunReport()
    for n in range(n_steps):
        reward = 0.1 * n / (n_steps - 1) + 0.85
        report.add(step(n, reward, positions=reward, exact=reward - 0.1), t=40.0 + 0.5 * n)
    return report


def test_line_shows_the_parts_that_are_not_the_reward_itself() -> None:
    line = demo_like().line()
    # last 10 steps: rewards 0.8682..0.95, mean 0.9091; exact 0.1 lower; 9 steps in 4.5 s
    assert line == (
        "step   11 | reward 0.909 (exact 0.81) | staleness 1.00 | 120.0 steps/min |   1000 tok/s | "
        "trainer idle 22% | withheld 272 | 46s"
    )


def test_line_names_every_part_and_none_when_there_are_none() -> None:
    report = RunReport()
    report.add(step(0, 0.5, format=1.0, correct=0.25), t=3.0)
    assert report.line().startswith("step    0 | reward 0.500 (format 1.00, correct 0.25) | staleness 1.00 |")
    bare = RunReport()
    bare.add(step(0, 0.5), t=3.0)
    assert bare.line().startswith("step    0 | reward 0.500 | staleness")
    assert "max" not in bare.line() and bare.parts == []


def test_summary_has_a_last10_per_shown_part() -> None:
    s = demo_like().summary()
    assert s == {
        "steps": 12,
        "reward_first": 0.85,
        "reward_last10": 0.9091,
        "exact_last10": 0.8091,
        "wall_s": 45.5,
        "steps_per_min": 15.8,
        "staleness_mean": 1.0,
        "trainer_idle_frac": 0.22,
        "withheld": 272,
        "streamed_steps": 0,
    }
    assert RunReport().summary() == {"steps": 0}


def test_summary_counts_the_steps_taken_as_their_groups_came() -> None:
    report = RunReport()
    for n, split in enumerate([[], [32, 16], [], [16, 16, 16]]):
        report.add(step(n, 0.5, micro_batches=split), t=1.0 + n)
    assert report.summary()["streamed_steps"] == 2
    assert [s["streamed"] for s in report.steps] == [0.0, 1.0, 0.0, 1.0]


def test_a_part_named_reward_does_not_overwrite_the_mean() -> None:
    report = RunReport()
    report.add(step(0, 0.5, reward=0.25), t=1.0)
    s = report.summary()
    assert s["reward_last10"] == 0.5 and s["reward_reward_last10"] == 0.25


def test_plot_writes_a_png(tmp_path: Path) -> None:
    path = demo_like().plot(tmp_path / "reward.png", "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def test_the_plot_shows_each_envs_held_out_evaluations_by_version() -> None:
    report = demo_like()
    for version, at_1 in ((10, 0.5), (0, 0.1), (5, 0.3)):  # in any order
        report.add_evaluation(evaluation("arithmetic", version, at_1, at_1 + 0.2))
    report.add_evaluation(evaluation("parity", 0, 0.4, 0.7), tenant="acme")
    ax = report.figure("t").axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    at_1 = lines["held-out pass@1 (arithmetic)"]
    assert list(at_1.get_xdata()) == [0, 5, 10] and list(at_1.get_ydata()) == [0.1, 0.3, 0.5]
    assert list(lines["held-out pass@4 (arithmetic)"].get_ydata()) == [0.1 + 0.2, 0.3 + 0.2, 0.5 + 0.2]
    assert list(lines["held-out pass@1 (acme/parity)"].get_ydata()) == [0.4]
    assert "mean reward (step)" in lines and ax.get_ylim() == (0.0, 1.02)
