"""Opening the store: engine setup per backend, schema migrations (Alembic), read-only opens.

Two ways in, and only the first changes the database:

- ``open_store_for_writing(url)``: creates the database if needed and migrates its schema to the
  head revision. The recorder and ``jetrl rebuild`` use it.
- ``open_store_read_only(url)``: opens an existing store read-only (SQLite: a ``mode=ro`` URI;
  PostgreSQL: a session whose transactions are READ ONLY) and checks, without upgrading, that it
  is a jetrl store at the head revision; otherwise it raises :class:`StoreError` saying which
  database and what to do. ``jetrl runs | history | evals | export | monitor`` and the
  supervisor's reads use it.

SQLite (the embedded default) is a file in WAL mode so readers (CLI, supervisor) never block the
recorder; PostgreSQL is reached by URL through psycopg 3 (``postgresql+psycopg://``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import msgspec
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


def _as_url(url: str) -> str:
    # A plain path is taken as a SQLite file.
    return url if "://" in url else sqlite_url(url)


def display_url(url: str) -> str:
    """The URL as a message may show it: without its password."""
    try:
        u = sa.make_url(_as_url(url))
    except sa.exc.ArgumentError:
        return url.split("@")[-1]  # unparseable: at least drop what could be credentials
    bare = sa.URL.create(u.drivername, u.username, None, u.host, u.port, u.database, u.query)
    return bare.render_as_string(hide_password=False)


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


def _sqlite_read_only_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # The connection is opened with mode=ro; nothing here writes (no journal_mode change, which
    # a rollback-journal file would refuse), and query_only refuses writes at the statement.
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA query_only=1")
    cur.close()


def _postgres_read_only(dbapi_conn: Any, _record: Any) -> None:
    # Every transaction of the session is READ ONLY on the server, whatever a client runs on it.
    cur = dbapi_conn.cursor()
    cur.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
    cur.close()
    dbapi_conn.commit()


_JSON = msgspec.json.Encoder()


def json_text(value: Any) -> str:
    """A JSON column's text: msgspec's encoding, which takes a tenth of ``json.dumps``' time (a
    rollout's row has two such columns, a step 256 rollouts: ``json.dumps`` was a sixth of the
    recorder's writer). Where msgspec's text could mean something else, ``json.dumps``' as
    before: msgspec writes a NaN or an infinity as ``null``, so any text with a null in it is
    made again (the projectors keep their own floats finite: a null there is a real None), and
    what msgspec refuses (a key that is no string or number, an int past 64 bits) is left to
    ``json.dumps`` to encode or refuse."""
    try:
        raw = _JSON.encode(value)
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError):
        return json.dumps(value)
    return json.dumps(value) if b"null" in raw else raw.decode()


def make_engine(url: str, **kwargs: Any) -> sa.Engine:
    """An engine for reading and writing; a SQLite file's folder is created if missing."""
    kwargs.setdefault("json_serializer", json_text)
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


def make_read_only_engine(url: str) -> sa.Engine:
    """An engine that cannot write: SQLite through a ``file:PATH?mode=ro`` URI (a missing file
    is not created), PostgreSQL in READ ONLY transactions."""
    u = _normalise_url(url)
    if u.get_backend_name() == "sqlite":
        if not u.database or u.database == ":memory:":
            raise ValueError("an in-memory SQLite database cannot be opened read-only: it starts empty")
        path = Path(u.database)
        uri = sa.URL.create(
            "sqlite+pysqlite",
            # A URI filename: characters such as ? # % in the path are escaped.
            database=f"file:{quote(str(path.resolve()))}",
            query={**u.query, "mode": "ro", "uri": "true"},
        )
        engine = sa.create_engine(uri)
        sa.event.listen(engine, "connect", _sqlite_read_only_pragmas)
        sa.event.listen(engine, "begin", _sqlite_begin)
        return engine
    engine = sa.create_engine(u, pool_pre_ping=True)
    sa.event.listen(engine, "connect", _postgres_read_only)
    return engine


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


def known_revisions() -> set[str]:
    return {r.revision for r in ScriptDirectory.from_config(alembic_config()).walk_revisions()}


class StoreError(Exception):
    """A database that cannot be read as a jetrl store; the message names it (no password) and
    says what to do."""


class NotAStore(StoreError):
    """No such database, or one without jetrl's tables."""


