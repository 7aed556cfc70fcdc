"""AlertRaised in the store: its projection (one row per event, first fact wins, any batching),
the queries, a store migrated from before the alerts table, and a rebuild from the log that
reproduces it."""

from __future__ import annotations

import math
import random
from typing import Literal

import pytest
import sqlalchemy as sa

from jetrl.bus import events as ev
from jetrl.bus import ids
from jetrl.bus.server import EmbeddedServer
from jetrl.store import dump, queries
from jetrl.store import schema as sc
from jetrl.store.db import Store, current_revision, head_revision, make_engine, open_store, upgrade
from jetrl.store.projection import apply_batch
from tests.store.test_store_cli import parse, record
from tests.store.test_store_projection import project
from tests.support.synthetic import log_items, synthetic_run


def alert(
    rule: str,
    key: str,
    state: ev.AlertState,
    step: int,
    *,
    severity: Literal["warning", "critical"] = "warning",
    value: float = 1.0,
    threshold: float = 0.5,
    message: str = "",
) -> ev.AlertRaised:
    return ev.AlertRaised(
        rule=rule,
        key=key,
        state=state,
        severity=severity,
        message=message or f"{rule} {state} for {key} at step {step}",
        step=step,
        value=value,
        threshold=threshold,
    )


def alert_events(run_id: str) -> list[ev.Event]:
    bodies = [
        alert("staleness", "staleness", "firing", 3, value=4.0, threshold=2.0),
        alert("worker_silent", "inference-0", "firing", 4, severity="critical", value=31.0, threshold=30.0),
        alert("staleness", "staleness", "resolved", 6, value=1.0, threshold=2.0),
        alert("loss_nan", "trainer", "firing", 7, severity="critical", value=math.nan, threshold=0.0),
        alert("staleness", "staleness", "firing", 9, value=math.inf, threshold=2.0),
        # The first transition raised again by another monitor, other numbers: the first wins.
        alert("staleness", "staleness", "firing", 3, value=99.0, threshold=2.0, message="again"),
    ]
    return [
        ev.new_event(
            b,
            run_id=run_id,
            time=1_760_000_200.0 + i,
            event_id=ids.alert_event_id(run_id, b.rule, b.key, b.state, b.step),
        )
        for i, b in enumerate(bodies)
    ]


def test_alerts_project_one_row_per_event_in_any_batching(store: Store) -> None:
    items = log_items(alert_events("al"))
    project(store, items, "al", [len(items)], consumer="one")
    with store.read() as conn:
        whole = dump.dump_run(conn, "al", offsets=False)
    rng = random.Random(7)
    project(store, items, "al", [rng.randint(1, 3) for _ in range(9)], consumer="small")
    project(store, items[:-1][::-1], "al", [2], consumer="reversed")  # the repeat's earlier fact last
    with store.read() as conn:
        assert dump.dump_run(conn, "al", offsets=False) == whole
    assert len(whole["alerts"]) == 5

    rows = queries.alerts(store, "al")
    assert [(r.seq, r.rule, r.key, r.state, r.step) for r in rows] == [
        (1, "staleness", "staleness", "firing", 3),
        (2, "worker_silent", "inference-0", "firing", 4),
        (3, "staleness", "staleness", "resolved", 6),
        (4, "loss_nan", "trainer", "firing", 7),
        (5, "staleness", "staleness", "firing", 9),
    ]
    first, silent, _, nan, inf = rows
    assert (first.value, first.threshold, first.severity) == (4.0, 2.0, "warning")
    assert first.message == "staleness firing for staleness at step 3"  # not the repeat's
    assert first.raised_at == 1_760_000_200.0
    assert first.event_id == ids.alert_event_id("al", "staleness", "staleness", "firing", 3)
    assert (silent.severity, silent.value, silent.threshold) == ("critical", 31.0, 30.0)
    assert (nan.value, nan.threshold) == (None, 0.0)  # NaN is kept as NULL on both backends
    assert inf.value == math.inf
    assert [r.step for r in queries.alerts(store, "al", rule="staleness")] == [3, 6, 9]
    assert queries.alerts(store, "al", rule="nope") == []
    assert queries.alerts(store, "other") == []

    assert queries.alert_counts(store, "al") == {
        "loss_nan": {"firing": 1, "resolved": 0},
        "staleness": {"firing": 2, "resolved": 1},
        "worker_silent": {"firing": 1, "resolved": 0},
    }
    assert list(queries.alert_counts(store, "al")) == ["loss_nan", "staleness", "worker_silent"]
    assert queries.alert_counts(store, "other") == {}


def test_the_same_alert_twice_is_stored_once(store: Store) -> None:
    (e,) = alert_events("once")[:1]
    for seq in (1, 2):  # a redelivery under a new sequence (the bus would deduplicate it)
        with store.write() as conn:
            apply_batch(conn, run_id="once", stream="S", consumer="c", items=log_items([e], first_seq=seq))
    with store.write() as conn:  # and one the tracking row has already seen
        r = apply_batch(conn, run_id="once", stream="S", consumer="c", items=log_items([e]))
    assert r.skipped == 1
    (row,) = queries.alerts(store, "once")
    assert row.seq == 1
    assert queries.alert_counts(store, "once") == {"staleness": {"firing": 1, "resolved": 0}}


def test_a_store_from_before_alerts_is_migrated(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        assert upgrade(engine, "0002") == (None, "0002")
        assert "alerts" not in sa.inspect(engine).get_table_names()
    finally:
        engine.dispose()
    with open_store(db_url) as store:
        assert current_revision(store.engine) == head_revision()
        assert "alerts" in sa.inspect(store.engine).get_table_names()
        with store.write() as conn:
            apply_batch(conn, run_id="m", stream="S", consumer="c", items=log_items(alert_events("m")))
        assert len(queries.alerts(store, "m")) == 5
        with store.read() as conn:
            assert len(dump.dump_run(conn, "m")["alerts"]) == 5
        with store.write() as conn:
            dump.delete_run(conn, "m")
        assert queries.alerts(store, "m") == []


def test_alerts_is_a_projection_table() -> None:
    assert sc.table_of(sc.Alert) in sc.PROJECTION_TABLES


@pytest.fixture
def recorded_with_alerts(nats_server: EmbeddedServer, run_id: str, db_url: str) -> str:
    run = synthetic_run(run_id, steps=3, seed=44)
    run.events.extend(alert_events(run_id))  # the bus keeps the first of the repeated id
    record(nats_server.url, run, db_url)
    return db_url


def test_rebuild_reproduces_the_alerts(
    nats_server: EmbeddedServer, run_id: str, recorded_with_alerts: str, capsys: pytest.CaptureFixture[str]
) -> None:
    db = recorded_with_alerts
    with open_store(db) as store:
        before = queries.alerts(store, run_id)
        assert [(r.rule, r.state, r.step) for r in before] == [
            ("staleness", "firing", 3),
            ("worker_silent", "firing", 4),
            ("staleness", "resolved", 6),
            ("loss_nan", "firing", 7),
            ("staleness", "firing", 9),
        ]
    args = parse(["rebuild", run_id, "--db", db, "--nats-url", nats_server.url])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "identical" in out and "alerts" in out
    with open_store(db) as store:
        assert queries.alerts(store, run_id) == before
        assert queries.alert_counts(store, run_id)["staleness"] == {"firing": 2, "resolved": 1}
