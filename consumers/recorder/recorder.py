"""The recorder: a durable consumer over a run's whole log that keeps the SQL projection.

Per batch: fetch up to N events, check that they follow the tracking row without a gap, apply
them all and move the tracking row in one transaction (``store.projection.apply_batch``),
commit, then ack each of them. The store, not the server, says where recording resumes: on
start the durable consumer is re-created at ``tracking.last_seq + 1``, so a crash between
commit and ack, or an ack the server never saw, can neither skip nor repeat an event. Events at
or below the tracking row are ignored anyway (redelivery), and every upsert is idempotent, so
the tables stay exact whatever is killed and when.

The recorder takes every subject of the run's stream, so the sequences it is delivered are
contiguous; a batch that does not go on from the tracking row (messages delivered over a
connection that died, or taken by another client of the same durable) is never committed: the
consumer is re-created at the tracking row + 1 and recording goes on from there. A sequence the
log itself no longer holds (a message deleted from the stream) is not a gap.

Malformed, spoofed or otherwise poisonous messages are dead-lettered by the bus consumer while
fetching; the ``DeadLettered`` event it publishes is part of the log and is recorded like any
other, and the tracking row moves past the poisoned sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import nats.js.errors
from nats.js import api

from jetrl.bus import events as ev
from jetrl.bus import subjects
from jetrl.bus.client import Bus
from jetrl.bus.consumer import Batch, ConsumerSpec, PullConsumer
from jetrl.bus.facts import spoofed
from jetrl.bus.log import get_logger
from jetrl.bus.retry import RETRYABLE, retrying
from jetrl.bus.streams import stream_name
from jetrl.consumers.recorder.settings import DEFAULT_DURABLE, DEFAULT_GATHER_S
from jetrl.consumers.recorder.writer import Target, WriterKind, make_writer
from jetrl.store.db import Store
from jetrl.store.projection import Logged, LogItem

log = get_logger(__name__)


def configure_gc(young: int = 50_000) -> None:
    """Set this process's garbage collector up for recording (the recorder's process calls it
    once it is set up; bench/store.py too, for every side it compares).

    A batch is ~30 tracked objects per event (decoded bodies, rows, payload references) that
    live until it is committed: CPython's default (a young collection every 700 allocations)
    promoted them into the old generation, and every few batches a full collection walked the
    whole heap, modules and connection pool included, to find nothing (0.5-1.4 s of a 30,000
    event catch-up, measured). Now what exists is frozen out of collections, and a collection
    starts only after ``young`` net allocations: a batch's objects die by reference counting
    first. Cyclic garbage is still collected, after at most ``young`` objects of it."""
    gc.collect()
    gc.freeze()
    _, mid, old = gc.get_threshold()
    gc.set_threshold(young, mid, old)


@dataclass(frozen=True)
class Lag:
    """How far the projection is behind the log head: events not yet recorded and the age (s)
    of the oldest of them (0 when caught up)."""

    events: int
    seconds: float
    recorded_seq: int
    head_seq: int


@dataclass
class RecorderStats:
    batches: int = 0
    events: int = 0
    skipped: int = 0
    rows: int = 0
    dead_lettered: int = 0
    # Times the consumer was re-created at the tracking row + 1 after a gap or a stall.
    repositions: int = 0
    # Seconds from an event's arrival in the log to the commit that recorded it (per batch, the
    # oldest event in it): what the bench's lag percentiles are made of.
    commit_lag_s: list[float] = field(default_factory=list)


class _Gap(Exception):
    """What was delivered does not go on from the recorded sequence: ``expected`` is missing."""

    def __init__(self, expected: int, got: int, why: str) -> None:
        super().__init__(f"sequence {expected} missing ({why}; got {got})")
        self.expected = expected
        self.got = got
        self.why = why


class Recorder:
    """Records one run's log into a :class:`~jetrl.store.db.Store`.

    ``await run()`` records until :meth:`stop` (or ``until_seq`` is recorded); ``await lag()``
    says how far behind the log head it is; :meth:`replay` is the read-only pass a rebuild uses.
    """

    def __init__(
        self,
        bus: Bus,
        store: Store,
        run_id: str,
        *,
        durable: str = DEFAULT_DURABLE,
        batch: int = 2000,
        fetch_timeout: float = 0.5,
        ack_wait: float = 60.0,
        log_every_s: float = 5.0,
        stall_s: float = 5.0,
        writer: WriterKind | None = None,
        gather_s: float = DEFAULT_GATHER_S,
    ) -> None:
        self.bus = bus
        self.store = store
        self.run_id = run_id
        self.durable = durable
        self.stream = stream_name(run_id)
        self.batch = batch
        self.fetch_timeout = fetch_timeout
        # Keeping up with the log, a batch is what came within this long: one transaction.
        self.gather_s = gather_s
        self.ack_wait = ack_wait
        self.log_every_s = log_every_s
        # Nothing delivered for this long while the oldest unrecorded event has waited as long:
        # what was delivered last was lost (the server would redeliver it only after ack_wait).
        self.stall_s = stall_s
        self.stats = RecorderStats()
        self.log = log.bind(run_id=run_id, consumer=durable)
        self._stop = asyncio.Event()
        self._last_seq = 0
        # Where transactions run (writer.py). In this process by default (tests, rebuilds):
        # PostgreSQL on a thread, as its statements wait on the server, SQLite inline. The
        # recorder's own process runs them in a child process.
        self.writer_kind: WriterKind = writer or ("inline" if store.backend == "sqlite" else "thread")
        self.writer = make_writer(self.writer_kind, store, Target(run_id, self.stream, durable))
        self._writer_started = False

    # ------------------------------------------------------------------ control

    @property
    def recorded_seq(self) -> int:
        """Last stream sequence committed to the store by this recorder."""
        return self._last_seq

    def stop(self) -> None:
        """Stop after the batch being applied is committed and acked (signal-handler safe)."""
        self._stop.set()

    async def start(self) -> None:
        """Get the writer ready (a writer process started and its store open); run() and
        replay() do it on their own, a caller may do it ahead to keep it out of a measurement."""
        if not self._writer_started:
            await self.writer.start()
            self._writer_started = True

    def close(self) -> None:
        self.writer.close()

    # ------------------------------------------------------------------ lag

    async def lag(self) -> Lag:
        """Events in the log after the recorded sequence, and how long the oldest of them has
        waited (from its stream timestamp)."""
        head = await self.bus.last_seq(self.run_id)
        recorded = self._last_seq
        if head <= recorded:
            return Lag(0, 0.0, recorded, head)
        try:
            msg = await self.bus.js.get_msg(self.stream, seq=recorded + 1)
            waited = max(0.0, time.time() - msg.time.timestamp()) if msg.time else 0.0
        except nats.js.errors.NotFoundError:
            waited = 0.0
        return Lag(head - recorded, waited, recorded, head)

    # ------------------------------------------------------------------ live recording

    async def _wait_for_stream(self) -> None:
        delay, waited, next_log = 0.2, 0.0, 0.0
        while not self._stop.is_set():
            try:
                await self.bus.js.stream_info(self.stream)
                return
            # Not made yet, or a cluster electing its leader (no answer meanwhile): wait for it
            # rather than crash and restart.
            except (nats.js.errors.NotFoundError, *RETRYABLE) as exc:
                if waited >= next_log:  # once at first, then every 10 s
                    self.log.info("waiting_for_stream", stream=self.stream, error=repr(exc))
                    next_log += 10.0
                await asyncio.sleep(delay)
                waited += delay

    async def _open_consumer(self, start_seq: int) -> PullConsumer[ev.EventBody]:
        # The tracking row is the truth: re-create the durable at its position rather than
        # trusting the server's ack floor (which a crash between commit and ack leaves behind).
        async def delete() -> None:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await self.bus.js.delete_consumer(self.stream, self.durable)

        await retrying(f"delete consumer {self.durable}", delete)  # through a leader election
        consumer = await self.bus.consumer(
            ConsumerSpec(
                run_id=self.run_id,
                durable=self.durable,
                filter_subjects=[subjects.all_subjects(self.run_id)],
                ack_wait=self.ack_wait,
                # Re-positioning on start makes redelivery counts meaningless: never park for them.
                max_deliver=1_000_000,
                max_ack_pending=self.batch * 4,
                deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                start_seq=start_seq,
                # One ack per batch, its last message's, settling the whole batch: safe since a
                # batch is committed only when it runs on from the tracking row without a gap
                # (_first_missing), so the ack floor never passes an event not recorded.
                ack_policy=api.AckPolicy.ALL,
            )
        )
        return consumer

    async def _first_missing(self, seqs: Sequence[int]) -> _Gap | None:
        """The gap in ``seqs`` (a batch's delivered and dead-lettered sequences) after the
        recorded sequence, or None when they go on from it without one: every sequence after
        it up to the highest is there, or was deleted from the log (asked of the stream's
        leader, only when one is missing)."""
        last = self._last_seq
        fresh = {s for s in seqs if s > last}
        if not fresh or len(fresh) == max(fresh) - last:  # the usual case: no hole
            return None
        top, seq = max(fresh), last + 1
        while seq <= top:
            if seq in fresh:
                seq += 1
                continue
            there = await self._first_in_log(seq)
            if there is None or there not in fresh:
                return _Gap(seq if there is None else there, min(fresh), "not delivered")
            seq = there  # seq .. there - 1 are not in the log: nothing to record
        return None

    async def _first_in_log(self, seq: int) -> int | None:
        """The first sequence at or after ``seq`` that the log holds (None: none)."""

        async def get() -> int | None:
            try:
                msg = await self.bus.js.get_msg(
                    self.stream, seq, subject=subjects.all_subjects(self.run_id), next=True
                )
            except nats.js.errors.NotFoundError:
                return None
            return int(msg.seq) if msg.seq is not None else None

        return await retrying(f"get {self.stream} {seq}", get)

    async def _read_offset(self) -> int:
        await self.start()
        return await self.writer.read_offset()

    async def _commit(self, items: Sequence[Logged], through_seq: int, oldest_ts: float | None) -> None:
        res = await self.writer.apply(items, through_seq, self._last_seq)
        self._last_seq = max(self._last_seq, res.last_seq)
        s = self.stats
        s.batches += 1
        s.events += res.applied
        s.skipped += res.skipped
        s.rows += res.rows
        if oldest_ts is not None:
            s.commit_lag_s.append(max(0.0, time.time() - oldest_ts))
            if len(s.commit_lag_s) > 100_000:
                del s.commit_lag_s[:50_000]

    async def run(self, *, until_seq: int | None = None) -> None:
        """Record until :meth:`stop` is called, or (with ``until_seq``) until that sequence is
        recorded. Fetching the next batch overlaps committing the current one."""
        await self._wait_for_stream()
        if self._stop.is_set():
            return
        self._last_seq = await self._read_offset()
        if until_seq is not None and self._last_seq >= until_seq:
            return
        consumer = await self._open_consumer(self._last_seq + 1)
        self.log.info(
            "recorder_started", stream=self.stream, resume_from=self._last_seq + 1, batch=self.batch
        )
        last_log = last_batch = last_stall_check = time.monotonic()
        handled = False  # a batch came with this fetch

        async def record(got: Batch[ev.EventBody]) -> None:
            nonlocal handled
            handled = True
            items = got.deliveries  # a delivery has what the projection reads: seq, subject, event
            # Dead-lettered sequences carry nothing to record, but the tracking row moves past them.
            seqs = [*(i.seq for i in items), *got.dead_lettered]
            gap = await self._first_missing(seqs)
            if gap is not None:
                raise gap  # never commit past it: run() re-positions the consumer
            oldest = got.deliveries[0].msg.metadata.timestamp.timestamp() if got.deliveries else None
            await self._commit(items, max(seqs), oldest)
            self.stats.dead_lettered += len(got.dead_lettered)
            if got.deliveries:  # an ack lost is only a redelivery, skipped by seq
                with contextlib.suppress(Exception):
                    await got.deliveries[-1].msg.ack()

        async def done() -> bool:
            nonlocal last_log, last_batch, last_stall_check, handled
            now = time.monotonic()
            if handled:  # idle time counts from the end of the last batch's commit
                last_batch, handled = now, False
            if now - last_log >= self.log_every_s:
                last_log = now
                await self._log_progress()
            if now - last_batch >= self.stall_s and now - last_stall_check >= self.stall_s:
                last_stall_check = now
                await self._check_stall()
            return until_seq is not None and self._last_seq >= until_seq

        try:
            while True:
                try:
                    # The server keeps a prefetched batch unacked while this one commits. A
                    # failed commit must stop the recorder (its restart resumes from the store's
                    # row): never settle the batch and record past it.
                    await consumer.run_batches(
                        record,
                        batch=self.batch,
                        fetch_timeout=self.fetch_timeout,
                        stop=self._stop,
                        after=done,
                        prefetch=True,
                        settle_failures=False,
                        gather_s=self.gather_s,
                    )
                    return
                except _Gap as gap:
                    await consumer.unsubscribe()
                    consumer = await self._reposition(gap)
                    last_batch = time.monotonic()
        finally:
            await consumer.unsubscribe()
            self.log.info(
                "recorder_stopped",
                recorded_seq=self._last_seq,
                events=self.stats.events,
                batches=self.stats.batches,
                dead_lettered=self.stats.dead_lettered,
                repositions=self.stats.repositions,
            )

    async def _check_stall(self) -> None:
        """Nothing delivered for ``stall_s`` while the log holds events not recorded that have
        waited as long: the messages delivered last were lost in transit (the next ones, had
        any come, would have shown the gap). Raises :class:`_Gap` to re-position."""
        try:
            lag = await self.lag()
        except Exception as exc:  # advisory, as the progress log: the next check asks again
            self.log.warning("lag_unavailable", error=repr(exc))
            return
        if lag.events and lag.seconds >= self.stall_s:
            raise _Gap(lag.recorded_seq + 1, lag.head_seq, f"nothing delivered for {self.stall_s:g}s")

    async def _reposition(self, gap: _Gap) -> PullConsumer[ev.EventBody]:
        """Re-create the durable at the store's tracking row + 1, as on start. The row is not
        taken below what this recorder committed: the next commit then fails with
        TrackingRowBehind and the restart reads from the row."""
        self.stats.repositions += 1
        offset = await self._read_offset()
        self.log.warning(
            "recorder_gap",
            missing_seq=gap.expected,
            got_seq=gap.got,
            why=gap.why,
            recorded_seq=self._last_seq,
            resume_from=offset + 1,
            repositions=self.stats.repositions,
        )
        return await self._open_consumer(offset + 1)

    async def _log_progress(self) -> None:
        try:
            lag = await self.lag()
        except Exception as exc:  # lag is advisory; never let it stop recording
            self.log.warning("lag_unavailable", error=repr(exc))
            return
        self.log.info(
            "recorder_progress",
            recorded_seq=lag.recorded_seq,
            head_seq=lag.head_seq,
            lag_events=lag.events,
            lag_s=round(lag.seconds, 3),
            events=self.stats.events,
        )

    async def catch_up(self, *, timeout: float | None = None) -> Lag:
        """Record until the log head as of now is recorded, then return the lag (0 events
        unless more arrived meanwhile). For tests, rebuilds and one-shot use."""
        head = await self.bus.last_seq(self.run_id)
        await asyncio.wait_for(self.run(until_seq=head), timeout)
        return await self.lag()

    # ------------------------------------------------------------------ replay (rebuild)

    async def replay(self, *, until_seq: int | None = None, idle_timeout: float = 2.0) -> int:
        """Record from the tracking row up to ``until_seq`` (default: the head as of now) by
        reading the log with an ordered consumer, without acking or dead-lettering anything:
        a rebuild must not write to the log it is checking. Messages the bus consumer would
        have dead-lettered are skipped here exactly as it would have (their DeadLettered
        events are in the log). Returns the recorded sequence."""
        head = await self.bus.last_seq(self.run_id)
        until = head if until_seq is None else min(until_seq, head)
        self._last_seq = await self._read_offset()
        if self._last_seq >= until:
            return self._last_seq
        buf: list[LogItem] = []
        through = self._last_seq
        async for item in self.bus.tail(self.run_id, from_seq=self._last_seq + 1, idle_timeout=idle_timeout):
            if item.seq > until:
                break
            through = item.seq
            if item.event is not None and spoofed(self.run_id, item.subject, item.event) is None:
                buf.append(LogItem(item.seq, item.subject, item.event))
            if len(buf) >= self.batch:
                await self._commit(buf, through, None)
                buf = []
            if item.seq >= until:
                break
        if through > self._last_seq:  # the rest, up to ``until``
            await self._commit(buf, through, None)
        return self._last_seq