class StoreSchemaMismatch(StoreError):
    """A jetrl store at another schema revision than this jetrl's head."""

    def __init__(self, message: str, revision: str, head: str | None) -> None:
        super().__init__(message)
        self.revision = revision
        self.head = head


_MAKE_ONE = (
    "give the URL of a run's store (--db) or its runs directory (--runs-dir); a store is made "
    "by a run's recorder (docs/store.md)"
)


def check_schema(conn: sa.Connection, name: str) -> None:
    """Raise :class:`StoreError` unless the database on ``conn`` is a jetrl store at the head
    revision; reads only (alembic's version table and the table names)."""
    rev = MigrationContext.configure(conn).get_current_revision()
    head = head_revision()
    if rev is None:
        tables = sorted(sa.inspect(conn).get_table_names())
        if not tables:
            raise NotAStore(f"not a jetrl store: {name} has no tables; {_MAKE_ONE}")
        shown = ", ".join(tables[:5]) + (f" and {len(tables) - 5} more" if len(tables) > 5 else "")
        raise NotAStore(f"not a jetrl store: {name} has no jetrl tables (it has {shown}); {_MAKE_ONE}")
    if rev == head:
        return
    if rev in known_revisions():
        raise StoreSchemaMismatch(
            f"the store {name} is at schema revision {rev}, older than this jetrl's {head}; it is "
            "left as it is: the run's recorder migrates it when it next records, or `jetrl rebuild "
            "RUN --db URL --nats-url URL` migrates it and rebuilds the run",
            rev,
            head,
        )
    raise StoreSchemaMismatch(
        f"the store {name} is at schema revision {rev}, which this jetrl does not know (its head "
        f"is {head}): a newer jetrl wrote it; read it with that version",
        rev,
        head,
    )


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
    """A database at the head schema revision holding one or more runs' projections; opened
    for writing (:func:`open_store_for_writing`) or read-only (:func:`open_store_read_only`)."""

    engine: sa.Engine
    read_only: bool = False
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
        if self.backend == "sqlite" and not self.read_only and self._checkpointer is None:
            self._checkpointer = _Checkpointer(self.engine, every_s)

    @contextmanager
    def write(self) -> Iterator[sa.Connection]:
        """One write transaction (BEGIN IMMEDIATE on SQLite)."""
        if self.read_only:
            raise StoreError("this store was opened read-only")
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


def open_store_for_writing(url: str) -> Store:
    """Open the store at ``url`` for writing, creating the database if needed and migrating its
    schema to the head revision: for the recorder and ``jetrl rebuild``, nothing else. ``url``
    is a SQLAlchemy URL; a plain path is taken as a SQLite file."""
    url = _as_url(url)
    engine = make_engine(url)
    before, after = upgrade(engine)
    if before != after:
        log.info("store_migrated", backend=engine.dialect.name, from_rev=before, to_rev=after)
    return Store(engine=engine)


# The former name of open_store_for_writing, which tests and benchmarks use to set up stores.
open_store = open_store_for_writing


def open_store_read_only(url: str) -> Store:
    """Open the existing store at ``url`` read-only and check that it is a jetrl store at the
    head revision, creating and migrating nothing (a missing SQLite file stays missing). Raises
    :class:`StoreError`, whose message names the database and what to do, otherwise."""
    url = _as_url(url)
    name = display_url(url)
    u = _normalise_url(url)
    if u.get_backend_name() == "sqlite":
        if not u.database or u.database == ":memory:":
            raise NotAStore(f"not a jetrl store: {name} is an in-memory database; {_MAKE_ONE}")
        if not Path(u.database).exists():
            raise NotAStore(f"not a jetrl store: {name} does not exist (nothing was created); {_MAKE_ONE}")
        if Path(u.database).is_dir():
            raise NotAStore(f"not a jetrl store: {name} is a directory; {_MAKE_ONE}")
    engine = make_read_only_engine(url)
    try:
        with engine.connect() as conn, conn.begin():
            check_schema(conn, name)
    except StoreError:
        engine.dispose()
        raise
    except sa.exc.DBAPIError as exc:  # no such server or database, not a database file, ...
        engine.dispose()
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else type(exc).__name__
        raise StoreError(f"cannot read the store {name}: {reason}") from None
    return Store(engine=engine, read_only=True)
