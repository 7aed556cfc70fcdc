"""The projection's write path (store/projection.py, TableWriter): rows go to the driver without
SQLAlchemy's per-row work, and must be stored exactly as SQLAlchemy Core would store them."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from jetrl.bus import events as ev
from jetrl.store import dump
from jetrl.store import schema as sc
from jetrl.store.db import Store, open_store
from jetrl.store.projection import (
    TrackingRowBehind,
    _upsert_statement,
    apply_batch,
    fold,
    prepare_batch,
    upsert_rows,
    write_batch,
)
from jetrl.store.specs import SPECS
from tests.support.synthetic import log_items, synthetic_run


def edge_events() -> list[ev.Event]:
    """Rows the synthetic run does not make: a step before any of its rollouts (rollout rows
    with JSON columns left empty), non-finite metrics, a worker loaded before any heartbeat, a
    dead letter's raw bytes, a run finished before it started."""
    return [
        ev.new_event(
            ev.StepCompleted(
                step=99,
                policy_version=1,
                rollout_ids=["ghost-1", "ghost-2"],
                rollout_seqs=[5],
                metrics={"loss": float("nan"), "g": float("inf"), "n": 3},
            ),
            run_id="w",
        ),
        ev.new_event(
            ev.WeightsLoaded(worker_id="wz", version=3, load_s=1, checksum_verified=True), run_id="w"
        ),
        ev.new_event(
            ev.DeadLettered(
                reason="malformed",
                detail="d",
                consumer="c",
                original_subject="s",
                original_stream_seq=3,
                original_data=b"\x00\xffab",
            ),
            run_id="w",
        ),
        ev.new_event(ev.RunFinished(status="failed", steps=3, reason="x"), run_id="w-other"),
    ]


def all_rows() -> dict[str, list[dict[str, Any]]]:
    events = synthetic_run("w", steps=3, seed=9).events
    return fold(log_items([*events[:150], *edge_events(), *events[150:]]))


def _rollouts() -> sa.Table:
    return next(t for t in sc.PROJECTION_TABLES if t.name == "rollouts")


def raw_rows(store: Store) -> dict[str, list[tuple[Any, ...]]]:
    """Every projection row as the database holds it: values and their storage types, read
    through the driver (no SQLAlchemy result processing)."""
    out = {}
    with store.read() as conn:
        for t in sc.PROJECTION_TABLES:
            cols = [c.name for c in t.columns]
            order = ", ".join(c.name for c in t.primary_key.columns)
            if store.backend == "sqlite":
                exprs = [f"{c}, typeof({c})" for c in cols]
            else:
                exprs = [f"{c}::text, pg_typeof({c})::text, {c} IS NULL" for c in cols]
            q = f"SELECT {', '.join(exprs)} FROM {t.name} ORDER BY {order}"
            out[t.name] = [tuple(r) for r in conn.exec_driver_sql(q).all()]
    return out


def test_rows_are_stored_as_sqlalchemy_core_stores_them(db_url: str) -> None:
    rows = all_rows()
    assert rows["rollouts"] and any(r["payloads"] is None for r in rows["rollouts"])
    fast, core = open_store(db_url), None
    try:
        with fast.write() as conn:
            for spec in SPECS:
                upsert_rows(conn, spec.table.name, rows.get(spec.table.name, []))
        # The reference: the same statement through Core's executemany (its bind processors).
        reference = raw_rows(fast)
        with fast.write() as conn:
            for t in sc.PROJECTION_TABLES:
                conn.execute(sa.delete(t))
        core = fast
        with core.write() as conn:
            for spec in SPECS:
                batch = rows.get(spec.table.name)
                if batch:
                    conn.execute(_upsert_statement(conn.dialect.name, spec), batch)
        assert raw_rows(core) == reference
        # A JSON column left empty holds JSON null (not SQL NULL), as Core writes None there.
        width = 2 if fast.backend == "sqlite" else 3  # value, type[, is null] per column
        names = [c.name for c in _rollouts().columns]
        (ghost,) = [r for r in reference["rollouts"] if r[names.index("rollout_id") * width] == "ghost-1"]
        at = names.index("payloads") * width
        assert ghost[at] == "null"
        assert fast.backend == "sqlite" or ghost[at + 2] is False
    finally:
        fast.close()


