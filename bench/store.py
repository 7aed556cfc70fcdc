"""Benchmark of the step-history store: how fast the recorder projects a run's log into SQLite
and PostgreSQL, against jetrl's own consume rate for the same events, and the lag it keeps while
the log grows at a steady rate.

    python bench/store.py [--events 60000] [--rate 5000] [--lag-seconds 12] [--rounds 3]
                          [--batch 1000] [--pg-url URL] [--load N]

It starts its own nats-server. PostgreSQL comes from --pg-url or JETRL_TEST_POSTGRES_URL (a
fresh database is created and dropped there); without either the PostgreSQL half is skipped.
``--load N`` runs it all beside N busy CPU processes (bench/load.py).

* consume: the pre-filled log of a synthetic run of ``--events`` events read by a durable
  consumer of ``Bus.consumer`` configured as the recorder's (``PullConsumer.fetch`` of up to
  ``--batch`` events, strict decoding and admission, acked as the recorder acks: the last
  message of each batch, AckPolicy.ALL), no store: the bus's limit for these
  events on this machine.
* recorder: the same log recorded from the first event to the last (fetch, decode, fold,
  upsert, commit with the tracking row, ack) into a fresh database. The result is checked
  against the run's truth, so the figure is for a correct projection. Rounds alternate which of
  consume and recorder goes first; medians are reported, and recorder/consume is the headline.
* bulk insert: the very rows the recorder ended with, inserted with SQLAlchemy Core
  (executemany, ``--batch`` rows per transaction) into a fresh database of the same schema.
* projection without the bus: fold + upserts + commits of the same events, no fetch or decode.
* lag: a child process publishes a synthetic run at ``--rate`` events/s while the recorder runs;
  every 100 ms the recorder's ``lag()`` is sampled (age of the oldest event not yet recorded).

The process's garbage collector is set up as the recorder's own process sets it up
(``configure_gc``), before each timed phase, for every side alike.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Quiet before jetrl configures structlog at import: only the figures go to the terminal.
os.environ.setdefault("JETRL_LOG_LEVEL", "warning")
# `python bench/store.py` puts bench/, not the repo root, on sys.path; the synthetic run lives
# in the tests tree (tests/support), which is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import asyncio
import multiprocessing as mp
import multiprocessing.queues
import multiprocessing.synchronize
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import sqlalchemy as sa
from load import cpu_load
from nats.js import api
from stats import pct

from jetrl.bus import subjects
from jetrl.bus.client import Bus
from jetrl.bus.consumer import ConsumerSpec
from jetrl.bus.log import configure
from jetrl.bus.server import EmbeddedServer
from jetrl.bus.streams import StreamLimits, stream_name
from jetrl.consumers.recorder import Recorder, configure_gc
from jetrl.consumers.recorder.writer import WriterKind
from jetrl.store import schema as sc
from jetrl.store.db import Store, open_store
from jetrl.store.projection import apply_batch
from tests.support.synthetic import (
    SyntheticRun,
    check_projection,
    log_items,
    publish_events,
    synthetic_run,
)

LIMITS = StreamLimits(max_bytes=4 * 1024**3, payload_max_bytes=64 * 1024**2)
EVENTS_PER_STEP = (
    42  # of synthetic_run's defaults (one event per task and per group), to size a run by events
)


@dataclass
class Result:
    backend: str
    writer: str
    events: int
    consume_s: list[float]
    recorder_s: list[float]
    recorder_batches: int
    baseline_s: float
    baseline_rows: int
    projection_s: float
    lag_samples: list[float] = field(default_factory=list)
    commit_lags: list[float] = field(default_factory=list)
    lag_events_max: int = 0
    published_rate: float = 0.0
    lag_batches: int = 0

    @property
    def consume_eps(self) -> float:
        return self.events / statistics.median(self.consume_s)

    @property
    def recorder_eps(self) -> float:
        return self.events / statistics.median(self.recorder_s)

    @property
    def baseline_eps(self) -> float:
        return self.events / self.baseline_s


@contextmanager
def fresh_database(backend: str, tmp: Path, pg_url: str | None) -> Iterator[str]:
    if backend == "sqlite":
        yield f"sqlite:///{tmp / f'store-{uuid.uuid4().hex[:8]}.db'}"
        return
    assert pg_url
    name = f"jetrl_bench_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield sa.make_url(pg_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as c:
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


# ----------------------------------------------------------------------------- phases


async def prefill(bus: Bus, events: int) -> SyntheticRun:
    run_id = f"bench{uuid.uuid4().hex[:8]}"
    run = synthetic_run(run_id, steps=max(1, events // EVENTS_PER_STEP), seed=7)
    await bus.ensure_run(run_id, LIMITS)
    await publish_events(bus, run.events)
    return run


async def consume_only(bus: Bus, run_id: str, n: int, batch: int) -> float:
    """Read the whole log as the recorder's consumer does, with nothing behind it."""
    durable = f"consume-{uuid.uuid4().hex[:8]}"
    c = await bus.consumer(
        ConsumerSpec(
            run_id=run_id,
            durable=durable,
            filter_subjects=[subjects.all_subjects(run_id)],
            ack_wait=60.0,
            max_deliver=1_000_000,
            max_ack_pending=batch * 4,
            ack_policy=api.AckPolicy.ALL,  # as the recorder's consumer
        )
    )
    configure_gc()
    got = 0
    t0 = time.perf_counter()
    while got < n:
        deliveries = await c.fetch(batch, timeout=0.5)
        if deliveries:
            await deliveries[-1].ack()  # AckPolicy.ALL, as the recorder acks a committed batch
            got += len(deliveries)
    elapsed = time.perf_counter() - t0
    await c.unsubscribe()
    await bus.js.delete_consumer(stream_name(run_id), durable)
    return elapsed


