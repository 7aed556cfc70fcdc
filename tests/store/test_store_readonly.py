"""The commands that read the store (`jetrl runs | history | evals | export | monitor`) create and
migrate nothing: on a database that is not a jetrl store at this jetrl's schema revision they end
with a message naming it, and the database is as it was, file for file or table for table."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from jetrl.deploy import cli
from jetrl.store import queries
from jetrl.store.db import head_revision, make_engine, open_store, upgrade
from jetrl.store.projection import apply_batch
from tests.support.synthetic import log_items, synthetic_run

RUN = "ro1"
COMMANDS = ("runs", "history", "history --tenants", "evals", "export", "monitor")


def argv(command: str, db: str, tmp_path: Path) -> list[str]:
    return {
        "runs": ["runs", "--db", db],
        "history": ["history", RUN, "--db", db, "--json"],
        "history --tenants": ["history", RUN, "--tenants", "--db", db, "--json"],
        "evals": ["evals", RUN, "--db", db, "--json"],
        "export": ["export", RUN, "--db", db, "--out", str(tmp_path / "export")],
        "monitor": ["monitor", RUN, "--db", db, "--runs-dir", str(tmp_path / "runs"), "--once"],
    }[command]


def jetrl(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """The CLI's entry point in this process: (exit code, stdout, stderr). A SystemExit with a
    message is what the interpreter prints without a traceback, with exit code 1."""
    try:
        code = cli.main(args)
        message = ""
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise
        code, message = 1, exc.code
    out = capsys.readouterr()
    return code, out.out, out.err + message


# ----------------------------------------------------------------------------- databases


def is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


def empty(db_url: str, tmp_path: Path) -> str:
    if is_sqlite(db_url):
        Path(sa.make_url(db_url).database or "").touch()  # a file SQLite reads as a database with no tables
    return db_url  # PostgreSQL: the fixture's new database has no tables


def foreign(db_url: str, tmp_path: Path) -> str:
    engine = sa.create_engine(db_url)  # another application's database, rollback journal on SQLite
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE inventory (id INTEGER PRIMARY KEY, item TEXT)"))
        conn.execute(sa.text("INSERT INTO inventory VALUES (1, 'bolts'), (2, 'nuts')"))
    engine.dispose()
    return db_url


def missing(db_url: str, tmp_path: Path) -> str:
    if is_sqlite(db_url):
        return f"sqlite:///{tmp_path / 'nowhere' / 'store.db'}"
    return sa.make_url(db_url).set(database=f"jetrl_missing_{uuid.uuid4().hex[:8]}").render_as_string(False)


def older(db_url: str, tmp_path: Path) -> str:
    """A jetrl store migrations back (0002: no alerts table yet)."""
    engine = make_engine(db_url)
    upgrade(engine, "0002")
    engine.dispose()
    return db_url


def unknown(db_url: str, tmp_path: Path) -> str:
    """A jetrl store that a later jetrl migrated past this one's head."""
    with open_store(db_url) as store, store.write() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '9999'"))
    return db_url


def files(root: Path) -> dict[str, bytes | None]:
    """Every file and folder under ``root``, files with their bytes; except the index (-shm) and
    an empty log (-wal) that SQLite makes beside a WAL database for any reader, read-only too."""
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
        for p in root.rglob("*")
        if not (p.name.endswith("-shm") or (p.name.endswith("-wal") and p.stat().st_size == 0))
    }


def tables(db_url: str) -> dict[str, list[tuple[object, ...]]]:
    """SQLite: nothing (its file is in ``files``); PostgreSQL: every table of the database
    (information_schema) with its rows."""
    if is_sqlite(db_url):
        return {}
    engine = sa.create_engine(db_url)
    with engine.connect() as conn:
        names = conn.execute(
            sa.text(
                "SELECT table_schema, table_name FROM information_schema.tables "
                "WHERE table_schema NOT IN ('pg_catalog', 'information_schema') ORDER BY 1, 2"
            )
        ).all()
        rows = {
            f"{s}.{t}": sorted(map(tuple, conn.execute(sa.text(f'SELECT * FROM "{s}"."{t}"')).all()))
            for s, t in names
        }
    engine.dispose()
    return rows


def exists(db_url: str, url: str) -> bool | None:
    """PostgreSQL: whether the database ``url`` names exists (asked of the fixture's database:
    other tests on the server make and drop databases of their own); SQLite: None."""
    if is_sqlite(db_url):
        return None
    engine = sa.create_engine(db_url)
    with engine.connect() as conn:
        n = conn.execute(
            sa.text("SELECT count(*) FROM pg_database WHERE datname = :name"),
            {"name": sa.make_url(url).database},
        ).scalar_one()
    engine.dispose()
    return bool(n)


def snapshot(db_url: str, url: str, tmp_path: Path) -> object:
    """What a command on ``url`` must leave as it was: the files under tmp_path (the SQLite
    database and anything beside it, the export folder, a runs folder), the tables and rows of
    the fixture's PostgreSQL database, and whether the database ``url`` names exists."""
    return files(tmp_path), tables(db_url), exists(db_url, url)


