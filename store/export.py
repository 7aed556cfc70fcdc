"""A run's projection as files: each table's rows of the run as JSON lines, CSV or Parquet (the
optional ``export`` extra's pyarrow), one file per table, streamed in primary-key order."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jetrl.store.db import Store

# SQLAlchemy, the schema and pyarrow are imported when a run is exported: the CLI names the
# formats without paying for them.

EXPORT_FORMATS = ("jsonl", "csv", "parquet")


def _export_rows(store: Store, table_name: str, run: str) -> tuple[list[str], Iterator[dict[str, Any]]]:
    import sqlalchemy as sa

    from jetrl.store import schema as sc

    table = sc.Base.metadata.tables[table_name]
    cols = [c.name for c in table.columns]

    def rows() -> Iterator[dict[str, Any]]:
        q = sa.select(table).where(table.c.run_id == run).order_by(*table.primary_key.columns)
        with store.read() as conn:
            for row in conn.execution_options(yield_per=5000).execute(q).mappings():
                yield dict(row)

    return cols, rows()


def _flat(v: Any) -> Any:
    # One value per cell: JSON columns as JSON text, bytes as hex.
    if isinstance(v, dict | list):
        return json.dumps(v, sort_keys=True)
    if isinstance(v, bytes | memoryview):
        return bytes(v).hex()
    return v


def _arrow_schema(table_name: str) -> Any:
    import pyarrow as pa
    import sqlalchemy as sa

    from jetrl.store import schema as sc

    fields = []
    for c in sc.Base.metadata.tables[table_name].columns:
        t = c.type
        at: pa.DataType
        if isinstance(t, sa.Boolean):
            at = pa.bool_()
        elif isinstance(t, sa.Integer):
            at = pa.int64()
        elif isinstance(t, sa.Double | sa.Float):
            at = pa.float64()
        elif isinstance(t, sa.LargeBinary):
            at = pa.binary()
        else:  # strings and JSON (as text)
            at = pa.string()
        fields.append(pa.field(c.name, at))
    return pa.schema(fields)


def export_run(store: Store, run: str, out_dir: Path, fmt: str, tables: list[str]) -> dict[str, int]:
    """Write each table's rows of ``run`` to ``out_dir/<table>.<fmt>``; returns rows per table."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"format must be one of {EXPORT_FORMATS}")
    out_dir.mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {}
    for name in tables:
        cols, rows = _export_rows(store, name, run)
        path = out_dir / f"{name}.{fmt}"
        n = 0
        if fmt == "jsonl":
            with path.open("w") as f:
                for r in rows:
                    f.write(
                        json.dumps({k: _flat(v) if isinstance(v, bytes) else v for k, v in r.items()}) + "\n"
                    )
                    n += 1
        elif fmt == "csv":
            with path.open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=cols)
                w.writeheader()
                for r in rows:
                    w.writerow({k: _flat(v) for k, v in r.items()})
                    n += 1
        else:
            try:
                import pyarrow as pa
                import pyarrow.parquet as pq
            except ImportError as exc:  # pyarrow is the optional `export` extra
                raise SystemExit("parquet export needs pyarrow: pip install 'jetrl[export]'") from exc
            schema = _arrow_schema(name)
            with pq.ParquetWriter(path, schema) as writer:
                chunk: list[dict[str, Any]] = []
                for r in rows:
                    chunk.append({k: (v if isinstance(v, bytes) else _flat(v)) for k, v in r.items()})
                    if len(chunk) >= 10_000:
                        writer.write_table(pa.Table.from_pylist(chunk, schema=schema))
                        n += len(chunk)
                        chunk = []
                if chunk or n == 0:
                    writer.write_table(pa.Table.from_pylist(chunk, schema=schema))
                    n += len(chunk)
        counts[name] = n
    return counts
