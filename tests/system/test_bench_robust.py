"""The benches' figures on too little data: a clear "too few ... to measure" line, never a crash.

Each bench's figure and summary functions are called on what a slow or loaded machine leaves
(no steps, a baseline without a rate, no recovery, no routing-changed token); no run is started.
"""

from __future__ import annotations

import subprocess
import sys
from types import ModuleType

import pytest
import torch

from tests.support.benches import load_bench


@pytest.fixture(scope="module")
def async_bench() -> ModuleType:
    return load_bench("async")


def steps_at(times: list[float], **extra: float) -> list[dict[str, float]]:
    return [{"step": float(i), "t": t, **extra} for i, t in enumerate(times)]


def test_async_mode_without_steps_measures_nothing(async_bench: ModuleType) -> None:
    f = async_bench.mode_figures([], 3.0)
    assert (f.steps, f.steps_per_min, f.idle, f.staleness, f.reward, f.withheld) == (
        0,
        None,
        None,
        None,
        None,
        0,
    )
    line = async_bench.speedup_line(1, f, f)
    assert line == (
        "async/sync steps-per-minute k=1: too few steps to measure "
        "(0 steps in 3 s; 6 needed: 3 warm-up, 3 timed)"
    )
    assert async_bench.idle_line(4, f).startswith("trainer idle k=4: too few steps to measure (0 steps")


def test_async_few_or_simultaneous_steps_give_no_rate(async_bench: ModuleType) -> None:
    # Two timed steps (the old code divided by the span of these), then steps all at one instant.
    assert async_bench.mode_figures(steps_at([1, 2, 3, 4, 5]), 45.0).steps_per_min is None
    same = async_bench.mode_figures(steps_at([1.0] * 8, trainer_wait_s=0.0, step_s=0.0), 45.0)
    assert same.steps_per_min is None and same.idle is None
    assert same.staleness == 0.0 and same.reward == 0.0


def test_async_group_latencies_against_the_step_pace(async_bench: ModuleType) -> None:
    none = async_bench.mode_figures([], 3.0)
    assert async_bench.latency_line(1, none, []) == "groups k=1: none scored"
    # No rate: the latencies alone; one group is enough for them.
    assert (
        async_bench.latency_line(1, none, [0.5])
        == "groups k=1: task to scored p50 0.50 s, p90 0.50 s (1 groups)"
    )
    # A step a second, half of it waiting: at k=1 a group has about 2 s, at the busy pace 1 s.
    paced = async_bench.mode_figures(steps_at([0, 1, 2, 3, 4, 5, 6], trainer_wait_s=0.5, step_s=0.5), 45.0)
    line = async_bench.latency_line(1, paced, [0.2, 0.4, 1.5, 1.6, 2.5])
    assert "a step every 1.00 s: 20% longer than 2 steps" in line
    assert "at the trainer's busy pace (0.50 s a step): 60% longer than 2 steps" in line


def test_async_ratio_needs_a_measured_baseline(async_bench: ModuleType) -> None:
    fast = async_bench.mode_figures(steps_at([0, 1, 2, 3, 4, 5, 6], trainer_wait_s=0.1, step_s=0.9), 45.0)
    assert fast.steps_per_min == pytest.approx(60.0) and fast.idle == pytest.approx(0.1)
    # Reading and checking the batch is the trainer's work, not idleness.
    reading = async_bench.mode_figures(
        steps_at([0, 1, 2, 3, 4, 5, 6], trainer_wait_s=0.1, trainer_read_s=0.2, step_s=0.7), 45.0
    )
    assert reading.idle == pytest.approx(0.1)
    slow = async_bench.mode_figures(steps_at([0, 10]), 45.0)
    assert async_bench.speedup_line(1, fast, slow) == (
        "async/sync steps-per-minute k=1: no sync baseline to compare with "
        "(sync: too few steps to measure (2 steps in 45 s; 6 needed: 3 warm-up, 3 timed))"
    )
    assert "mode 0 was not run" in async_bench.speedup_line(2, fast, None)
    assert async_bench.speedup_line(1, fast, fast) == "async/sync steps-per-minute k=1 1.00x (target >= 2x)"
    assert async_bench.idle_line(1, fast) == "trainer idle k=1 10.0% (target < 10%)"


def chaos_result(**over: object) -> dict[str, object]:
    r: dict[str, object] = {
        "status": 0,
        "steps": 0,
        "steps_contiguous": True,
        "streamed": 0,
        "injected": [],
        "recovery": {},
        "scored": 0,
        "trained": 0,
        "withheld": 0,
        "pending": 0,
        "lost": 0,
        "lost_why": {},
        "trained_twice": 0,
        "replay_verified": False,
        "restarts": {},
    }
    return r | over


