"""Opening the store: engine setup per backend and schema migrations (Alembic) on open.

SQLite (the embedded default) is a file in WAL mode so readers (CLI, supervisor) never block the
recorder; PostgreSQL is reached by URL through psycopg 3 (``postgresql+psycopg://``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from jetrl.bus.log import get_logger

log = get_logger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


def sqlite_url(path: str | Path) -> str:
    return f"sqlite:///{Path(path)}"


def _normalise_url(url: str) -> sa.URL:
    u = sa.make_url(url)
    # A bare postgresql:// would pick psycopg2, which jetrl does not ship.
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+psycopg")
    return u


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # The driver's implicit transaction handling is switched off; SQLAlchemy's "begin"
    # event below emits BEGIN itself, so a read-then-write is one real transaction.
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    # NORMAL in WAL mode: a commit survives a process crash (kill -9); only an OS crash can
    # lose the last commits, which the recorder then re-applies from the log.
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA temp_store=MEMORY")
    cur.execute("PRAGMA cache_size=-65536")
    cur.close()


def _sqlite_begin(conn: sa.Connection) -> None:
    # Writers ask for IMMEDIATE so two writers serialise at BEGIN instead of failing with
    # SQLITE_BUSY when a read lock is upgraded mid-transaction.
    mode = conn.get_execution_options().get("sqlite_begin", "DEFERRED")
    conn.exec_driver_sql(f"BEGIN {mode}")


def make_engine(url: str, **kwargs: Any) -> sa.Engine:
    u = _normalise_url(url)
    if u.get_backend_name() == "sqlite":
        if u.database and u.database != ":memory:":
            Path(u.database).parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(u, **kwargs)
        sa.event.listen(engine, "connect", _sqlite_pragmas)
        sa.event.listen(engine, "begin", _sqlite_begin)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    return sa.create_engine(u, **kwargs)


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("path_separator", "os")
    return cfg


def upgrade(engine: sa.Engine, revision: str = "head") -> tuple[str | None, str | None]:
    """Apply migrations up to ``revision`` on the engine's database (idempotent), in one
    transaction on one connection; returns the revisions before and after."""
    cfg = alembic_config()
    with engine.begin() as conn:
        before = MigrationContext.configure(conn).get_current_revision()
        cfg.attributes["connection"] = conn  # migrations/env.py runs on this connection
        command.upgrade(cfg, revision)
        return before, MigrationContext.configure(conn).get_current_revision()


def current_revision(engine: sa.Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


@dataclass
class Store:
    """A migrated database holding one or more runs' projections."""

    engine: sa.Engine

    @property
    def backend(self) -> str:
        return self.engine.dialect.name

    @contextmanager
    def write(self) -> Iterator[sa.Connection]:
        """One write transaction (BEGIN IMMEDIATE on SQLite)."""
        with self.engine.connect().execution_options(sqlite_begin="IMMEDIATE") as conn, conn.begin():
            yield conn

    @contextmanager
    def read(self) -> Iterator[sa.Connection]:
        with self.engine.connect() as conn, conn.begin():
            yield conn

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_store(url: str) -> Store:
    """Open (creating if needed) the store at ``url`` and bring its schema to the head
    revision. ``url`` is a SQLAlchemy URL; a plain path is taken as a SQLite file."""
    if "://" not in url:
        url = sqlite_url(url)
    engine = make_engine(url)
    before, after = upgrade(engine)
    if before != after:
        log.info("store_migrated", backend=engine.dialect.name, from_rev=before, to_rev=after)
    return Store(engine=engine)
