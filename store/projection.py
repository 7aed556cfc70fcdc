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

Each table's upsert is built once per dialect with SQLAlchemy Core and compiled once
(:class:`TableWriter`); a batch then goes straight to the driver, converted by the same bind
processors SQLAlchemy would apply (so the stored values are the ones ``conn.execute`` would
store): one ``executemany`` on SQLite, and on PostgreSQL a binary ``COPY`` into a temporary
staging table followed by one ``INSERT ... SELECT ... ON CONFLICT`` (docs/store.md, "Speed").

This module holds the fold, the SQL and the tracking row; what each event writes is in
store/projectors.py (from the fact it states, store/readmodel), each table's key and column
groups in store/specs.py, and columns computed from others (staleness) in store/derived.py,
shared by the fold and the SQL.
"""

from __future__ import annotations

import operator
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.schema import CreateTable

from jetrl.store import schema as sc
from jetrl.store.projectors import Logged, LogItem, partials
from jetrl.store.specs import SPECS, Group, Spec

__all__ = [
    "ApplyResult",
    "LogItem",
    "Logged",
    "PreparedBatch",
    "TableWriter",
    "TrackingRowBehind",
    "apply_batch",
    "fold",
    "prepare_batch",
    "read_offset",
    "upsert_rows",
    "write_batch",
    "write_tables",
]


class TrackingRowBehind(RuntimeError):
    """The tracking row is below the last sequence its writer committed: commits were lost (a
    PostgreSQL server that crashed while commits were asynchronous, a restored backup). The
    events after the row must be read again from the log, not skipped."""


@dataclass(frozen=True)
class ApplyResult:
    applied: int
    skipped: int
    last_seq: int
    rows: int


# ----------------------------------------------------------------------------- fold


def fold(items: Iterable[Logged]) -> dict[str, list[dict[str, Any]]]:
    """Fold events (in seq order) into at most one full row per table key.

    Within the batch the same rules hold as in SQL: a whole-row fact or a "first" group keeps
    its first writer, a "last" group its latest; insert defaults fill only empty columns."""
    acc: dict[Spec, dict[tuple[Any, ...], dict[str, Any]]] = {s: {} for s in SPECS}
    for item in items:
        for p in partials(item):
            spec = p.spec
            rows = acc[spec]
            row = rows.get(p.key)
            if p.group is None:
                if row is None:
                    row = dict(zip(spec.key, p.key, strict=True))
                    row.update(p.values)
                    rows[p.key] = row
                continue
            if row is None:
                row = spec.empty_row(p.key)
                rows[p.key] = row
            g = spec.groups_by_seq[p.group]
            current = row[g.seq_col]
            if current is None or (g.mode == "last" and p.seq > current):
                row.update(p.values)
                row[g.seq_col] = p.seq
            if p.defaults:
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


def _upsert_statement(dialect: str, spec: Spec, source: sa.Table | None = None) -> Any:
    """The upsert of ``spec``'s rows: of one row of parameters, or (``source``) of every row
    of a table with the same columns."""
    t = spec.table
    stmt = _dialect_insert(dialect, t)
    if source is not None:
        stmt = stmt.from_select(list(spec.columns), sa.select(*(source.c[c] for c in spec.columns)))
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


Converter = Callable[[Any], Any]


class TableWriter:
    """One table's upsert for one dialect, compiled once.

    It takes full rows (dicts with every column, as :func:`fold` makes them) and hands them to
    the driver in one go (:func:`write_tables`). Values are converted by the bind processor
    SQLAlchemy has for each column's type on that dialect (JSON to text on SQLite, ``Jsonb`` on
    PostgreSQL, floats and booleans coerced), so a row is stored exactly as
    ``conn.execute(insert, rows)`` would store it; what is skipped is SQLAlchemy's per-execute
    and per-row set-up around them.

    * SQLite: the compiled ``INSERT ... VALUES (?, ...) ON CONFLICT ...`` through the driver's
      ``executemany`` (its loop over the rows is C), after the rows that carry only a
      ``follows`` group are tried as an ``UPDATE`` each (:meth:`update_rows`: a third of the
      upsert's cost on a row that is there, whose every guard the upsert evaluates).
    * PostgreSQL: a binary ``COPY`` into a temporary staging table of the same columns
      (``pg_temp.jetrl_stage_<table>``, ``CREATE ... IF NOT EXISTS`` in each batch, emptied at
      commit), then one ``INSERT ... SELECT ... ON CONFLICT ...`` from it, then the staging rows
      are deleted (so a second batch in the same transaction starts empty). The server runs one
      statement per table and batch instead of one per row, and the client's per-row work is
      psycopg's C row encoder.
    """

    def __init__(self, spec: Spec, dialect: sa.Dialect) -> None:
        self.spec = spec
        t = spec.table
        self.columns: tuple[str, ...] = spec.columns
        self._values = operator.itemgetter(*self.columns)
        self._converters: tuple[tuple[int, Converter], ...] = tuple(
            (i, proc)
            for i, c in enumerate(self.columns)
            if (proc := t.c[c].type.dialect_impl(dialect).bind_processor(dialect)) is not None
        )
        self.updates: dict[str, _GroupUpdate] = {}  # SQLite's, by the group's sequence column
        if dialect.name == "postgresql":
            staging = sa.Table(
                f"jetrl_stage_{t.name}",
                sa.MetaData(),
                *(sa.Column(c.name, c.type) for c in t.columns),  # no constraints: the target checks
                schema="pg_temp",
                prefixes=["TEMPORARY"],
                postgresql_on_commit="DELETE ROWS",
            )
            name = f"pg_temp.{staging.name}"
            self.create_staging = str(CreateTable(staging, if_not_exists=True).compile(dialect=dialect))
            self.copy = f"COPY {name} ({', '.join(self.columns)}) FROM STDIN (FORMAT BINARY)"
            # psycopg names types as PostgreSQL does, without a length ("varchar", "double precision").
            self.copy_types = [
                t.c[c].type.compile(dialect=dialect).split("(")[0].lower() for c in self.columns
            ]
            upsert = str(_upsert_statement("postgresql", spec, staging).compile(dialect=dialect))
            self.merge = f"{upsert}; DELETE FROM {name}"
        elif dialect.name == "sqlite":
            compiled = _upsert_statement("sqlite", spec).compile(
                dialect=dialect, column_keys=list(self.columns)
            )
            if tuple(compiled.positiontup or ()) != self.columns:
                raise AssertionError(f"{t.name}: upsert parameters are not the table's columns in order")
            self.upsert = str(compiled)
            converters = dict((self.columns[i], conv) for i, conv in self._converters)
            self.updates = {
                g.seq_col: _GroupUpdate(spec, g, dialect, converters) for g in spec.groups if g.follows
            }
        else:
            raise NotImplementedError(f"the store supports sqlite and postgresql, not {dialect.name}")

    def params(self, rows: Iterable[dict[str, Any]]) -> list[Sequence[Any]]:
        """Each row's values in column order, converted as SQLAlchemy would bind them."""
        get, converters = self._values, self._converters
        try:
            if not converters:
                return [get(r) for r in rows]
            out: list[Sequence[Any]] = []
            for r in rows:
                vals = list(get(r))
                for i, conv in converters:
                    vals[i] = conv(vals[i])
                out.append(vals)
            return out
        except KeyError as exc:  # a projector left a column of a whole-row fact out
            raise KeyError(f"{self.spec.table.name}: a row has no value for column {exc}") from None

    def update_rows(self, cur: Any, rows: Sequence[dict[str, Any]]) -> Sequence[dict[str, Any]]:
        """SQLite: write the rows that carry one ``follows`` group alone as UPDATEs of their
        rows; returns the rest, and those whose UPDATE found no row to change (none yet, or
        the group there already), for the upsert. The row as the upsert would leave it: the
        group's columns and the derived ones, where the group applies."""
        if not self.updates:
            return rows
        rest: list[dict[str, Any]] = []
        groups = self.spec.groups
        for row in rows:
            present = [g.seq_col for g in groups if row[g.seq_col] is not None]
            update = self.updates.get(present[0]) if len(present) == 1 else None
            if update is None:
                rest.append(row)
                continue
            cur.execute(update.sql, update.params(row))
            if cur.rowcount != 1:
                rest.append(row)
        return rest

    def stage(self, cur: Any, rows: Sequence[dict[str, Any]]) -> None:
        """PostgreSQL: COPY ``rows`` into the (existing) staging table."""
        with cur.copy(self.copy) as copy:
            copy.set_types(self.copy_types)
            for p in self.params(rows):
                copy.write_row(p)


class _GroupUpdate:
    """One ``follows`` group's UPDATE on SQLite: its columns and the derived ones set where the
    key matches and the group applies (first: not there yet; last: newer), compiled once."""

    def __init__(self, spec: Spec, g: Group, dialect: sa.Dialect, converters: dict[str, Converter]) -> None:
        t = spec.table
        binds = {c: sa.bindparam(f"new_{c}", type_=t.c[c].type) for c in (*g.cols, g.seq_col)}
        keys = {k: sa.bindparam(f"key_{k}", type_=t.c[k].type) for k in spec.key}
        after: dict[str, sa.ColumnElement[Any]] = {c.name: binds.get(c.name, c) for c in t.columns}
        values: dict[str, sa.ColumnElement[Any]] = dict(binds)
        for d in spec.derived:
            values[d.column] = d.expr.sql(after)
        old = t.c[g.seq_col]
        applies = old.is_(None) if g.mode == "first" else sa.or_(old.is_(None), binds[g.seq_col] > old)
        where = [t.c[k] == b for k, b in keys.items()]
        compiled = sa.update(t).where(*where, applies).values(values).compile(dialect=dialect)
        self.sql = str(compiled)
        # Each positional parameter's column and its bind processor (as the upsert converts it).
        column_of = {b.key: c for c, b in (*binds.items(), *keys.items())}
        self._cols = [column_of[name] for name in compiled.positiontup or ()]
        self._convert = [converters.get(c) for c in self._cols]

    def params(self, row: dict[str, Any]) -> list[Any]:
        pairs = zip(self._cols, self._convert, strict=True)
        return [row[c] if conv is None else conv(row[c]) for c, conv in pairs]


def write_tables(conn: sa.Connection, writes: Sequence[tuple[TableWriter, Sequence[dict[str, Any]]]]) -> None:
    """Upsert each writer's rows, in the order given, inside ``conn``'s transaction. On
    PostgreSQL that is one round trip to make sure the staging tables exist, one ``COPY`` per
    table, and one for every table's merge."""
    writes = [(w, rows) for w, rows in writes if rows]
    if not writes:
        return
    driver = conn.connection.driver_connection
    if driver is None:
        raise RuntimeError("the store's connection has no driver connection")
    cur = driver.cursor()
    try:
        if conn.dialect.name == "sqlite":
            for w, rows in writes:
                rows = w.update_rows(cur, rows)
                if rows:
                    cur.executemany(w.upsert, w.params(rows))
            return
        # Statements without parameters: psycopg sends them as one simple query.
        cur.execute("; ".join(w.create_staging for w, _ in writes))
        for w, rows in writes:
            w.stage(cur, rows)
        cur.execute("; ".join(w.merge for w, _ in writes))
    finally:
        cur.close()


# Per dialect object (one per engine: its settings are part of the compiled SQL), per table.
_WRITERS: weakref.WeakKeyDictionary[sa.Dialect, dict[str, TableWriter]] = weakref.WeakKeyDictionary()


def _writer(conn: sa.Connection, spec: Spec) -> TableWriter:
    writers = _WRITERS.get(conn.dialect)
    if writers is None:
        writers = _WRITERS[conn.dialect] = {}
    w = writers.get(spec.table.name)
    if w is None:
        w = writers[spec.table.name] = TableWriter(spec, conn.dialect)
    return w


_SPECS_BY_TABLE = {s.table.name: s for s in SPECS}


def upsert_rows(conn: sa.Connection, table: str, rows: Sequence[dict[str, Any]]) -> None:
    """Upsert full rows of ``table`` (as :func:`fold` makes them) inside ``conn``'s transaction."""
    write_tables(conn, [(_writer(conn, _SPECS_BY_TABLE[table]), rows)])


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


@dataclass(frozen=True)
class PreparedBatch:
    """A batch folded against a tracking row, ready to write: its rows, the sequence the tracking
    row moves to, and the time of its last event."""

    rows: dict[str, list[dict[str, Any]]]
    applied: int
    skipped: int
    top_seq: int
    last_event_at: float | None


def prepare_batch(
    items: Sequence[Logged], *, after_seq: int, through_seq: int | None = None
) -> PreparedBatch:
    """Fold the events of ``items`` after ``after_seq`` (no database needed)."""
    fresh = sorted((i for i in items if i.seq > after_seq), key=lambda i: i.seq)
    top_seq = max([after_seq, *(i.seq for i in fresh), *([through_seq] if through_seq is not None else [])])
    return PreparedBatch(
        rows=fold(fresh) if fresh else {},
        applied=len(fresh),
        skipped=len(items) - len(fresh),
        top_seq=top_seq,
        last_event_at=fresh[-1].event.time if fresh else None,
    )


def _locked_offset(conn: sa.Connection, stream: str, consumer: str, committed_seq: int | None) -> int:
    last = read_offset(conn, stream, consumer, lock=True)
    if committed_seq is not None and last < committed_seq:
        raise TrackingRowBehind(
            f"tracking row of {stream}/{consumer} is at {last}, but {committed_seq} was committed"
        )
    return last


def _write_prepared(
    conn: sa.Connection, batch: PreparedBatch, last: int, *, run_id: str, stream: str, consumer: str
) -> ApplyResult:
    if batch.top_seq <= last:  # nothing after the tracking row
        return ApplyResult(applied=0, skipped=batch.applied + batch.skipped, last_seq=last, rows=0)
    writes = [
        (_writer(conn, spec), batch.rows[spec.table.name]) for spec in SPECS if spec.table.name in batch.rows
    ]
    write_tables(conn, writes)
    _write_offset(conn, stream, consumer, run_id, batch.top_seq, batch.last_event_at)
    n = sum(len(r) for _, r in writes)
    return ApplyResult(applied=batch.applied, skipped=batch.skipped, last_seq=batch.top_seq, rows=n)


def apply_batch(
    conn: sa.Connection,
    *,
    run_id: str,
    stream: str,
    consumer: str,
    items: Sequence[Logged],
    through_seq: int | None = None,
    committed_seq: int | None = None,
) -> ApplyResult:
    """Apply ``items`` and move the tracking row, inside the caller's transaction (use
    ``Store.write()``). Events at or below the tracking row are skipped. ``through_seq`` moves
    the tracking row past sequences that carried nothing to record (dead-lettered messages).
    ``committed_seq``, the last sequence the caller has committed, makes a tracking row below
    it an error (:class:`TrackingRowBehind`) instead of a gap."""
    last = _locked_offset(conn, stream, consumer, committed_seq)
    batch = prepare_batch(items, after_seq=last, through_seq=through_seq)
    return _write_prepared(conn, batch, last, run_id=run_id, stream=stream, consumer=consumer)


def write_batch(
    conn: sa.Connection,
    batch: PreparedBatch,
    *,
    run_id: str,
    stream: str,
    consumer: str,
    committed_seq: int | None = None,
) -> ApplyResult:
    """Write a batch folded elsewhere (:func:`prepare_batch`) and move the tracking row, as
    :func:`apply_batch` does. Folded against a tracking row that has moved on since, the batch
    holds events at or below the row again: their upserts change nothing (each group is
    guarded by its sequence), and the row moves only forward."""
    last = _locked_offset(conn, stream, consumer, committed_seq)
    return _write_prepared(conn, batch, last, run_id=run_id, stream=stream, consumer=consumer)