def test_chaos_summary_without_kills_or_recoveries() -> None:
    chaos = load_bench("chaos")
    lines = chaos.summary_lines(chaos_result(), 22)
    assert "faults injected 0 over 0 kinds of part (target >= 20) (the run ended after 0 steps" in "\n".join(
        lines
    )
    assert "recovery time: too few recoveries to measure (no step completed after any of 0 kills)" in lines
    assert "replay verified: too few steps to verify (0 steps) (target yes)" in lines
    # Kills after the last step: in the table without figures.
    r = chaos_result(steps=5, injected=[("trainer", 1.0, 5), ("inference-1", 2.0, 5)], replay_verified=True)
    lines = chaos.summary_lines(r, 2)
    assert any(line.startswith("inference") and line.rstrip().endswith("-") for line in lines)
    assert "faults injected 2 over 2 kinds of part (target >= 20)" in lines
    assert "replay verified yes (target yes)" in lines
    assert "rollouts lost 0 (target 0)" in lines
    # Lost rollouts say why: the reasons they were dead-lettered.
    r = chaos_result(lost=16, lost_why={"max_deliver": 16})
    assert "rollouts lost 16 (target 0): 16 max_deliver" in chaos.summary_lines(r, 22)


def test_bus_ratio_lines_when_nothing_was_measured() -> None:
    bus = load_bench("bus")
    assert bus.rate(10, 1000, 0.0).events_s > 0  # no ZeroDivisionError
    zero = {k: bus.Rate(0.0, 0.0) for k in ("pub_raw", "pub_jetrl", "con_raw", "con_jetrl")}
    assert "not measured (raw nats-py moved no events)" in bus.ratio_line("publish", "small", "", zero, "pub")
    assert bus.ratio_line("consume", "rollout", "", "0 events", "con") == (
        "consume ratio rollout: not measured (0 events) (target >= 0.8)"
    )


def test_r3_cut_on_too_few_changed_tokens() -> None:
    r3 = load_bench("r3")
    few = {"num_tokens": 3.0, "mismatch_kl": 1e-3}
    assert r3.kl_cut(few, few, " on routing-changed tokens", 20) == (
        "mismatch-KL cut on routing-changed tokens: too few tokens to measure (3; 20 needed) (target >= 10x)"
    )
    none_left = r3.kl_cut(
        {"num_tokens": 50.0, "mismatch_kl": 1e-3}, {"num_tokens": 50.0, "mismatch_kl": 0.0}, "", 1
    )
    assert "replay leaves no mismatch" in none_left
    assert r3.kl_cut(
        {"num_tokens": 50.0, "mismatch_kl": 1e-3}, {"num_tokens": 50.0, "mismatch_kl": 1e-4}, "", 1
    ) == ("mismatch-KL cut 10.0x (target >= 10x)")


def test_r3_routing_sets_compare_as_sets() -> None:
    r3 = load_bench("r3")
    rec = torch.tensor([[[[1, 2], [3, 4]], [[0, 1], [2, 3]]]])  # [B=1, L=2, layers=2, k=2]
    own = torch.tensor([[[[2, 1], [4, 3]], [[0, 1], [2, 5]]]])  # same sets at 0, layer 1 differs at 1
    assert r3.routing_differs(own, rec).tolist() == [[[False, False], [False, True]]]


def test_r3_fed_positions_of_a_row_without_loss_tokens() -> None:
    r3 = load_bench("r3")

    class Batch:
        loss_mask = torch.tensor([[False, True, True, False], [False, False, False, False]])

    assert r3.fed_positions(Batch()).tolist() == [[True, True, True, False], [False, False, False, False]]


def test_trainer_summary_when_layouts_failed() -> None:
    trainer = load_bench("trainer")
    lines = trainer.summary_lines({})  # nothing ran (timed out, or failed to start)
    assert lines[0] == "trainer step time local engine 1 rank: not measured (not run) (target: reported)"
    assert (
        "trainer params+optimizer per rank fsdp 2 ranks / whole: not measured (not run) (target ~0.5)"
        in lines
    )
    failed = {"fsdp": {"ok": False, "error": "rank 1: timed out after 60 s"}}
    assert any(
        "not measured (rank 1: timed out after 60 s)" in line for line in trainer.summary_lines(failed)
    )


def test_stall_bench_describes_a_stalled_run_and_one_that_ended_at_once() -> None:
    stall = load_bench("stall")
    stalled = stall.Outcome(4, 1004, None, 120.0, 0.78, 0.95, 0.012)
    assert stall.describe(stalled, 1500) == (
        "seed 4 sample 1004: stalled: not reached in 1500 steps (120 s); last 100 steps: "
        "reward 0.780, groups alike 95%, entropy 0.012"
    )
    # A training that took no step has nothing to average: said as nan, not a crash.
    empty = stall.Outcome(0, 1000, None, 0.1, float("nan"), float("nan"), float("nan"))
    assert "reward nan, groups alike nan%" in stall.describe(empty, 0)
    assert stall.describe(stall.Outcome(1, 1001, 437, 30.4, 0.93, 0.6, 0.2), 1500) == (
        "seed 1 sample 1001: reached in 437 steps (30 s)"
    )


