"""A canonical dump of one run's projection: the proof that a rebuild equals the original.

Rows are read in primary-key order and rendered backend-independently (JSON with sorted keys,
floats by ``repr``, bytes as hex), so two dumps are equal exactly when the tables hold the same
facts. Bookkeeping that legitimately differs between passes (the tracking row's wall-clock
``updated_at``) is left out.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from jetrl.store import schema as sc

Dump = dict[str, list[tuple[Any, ...]]]

_VOLATILE = {"consumer_offsets": {"updated_at"}}


def _canon(value: Any) -> Any:
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, bytes | memoryview):
        return bytes(value).hex()
    return value


def _table_rows(conn: sa.Connection, table: sa.Table, where: sa.ColumnElement[bool]) -> list[tuple[Any, ...]]:
    cols = [c for c in table.columns if c.name not in _VOLATILE.get(table.name, set())]
    pk = list(table.primary_key.columns)
    rows = conn.execute(sa.select(*cols).where(where).order_by(*pk)).all()
    return [tuple(_canon(v) for v in row) for row in rows]


def dump_run(conn: sa.Connection, run_id: str, *, offsets: bool = True) -> Dump:
    """Every row of ``run_id`` in every projection table (and its tracking rows)."""
    out: Dump = {}
    for t in sc.PROJECTION_TABLES:
        out[t.name] = _table_rows(conn, t, t.c.run_id == run_id)
    if offsets:
        out[sc.OFFSETS.name] = _table_rows(conn, sc.OFFSETS, sc.OFFSETS.c.run_id == run_id)
    return out


@dataclass(frozen=True)
class TableDigest:
    rows: int
    sha256: str


def digest(dump: Dump) -> dict[str, TableDigest]:
    out = {}
    for name, rows in dump.items():
        h = hashlib.sha256()
        for row in rows:
            h.update(json.dumps(row, default=str, separators=(",", ":")).encode())
            h.update(b"\n")
        out[name] = TableDigest(rows=len(rows), sha256=h.hexdigest())
    return out


def diff(a: Dump, b: Dump, *, limit: int = 5) -> dict[str, list[str]]:
    """Per table, a few rows present in one dump and not the other ({} when equal)."""
    out: dict[str, list[str]] = {}
    for name in sorted(set(a) | set(b)):
        ra, rb = set(a.get(name, [])), set(b.get(name, []))
        if ra == rb and len(a.get(name, [])) == len(b.get(name, [])):
            continue
        lines = [f"- {r}" for r in sorted(ra - rb, key=str)[:limit]]
        lines += [f"+ {r}" for r in sorted(rb - ra, key=str)[:limit]]
        out[name] = lines or [f"row counts {len(a.get(name, []))} != {len(b.get(name, []))}"]
    return out


def delete_run(conn: sa.Connection, run_id: str) -> int:
    """Remove a run's projection and tracking rows (the first half of a rebuild)."""
    n = 0
    for t in (*sc.PROJECTION_TABLES, sc.OFFSETS):
        n += conn.execute(sa.delete(t).where(t.c.run_id == run_id)).rowcount or 0
    return n
