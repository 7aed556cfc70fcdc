"""A run on a 3-node JetStream cluster survives losing nodes: the run stream's leader is
SIGKILLed mid-run and later restarted, then another node is killed and left dead, and the run
completes on 2 of 3 with its invariants intact and `replay --verify` passing.

How long publishing paused after each kill is measured by a probe: a publisher sending to its
own 3-replica stream every 50 ms, whose leader is moved to the node about to be killed so that it
goes through the same election as the run's stream. Measurements are printed (``-s``) and
written to ``cluster_faults.txt`` in the test's directory; they are not asserted."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import nats.js.api as api
import pytest

from jetrl.bus import events as ev
from jetrl.bus.client import Bus
from jetrl.bus.retry import retrying
from jetrl.bus.streams import payload_bucket, stream_name
from jetrl.deploy.config import load_config
from jetrl.deploy.replay_cmd import replay
from jetrl.deploy.supervisor import Supervisor
from jetrl.store import queries
from jetrl.store.db import open_store
from tests.support.cluster import LoopbackCluster
from tests.support.invariants import assert_run_invariants
from tests.support.runlog import bodies, read_log
from tests.system.test_faults import FAST_REDELIVERY

pytestmark = [pytest.mark.slow, pytest.mark.fault]

# Long enough that the run outlasts both kills and the restart between them on a fast machine
# (45 once ended before the second kill).
STEPS = 90
PROBE = "PROBE"
PROBE_EVERY_S = 0.05


@dataclass
class Probe:
    """Publishes one message every 50 ms to a 3-replica stream, each under its own message id
    and re-sent under that id until acked; ``acks`` are the monotonic times of the acks."""

    bus: Bus
    acks: list[float] = field(default_factory=list)
    sent: int = 0
    retries: int = 0
    duplicates: int = 0  # retries the stream had stored already (their first attempt timed out)
    task: asyncio.Task[None] | None = None
    stopping: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    async def start(cls, url: str) -> Probe:
        bus = await Bus.connect(url, name="probe", request_timeout=2.0)
        config = api.StreamConfig(
            name=PROBE,
            subjects=["probe.>"],
            storage=api.StorageType.FILE,
            num_replicas=3,
            max_bytes=16 * 1024**2,
            duplicate_window=120.0,
        )
        # A new cluster on a busy machine may take longer than the probe's 2 s request timeout
        # to place a 3-replica stream; creating it again with the same config is idempotent.
        await retrying("create the probe stream", lambda: bus.js.add_stream(config))
        probe = cls(bus)
        probe.task = asyncio.create_task(probe.run())
        return probe

    async def run(self) -> None:
        while not self.stopping.is_set():
            msg_id = f"probe-{self.sent}"
            first = True
            while True:
                try:
                    ack = await self.bus.js.publish(
                        "probe.tick", b"x", timeout=1.0, headers={"Nats-Msg-Id": msg_id}
                    )
                except Exception:  # no leader, reconnecting, no ack in time: the same id again
                    first = False
                    self.retries += 1
                    await asyncio.sleep(PROBE_EVERY_S)
                    continue
                self.duplicates += int(bool(ack.duplicate) and not first)
                break
            self.acks.append(time.monotonic())
            self.sent += 1
            await asyncio.sleep(PROBE_EVERY_S)

    def pause_after(self, t_kill: float, window: float = 30.0) -> float:
        """The longest wait between two acks that begins at most a second before ``t_kill``
        and within ``window`` after it: how long publishing stopped."""
        pairs = itertools.pairwise(self.acks)
        return max((b - a for a, b in pairs if t_kill - 1.0 <= a < t_kill + window), default=float("nan"))

    async def stop(self) -> int:
        """Stop; the number of messages the probe stream holds."""
        assert self.task is not None
        self.stopping.set()  # the publish in flight ends first, so that every stored one is counted
        try:
            await asyncio.wait_for(self.task, 30)
        finally:
            self.task.cancel()
        info = await self.bus.js.stream_info(PROBE)
        await self.bus.close()
        return int(info.state.messages)


async def move_leader(cluster: LoopbackCluster, bus: Bus, stream: str, to: int) -> bool:
    """Ask ``stream``'s leader to step down in favour of node ``to``; whether it leads now."""
    want = cluster.names()[to]
    for _ in range(5):
        if await cluster.leader(stream) == to:
            return True
        body = json.dumps({"placement": {"preferred": want}}).encode()
        with contextlib.suppress(Exception):  # an election in progress: ask again
            await bus.nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", body, timeout=5)
        await asyncio.sleep(0.5)
    return await cluster.leader(stream) == to


