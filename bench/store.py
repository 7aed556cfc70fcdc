"""Benchmark of the step-history store: how fast the recorder projects a run's log into SQLite
and PostgreSQL, against a plain bulk insert of the same rows, and the lag it keeps while the
log grows at a steady rate.

    python bench/store.py [--events 60000] [--rate 5000] [--lag-seconds 12] [--pg-url URL]

It starts its own nats-server. PostgreSQL comes from --pg-url or JETRL_TEST_POSTGRES_URL (a
fresh database is created and dropped there); without either the PostgreSQL half is skipped.

* recorder: a log pre-filled with a synthetic run of ``--events`` events is recorded from
  the first event to the last (fetch, decode, fold, upsert, commit with the tracking row, ack).
  The result is checked against the run's truth, so the figure is for a correct projection.
* baseline: the very rows the recorder ended with, bulk-inserted with SQLAlchemy Core
  (executemany, ``--batch`` rows per transaction) into a fresh database of the same schema.
* lag: a child process publishes a synthetic run at ``--rate`` events/s while the recorder runs;
  every 100 ms the recorder's ``lag()`` is sampled (age of the oldest event not yet recorded).
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
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import sqlalchemy as sa

from jetrl.bus.client import Bus
from jetrl.bus.log import configure
from jetrl.bus.server import EmbeddedServer
from jetrl.bus.streams import StreamLimits, stream_name
from jetrl.consumers.recorder import Recorder
from jetrl.store import schema as sc
from jetrl.store.db import Store, open_store
from jetrl.store.projection import apply_batch
from tests.support.synthetic import check_projection, log_items, publish_events, synthetic_run

LIMITS = StreamLimits(max_bytes=4 * 1024**3, payload_max_bytes=64 * 1024**2)
EVENTS_PER_STEP = 154  # of synthetic_run's defaults, to size a run by events


@dataclass
class Result:
    backend: str
    events: int
    recorder_s: float
    baseline_s: float
    baseline_rows: int
    projection_s: float
    lag_samples: list[float]
    commit_lags: list[float]
    lag_events_max: int
    published_rate: float

    @property
    def recorder_eps(self) -> float:
        return self.events / self.recorder_s

    @property
    def baseline_eps(self) -> float:
        return self.events / self.baseline_s


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


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


async def record_prefilled(nats_url: str, db_url: str, events: int, batch: int) -> tuple[float, int, Store]:
    run_id = f"bench{uuid.uuid4().hex[:8]}"
    run = synthetic_run(run_id, steps=max(1, events // EVENTS_PER_STEP), seed=7)
    bus = await Bus.connect(nats_url, name="bench")
    await bus.ensure_run(run_id, LIMITS)
    await publish_events(bus, run.events)
    store = open_store(db_url)
    rec = Recorder(bus, store, run_id, batch=batch)
    t0 = time.perf_counter()
    await rec.catch_up()
    elapsed = time.perf_counter() - t0
    rec.close()
    with store.read() as conn:
        bad = check_projection(conn, run)
    if bad:
        raise SystemExit(f"recorder projection is wrong ({len(bad)} mismatches), e.g. {bad[:3]}")
    await bus.js.delete_stream(stream_name(run_id))
    await bus.close()
    return elapsed, len(run.events), store


def projection_only(db_url: str, events: int, batch: int) -> float:
    """The same projection without the bus (no fetch, decode or ack): where the rest goes."""
    run = synthetic_run("proj", steps=max(1, events // EVENTS_PER_STEP), seed=7)
    items = log_items(run.events)
    store = open_store(db_url)
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
    nats_url: str, db_url: str, rate: float, seconds: float, batch: int
) -> tuple[list[float], list[float], int, float]:
    run_id = f"lag{uuid.uuid4().hex[:8]}"
    bus = await Bus.connect(nats_url, name="bench")
    await bus.ensure_run(run_id, LIMITS)
    store = open_store(db_url)
    rec = Recorder(bus, store, run_id, batch=batch, log_every_s=3600)
    task = asyncio.create_task(rec.run())
    ctx = mp.get_context("spawn")
    ready, out = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_publisher, args=(nats_url, run_id, rate, seconds, ready, out))
    proc.start()
    while not ready.is_set():
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
    published, took = out.get()
    proc.join()
    head = await bus.last_seq(run_id)
    while rec.recorded_seq < head:
        await asyncio.sleep(0.05)
    rec.stop()
    await task
    rec.close()
    store.close()
    await bus.js.delete_stream(stream_name(run_id))
    await bus.close()
    return samples, rec.stats.commit_lag_s, max_events, published / took


async def bench_backend(backend: str, nats_url: str, tmp: Path, args: argparse.Namespace) -> Result:
    with fresh_database(backend, tmp, args.pg_url) as rec_db:
        rec_s, n, store = await record_prefilled(nats_url, rec_db, args.events, args.batch)
        with fresh_database(backend, tmp, args.pg_url) as base_db:
            base_s, base_rows = baseline_insert(store, base_db, args.batch)
        store.close()
    with fresh_database(backend, tmp, args.pg_url) as proj_db:
        proj_s = projection_only(proj_db, args.events, args.batch)
    with fresh_database(backend, tmp, args.pg_url) as lag_db:
        samples, commit_lags, max_events, rate = await lag_under_load(
            nats_url, lag_db, args.rate, args.lag_seconds, args.batch
        )
    return Result(backend, n, rec_s, base_s, base_rows, proj_s, samples, commit_lags, max_events, rate)


def report(r: Result) -> None:
    print(f"\n== {r.backend}")
    print(f"recorder  {r.events} events in {r.recorder_s:.2f} s = {r.recorder_eps:,.0f} events/s")
    print(
        f"baseline  {r.baseline_rows} rows (the recorder's result) bulk-inserted in {r.baseline_s:.2f} s"
        f" = {r.baseline_eps:,.0f} events/s equivalent"
    )
    print(
        f"projection without the bus (fold + upserts + commits) {r.projection_s:.2f} s"
        f" = {r.events / r.projection_s:,.0f} events/s"
    )
    print(
        f"lag       publishing {r.published_rate:,.0f} events/s: lag() p50 {pct(r.lag_samples, 0.5):.3f} s,"
        f" p99 {pct(r.lag_samples, 0.99):.3f} s, max {max(r.lag_samples, default=0):.3f} s"
        f" ({len(r.lag_samples)} samples, max {r.lag_events_max} events behind);"
        f" commit latency p99 {pct(r.commit_lags, 0.99):.3f} s"
    )


async def amain(args: argparse.Namespace) -> int:
    backends = ["sqlite"]
    if args.pg_url:
        backends.append("postgresql")
    results: list[Result] = []
    with (
        tempfile.TemporaryDirectory(prefix="jetrl-bench-store-") as tmp,
        EmbeddedServer(Path(tmp) / "nats") as srv,
    ):
        for b in backends:
            r = await bench_backend(b, srv.url, Path(tmp), args)
            report(r)
            results.append(r)
    if not args.pg_url:
        print("\npostgresql: skipped (set JETRL_TEST_POSTGRES_URL or pass --pg-url)")
    print()
    for r in results:
        print(f"recorder/baseline {r.backend} {r.recorder_eps / r.baseline_eps:.2f} (target >= 0.7)")
    for r in results:
        print(f"recorder lag p99 {r.backend} {pct(r.lag_samples, 0.99):.2f} s (target < 1 s)")
    for r in results:
        print(f"recorder events/s {r.backend} {r.recorder_eps:,.0f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", type=int, default=60_000, help="events of the pre-filled log")
    p.add_argument(
        "--batch", type=int, default=1000, help="recorder batch (and baseline rows per transaction)"
    )
    p.add_argument("--rate", type=float, default=5000.0, help="events/s published during the lag phase")
    p.add_argument("--lag-seconds", type=float, default=12.0)
    p.add_argument("--pg-url", default=os.environ.get("JETRL_TEST_POSTGRES_URL"))
    args = p.parse_args(argv)
    configure("warning")
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