# ----------------------------------------------------------------------------- not a store


NOT_A_STORE: dict[str, tuple[Callable[[str, Path], str], tuple[str, ...]]] = {
    "empty": (empty, ("not a jetrl store", "has no tables", "recorder")),
    "foreign": (foreign, ("not a jetrl store", "has no jetrl tables", "inventory", "recorder")),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", [*NOT_A_STORE, "missing"])
def test_a_database_that_is_not_a_store_is_named_and_left_as_it_was(
    db_url: str, tmp_path: Path, kind: str, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if kind == "missing":
        url = missing(db_url, tmp_path)
        says: tuple[str, ...] = (
            ("not a jetrl store", "does not exist", "nothing was created", "recorder")
            if is_sqlite(db_url)
            else ("cannot read the store", "does not exist")
        )
    else:
        make, says = NOT_A_STORE[kind]
        url = make(db_url, tmp_path)
    before = snapshot(db_url, url, tmp_path)
    code, _, err = jetrl(argv(command, url, tmp_path), capsys)
    assert code != 0
    assert url in err  # the database's name, as given (these URLs carry no password)
    for words in says:
        assert words in err
    assert "Traceback" not in err
    assert snapshot(db_url, url, tmp_path) == before


def test_runs_over_a_runs_directory_skips_and_names_what_is_not_a_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good, bad = tmp_path / "good" / "store.db", tmp_path / "bad" / "store.db"
    good.parent.mkdir()
    with open_store(f"sqlite:///{good}") as store, store.write() as conn:
        events = synthetic_run("good", steps=2, tasks_per_step=2, group_size=2).events
        apply_batch(conn, run_id="good", stream="S", consumer="c", items=log_items(events))
    bad.parent.mkdir()
    bad.touch()
    before = files(tmp_path / "bad")
    code, out, err = jetrl(["runs", "--runs-dir", str(tmp_path), "--json"], capsys)
    assert code == 1
    assert '"run_id": "good"' in out
    assert f"skipped {bad}" in err and "not a jetrl store" in err
    assert files(tmp_path / "bad") == before


# ----------------------------------------------------------------------------- other revisions


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", ["older", "unknown"])
def test_a_store_of_another_schema_revision_is_named_and_not_migrated(
    db_url: str, tmp_path: Path, kind: str, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = older(db_url, tmp_path) if kind == "older" else unknown(db_url, tmp_path)
    before = snapshot(db_url, url, tmp_path)
    code, _, err = jetrl(argv(command, url, tmp_path), capsys)
    assert code != 0
    assert url in err and "Traceback" not in err
    if kind == "older":
        assert "schema revision 0002" in err and f"this jetrl's {head_revision()}" in err
        assert "recorder migrates it" in err and "jetrl rebuild" in err
    else:
        assert "schema revision 9999" in err and "does not know" in err
    assert snapshot(db_url, url, tmp_path) == before


# ----------------------------------------------------------------------------- a real store


@pytest.fixture
def real_store(db_url: str) -> str:
    with open_store(db_url) as store, store.write() as conn:
        events = synthetic_run(RUN, steps=3, tasks_per_step=2, group_size=2).events
        apply_batch(conn, run_id=RUN, stream="S", consumer="c", items=log_items(events))
    return db_url


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "monitor"])  # monitor: test_monitor_cmd
def test_a_real_store_is_read_and_left_as_it_was(
    real_store: str, tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    def state() -> object:  # beside the SQLite file a reader may leave SQLite's -wal and -shm
        return Path(sa.make_url(real_store).database or "").read_bytes() if is_sqlite(real_store) else None

    before = state(), tables(real_store)
    code, out, err = jetrl(argv(command, real_store, tmp_path), capsys)
    assert code == 0, err
    assert out.strip()
    assert (state(), tables(real_store)) == before


def test_a_read_only_store_refuses_writes_in_the_database(real_store: str) -> None:
    from jetrl.store.db import StoreError, open_store_read_only

    with open_store_read_only(real_store) as store:
        assert store.read_only and queries.run_summary(store, RUN) is not None
        with pytest.raises(StoreError, match="read-only"):
            store.write().__enter__()
        # Past the Store's own check, the database itself refuses: SQLite mode=ro, PostgreSQL
        # READ ONLY transactions.
        with pytest.raises(sa.exc.DBAPIError, match=r"read-only|readonly"), store.engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE intruder (x INTEGER)"))
    with open_store(real_store) as store, store.read() as conn:
        assert "intruder" not in sa.inspect(conn).get_table_names()


def test_the_url_shown_has_no_password() -> None:
    from jetrl.store.db import StoreError, open_store_read_only

    url = "postgresql+psycopg://jetrl:s3cret@127.0.0.1:1/nowhere"  # nothing listens on port 1
    with pytest.raises(StoreError) as caught:
        open_store_read_only(url)
    assert "postgresql+psycopg://jetrl@127.0.0.1:1/nowhere" in str(caught.value)
    assert "s3cret" not in str(caught.value)