def test_a_second_batch_in_one_transaction_starts_from_empty_staging(db_url: str) -> None:
    run = synthetic_run("w2", steps=4, seed=10)
    items = log_items(run.events)
    half = len(items) // 2  # rollouts scored in the first half are trained in the second
    one, two = open_store(db_url), None
    try:
        with one.write() as conn:  # two batches, one transaction
            apply_batch(conn, run_id="w2", stream="S", consumer="c", items=items[:half])
            apply_batch(conn, run_id="w2", stream="S", consumer="c", items=items[half:])
        with one.read() as conn:
            together = dump.dump_run(conn, "w2", offsets=False)
        with one.write() as conn:
            dump.delete_run(conn, "w2")
        two = one
        with two.write() as conn:
            apply_batch(conn, run_id="w2", stream="S", consumer="c", items=items)
        with two.read() as conn:
            assert dump.dump_run(conn, "w2", offsets=False) == together
    finally:
        one.close()


def test_a_batch_folded_against_an_older_tracking_row_writes_the_same_rows(db_url: str) -> None:
    items = log_items(synthetic_run("w5", steps=3, seed=13).events)
    a, b = len(items) // 3, 2 * len(items) // 3
    store = open_store(db_url)
    try:
        with store.write() as conn:
            apply_batch(conn, run_id="w5", stream="S", consumer="c", items=items)
        with store.read() as conn:
            once = dump.dump_run(conn, "w5")
        with store.write() as conn:
            dump.delete_run(conn, "w5")
        # Folded while the row was at 0; by the time it is written the row is at ``a``.
        late = prepare_batch(items[:b], after_seq=0)
        with store.write() as conn:
            apply_batch(conn, run_id="w5", stream="S", consumer="c", items=items[:a])
        with store.write() as conn:
            r = write_batch(conn, late, run_id="w5", stream="S", consumer="c", committed_seq=a)
        assert r.last_seq == b
        # Entirely at or below the row: nothing is written, the row stays.
        stale = prepare_batch(items[:a], after_seq=0)
        with store.write() as conn:
            r = write_batch(conn, stale, run_id="w5", stream="S", consumer="c")
        assert (r.last_seq, r.rows) == (b, 0)
        with store.write() as conn:
            apply_batch(conn, run_id="w5", stream="S", consumer="c", items=items[b:])
        with store.read() as conn:
            again = dump.dump_run(conn, "w5")
        # The tracking row's time of the last event is the same too: only its wall clock differs.
        assert again == once
    finally:
        store.close()


def test_a_tracking_row_behind_what_was_committed_is_refused(db_url: str) -> None:
    items = log_items(synthetic_run("w3", steps=3, seed=11).events)
    assert len(items) > 80
    store = open_store(db_url)
    try:
        with store.write() as conn:
            r = apply_batch(conn, run_id="w3", stream="S", consumer="c", items=items[:50], committed_seq=0)
        assert r.last_seq == 50
        # As if the last commit were lost: the row is back at 20, the writer knows it had 50.
        with store.write() as conn:
            conn.execute(sa.update(sc.OFFSETS).values(last_seq=20))
        with pytest.raises(TrackingRowBehind), store.write() as conn:
            apply_batch(conn, run_id="w3", stream="S", consumer="c", items=items[50:80], committed_seq=50)
        with store.read() as conn:  # nothing of the refused batch was written
            assert dump.dump_run(conn, "w3")["consumer_offsets"][0][3] == 20
    finally:
        store.close()


def test_background_checkpoints_bring_the_wal_into_the_database_file(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    store = open_store(f"sqlite:///{path}")
    store.checkpoint_in_background(every_s=0.05)
    items = log_items(synthetic_run("w4", steps=2, seed=12).events)
    try:
        with store.write() as conn:
            assert conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar() == 0
            apply_batch(conn, run_id="w4", stream="S", consumer="c", items=items)
        # The database file alone (immutable: its WAL ignored) holds the rows once a
        # checkpoint has copied them there, with the writer's connection still open.
        deadline = time.monotonic() + 30
        seen = 0
        while time.monotonic() < deadline:
            ro = sqlite3.connect(f"file:{path}?immutable=1", uri=True)
            try:
                seen = ro.execute("SELECT count(*) FROM tasks").fetchone()[0]
            except sqlite3.DatabaseError:
                seen = 0
            finally:
                ro.close()
            if seen:
                break
            time.sleep(0.05)
        assert seen > 0
    finally:
        store.close()