def test_ab_sign_test_and_summary(capsys: pytest.CaptureFixture[str]) -> None:
    ab = load_bench("ab")
    assert ab.sign_test_p(4, 4) == 0.125
    assert ab.sign_test_p(0, 4) == 0.125  # as far from even the other way
    assert ab.sign_test_p(2, 4) == 1.0
    assert abs(ab.sign_test_p(6, 6) - 0.03125) < 1e-12
    ab.summarise([], "abc1234")  # every round failed on one side: a line, no crash
    assert capsys.readouterr().out.strip() == "ab this tree/abc1234: no round ran on both sides"
    base = {"wall_s": 0.060, "cpu_s": 0.100, "cpu of trainer": 0.050}
    pairs = [
        (base, {"wall_s": 0.054, "cpu_s": 0.095, "cpu of trainer": 0.045}),
        (base, {"wall_s": 0.057, "cpu_s": 0.105, "cpu of trainer": 0.040}),
    ]
    ab.summarise(pairs, "abc1234")
    out = capsys.readouterr().out
    # The ratio is the median of the rounds' own ratios: (0.9 + 0.95) / 2.
    assert "ab step time this tree/abc1234 0.925x (median of 2 paired rounds; lower in 2 of 2" in out
    assert "ab all processes' CPU this tree/abc1234 1.000x" in out and "lower in 1 of 2" in out
    assert "cpu of trainer" in out and "50.0 ms" in out
    assert "trainer's event loop" not in out  # not measured on either side: not reported
    # --to-target: overhead.py's seeds, one round each; a seed short of the target: no figures.
    got = ab.to_target_figures({"0": [{"jet_s": 20.0, "jet_n": 300}], "1": [{"jet_s": 24.0, "jet_n": 340}]})
    assert got == {
        "seed 0 to target": 20.0,
        "seed 1 to target": 24.0,
        "time_to_target_s": 44.0,
        "per_step_s": 44.0 / 640,
    }
    assert ab.to_target_figures({"0": [{"jet_s": None, "jet_n": 1500}]}) is None
    ab.summarise([(got, {**got, "time_to_target_s": 40.0})], "abc1234")
    out = capsys.readouterr().out
    assert "44.0 s" in out and "40.0 s" in out
    assert "ab time to target, all seeds this tree/abc1234 0.909x" in out


def test_step_time_keeps_the_cpu_of_a_part_s_children_that_ended() -> None:
    """A part's child (a sandbox's program, the recorder's writer) that burns CPU and ends: its
    CPU stays in the part's count once it is reaped, as it was while it ran."""
    step_time = load_bench("step_time")
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    # The part: starts a child that burns 0.3 s of CPU, reaps it, then waits to be read.
    part = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time\nsubprocess.run([sys.executable, '-c', {burn!r}])\n"
            "print('reaped', flush=True)\ntime.sleep(30)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert part.stdout is not None and part.stdout.readline().strip() == "reaped"
        assert step_time.descendants(part.pid) == []  # the child is gone
        own = step_time.cpu_s(part.pid)
        counted = step_time.cpu_of("env-default-modsum-0", part.pid)
        assert own is not None and counted is not None
        assert counted - own >= 0.25  # the child's 0.3 s, at the clock's tick
        assert step_time.cpu_of("supervisor", part.pid) == own  # the supervisor's: its own only
    finally:
        part.kill()
        part.wait()


def test_gil_summary_is_each_setting_against_the_call_alone_in_its_round() -> None:
    gil = load_bench("gil")
    assert gil.summary_lines([], 2) == ["train call: too few rounds to measure (none completed)"]
    rounds = [
        {"alone": 40.0, "busy thread": 64.0, "busy thread, switch 0.2 ms": 52.0, "busy process": 40.0},
        {"alone": 50.0, "busy thread": 90.0, "busy process": 45.0},  # a slower round, one setting short
    ]
    lines = gil.summary_lines(rounds, 2)
    assert lines[0] == "train call alone 45.0 ms (median of 2 rounds)"
    # Ratios within a round, then their median: (1.6 + 1.8) / 2, not 77 / 45.
    assert lines[1].startswith("train call beside a busy thread/alone 1.70x (median of 2 rounds;")
    assert lines[2].startswith(
        "train call beside a busy thread, switch 0.2 ms/alone 1.30x (median of 1 rounds;"
    )
    assert lines[3].startswith("train call beside a busy process/alone 0.95x (median of 2 rounds;")
    assert "this machine has one" in gil.summary_lines(rounds, 1)[3]