def count_in_logs(run_dir: Path, events: tuple[str, ...]) -> dict[str, int]:
    """How often the parts logged each of ``events`` (JSON log lines' ``event`` field)."""
    counts = dict.fromkeys(events, 0)
    pattern = re.compile(r'"event": "([a-z_]+)"')
    for path in (run_dir / "logs").glob("*.log"):
        for m in pattern.finditer(path.read_text(errors="replace")):
            if m.group(1) in counts:
                counts[m.group(1)] += 1
    return counts


async def wait_for_step(sup: Supervisor, run: asyncio.Task[int], n: int) -> None:
    while len(sup.progress.steps) < n and not run.done():
        await asyncio.sleep(0.05)
    assert not run.done(), f"the run ended before step {n}"


def next_step_after(sup: Supervisor, t_kill: float) -> float:
    """Seconds from a kill to the first step completed after it."""
    times = [s["t"] + sup.progress.started for s in sup.progress.steps]
    later = [t for t in times if t > t_kill]
    return min(later) - t_kill if later else float("nan")


async def test_run_survives_losing_the_stream_leader_and_another_node(tmp_path: Path) -> None:
    notes: list[str] = []

    def note(text: str) -> None:
        notes.append(text)
        print(text, flush=True)

    run_id = "cluster-kill"
    run_dir = tmp_path / "runs" / run_id
    args = f"--trainer.max_steps {STEPS} --trainer.batch_groups 2 --trainer.checkpoint_every 4 "
    args += "--inference.workers 1 --envs.0.name modsum --envs.0.group_size 4 "
    args += "--bus.max_gib 0.25 --bus.payload_max_gib 0.5"
    cfg = load_config(None, [*args.split(), *FAST_REDELIVERY])
    t_test = time.monotonic()
    with LoopbackCluster(tmp_path / "nats", 3) as cluster:
        probe = await Probe.start(cluster.url)
        admin = await Bus.connect(cluster.url, name="test-admin")
        sup = Supervisor(cfg, run_id, run_dir, nats_url=cluster.url, quiet=True)
        run = asyncio.create_task(sup.run())
        try:
            run_stream = stream_name(run_id)
            await wait_for_step(sup, run, 1)
            info = await admin.js.stream_info(run_stream)
            assert info.config.num_replicas == 3
            bucket = await admin.js.stream_info(f"OBJ_{payload_bucket(run_id)}")
            assert bucket.config.num_replicas == 3

            # 1: the run stream's leader, killed; restarted a few seconds later.
            first = await cluster.leader(run_stream)
            colocated = await move_leader(cluster, admin, PROBE, first)
            assert not run.done()
            t1 = time.monotonic()
            cluster.kill(first)
            at1 = len(sup.progress.steps)
            new_leader = cluster.names()[await cluster.leader(run_stream)]
            elected = time.monotonic() - t1
            await asyncio.sleep(2.0)
            cluster.restart(first)
            caught_up1 = cluster.wait_healthy(first)

            # 2: another node (the run stream's new leader), killed and left dead.
            # (as soon as the run has gone on: without a restarted part, steps take a fraction
            # of a second)
            await wait_for_step(sup, run, at1 + 1)
            second = await cluster.leader(run_stream)
            if second == first:
                second = next(i for i in range(3) if i != first)
            colocated2 = await move_leader(cluster, admin, PROBE, second)
            assert not run.done()
            t2 = time.monotonic()
            cluster.kill(second)
            at2 = len(sup.progress.steps)

            assert await asyncio.wait_for(run, 240) == 0
        finally:
            if not run.done():
                run.cancel()
            total = await probe.stop()
            await admin.close()

        names = cluster.names()
        note(f"cluster run {run_id}: {STEPS} steps on 3 nodes {names}")
        note(
            f"kill 1: {names[first]} (run stream leader{', probe leader too' if colocated else ''}) "
            f"at step {at1}; new run stream leader {new_leader} seen after {elected:.1f}s; "
            f"probe publishing paused {probe.pause_after(t1):.1f}s; next step after "
            f"{next_step_after(sup, t1):.1f}s; restarted 2s later, caught up (/healthz ok) in "
            f"{caught_up1:.1f}s"
        )
        note(
            f"kill 2: {names[second]} ({'probe leader, ' if colocated2 else ''}left dead) at step {at2}; "
            f"probe publishing paused {probe.pause_after(t2):.1f}s; next step after "
            f"{next_step_after(sup, t2):.1f}s"
        )
        note(
            f"probe: {probe.sent} acked, {total} stored, {probe.retries} re-sends, "
            f"{probe.duplicates} of them already stored (their first attempt's ack was lost)"
        )
        restarts = {p.name: p.restarts for p in sup.parts if p.restarts}
        logged = count_in_logs(run_dir, ("publish_retry", "nats_disconnected", "nats_reconnected"))
        note(f"part restarts {restarts or 'none'}; parts logged {logged}")
        # Each message id stored once: a re-sent probe was deduplicated, not stored twice.
        assert total == probe.sent

        # The run's invariants, read from the log on the 2 live nodes.
        log = await read_log(",".join(cluster.live_urls()), run_id)
        # Steps contiguous, each once; every rollout scored once, trained at most once, and
        # trained or withheld; versions one per step; the run completed.
        assert_run_invariants(
            log, steps=STEPS, rollouts_per_step=2 * 4, max_off=cfg.trainer.max_off_policy_steps
        )
        assert (
            await replay(
                ",".join(cluster.live_urls()),
                run_id,
                run_dir,
                from_step=0,
                to_step=None,
                verify=True,
                quiet=True,
            )
            == 0
        )
        # The store equals the log, step by step: every StepCompleted in the log is a row of the
        # store, with its version and rollouts, and there is no other (the recorder re-positions
        # over what a killed node's connection lost, never records past it).
        log_steps = sorted(
            (b.step, b.policy_version, len(b.rollout_ids), b.tokens) for b in bodies(log, ev.StepCompleted)
        )
        store = open_store(sup.db_url)
        try:
            stored = [
                (h.step, h.policy_version, h.num_rollouts, h.tokens)
                for h in queries.step_history(store, run_id)
            ]
        finally:
            store.close()
        missing = sorted(set(log_steps) - set(stored))
        extra = sorted(set(stored) - set(log_steps))
        assert stored == log_steps, f"steps the store lacks: {missing}; steps it has beyond the log: {extra}"
        assert len(stored) == STEPS
        gaps = count_in_logs(run_dir, ("recorder_gap",))["recorder_gap"]
        note(f"store equals the log: {len(stored)} steps; the recorder re-positioned {gaps} time(s)")

        # The node left dead comes back and catches up with what it missed.
        cluster.restart(second)
        caught_up2 = cluster.wait_healthy(second)
        # Healthy first, then its replica of the run's stream current (it may lag a moment).
        t_current = time.monotonic()
        while True:
            c = await cluster.stream_cluster(run_stream)
            if all(p.current for p in c.replicas or []):
                break
            assert time.monotonic() - t_current < 60, f"a replica stayed behind: {c.replicas}"
            await asyncio.sleep(0.2)
        note(
            f"{names[second]} restarted after the run: healthy in {caught_up2:.1f}s, its replica "
            f"of the log current {time.monotonic() - t_current:.1f}s later"
        )
    note(f"test wall time {time.monotonic() - t_test:.0f}s")
    (tmp_path / "cluster_faults.txt").write_text("\n".join(notes) + "\n")
