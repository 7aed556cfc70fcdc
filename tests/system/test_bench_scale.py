"""bench/scale_sim.py's arithmetic: the seed run's step on paper, headroom, and the summary lines
on what a slow machine leaves (no rate, no step, no probe). No server is started."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections import Counter
from types import ModuleType
from typing import Any

import pytest

from tests.support.benches import load_bench


@pytest.fixture(scope="module")
def sim() -> ModuleType:
    return load_bench("scale_sim")


@pytest.fixture(scope="module")
def seed_traffic(sim: ModuleType) -> Any:
    return asyncio.run(sim.paper_traffic(sim.SEED))


def test_the_seed_shape_is_the_issue_s_run(sim: ModuleType) -> None:
    s = sim.SEED
    assert (s.rollouts, s.tokens, s.step_s) == (256, 131_072, 300.0)
    assert (s.moe_layers, s.top_k, s.experts) == (75, 8, 256)
    assert s.trace_itemsize == 1  # 256 experts fit uint8 (policy/routing.py)
    assert dataclasses.replace(s, experts=257).trace_itemsize == 2
    # Every token fed forward (all but the last), 75 layers, 8 experts, one byte each.
    assert sim.final_trace_bytes(s) == 131_071 * 75 * 8 == 78_642_600
    assert s.weights_bytes == 1_488_000_000_000  # 744B parameters in bf16


def test_turn_plan_ends_at_the_rollout_length(sim: ModuleType) -> None:
    for shape in (
        sim.SEED,
        dataclasses.replace(sim.SEED, tokens=16_384, prompt=1_024, turns=8),
        sim.Shape(turns=1),
    ):
        plan = sim.turn_plan(shape)
        assert len(plan) == shape.turns
        assert plan[0].history == shape.prompt
        assert plan[-1].reply == 0
        assert plan[-1].history + plan[-1].completion == shape.tokens
        for a, b in itertools.pairwise(plan):
            assert b.history == a.history + a.completion + a.reply
        assert all(t.completion >= 1 for t in plan)


def test_bad_shapes_are_refused(sim: ModuleType) -> None:
    for bad in (
        sim.Shape(rollouts=10, group_size=4),  # not whole groups
        sim.Shape(tokens=100, prompt=90, turns=32),
        sim.Shape(turns=0),
        sim.Shape(step_s=0.0),
    ):
        with pytest.raises(ValueError):
            bad.check()


def test_seed_events_per_step_and_per_second(sim: ModuleType, seed_traffic: Any) -> None:
    s = sim.SEED
    e = seed_traffic.events
    # A group's first turn is one task; every later turn is one task per sample.
    assert e["task"] == s.groups + s.rollouts * (s.turns - 1) == 7_968
    # One CompletionsGenerated a task (a first turn's G samples together): 8,192 samples in all.
    assert e["generation"] == e["task"] == 7_968
    # One RolloutsScored an episode (a multi-turn environment's rollouts end on their own).
    assert e["rollout"] == s.rollouts == 256
    assert (e["step"], e["policy"], e["weights"]) == (1, 1, 1)
    assert e["worker"] == s.heartbeats + s.inference_workers == 16 * 150 + 16
    r = sim.required(s, seed_traffic)
    assert r.events["generation"] == pytest.approx(7_968 / 300)
    assert r.events_total == pytest.approx(sum(e.values()) / 300)


def test_seed_payload_bytes(sim: ModuleType, seed_traffic: Any) -> None:
    s = sim.SEED
    plan = sim.turn_plan(s)
    # Every turn's generation carries the trace of the whole conversation so far.
    per_rollout = sum(sim.trace_bytes(s, t.history + t.completion - 1) for t in plan)
    assert seed_traffic.put["trace"] == s.rollouts * per_rollout
    assert seed_traffic.put["trace"] > 16 * s.rollouts * sim.final_trace_bytes(s)
    assert seed_traffic.put["weights"] == s.weights_bytes
    assert seed_traffic.get["weights"] == s.weights_bytes * s.inference_workers
    # The trainer reads each rollout's last trace plus its episode arrays (int32 tokens,
    # float32 logprobs, uint8 mask, the int32 first prompt).
    episode = (s.tokens - s.prompt) * (4 + 4 + 1) + s.prompt * 4
    assert seed_traffic.get["trainer"] == s.rollouts * (sim.final_trace_bytes(s) + episode)
    # A later turn's task carries the episode inline: the largest grows with the history.
    assert seed_traffic.largest["task"] > 2 * 1024 * 1024
    assert seed_traffic.log_bytes["task"] > 100 * seed_traffic.log_bytes["generation"] / 2


def test_rates_over_no_time_are_zero(sim: ModuleType) -> None:
    t = sim.Traffic(events=Counter(task=5), put=Counter(trace=10))
    r = sim.rates(t, 0.0)
    assert r.events == {"task": 0.0} and r.put_total == 0.0
    assert sim.rates(t, 2.0).events["task"] == 2.5


def test_headroom(sim: ModuleType) -> None:
    assert sim.headroom(10.0, 5.0) == 2.0
    assert sim.headroom(0.0, 5.0) == 0.0
    assert sim.headroom(-1.0, 5.0) == 0.0
    assert sim.headroom(None, 5.0) is None
    assert sim.headroom(3.0, 0.0) is None


def test_headroom_lines(sim: ModuleType) -> None:
    assert sim.headroom_line("events", 123.0, 10.0) == "scale headroom events 12.3x seed (target >= 1x)"
    assert (
        sim.headroom_line("trace bytes", 4.0, 10.0) == "scale headroom trace bytes 0.4x seed (target >= 1x)"
    )
    assert sim.headroom_line("x", 5000.0, 1.0) == "scale headroom x 5,000x seed (target >= 1x)"
    assert "too slow to measure" in sim.headroom_line("events", 0.0, 10.0)
    assert "not measured (no server)" in sim.headroom_line("events", None, 10.0, "no server")
    assert "not needed" in sim.headroom_line("events", 3.0, 0.0)


def test_first_to_saturate(sim: ModuleType) -> None:
    assert sim.first_to_saturate({}) == "scale first to saturate: not measured (no path was measured)"
    assert "not measured" in sim.first_to_saturate({"payload put": None})
    line = sim.first_to_saturate({"the log's event rate": 85.0, "payload put": None, "weights": None})
    assert (
        line
        == "scale first to saturate: the log's event rate (85.0x seed; not measured: payload put, weights)"
    )
    line = sim.first_to_saturate({"the log's event rate": 200.0, "payload put": 0.04, "payload get": None})
    assert line == (
        "scale first to saturate: payload put (0.04x seed, then the log's event rate (200x seed);"
        " not measured: payload get)"
    )
    line = sim.first_to_saturate({"payload get": 0.0}, cpu="client 98% of a core")
    assert line == "scale first to saturate: payload get (0x seed; CPU-bound: client 98% of a core)"


def test_shared_headroom(sim: ModuleType) -> None:
    # One put of 10 B/s at 100 B/s, gets of 40 B/s at 100 B/s: busy half the time.
    assert sim.shared_headroom([(10.0, 100.0), (40.0, 100.0)]) == pytest.approx(2.0)
    assert sim.shared_headroom([(10.0, 100.0), (40.0, 0.0)]) == 0.0
    assert sim.shared_headroom([(10.0, None)]) is None
    assert sim.shared_headroom([(0.0, 5.0)]) is None


def test_cpu_bound(sim: ModuleType) -> None:
    assert sim.Cpu(client=0.5, server=0.2).bound(2) == ""
    assert sim.Cpu(client=0.95, server=None).bound(2).startswith("client 95% of a core")
    assert "nats-server 100%" in sim.Cpu(client=0.85, server=1.0).bound(2)
    assert sim.server_cpu_s(None) is None
    assert sim.server_cpu_s(2**30) is None  # no such process


def test_summary_without_a_step_or_probes(sim: ModuleType, seed_traffic: Any) -> None:
    seed = sim.required(sim.SEED, seed_traffic)
    lines = sim.summary("objstore", None, {}, seed, "no server")
    assert all(line.startswith("scale ") for line in lines)
    assert sum("not measured (no server)" in line for line in lines) == 6
    assert sum("alone: not measured" in line for line in lines) == 4
    assert lines[-1] == "scale first to saturate (objstore): not measured (no path was measured)"


def test_summary_of_a_step_that_moved_nothing(sim: ModuleType, seed_traffic: Any) -> None:
    seed = sim.required(sim.SEED, seed_traffic)
    run = sim.StepRun(sim.Traffic(), 0.0, False, Counter(), None, "past its 60 s budget")
    probes = {"log publish": sim.Probe(0, 0.0), "log consume": sim.Probe(0, 6.0), "put": sim.Probe(0, 6.0)}
    lines = sim.summary("file", run, probes, seed)
    assert "scale headroom events (file): too slow to measure (past its 60 s budget)" in lines[0]
    # A tie keeps the paths' order.
    assert lines[-1] == (
        "scale first to saturate (file): the log's event rate (0x seed, then payload put (0x seed);"
        " not measured: payload get)"
    )


def test_summary_names_the_lowest_path(sim: ModuleType, seed_traffic: Any) -> None:
    seed = sim.required(sim.SEED, seed_traffic)
    t = sim.Traffic(events=Counter(generation=600), put=Counter(trace=10**9), get=Counter(trainer=10**8))
    run = sim.StepRun(t, 10.0, True, Counter(), sim.Cpu(client=0.3, server=0.1))
    probes = {
        "log publish": sim.Probe(100_000, 10.0),
        "log consume": sim.Probe(50_000, 10.0),
        "put": sim.Probe(2e9, 10.0),
        "get": sim.Probe(1e8, 10.0),
    }
    lines = sim.summary("objstore", run, probes, seed)
    events = 60.0 / seed.events_total
    assert lines[0] == f"scale headroom events (objstore) {sim.fmt_x(events)} seed (target >= 1x)"
    assert f"alone: {sim.fmt_x(5_000 / seed.events_total)} seed" in lines[6]
    weights = 1 / (seed.put["weights"] / 2e8 + seed.get["weights"] / 1e7)
    get = 1e7 / seed.get_arrays
    assert lines[-1] == (
        f"scale first to saturate (objstore): weights ({sim.fmt_x(weights)} seed,"
        f" then payload get ({sim.fmt_x(get)} seed))"
    )
    assert seed.get_arrays == pytest.approx(seed.get["trainer"] + seed.get["scorer"])