async def record_prefilled(
    bus: Bus, run: SyntheticRun, db_url: str, batch: int, writer: WriterKind
) -> tuple[float, int, Store]:
    store = open_store(db_url)
    rec = Recorder(bus, store, run.run_id, batch=batch, writer=writer)
    await rec.start()  # a recorder that is up: a writer process started
    configure_gc()
    t0 = time.perf_counter()
    await rec.catch_up()
    elapsed = time.perf_counter() - t0
    rec.close()
    with store.read() as conn:
        bad = check_projection(conn, run)
    if bad:
        raise SystemExit(f"recorder projection is wrong ({len(bad)} mismatches), e.g. {bad[:3]}")
    return elapsed, rec.stats.batches, store


def projection_only(db_url: str, events: int, batch: int) -> float:
    """The same projection without the bus (no fetch, decode or ack): where the rest goes."""
    run = synthetic_run("proj", steps=max(1, events // EVENTS_PER_STEP), seed=7)
    items = log_items(run.events)
    store = open_store(db_url)
    store.checkpoint_in_background()  # as the recorder runs it
    configure_gc()
    t0 = time.perf_counter()
    for i in range(0, len(items), batch):
        with store.write() as conn:
            apply_batch(conn, run_id="proj", stream="S", consumer="c", items=items[i : i + batch])
    elapsed = time.perf_counter() - t0
    store.close()
    return elapsed


def baseline_insert(source: Store, db_url: str, batch: int) -> tuple[float, int]:
    """Bulk-insert the recorder's final rows with Core into a fresh database of the schema."""
    tables = [*sc.PROJECTION_TABLES, sc.OFFSETS]
    with source.read() as conn:
        rows = {t.name: [dict(r) for r in conn.execute(sa.select(t)).mappings()] for t in tables}
    target = open_store(db_url)
    configure_gc()
    t0 = time.perf_counter()
    for t in tables:
        data = rows[t.name]
        for i in range(0, len(data), batch):
            with target.write() as conn:
                conn.execute(t.insert(), data[i : i + batch])
    elapsed = time.perf_counter() - t0
    target.close()
    return elapsed, sum(len(v) for v in rows.values())


def _publisher(
    nats_url: str,
    run_id: str,
    rate: float,
    seconds: float,
    ready: multiprocessing.synchronize.Event,
    out: multiprocessing.queues.Queue[tuple[int, float]],
) -> None:
    async def go() -> None:
        run = synthetic_run(run_id, steps=max(1, int(rate * seconds) // EVENTS_PER_STEP + 1), seed=8)
        events = run.events[: int(rate * seconds)]
        bus = await Bus.connect(nats_url, name="bench-publisher")
        ready.set()
        tick = 0.01
        per_tick = max(1, round(rate * tick))
        t0 = time.perf_counter()
        async with bus.publisher(max_inflight=2048) as pub:
            for i in range(0, len(events), per_tick):
                for e in events[i : i + per_tick]:
                    await pub.publish(e)
                # Pace on the wall clock so a slow tick is caught up, not accumulated.
                delay = t0 + (i // per_tick + 1) * tick - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
        out.put((len(events), time.perf_counter() - t0))
        await bus.close()

    asyncio.run(go())


async def lag_under_load(
    nats_url: str, db_url: str, rate: float, seconds: float, batch: int, writer: WriterKind
) -> tuple[list[float], list[float], int, float, int]:
    run_id = f"lag{uuid.uuid4().hex[:8]}"
    bus = await Bus.connect(nats_url, name="bench")
    await bus.ensure_run(run_id, LIMITS)
    store = open_store(db_url)
    rec = Recorder(bus, store, run_id, batch=batch, log_every_s=3600, writer=writer)
    await rec.start()
    configure_gc()
    task = asyncio.create_task(rec.run())
    ctx = mp.get_context("spawn")
    ready: multiprocessing.synchronize.Event = ctx.Event()
    out: multiprocessing.queues.Queue[tuple[int, float]] = ctx.Queue()
    proc = ctx.Process(target=_publisher, args=(nats_url, run_id, rate, seconds, ready, out))
    proc.start()
    while not ready.is_set():
        if not proc.is_alive():
            raise SystemExit(f"the publisher process died before publishing (exit {proc.exitcode})")
        await asyncio.sleep(0.05)
    samples: list[float] = []
    max_events = 0
    while proc.is_alive() or out.empty():
        lag = await rec.lag()
        samples.append(lag.seconds)
        max_events = max(max_events, lag.events)
        await asyncio.sleep(0.1)
        if not proc.is_alive() and out.empty():
            break
    if out.empty():
        raise SystemExit(f"the publisher process died (exit {proc.exitcode})")
    published, took = out.get()
    proc.join()
    head = await bus.last_seq(run_id)
    deadline = time.monotonic() + 120.0
    while rec.recorded_seq < head:
        if task.done():
            await task  # raises what stopped the recorder
            raise SystemExit(f"the recorder stopped at {rec.recorded_seq} of {head}")
        if time.monotonic() > deadline:
            raise SystemExit(f"the recorder is stuck at {rec.recorded_seq} of {head} after 120 s")
        await asyncio.sleep(0.05)
    rec.stop()
    await task
    rec.close()
    store.close()
    await bus.js.delete_stream(stream_name(run_id))
    await bus.close()
    return samples, rec.stats.commit_lag_s, max_events, published / took, rec.stats.batches


async def bench_backend(backend: str, nats_url: str, tmp: Path, args: argparse.Namespace) -> Result:
    bus = await Bus.connect(nats_url, name="bench")
    run = await prefill(bus, args.events)
    n = len(run.events)
    consume_s: list[float] = []
    recorder_s: list[float] = []
    batches = 0
    base_s, base_rows = 0.0, 0
    for r in range(args.rounds):
        for side in ("consume", "recorder") if r % 2 == 0 else ("recorder", "consume"):
            if side == "consume":
                consume_s.append(await consume_only(bus, run.run_id, n, args.batch))
                continue
            with fresh_database(backend, tmp, args.pg_url) as rec_db:
                rec_s, batches, store = await record_prefilled(bus, run, rec_db, args.batch, args.writer)
                recorder_s.append(rec_s)
                if r == 0:
                    with fresh_database(backend, tmp, args.pg_url) as base_db:
                        base_s, base_rows = baseline_insert(store, base_db, args.batch)
                store.close()
    await bus.js.delete_stream(stream_name(run.run_id))
    await bus.close()
    del run
    with fresh_database(backend, tmp, args.pg_url) as proj_db:
        proj_s = projection_only(proj_db, args.events, args.batch)
    result = Result(backend, args.writer, n, consume_s, recorder_s, batches, base_s, base_rows, proj_s)
    with fresh_database(backend, tmp, args.pg_url) as lag_db:
        (
            result.lag_samples,
            result.commit_lags,
            result.lag_events_max,
            result.published_rate,
            result.lag_batches,
        ) = await lag_under_load(nats_url, lag_db, args.rate, args.lag_seconds, args.batch, args.writer)
    return result


def report(r: Result) -> None:
    def runs(xs: list[float]) -> str:
        return ", ".join(f"{x:.2f}" for x in xs)

    print(f"\n== {r.backend} (recorder writer: {r.writer})")
    print(
        f"consume   {r.events} events, median {statistics.median(r.consume_s):.2f} s = {r.consume_eps:,.0f}"
        f" events/s (rounds: {runs(r.consume_s)} s)"
    )
    print(
        f"recorder  {r.events} events, median {statistics.median(r.recorder_s):.2f} s = {r.recorder_eps:,.0f}"
        f" events/s (rounds: {runs(r.recorder_s)} s; {r.recorder_batches} batches)"
        f" = {r.recorder_eps / r.consume_eps:.2f} of consume"
    )
    print(
        f"bulk insert of the recorder's {r.baseline_rows} rows {r.baseline_s:.2f} s"
        f" = {r.baseline_eps:,.0f} events/s equivalent;"
        f" recorder/bulk insert {r.recorder_eps / r.baseline_eps:.2f}"
    )
    print(
        f"projection without the bus (fold + upserts + commits) {r.projection_s:.2f} s"
        f" = {r.events / r.projection_s:,.0f} events/s"
    )
    print(
        f"lag       publishing {r.published_rate:,.0f} events/s: lag() p50 {pct(r.lag_samples, 0.5):.3f} s,"
        f" p99 {pct(r.lag_samples, 0.99):.3f} s, max {max(r.lag_samples, default=0):.3f} s"
        f" ({len(r.lag_samples)} samples, max {r.lag_events_max} events behind);"
        f" commit latency p99 {pct(r.commit_lags, 0.99):.3f} s; {r.lag_batches} batches"
    )


async def amain(args: argparse.Namespace) -> int:
    backends = ["sqlite"]
    if args.pg_url:
        backends.append("postgresql")
    results: list[Result] = []
    loaded = f" (load {args.load})" if args.load else ""
    with (
        tempfile.TemporaryDirectory(prefix="jetrl-bench-store-") as tmp,
        EmbeddedServer(Path(tmp) / "nats") as srv,
        cpu_load(args.load),
    ):
        for b in backends:
            r = await bench_backend(b, srv.url, Path(tmp), args)
            report(r)
            results.append(r)
    if not args.pg_url:
        print("\npostgresql: skipped (set JETRL_TEST_POSTGRES_URL or pass --pg-url)")
    print()
    for r in results:
        print(f"recorder/consume {r.backend}{loaded} {r.recorder_eps / r.consume_eps:.2f} (target >= 0.7)")
    for r in results:
        print(f"recorder lag p99 {r.backend}{loaded} {pct(r.lag_samples, 0.99):.2f} s (target < 1 s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", type=int, default=60_000, help="events of the pre-filled log")
    p.add_argument(
        "--batch", type=int, default=2000, help="recorder batch (and bulk-insert rows per transaction)"
    )
    p.add_argument("--rounds", type=int, default=3, help="consume and recorder passes over the log")
    p.add_argument("--rate", type=float, default=5000.0, help="events/s published during the lag phase")
    p.add_argument("--lag-seconds", type=float, default=12.0)
    p.add_argument("--pg-url", default=os.environ.get("JETRL_TEST_POSTGRES_URL"))
    p.add_argument("--load", type=int, default=0, help="busy CPU processes running beside the bench")
    p.add_argument(
        "--writer",
        choices=["process", "thread", "inline"],
        default="process",
        help="where the recorder's transactions run (process: as the recorder's own process runs)",
    )
    args = p.parse_args(argv)
    if args.batch < 1 or args.events < 1 or args.rounds < 1 or args.rate <= 0 or args.lag_seconds <= 0:
        p.error("--batch, --events, --rounds, --rate and --lag-seconds must be positive")
    configure("warning")
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
