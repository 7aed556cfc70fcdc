"""The recorder over a real log (nats-server fixture) into SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from jetrl.bus import events as ev
from jetrl.bus import subjects
from jetrl.bus.client import Bus
from jetrl.consumers.recorder import Recorder
from jetrl.store import dump, queries
from jetrl.store.db import Store, open_store
from tests.support.synthetic import check_projection, publish_events, synthetic_run


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = open_store(db_url)
    yield s
    s.close()


async def test_recorder_projects_a_synthetic_run_exactly(bus: Bus, run_id: str, store: Store) -> None:
    run = synthetic_run(run_id, steps=20, seed=21)
    assert len(run) > 3000
    await publish_events(bus, run.events)
    rec = Recorder(bus, store, run_id, batch=400)
    try:
        lag = await rec.catch_up(timeout=120)
    finally:
        rec.close()
    assert (lag.events, lag.seconds, lag.recorded_seq) == (0, 0.0, len(run.events))
    assert rec.stats.events == len(run.events)
    with store.read() as conn:
        assert check_projection(conn, run) == []
    assert queries.recorded_seq(store, run_id) == len(run.events)


async def test_lag_counts_what_is_not_recorded_yet(bus: Bus, run_id: str, store: Store) -> None:
    run = synthetic_run(run_id, steps=2, seed=22)
    await publish_events(bus, run.events[:100])
    rec = Recorder(bus, store, run_id, batch=30)
    try:
        await rec.run(until_seq=60)
        lag = await rec.lag()
        assert 60 <= lag.recorded_seq < 100 and lag.head_seq == 100
        assert lag.events == 100 - lag.recorded_seq
        assert lag.seconds > 0.0  # the oldest unrecorded event has been waiting
        await publish_events(bus, run.events[100:])
        lag = await rec.catch_up(timeout=60)
        assert lag.events == 0
    finally:
        rec.close()
    with store.read() as conn:
        assert check_projection(conn, run) == []


async def test_malformed_and_spoofed_events_are_dead_lettered_and_recorded(
    bus: Bus, run_id: str, store: Store
) -> None:
    run = synthetic_run(run_id, steps=4, seed=23)
    half = len(run.events) // 2
    await publish_events(bus, run.events[:half])
    garbage = await bus.js.publish(subjects.step_subject(run_id), b"\x00 not an event \xff")
    # A well-formed event whose envelope tenant is not the subject's tenant.
    spoof = ev.new_event(
        ev.TaskSubmitted(task_id="spoofed-task", env="math", group_size=1, prompt_tokens=[1]),
        run_id=run_id,
        tenant="acme",
    )
    spoofed = await bus.js.publish(
        subjects.task_subject(run_id, "globex", "math"),
        ev.encode_event(spoof),
        headers=ev.event_headers(spoof),
    )
    await publish_events(bus, run.events[half:])
    rec = Recorder(bus, store, run_id, batch=100)
    try:
        await rec.catch_up(timeout=60)
        # Its own dead letters landed after the head it aimed at: record them too.
        lag = await rec.catch_up(timeout=60)
    finally:
        rec.close()
    assert lag.events == 0
    dls = {d.original_seq: d for d in queries.dead_letters(store, run_id)}
    assert set(dls) == {garbage.seq, spoofed.seq}
    assert dls[garbage.seq].reason == "malformed" and dls[garbage.seq].consumer == "recorder"
    assert dls[garbage.seq].original_subject == subjects.step_subject(run_id)
    assert dls[spoofed.seq].reason == "spoofed" and dls[spoofed.seq].original_type == "TaskSubmitted"
    with store.read() as conn:
        # Everything before and after the poison is recorded, and nothing of the spoof.
        assert check_projection(conn, run, dead_letters=2) == []
        tasks = dump.dump_run(conn, run_id)["tasks"]
    assert not any("spoofed-task" in str(t) for t in tasks)


async def test_replay_equals_live_recording(bus: Bus, run_id: str, store: Store) -> None:
    run = synthetic_run(run_id, steps=4, seed=24)
    await publish_events(bus, run.events[:200])
    await bus.js.publish(subjects.policy_subject(run_id), b"garbage")
    await publish_events(bus, run.events[200:])
    rec = Recorder(bus, store, run_id, batch=64)
    try:
        await rec.catch_up(timeout=60)
        await rec.catch_up(timeout=60)
    finally:
        rec.close()
    with store.read() as conn:
        live = dump.dump_run(conn, run_id)
    with store.write() as conn:
        dump.delete_run(conn, run_id)
    again = Recorder(bus, store, run_id, batch=37)
    try:
        assert await again.replay() == live["consumer_offsets"][0][3]
    finally:
        again.close()
    with store.read() as conn:
        rebuilt = dump.dump_run(conn, run_id)
    assert dump.diff(live, rebuilt) == {}
    assert rebuilt == live
