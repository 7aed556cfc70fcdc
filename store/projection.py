"""Events → rows: the projection of a run's log, applied in batches.

:func:`apply_batch` is the one write path. In a single transaction it reads the tracking row
(stream, consumer, last_seq), drops every event at or below it (already applied: redelivery,
a restart after a crash between commit and ack), folds the rest into at most one row per
table key, upserts them, and moves the tracking row to the batch's last sequence. A crash
before the commit leaves nothing; a crash after it leaves rows and offset together.

The upserts are idempotent on their own as well: each group of columns carries the sequence
of the event that wrote it and is written "first fact wins" or "last state wins" against that
sequence, so applying the same events twice, or the groups of a batch in any order, yields the
same row (docs/store.md, "How the recorder stays exact").

This module holds the fold, the SQL and the tracking row; what each event writes is in
store/projectors.py, each table's key and column groups in store/specs.py, and columns
computed from others (staleness) in store/derived.py, shared by the fold and the SQL.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from jetrl.store import schema as sc
from jetrl.store.projectors import LogItem, partials
from jetrl.store.specs import SPECS, Group, Spec

__all__ = ["ApplyResult", "LogItem", "apply_batch", "fold", "read_offset", "upsert_rows"]


@dataclass(frozen=True)
class ApplyResult:
    applied: int
    skipped: int
    last_seq: int
    rows: int


# ----------------------------------------------------------------------------- fold


def fold(items: Iterable[LogItem]) -> dict[str, list[dict[str, Any]]]:
    """Fold events (in seq order) into at most one full row per table key.

    Within the batch the same rules hold as in SQL: a whole-row fact or a "first" group keeps
    its first writer, a "last" group its latest; insert defaults fill only empty columns."""
    acc: dict[Spec, dict[tuple[Any, ...], dict[str, Any]]] = {s: {} for s in SPECS}
    for item in items:
        for p in partials(item):
            rows = acc[p.spec]
            row = rows.get(p.key)
            if p.group is None:
                if row is None:
                    rows[p.key] = {**dict(zip(p.spec.key, p.key, strict=True)), **p.values}
                continue
            if row is None:
                row = dict.fromkeys(p.spec.columns)
                row.update(zip(p.spec.key, p.key, strict=True))
                rows[p.key] = row
            g = p.spec.group(p.group)
            current = row[g.seq_col]
            if current is None or (g.mode == "last" and p.seq > current):
                row.update(p.values)
                row[g.seq_col] = p.seq
            for k, v in p.defaults.items():
                if row[k] is None:
                    row[k] = v
    out: dict[str, list[dict[str, Any]]] = {}
    for spec, rows in acc.items():
        if not rows:
            continue
        for d in spec.derived:
            for row in rows.values():
                row[d.column] = d.expr.value(row)
        out[spec.table.name] = list(rows.values())
    return out


# ----------------------------------------------------------------------------- SQL


def _dialect_insert(dialect: str, table: sa.Table) -> Any:
    if dialect == "postgresql":
        return postgresql.insert(table)
    if dialect == "sqlite":
        return sqlite.insert(table)
    raise NotImplementedError(f"the store supports sqlite and postgresql, not {dialect}")


def _group_applies(t: sa.Table, x: Any, g: Group) -> sa.ColumnElement[bool]:
    new, old = x[g.seq_col], t.c[g.seq_col]
    if g.mode == "first":
        return sa.and_(new.is_not(None), old.is_(None))
    return sa.and_(new.is_not(None), sa.or_(old.is_(None), new > old))


def _upsert_statement(dialect: str, spec: Spec) -> Any:
    t = spec.table
    stmt = _dialect_insert(dialect, t)
    if not spec.groups:
        return stmt.on_conflict_do_nothing(index_elements=list(spec.key))
    x = stmt.excluded
    set_: dict[str, sa.ColumnElement[Any]] = {}
    for g in spec.groups:
        cond = _group_applies(t, x, g)
        for col in (*g.cols, g.seq_col):
            set_[col] = sa.case((cond, x[col]), else_=t.c[col])
    # Derived columns read the row as it will be: each group as updated, the rest as stored.
    after = {c.name: set_.get(c.name, c) for c in t.columns}
    for d in spec.derived:
        set_[d.column] = d.expr.sql(after)
    return stmt.on_conflict_do_update(index_elements=list(spec.key), set_=set_)


_STATEMENTS: dict[tuple[str, str], Any] = {}


def upsert_rows(conn: sa.Connection, table: str, rows: Sequence[dict[str, Any]]) -> None:
    if not rows:
        return
    dialect = conn.dialect.name
    stmt = _STATEMENTS.get((dialect, table))
    if stmt is None:
        spec = next(s for s in SPECS if s.table.name == table)
        stmt = _STATEMENTS[(dialect, table)] = _upsert_statement(dialect, spec)
    conn.execute(stmt, list(rows))


def read_offset(conn: sa.Connection, stream: str, consumer: str, *, lock: bool = False) -> int:
    o = sc.OFFSETS
    q = sa.select(o.c.last_seq).where(o.c.stream == stream, o.c.consumer == consumer)
    if lock and conn.dialect.name == "postgresql":
        q = q.with_for_update()
    return int(conn.execute(q).scalar_one_or_none() or 0)


def _write_offset(
    conn: sa.Connection, stream: str, consumer: str, run_id: str, last_seq: int, last_event_at: float | None
) -> None:
    o = sc.OFFSETS
    stmt = _dialect_insert(conn.dialect.name, o)
    values = {
        "stream": stream,
        "consumer": consumer,
        "run_id": run_id,
        "last_seq": last_seq,
        "last_event_at": last_event_at,
        "updated_at": time.time(),
    }
    stmt = stmt.values(**values).on_conflict_do_update(
        index_elements=["stream", "consumer"],
        set_={
            "last_seq": stmt.excluded.last_seq,
            # A batch of nothing but dead-lettered messages keeps the last recorded event's time.
            "last_event_at": sa.func.coalesce(stmt.excluded.last_event_at, o.c.last_event_at),
            "updated_at": stmt.excluded.updated_at,
        },
    )
    conn.execute(stmt)


def apply_batch(
    conn: sa.Connection,
    *,
    run_id: str,
    stream: str,
    consumer: str,
    items: Sequence[LogItem],
    through_seq: int | None = None,
) -> ApplyResult:
    """Apply ``items`` and move the tracking row, inside the caller's transaction (use
    ``Store.write()``). Events at or below the tracking row are skipped. ``through_seq`` moves
    the tracking row past sequences that carried nothing to record (dead-lettered messages)."""
    last = read_offset(conn, stream, consumer, lock=True)
    fresh = sorted((i for i in items if i.seq > last), key=lambda i: i.seq)
    top_seq = max([last, *(i.seq for i in fresh), *([through_seq] if through_seq is not None else [])])
    if top_seq == last:
        return ApplyResult(applied=0, skipped=len(items), last_seq=last, rows=0)
    rows = fold(fresh)
    n = 0
    for spec in SPECS:
        batch = rows.get(spec.table.name)
        if batch:
            upsert_rows(conn, spec.table.name, batch)
            n += len(batch)
    _write_offset(conn, stream, consumer, run_id, top_seq, fresh[-1].event.time if fresh else None)
    return ApplyResult(applied=len(fresh), skipped=len(items) - len(fresh), last_seq=top_seq, rows=n)
