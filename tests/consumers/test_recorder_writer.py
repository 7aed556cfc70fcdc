"""Where the recorder's transactions run (consumers/recorder/writer.py): a writer process
records exactly what the recorder records in its own process, and a tracking row found behind
what was committed stops the recorder instead of leaving a gap."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from jetrl.bus import subjects
from jetrl.bus.client import Bus
from jetrl.consumers.recorder import Recorder
from jetrl.consumers.recorder.writer import ProcessWriter, WriterKind, WriterProcessError
from jetrl.store import dump
from jetrl.store import schema as sc
from jetrl.store.db import Store, open_store
from jetrl.store.projection import TrackingRowBehind
from tests.support.synthetic import check_projection, publish_events, synthetic_run


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = open_store(db_url)
    yield s
    s.close()


async def test_a_writer_process_records_what_the_recorder_records_itself(
    bus: Bus, run_id: str, store: Store
) -> None:
    run = synthetic_run(run_id, steps=6, seed=41)
    await publish_events(bus, run.events[:300])
    await bus.js.publish(subjects.policy_subject(run_id), b"garbage")  # dead-lettered, recorded
    await publish_events(bus, run.events[300:])
    tables = {}
    for name in ("process", "process folding", "inline"):
        kind: WriterKind = "inline" if name == "inline" else "process"
        # The same durable: its dead letter has the same id, which the log stores once.
        rec = Recorder(bus, store, run_id, batch=128, writer=kind)
        if name == "process folding":  # every batch folded here and sent as rows
            assert isinstance(rec.writer, ProcessWriter)
            rec.writer.fold_above_bytes = 0
        try:
            await rec.catch_up(timeout=120)
            lag = await rec.catch_up(timeout=120)  # the DeadLettered event the first pass made
        finally:
            rec.close()
        assert lag.events == 0
        with store.read() as conn:
            assert check_projection(conn, run, dead_letters=1) == []
            tables[name] = dump.dump_run(conn, run_id, offsets=False)
        with store.write() as conn:
            dump.delete_run(conn, run_id)
    assert tables["process"] == tables["inline"]
    assert tables["process folding"] == tables["inline"]


@pytest.mark.parametrize("kind", ["process", "inline"])
async def test_a_tracking_row_behind_the_commits_stops_the_recorder(
    bus: Bus, run_id: str, store: Store, kind: WriterKind
) -> None:
    run = synthetic_run(run_id, steps=12, seed=42)
    third = len(run.events) // 3
    assert third > 150
    await publish_events(bus, run.events[:third])
    rec = Recorder(bus, store, run_id, batch=100, writer=kind, fetch_timeout=0.1)
    try:
        task = asyncio.create_task(rec.run())
        while rec.recorded_seq < third:
            assert not task.done(), task
            await asyncio.sleep(0.02)
        # As if the last commits were lost (a database crash with asynchronous commits).
        with store.write() as conn:
            conn.execute(sa.update(sc.OFFSETS).values(last_seq=third - 150))
        await publish_events(bus, run.events[third:])
        with pytest.raises(TrackingRowBehind):
            await asyncio.wait_for(task, 60)
        # Started again, it resumes from the row and reads the lost part again.
        await rec.catch_up(timeout=120)
    finally:
        rec.close()
    with store.read() as conn:
        assert check_projection(conn, run) == []


async def test_a_dead_writer_process_stops_the_recorder(bus: Bus, run_id: str, store: Store) -> None:
    run = synthetic_run(run_id, steps=2, seed=43)
    await publish_events(bus, run.events)
    rec = Recorder(bus, store, run_id, batch=50, writer="process")
    try:
        await rec.start()
        writer = rec.writer
        assert isinstance(writer, ProcessWriter) and writer.pid is not None
        os.kill(writer.pid, signal.SIGKILL)
        with pytest.raises(WriterProcessError):
            await rec.catch_up(timeout=60)
    finally:
        rec.close()
    # A new recorder (a restart) records everything from the tracking row.
    again = Recorder(bus, store, run_id, batch=50, writer="process")
    try:
        await again.catch_up(timeout=120)
        child = again.writer.pid if isinstance(again.writer, ProcessWriter) else None
    finally:
        again.close()
    assert child is not None
    with pytest.raises(ProcessLookupError):  # close() ended the child (and reaped it)
        os.kill(child, 0)
    with store.read() as conn:
        assert check_projection(conn, run) == []
