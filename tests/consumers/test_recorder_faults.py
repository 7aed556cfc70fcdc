"""The recorder as a real process (``python -m jetrl.consumers.recorder``): killed with SIGKILL
at random points and restarted, it ends with exactly the tables of an uninterrupted pass;
SIGTERM stops it cleanly after the batch in progress."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jetrl.bus import subjects
from jetrl.bus.client import Bus
from jetrl.bus.server import EmbeddedServer
from jetrl.consumers.recorder import Recorder
from jetrl.store import dump, queries
from jetrl.store.db import Store, open_store
from tests.support.synthetic import SyntheticRun, check_projection, publish_events, synthetic_run

pytestmark = [pytest.mark.fault, pytest.mark.slow]


def start_recorder(
    nats: EmbeddedServer, run_id: str, db_url: str, log: Path, batch: int
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "JETRL_LOG_JSON": "1"}
    cmd = [
        sys.executable,
        "-m",
        "jetrl.consumers.recorder",
        "--nats-url",
        nats.url,
        "--run",
        run_id,
        "--settings",
        json.dumps({"db": db_url, "batch": batch}),
    ]
    with log.open("ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)


def tail_of(log: Path, n: int = 3000) -> str:
    return log.read_text()[-n:]


async def wait_recorded(
    store: Store, run_id: str, at_least: int, proc: subprocess.Popen[bytes], log: Path
) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        seq = queries.recorded_seq(store, run_id)
        if seq >= at_least:
            return seq
        assert proc.poll() is None, f"recorder exited with {proc.returncode}:\n{tail_of(log)}"
        await asyncio.sleep(0.005)
    raise AssertionError(f"recorder stuck below seq {at_least}:\n{tail_of(log)}")


async def settled_seq(store: Store, run_id: str) -> int:
    """The recorded sequence once it has stopped moving (an orphaned writer has committed)."""
    last, still = -1, 0
    for _ in range(200):
        seq = queries.recorded_seq(store, run_id)
        still = still + 1 if seq == last else 0
        if still >= 3:
            return seq
        last = seq
        await asyncio.sleep(0.1)
    return last


async def publish_run_with_poison(bus: Bus, run_id: str, seed: int) -> tuple[SyntheticRun, int]:
    run = synthetic_run(run_id, steps=20, seed=seed)
    third = len(run.events) // 3
    await publish_events(bus, run.events[:third])
    await bus.js.publish(subjects.rollout_subject(run_id, "acme", "math"), b"\x93garbage")
    await publish_events(bus, run.events[third:])
    return run, len(run.events) + 1


async def test_sigkill_at_random_points_leaves_the_same_tables(
    nats_server: EmbeddedServer, bus: Bus, run_id: str, db_url: str, tmp_path: Path
) -> None:
    run, published = await publish_run_with_poison(bus, run_id, seed=31)
    store = open_store(db_url)
    try:
        # The uninterrupted pass (in-process). It dead-letters the poison, whose DeadLettered
        # event it then records as well.
        rec = Recorder(bus, store, run_id, batch=20)
        try:
            await rec.catch_up(timeout=120)
            lag = await rec.catch_up(timeout=120)
        finally:
            rec.close()
        head = lag.head_seq
        assert head == published + 1 and lag.events == 0
        with store.read() as conn:
            reference = dump.dump_run(conn, run_id)
            assert check_projection(conn, run, dead_letters=1) == []
        with store.write() as conn:
            dump.delete_run(conn, run_id)

        # The same log again, by a process killed at random points.
        rng = random.Random(run_id)
        log = tmp_path / "recorder.log"
        kills = sorted(rng.sample(range(1, head // 2), 4))
        reached = 0
        for target in kills:
            # Past what the previous process committed: otherwise two close kill points can
            # kill a process before its first commit, and the test would see one resume twice.
            target = max(target, reached + 1)
            proc = start_recorder(nats_server, run_id, db_url, log, batch=20)
            reached = await wait_recorded(store, run_id, target, proc, log)
            await asyncio.sleep(rng.uniform(0, 0.03))  # anywhere: mid-fetch, mid-commit, mid-ack
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            assert reached >= target
            # Its writer finishes the transaction in hand after the kill (consumers/recorder/
            # writer.py): the next process must commit past that to be killed at a new point.
            reached = await settled_seq(store, run_id)
        starts = tail_of(log, 10**7).count('"recorder_started"')
        proc = start_recorder(nats_server, run_id, db_url, log, batch=20)
        await wait_recorded(store, run_id, head, proc, log)
        # The last killed process may already have reached the head: wait until this one is up
        # (its signal handlers installed) before asking it to stop.
        deadline = time.monotonic() + 60
        while tail_of(log, 10**7).count('"recorder_started"') == starts and time.monotonic() < deadline:
            assert proc.poll() is None, tail_of(log)
            await asyncio.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, tail_of(log)
        assert await bus.last_seq(run_id) == head  # the poison was not dead-lettered twice
        # The kills landed mid-log: the restarts resumed from several different points.
        resumes = {int(m) for m in re.findall(r'"resume_from": (\d+)', tail_of(log, 10**7))}
        assert len(resumes - {1}) >= 3, resumes
        with store.read() as conn:
            after = dump.dump_run(conn, run_id)
    finally:
        store.close()
    assert dump.diff(reference, after) == {}
    assert after == reference


async def test_sigterm_stops_after_the_current_batch(
    nats_server: EmbeddedServer, bus: Bus, run_id: str, db_url: str, tmp_path: Path
) -> None:
    run = synthetic_run(run_id, steps=10, seed=32)
    await publish_events(bus, run.events)
    store = open_store(db_url)
    log = tmp_path / "recorder.log"
    try:
        proc = start_recorder(nats_server, run_id, db_url, log, batch=10)
        await wait_recorded(store, run_id, 50, proc, log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, tail_of(log)
        stopped_at = queries.recorded_seq(store, run_id)
        assert '"event": "recorder_stopped"' in tail_of(log)
        # Whatever it stopped at, a restart finishes the job exactly.
        rec = Recorder(bus, store, run_id, batch=100)
        try:
            await rec.catch_up(timeout=60)
        finally:
            rec.close()
        assert rec.stats.events == len(run.events) - stopped_at
        with store.read() as conn:
            assert check_projection(conn, run) == []
    finally:
        store.close()
