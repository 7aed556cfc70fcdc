"""The monitor on a real nats-server: it folds the log as the fold of its events says, skips
and counts what is not an event, starts at a step or a time, and publishes each alert once."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from jetrl.bus import events as ev
from jetrl.bus import subjects
from jetrl.bus.client import Bus
from jetrl.consumers.monitor.alerts import conditions
from jetrl.consumers.monitor.reader import Start, follow
from jetrl.consumers.monitor.series import FOLDED, STEP_EVENTS, MonitorState, StepPoint
from jetrl.consumers.monitor.service import Monitor
from jetrl.consumers.monitor.settings import AlertSettings, MonitorSettings
from jetrl.store import readmodel as rec
from tests.support.synthetic import log_items, publish_events, synthetic_run


def _fold(events: list[ev.Event], run_id: str, first_seq: int = 1) -> MonitorState:
    state = MonitorState(run_id)
    for item in log_items(events, first_seq):
        r = rec.fact_of(item.seq, item.subject, item.event)
        if r is not None:
            state.apply(r)
    return state


def with_rollout_seqs(events: list[ev.Event]) -> list[ev.Event]:
    """The synthetic steps with the log positions of their rollouts, as the trainer records."""
    seq_of = {
        r.rollout_id: i + 1
        for i, e in enumerate(events)
        if isinstance(e.body, ev.RolloutsScored)
        for r in e.body.rollouts
    }
    out = []
    for e in events:
        if isinstance(e.body, ev.StepCompleted):
            body = msgspec.structs.replace(e.body, rollout_seqs=[seq_of[r] for r in e.body.rollout_ids])
            e = msgspec.structs.replace(e, body=body)
        out.append(e)
    return out


async def test_follow_folds_the_log_and_counts_what_is_not_an_event(bus: Bus, run_id: str) -> None:
    events = with_rollout_seqs(synthetic_run(run_id, steps=6, tasks_per_step=3, group_size=4).events)
    await publish_events(bus, events)
    await bus.js.publish(subjects.step_subject(run_id), b"not an event")
    state = MonitorState(run_id)
    await follow(bus, state, to_head=True)
    expected = _fold(events, run_id)
    assert state.undecodable == 1
    assert [p.as_json() for p in state.steps] == [p.as_json() for p in expected.steps]
    assert state.finished is not None

    # From a step: the series starts there, with the same figures.
    later = MonitorState(run_id)
    await follow(bus, later, start=Start(step=4), to_head=True)
    assert [p.step for p in later.steps] == [4, 5, 6]

    # Every figure but the backlog, which the reader counts from where it started.
    def figures(p: StepPoint) -> dict[str, float]:
        return {k: v for k, v in p.as_json().items() if not k.startswith("queue/")}

    assert [figures(p) for p in later.steps] == [figures(p) for p in state.steps if p.step >= 4]


async def test_a_fold_of_the_steps_alone_passes_the_rollouts_over_and_alerts_alike(
    bus: Bus, run_id: str
) -> None:
    """The alerts-only monitor part's fold: the tasks, generations and rollouts are passed over
    undecoded (a garbled rollout event is no undecodable message to it), and its steps' rewards
    are the trainer's, so every rule comes to the same verdict as on the whole fold."""
    events = with_rollout_seqs(synthetic_run(run_id, steps=8, tasks_per_step=3, group_size=4).events)
    await publish_events(bus, events)
    garbled = {ev.HEADER_TYPE: "RolloutsScored"}
    await bus.js.publish(subjects.rollout_subject(run_id, "local", "env"), b"garbled", headers=garbled)
    whole, steps = MonitorState(run_id), MonitorState(run_id, rollouts=False)
    await follow(bus, whole, to_head=True)
    await follow(bus, steps, to_head=True, types=STEP_EVENTS)
    assert (whole.undecodable, steps.undecodable) == (1, 0)
    assert steps.events == sum(1 for e in events if e.type in STEP_EVENTS) < whole.events / 2
    assert [p.step for p in steps.steps] == [p.step for p in whole.steps]
    rewards = [p.reward_mean for p in whole.steps]
    assert len(set(rewards)) > 1
    assert [p.reward_mean for p in steps.steps] == pytest.approx(rewards, abs=1e-6)
    # A reward window of 2 and a drop of a hundredth: the collapse rule reads the rewards.
    rules = AlertSettings(reward_window=2, reward_drop=0.01, trainer_stall_s=1.0)
    now = whole.last_t + 5.0

    def verdicts(state: MonitorState) -> list[tuple[str, str, bool, float]]:
        return [(c.rule, c.key, c.holds, round(c.value, 5)) for c in conditions(state, rules, now)]

    assert ("reward_collapse", "run", True) in [v[:3] for v in verdicts(whole)]
    assert verdicts(steps) == verdicts(whole)


async def test_follow_from_a_time(bus: Bus, run_id: str) -> None:
    first = synthetic_run(run_id, steps=2, tasks_per_step=2, group_size=2)
    await publish_events(bus, first.events[:10])
    await asyncio.sleep(1.2)
    cut = time.time()
    await asyncio.sleep(0.2)
    await publish_events(bus, first.events[10:])
    state = MonitorState(run_id)
    await follow(bus, state, start=Start(time=cut), to_head=True)
    folded = [rec.fact_of(0, subjects.subject_for(e), e) for e in first.events[10:]]
    assert state.events == sum(1 for f in folded if isinstance(f, FOLDED))


async def test_alerts_are_published_once_by_two_monitors(bus: Bus, run_id: str) -> None:
    now = time.time()
    await bus.publish(ev.new_event(ev.RunStarted(config={}, code_version="t"), run_id=run_id, time=now - 600))
    await bus.publish(
        ev.new_event(
            ev.StepCompleted(step=0, policy_version=1, rollout_ids=[], metrics={"mismatch_kl": 0.5}),
            run_id=run_id,
            time=now - 500,
        )
    )
    settings = MonitorSettings(rules=AlertSettings(trainer_stall_s=60, mismatch_kl=0.05))
    for _ in range(2):
        m = Monitor(run_id, bus=bus, settings=settings, publish_alerts=True)
        stop = asyncio.Event()
        task = asyncio.create_task(m.run(stop))
        await asyncio.wait_for(m.caught_up.wait(), 10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not m.state.firing() >= {
            ("trainer_stalled", "trainer"),
            ("mismatch_kl", "trainer"),
        }:
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.5)  # its publishes land, and fold back in
        stop.set()
        await task
        assert m.state.alert_counts == {"mismatch_kl": 1, "trainer_stalled": 1}
    alerts = [
        i.event.body
        for i in await bus.read_log(run_id, filter_subject=subjects.alert_subject(run_id))
        if i.event is not None
    ]
    assert sorted((a.rule, a.state) for a in alerts if isinstance(a, ev.AlertRaised)) == [
        ("mismatch_kl", "firing"),
        ("trainer_stalled", "firing"),
    ]
