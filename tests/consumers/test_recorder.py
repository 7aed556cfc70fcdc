"""The recorder over a real log (nats-server fixture) into SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator

import pytest
from nats.aio.msg import Msg

from jetrl.bus import events as ev
from jetrl.bus import subjects
from jetrl.bus.client import Bus
from jetrl.bus.server import EmbeddedServer
from jetrl.bus.streams import stream_name
from jetrl.consumers.recorder import DEFAULT_DURABLE, Recorder
from jetrl.store import dump, queries
from jetrl.store.db import Store, open_store
from tests.support.synthetic import check_projection, publish_events, synthetic_run


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = open_store(db_url)
    yield s
    s.close()


async def test_recorder_projects_a_synthetic_run_exactly(bus: Bus, run_id: str, store: Store) -> None:
    run = synthetic_run(run_id, steps=75, seed=21)
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
    # Every committed batch was acked (AckPolicy.ALL, its last message): the server ends with
    # nothing pending and its ack floor at the head.
    deadline = time.monotonic() + 10
    while True:
        info = await bus.js.consumer_info(stream_name(run_id), DEFAULT_DURABLE)
        assert info.ack_floor is not None
        if info.num_ack_pending == 0 and info.ack_floor.stream_seq == len(run.events):
            break
        assert time.monotonic() < deadline, f"acks missing: {info.num_ack_pending} pending, {info.ack_floor}"
        await asyncio.sleep(0.02)


async def test_lag_counts_what_is_not_recorded_yet(bus: Bus, run_id: str, store: Store) -> None:
    run = synthetic_run(run_id, steps=5, seed=22)
    assert len(run) > 100
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
    run = synthetic_run(run_id, steps=6, seed=24)
    assert len(run) > 200
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


# ------------------------------------------------------------------ gaps in what is delivered


class Thief:
    """A second client of the recorder's durable consumer: it asks for messages with one pull
    request of its own and never acks them, so the recorder is never delivered them (as with
    messages delivered over a connection that died)."""

    def __init__(self, bus: Bus, run_id: str, durable: str = DEFAULT_DURABLE) -> None:
        self.bus = bus
        self.next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream_name(run_id)}.{durable}"
        self.got: asyncio.Queue[Msg] = asyncio.Queue()

    async def ask(self, n: int, expires_s: float = 60.0) -> None:
        """Queue a pull request for ``n`` messages at the server (before what it takes is published)."""
        inbox = self.bus.nc.new_inbox()

        async def on_msg(msg: Msg) -> None:
            if msg.data:  # not a status (heartbeat, request expired)
                self.got.put_nowait(msg)

        await self.bus.nc.subscribe(inbox, cb=on_msg)
        req = {"batch": n, "expires": int(expires_s * 1e9)}
        await self.bus.nc.publish(self.next_subject, json.dumps(req).encode(), reply=inbox)
        await self.bus.nc.flush()

    async def taken(self, n: int, timeout: float = 30.0) -> list[int]:
        """The stream sequences of the first ``n`` messages it was delivered."""
        msgs = [await asyncio.wait_for(self.got.get(), timeout) for _ in range(n)]
        return [m.metadata.sequence.stream for m in msgs]


async def until(what: str, cond: Callable[[], bool], task: asyncio.Task[None], timeout: float = 60.0) -> None:
    """Poll ``cond`` until it holds; the recorder's task ending first raises what ended it."""
    deadline = time.monotonic() + timeout
    while not cond():
        if task.done():
            await task
            raise AssertionError(f"the recorder stopped before {what}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def stop_recorder(rec: Recorder, task: asyncio.Task[None]) -> None:
    rec.stop()
    try:
        await asyncio.wait_for(task, 30)
    finally:
        rec.close()


async def test_a_gap_in_what_is_delivered_is_never_committed_past(
    nats_server: EmbeddedServer, bus: Bus, run_id: str, store: Store
) -> None:
    run = synthetic_run(run_id, steps=6, seed=25)
    head = len(run.events)
    first, second = 150, 450
    await publish_events(bus, run.events[:first])
    rec = Recorder(bus, store, run_id, batch=20)
    task = asyncio.create_task(rec.run())
    other = await Bus.connect(nats_server.url, name="thief")
    try:
        await until("the first events are recorded", lambda: rec.recorded_seq >= first, task)
        # While the recorder runs, another client of its durable takes 5 of the next events.
        thief = Thief(other, run_id)
        await thief.ask(5)
        await publish_events(bus, run.events[first:second])
        stolen = await thief.taken(5)
        assert all(first < s <= second for s in stolen), stolen
        await publish_events(bus, run.events[second:])
        await until("the head is recorded", lambda: rec.recorded_seq >= head, task)
    finally:
        await stop_recorder(rec, task)
        await other.close()
    # The store equals the log: the tracking row at the head, every event applied once (the
    # stolen ones too, after the re-position), none twice.
    assert queries.recorded_seq(store, run_id) == head
    assert rec.stats.events == head, f"{head - rec.stats.events} events never recorded (stolen: {stolen})"
    with store.read() as conn:
        assert check_projection(conn, run) == []
    assert rec.stats.repositions >= 1


async def test_events_lost_at_the_head_are_read_again_after_a_stall(
    nats_server: EmbeddedServer, bus: Bus, run_id: str, store: Store
) -> None:
    run = synthetic_run(run_id, steps=2, seed=26)
    await publish_events(bus, run.events)
    head = len(run.events)
    # A long lingering fetch: the recorder's request, waiting at the server, is served first.
    # The server would redeliver what the thief took only after ack_wait: not within the test.
    rec = Recorder(bus, store, run_id, batch=50, fetch_timeout=2.0, ack_wait=600.0, stall_s=0.5)
    task = asyncio.create_task(rec.run())
    other = await Bus.connect(nats_server.url, name="thief")
    garbage = 0
    try:
        await until("the run is recorded", lambda: rec.recorded_seq >= head, task)
        thief = Thief(other, run_id)
        await thief.ask(1)
        # One message at a time until the thief has taken one (the recorder's request waiting
        # before the thief's takes the first): then nothing comes after what the recorder lost.
        # Garbage, so that each is a dead letter in the end, whoever was delivered it first
        # (the thief may take the recorder's dead letter of one, the last in the log too).
        while thief.got.empty():
            assert garbage < 10, "the thief was never delivered a message"
            await bus.js.publish(subjects.step_subject(run_id), b"\x00 garbage %d" % garbage)
            garbage += 1
            deadline = time.monotonic() + 10
            while thief.got.empty() and rec.stats.dead_lettered < garbage:
                assert time.monotonic() < deadline, "nobody was delivered the garbage"
                await asyncio.sleep(0.01)
        [stolen] = await thief.taken(1)
        assert stolen > head and rec.recorded_seq < stolen
        # The recorder's own dead letters follow the garbage: the head is where they all are.
        await until(
            "every garbage message is dead-lettered and recorded",
            lambda: len(queries.dead_letters(store, run_id)) == garbage,
            task,
        )
        await until("the head is recorded", lambda: rec.recorded_seq >= head + 2 * garbage, task)
    finally:
        await stop_recorder(rec, task)
        await other.close()
    assert await bus.last_seq(run_id) == head + 2 * garbage
    # Every event applied once: the run's and the dead letters, the one stolen among them.
    assert rec.stats.events == head + garbage
    assert rec.stats.repositions >= 1
    with store.read() as conn:
        assert check_projection(conn, run, dead_letters=garbage) == []


async def test_a_message_deleted_from_the_log_is_not_a_gap(bus: Bus, run_id: str, store: Store) -> None:
    run = synthetic_run(run_id, steps=2, seed=27)
    half = len(run.events) // 2
    doomed = [await bus.js.publish(subjects.step_subject(run_id), b"deleted")]  # the log's first
    await publish_events(bus, run.events[:half])
    doomed.append(await bus.js.publish(subjects.step_subject(run_id), b"deleted"))
    await publish_events(bus, run.events[half:])
    for ack in doomed:
        await bus.js.delete_msg(stream_name(run_id), ack.seq)
    rec = Recorder(bus, store, run_id, batch=50)
    try:
        lag = await rec.catch_up(timeout=60)
    finally:
        rec.close()
    # Recorded to the head, past both holes, without re-positioning over them again and again.
    assert (lag.events, lag.recorded_seq) == (0, len(run.events) + 2)
    assert rec.stats.repositions == 0 and rec.stats.events == len(run.events)
    with store.read() as conn:
        assert check_projection(conn, run) == []
