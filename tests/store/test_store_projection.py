"""The projection without a bus: exact against the synthetic run's truth, idempotent,
independent of batching, and skipping what the tracking row has already seen."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import sqlalchemy as sa

from jetrl.bus import events as ev
from jetrl.store import dump
from jetrl.store import schema as sc
from jetrl.store.db import Store
from jetrl.store.projection import LogItem, apply_batch, fold
from jetrl.store.projectors import PROJECTORS
from tests.support.synthetic import check_projection, log_items, synthetic_run


def project(
    store: Store, items: Sequence[LogItem], run_id: str, sizes: Sequence[int], consumer: str = "c"
) -> None:
    i = 0
    k = 0
    while i < len(items):
        n = sizes[k % len(sizes)]
        with store.write() as conn:
            apply_batch(conn, run_id=run_id, stream="S", consumer=consumer, items=items[i : i + n])
        i += n
        k += 1


def snapshot(store: Store, run_id: str) -> dump.Dump:
    with store.read() as conn:
        return dump.dump_run(conn, run_id, offsets=False)


def test_synthetic_run_projects_exactly(store: Store) -> None:
    run = synthetic_run("proj", steps=40, seed=1)
    assert len(run) > 1500 and len(run.truth.rewards) > 2500 and run.truth.withheld
    project(store, log_items(run.events), "proj", [1, 7, 250, 64, 1000])
    with store.read() as conn:
        assert check_projection(conn, run) == []


def test_batching_and_repetition_do_not_change_the_rows(store: Store) -> None:
    run = synthetic_run("rep", steps=6, seed=2)
    items = log_items(run.events)
    project(store, items, "rep", [len(items)], consumer="one-batch")
    whole = snapshot(store, "rep")
    # Same events again under other tracking rows: every upsert must be a no-op.
    rng = random.Random(3)
    project(store, items, "rep", [rng.randint(1, 40) for _ in range(50)], consumer="small-batches")
    project(store, items[::-1], "rep", [97], consumer="reversed")
    assert snapshot(store, "rep") == whole


def test_tracking_row_skips_what_was_applied(store: Store) -> None:
    run = synthetic_run("skip", steps=5, seed=4)
    assert len(run) > 151
    items = log_items(run.events)
    with store.write() as conn:
        r1 = apply_batch(conn, run_id="skip", stream="S", consumer="c", items=items[:100])
    with store.write() as conn:
        r2 = apply_batch(conn, run_id="skip", stream="S", consumer="c", items=items[50:150])
    assert (r1.applied, r1.last_seq) == (100, 100)
    assert (r2.applied, r2.skipped, r2.last_seq) == (50, 50, 150)
    with store.write() as conn:  # nothing new, but a dead-lettered sequence to move past
        r3 = apply_batch(conn, run_id="skip", stream="S", consumer="c", items=[], through_seq=151)
    assert (r3.applied, r3.last_seq) == (0, 151)


def test_rolled_back_batch_leaves_nothing(store: Store) -> None:
    run = synthetic_run("rb", steps=2, seed=5)
    items = log_items(run.events)

    class Boom(Exception):
        pass

    try:
        with store.write() as conn:
            apply_batch(conn, run_id="rb", stream="S", consumer="c", items=items)
            raise Boom
    except Boom:
        pass
    assert all(rows == [] for rows in dump_all(store, "rb").values())


def dump_all(store: Store, run_id: str) -> dump.Dump:
    with store.read() as conn:
        return dump.dump_run(conn, run_id)


def test_fold_merges_groups_of_one_row() -> None:
    run = synthetic_run("fold", steps=3, seed=6)
    rows = fold(log_items(run.events))
    by_id = {r["rollout_id"]: r for r in rows["rollouts"]}
    for rid, (step, pos) in run.truth.trained.items():
        assert (by_id[rid]["trained_step"], by_id[rid]["train_position"]) == (step, pos)
        assert by_id[rid]["scored_seq"] is not None
    # One row per worker, and every worker the run saw has one.
    assert sorted(r["worker_id"] for r in rows["workers"]) == sorted(run.truth.workers)


def test_non_finite_metrics_are_kept_readable(store: Store) -> None:
    e = ev.new_event(
        ev.StepCompleted(step=1, policy_version=1, rollout_ids=[], metrics={"loss": float("nan"), "g": 1.5}),
        run_id="nan",
    )
    with store.write() as conn:
        apply_batch(conn, run_id="nan", stream="S", consumer="c", items=log_items([e]))
    with store.read() as conn:
        (row,) = dump.dump_run(conn, "nan")["steps"]
    assert '"loss":"nan"' in row[4]


def test_every_event_type_has_a_projector() -> None:
    assert set(PROJECTORS) == set(ev.CATALOG.values())


def test_a_resume_makes_a_finished_run_running_until_it_finishes_again(store: Store) -> None:
    rid = "resumed"
    lifecycle = [
        ev.RunStarted(config={"trainer": {"max_steps": 3}}, code_version="0"),
        ev.RunFinished(status="cancelled", steps=1, reason="interrupted"),
        ev.RunResumed(config={"trainer": {"max_steps": 5}}, code_version="0"),
        ev.RunFinished(status="completed", steps=5),
    ]
    items = log_items([ev.new_event(b, run_id=rid) for b in lifecycle])
    seen = []
    for i in range(len(items)):
        with store.write() as conn:
            apply_batch(conn, run_id=rid, stream="S", consumer="c", items=items[i : i + 1])
        with store.read() as conn:
            q = sa.select(sc.Run.status, sc.Run.steps, sc.Run.finish_reason).where(sc.Run.run_id == rid)
            seen.append(tuple(conn.execute(q).one()))
    assert seen == [
        ("running", None, None),
        ("cancelled", 1, "interrupted"),
        ("running", None, None),
        ("completed", 5, ""),
    ]
    # Applied in any order, the last lifecycle event wins; the config stays RunStarted's.
    project(store, items[::-1], rid, [1], consumer="reversed")
    with store.read() as conn:
        row = conn.execute(sa.select(sc.Run.status, sc.Run.config).where(sc.Run.run_id == rid)).one()
    assert tuple(row) == ("completed", {"trainer": {"max_steps": 3}})


def test_trained_and_withheld_rollouts_are_updates_of_their_rows(store: Store) -> None:
    """On SQLite a rollout's training or withholding, folded apart from its scoring, is an
    UPDATE of the scored row (``Group.follows``); a row that is not there yet (or has the group
    already) is left to the upsert, which makes it. The rows are those of one whole batch."""
    from jetrl.store.projection import _writer, write_tables
    from jetrl.store.specs import ROLLOUTS

    run = synthetic_run("upd", steps=4, seed=7)
    items = log_items(run.events)
    scored = [it for it in items if isinstance(it.event.body, ev.RolloutsScored)]
    later = [it for it in items if isinstance(it.event.body, (ev.StepCompleted, ev.RolloutWithheld))]
    rows = fold(later)["rollouts"]
    assert rows and all(r["scored_seq"] is None for r in rows)
    assert {r["rollout_id"] for r in rows if r["withheld_seq"] is not None}, "the run withholds some"
    project(store, scored, "upd", [len(scored)], consumer="scored")
    made = {r["rollout_id"] for r in fold(scored)["rollouts"]}
    orphan = dict(rows[0], rollout_id="not-scored-yet")
    with store.write() as conn:
        if conn.dialect.name != "sqlite":
            pytest.skip("the UPDATE path is SQLite's (PostgreSQL merges from a staging table)")
        w = _writer(conn, ROLLOUTS)
        driver = conn.connection.driver_connection
        assert driver is not None
        cur = driver.cursor()
        left = w.update_rows(cur, [*rows, orphan])
        assert [r["rollout_id"] for r in left] == [
            *(r["rollout_id"] for r in rows if r["rollout_id"] not in made),
            "not-scored-yet",
        ]
        again = w.update_rows(cur, rows)  # the groups are there now: nothing is changed twice
        assert len(again) == len(rows)
        write_tables(conn, [(w, left)])
    with store.read() as conn:
        by_id = {r.rollout_id: r._mapping for r in conn.execute(sa.select(sc.table_of(sc.Rollout)))}
    for rid, (step, pos) in run.truth.trained.items():
        if rid in made:
            assert (by_id[rid]["trained_step"], by_id[rid]["train_position"]) == (step, pos)
            assert by_id[rid]["staleness"] == step - by_id[rid]["policy_version_start"]
    assert by_id["not-scored-yet"]["trained_seq"] == orphan["trained_seq"]
