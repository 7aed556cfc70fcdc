"""The schema and its migrations, on SQLite and PostgreSQL."""

from __future__ import annotations

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from jetrl.store import schema as sc
from jetrl.store.db import Store, current_revision, head_revision, open_store


def test_open_store_migrates_to_head(store: Store) -> None:
    assert head_revision() is not None
    assert current_revision(store.engine) == head_revision()
    names = set(sa.inspect(store.engine).get_table_names())
    assert {t.name for t in sc.PROJECTION_TABLES} | {"consumer_offsets", "alembic_version"} <= names


def test_migrations_match_the_models(store: Store) -> None:
    # A model changed without a migration (or the reverse) shows up as a difference here.
    with store.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        diffs = compare_metadata(ctx, sc.Base.metadata)
    assert diffs == []


def test_reopen_is_idempotent(db_url: str) -> None:
    for _ in range(2):
        s = open_store(db_url)
        assert current_revision(s.engine) == head_revision()
        s.close()


def test_sqlite_runs_in_wal_mode(tmp_path) -> None:
    s = open_store(str(tmp_path / "x" / "store.db"))  # a bare path means a SQLite file
    with s.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL
    assert s.backend == "sqlite"
    s.close()
