"""The schema and its migrations, on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

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


def test_generations_are_keyed_by_sample_from_0004_on(db_url: str) -> None:
    """0004: a generation row is a sample (a CompletionsGenerated carries a task's samples),
    keyed by its generation id, with its event id indexed. The table is a projection: it is
    made anew (rebuilt from the log), and 0003's key comes back on a downgrade."""
    from alembic import command

    from jetrl.store.db import alembic_config, make_engine, upgrade

    def key_and_indexes(engine: sa.Engine) -> tuple[list[str], set[tuple[str, ...]]]:
        insp = sa.inspect(engine)
        pk = insp.get_pk_constraint("generations")["constrained_columns"]
        return list(pk), {tuple(str(c) for c in i["column_names"]) for i in insp.get_indexes("generations")}

    engine = make_engine(db_url)
    try:
        upgrade(engine, "0003")
        assert key_and_indexes(engine)[0] == ["run_id", "event_id"]
        with engine.begin() as conn:  # a row of 0003's, keyed by its event
            table = sa.Table("generations", sa.MetaData(), autoload_with=conn)
            strings = {c.name for c in table.columns if isinstance(c.type, sa.String)}
            conn.execute(
                table.insert().values({c.name: "x" if c.name in strings else 0 for c in table.columns})
            )
        assert upgrade(engine, "head") == ("0003", head_revision())
        pk, indexes = key_and_indexes(engine)
        assert pk == ["run_id", "generation_id"]
        assert {("run_id", "task_id"), ("run_id", "event_id")} <= indexes
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM generations")).scalar() == 0
        cfg = alembic_config()
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0003")
        assert key_and_indexes(engine)[0] == ["run_id", "event_id"]
        assert upgrade(engine, "head")[1] == head_revision()
        assert key_and_indexes(engine)[0] == ["run_id", "generation_id"]
    finally:
        engine.dispose()


def test_json_columns_read_back_what_was_written(db_url: str) -> None:
    """A JSON column's value goes in as msgspec's text (``json_text``) and reads back as it was;
    where msgspec would write a non-finite float as null (a real null in the same value), the
    text is ``json.dumps``', whose NaN reads back as NaN on SQLite (PostgreSQL's jsonb refuses it:
    the projectors keep their floats finite)."""
    import math

    from jetrl.store.db import json_text, make_engine

    assert json_text({"a": 1.5, "b": [1, 2], "é": "ü"}) == '{"a":1.5,"b":[1,2],"é":"ü"}'
    assert json_text({"x": float("nan"), "y": None}) == '{"x": NaN, "y": null}'
    assert json_text({1: 2**70}) == '{"1":1180591620717411303424}'
    nan_ok = not db_url.startswith("postgresql")
    values: list[dict[str, Any]] = [
        {"payloads": {"logprobs": {"kind": "log", "seq": 7, "shape": [3]}}, "flag": True},
        {"n": None, "x": 0.1},
        {"big": 2**63 + 1, "neg": -1e-300, "text": "ü\u2028", "key": {"1": True}},
        *([{"nan": float("nan"), "inf": float("-inf")}] if nan_ok else []),
    ]
    engine = make_engine(db_url)
    t = sa.Table(
        "json_probe", sa.MetaData(), sa.Column("i", sa.Integer, primary_key=True), sa.Column("v", sc.Json)
    )
    try:
        with engine.begin() as conn:
            t.create(conn)
            conn.execute(t.insert(), [{"i": i, "v": v} for i, v in enumerate(values)])
        with engine.connect() as conn:
            back = [r.v for r in conn.execute(sa.select(t).order_by(t.c.i))]
            if engine.dialect.name == "sqlite":
                raw = conn.exec_driver_sql("SELECT v FROM json_probe WHERE i = 0").scalar()
                assert raw == '{"payloads":{"logprobs":{"kind":"log","seq":7,"shape":[3]}},"flag":true}'
        for got, want in zip(back, values, strict=True):
            assert got.keys() == want.keys()
            for k, w in want.items():
                g = got[k]
                assert (isinstance(w, float) and math.isnan(w) and math.isnan(g)) or g == w, (k, g, w)
    finally:
        with engine.begin() as conn:
            t.drop(conn, checkfirst=True)
        engine.dispose()
