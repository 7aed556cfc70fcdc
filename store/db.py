"""Opening the store: engine setup per backend and schema migrations (Alembic) on open.

SQLite (the embedded default) is a file in WAL mode so readers (CLI, supervisor) never block the
recorder; PostgreSQL is reached by URL through psycopg 3 (``postgresql+psycopg://``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
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


class _Checkpointer:
    """SQLite's WAL checkpoints on a thread of their own, after commits, at most one at a time
    and one per ``every_s``: a PASSIVE checkpoint copies what it can of the WAL into the
    database file and syncs it, never waiting for readers or the writer."""

    def __init__(self, engine: sa.Engine, every_s: float) -> None:
        self.engine = engine
        self.every_s = every_s
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="store-checkpoints", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            if self._stopping.is_set():
                return
            self._wake.clear()
            try:
                with self.engine.connect() as conn:
                    driver = conn.connection.driver_connection
                    assert driver is not None
                    driver.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            except Exception as exc:  # the next commit pokes again; the WAL only grows meanwhile
                log.warning("store_checkpoint_failed", error=repr(exc))
            if self._stopping.wait(self.every_s):
                return

    def close(self) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join()


@dataclass
class Store:
    """A migrated database holding one or more runs' projections."""

    engine: sa.Engine
    _checkpointer: _Checkpointer | None = field(default=None, repr=False)

    @property
    def backend(self) -> str:
        return self.engine.dialect.name

    def checkpoint_in_background(self, every_s: float = 0.5) -> None:
        """SQLite: take WAL checkpoints off this store's commits. By default the connection
        that commits runs a checkpoint (copy the WAL into the database file, then sync it)
        whenever the WAL passes 1,000 pages, inside ``commit``; for a steady writer such as the
        recorder that was most of a commit's time. Here writes switch automatic checkpoints
        off and a thread checkpoints after them instead. Idempotent; PostgreSQL: nothing."""
        if self.backend == "sqlite" and self._checkpointer is None:
            self._checkpointer = _Checkpointer(self.engine, every_s)

    @contextmanager
    def write(self) -> Iterator[sa.Connection]:
        """One write transaction (BEGIN IMMEDIATE on SQLite)."""
        ckpt = self._checkpointer
        with self.engine.connect().execution_options(sqlite_begin="IMMEDIATE") as conn:
            if ckpt is not None:
                driver = conn.connection.driver_connection
                assert driver is not None
                driver.execute("PRAGMA wal_autocheckpoint=0")  # per connection, not per transaction
            with conn.begin():
                yield conn
        if ckpt is not None:
            ckpt.poke()

    @contextmanager
    def read(self) -> Iterator[sa.Connection]:
        with self.engine.connect() as conn, conn.begin():
            yield conn

    def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None
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
