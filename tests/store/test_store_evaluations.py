"""EvaluationReported in the store: its projection (first fact wins, any batching), the
queries and CLI's latest and best per env, and a rebuild from the log that reproduces it."""

from __future__ import annotations

import json
import random

import pytest

from jetrl.bus import events as ev
from jetrl.bus import ids
from jetrl.bus.server import EmbeddedServer
from jetrl.deploy.report import RunReport
from jetrl.store import dump, queries
from jetrl.store.db import Store, open_store
from tests.store.test_store_cli import parse, record
from tests.store.test_store_projection import project
from tests.support.synthetic import log_items, synthetic_run


def report(env: str, version: int, p1: float, pk: float, k: int = 4) -> ev.EvaluationReported:
    return ev.EvaluationReported(
        env=env,
        policy_version=version,
        n_tasks=2,
        samples=k,
        pass_at_1=p1,
        pass_at_k=pk,
        reward_mean=p1 + 0.05,
        version_min=version,
        version_max=version + 1,
        temperature=0.7,
        successes=[round(p1 * k), round(p1 * k)],
    )


def evaluation_events(run_id: str) -> list[ev.Event]:
    out = []
    for i, (tenant, body) in enumerate(
        [
            ("acme", report("math", 0, 0.25, 0.5)),
            ("acme", report("math", 10, 0.75, 1.0)),
            ("acme", report("math", 20, 0.5, 1.0)),  # latest, but not the best
            ("globex", report("code", 0, 0.0, 0.0)),
            ("acme", report("math", 10, 0.0, 0.0)),  # the same fact again, other numbers: the first wins
        ]
    ):
        out.append(
            ev.new_event(
                body,
                run_id=run_id,
                tenant=tenant,
                time=1_760_000_100.0 + i,
                event_id=ids.evaluation_event_id(run_id, tenant, body.env, body.policy_version),
            )
        )
    return out


def test_evaluations_project_first_fact_wins_in_any_batching(store: Store) -> None:
    items = log_items(evaluation_events("ev"))
    project(store, items, "ev", [len(items)], consumer="one")
    with store.read() as conn:
        whole = dump.dump_run(conn, "ev", offsets=False)
    rng = random.Random(5)
    project(store, items, "ev", [rng.randint(1, 3) for _ in range(9)], consumer="small")
    project(store, items[:-1][::-1], "ev", [2], consumer="reversed")  # the repeat's earlier fact last
    with store.read() as conn:
        assert dump.dump_run(conn, "ev", offsets=False) == whole
    rows = queries.evaluations(store, "ev")
    assert [(r.tenant, r.env, r.policy_version, r.pass_at_1) for r in rows] == [
        ("acme", "math", 0, 0.25),
        ("acme", "math", 10, 0.75),
        ("acme", "math", 20, 0.5),
        ("globex", "code", 0, 0.0),
    ]
    assert rows[1].successes == [3, 3] and (rows[1].version_min, rows[1].version_max) == (10, 11)
    assert [r.env for r in queries.evaluations(store, "ev", env="code")] == ["code"]
    math_, code = queries.evaluation_summary(store, "ev")
    assert (math_.env, math_.evaluations, math_.latest_version, math_.latest_pass_at_1) == (
        "math",
        3,
        20,
        0.5,
    )
    assert (math_.best_pass_at_1, math_.best_pass_at_1_version) == (0.75, 10)
    assert (math_.best_pass_at_k, math_.best_pass_at_k_version) == (1.0, 10)  # the earliest of a tie
    assert (code.tenant, code.best_pass_at_k, code.best_pass_at_k_version) == ("globex", 0.0, 0)


def test_the_run_report_has_latest_and_best_per_env() -> None:
    rep = RunReport()
    for e in evaluation_events("r"):
        assert isinstance(e.body, ev.EvaluationReported)
        rep.add_evaluation(e.body, e.tenant)
    summary = rep.summary()
    assert summary["evaluations"]["acme/math"] == {
        "evaluations": 3,
        "k": 4,
        "latest_version": 20,
        "pass_at_1": 0.5,
        "pass_at_k": 1.0,
        "best_pass_at_1": 0.75,
        "best_pass_at_1_version": 10,
        "best_pass_at_k": 1.0,
        "best_pass_at_k_version": 10,
    }
    assert summary["evaluations"]["globex/code"]["latest_version"] == 0
    assert RunReport().summary() == {"steps": 0}  # no evaluations, no key


@pytest.fixture
def recorded_with_evals(nats_server: EmbeddedServer, run_id: str, db_url: str) -> str:
    run = synthetic_run(run_id, steps=3, seed=43)
    run.events.extend(evaluation_events(run_id))  # the bus keeps the first of the repeated id
    record(nats_server.url, run, db_url)
    return db_url


def test_rebuild_reproduces_the_evaluations_and_the_cli_shows_them(
    nats_server: EmbeddedServer, run_id: str, recorded_with_evals: str, capsys: pytest.CaptureFixture[str]
) -> None:
    db = recorded_with_evals
    with open_store(db) as store:
        assert len(queries.evaluations(store, run_id)) == 4
    args = parse(["rebuild", run_id, "--db", db, "--nats-url", nats_server.url])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "identical" in out and "evaluations" in out
    args = parse(["evals", run_id, "--db", db, "--json"])
    assert args.func(args) == 0
    got = json.loads(capsys.readouterr().out)
    assert [r["policy_version"] for r in got["evaluations"]] == [0, 10, 20, 0]
    assert [(s["env"], s["best_pass_at_1"], s["best_pass_at_1_version"]) for s in got["summary"]] == [
        ("math", 0.75, 10),
        ("code", 0.0, 0),
    ]
    args = parse(["evals", run_id, "--db", db])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "held-out evaluations" in out and "0.750 (v10)" in out
    args = parse(["history", run_id, "--db", db])
    assert args.func(args) == 0
    assert "latest and best" in capsys.readouterr().out
