"""Queries over a projected synthetic run, checked against values computed from its truth."""

from __future__ import annotations

from collections import defaultdict
from statistics import mean

import pytest

from jetrl.bus import events as ev
from jetrl.store import queries
from jetrl.store.db import Store
from jetrl.store.projection import apply_batch
from tests.support.synthetic import SyntheticRun, log_items, synthetic_run


@pytest.fixture
def projected(store: Store) -> SyntheticRun:
    run = synthetic_run("q", steps=10, seed=11)
    with store.write() as conn:
        apply_batch(conn, run_id="q", stream="JETRL_q", consumer="recorder", items=log_items(run.events))
    return run


def test_run_summary_and_list(store: Store, projected: SyntheticRun) -> None:
    t = projected.truth
    s = queries.run_summary(store, "q")
    assert s is not None
    assert (s.status, s.steps, s.last_step, s.latest_version) == ("completed", 10, 10, 10)
    assert (s.rollouts, s.trained, s.withheld, s.pending) == (
        len(t.rewards),
        len(t.trained),
        len(t.withheld),
        0,
    )
    assert s.reward_mean == pytest.approx(mean(t.rewards.values()))
    assert s.tokens == sum(st["tokens"] for st in t.steps.values())
    assert s.recorded_seq == len(projected.events)
    assert [r.run_id for r in queries.list_runs(store)] == ["q"]
    assert queries.run_summary(store, "nope") is None
    assert queries.recorded_seq(store, "q") == len(projected.events)


def test_step_history(store: Store, projected: SyntheticRun) -> None:
    t = projected.truth
    hist = queries.step_history(store, "q")
    assert [h.step for h in hist] == list(range(1, 11))
    for h in hist:
        ids = t.steps[h.step]["rollout_ids"]
        assert h.num_rollouts == len(ids)
        assert h.reward_mean == pytest.approx(mean(t.rewards[r] for r in ids))
        assert h.staleness_max == max(t.staleness[r] for r in ids)
        assert h.metrics["reward_mean"] == pytest.approx(h.reward_mean, abs=1e-5)
        assert h.withheld == sum(
            1 for r in t.withheld if t.trained.get(r) is None and _withheld_step(projected, r) == h.step
        )
    assert [h.step for h in queries.step_history(store, "q", from_step=3, to_step=5)] == [3, 4, 5]
    assert len(queries.step_history(store, "q", limit=2)) == 2


def _withheld_step(run: SyntheticRun, rollout_id: str) -> int | None:
    for e in run.events:
        if isinstance(e.body, ev.RolloutWithheld) and e.body.rollout_id == rollout_id:
            return e.body.trainer_step
    return None


def test_tenant_and_env_stats(store: Store, projected: SyntheticRun) -> None:
    t = projected.truth
    for by, idx, rows in (
        ("tenant", 0, queries.tenant_stats(store, "q")),
        ("env", 1, queries.env_stats(store, "q")),
    ):
        groups: dict[str, list[str]] = defaultdict(list)
        for rid, scope in t.rollout_scope.items():
            groups[scope[idx]].append(rid)
        assert sorted(getattr(r, by) for r in rows) == sorted(groups)
        for r in rows:
            ids = groups[getattr(r, by)]
            assert r.rollouts == len(ids)
            assert r.trained == sum(1 for i in ids if i in t.trained)
            assert r.withheld == sum(1 for i in ids if i in t.withheld)
            assert r.stale == sum(1 for i in ids if t.withheld.get(i) == "stale")
            assert r.reward_mean == pytest.approx(mean(t.rewards[i] for i in ids))
    both = queries.scope_stats(store, "q", ("tenant", "env"))
    assert sum(r.rollouts for r in both) == len(t.rewards)
    with pytest.raises(ValueError):
        queries.scope_stats(store, "q", ("worker",))


def test_step_rollouts_in_training_order(store: Store, projected: SyntheticRun) -> None:
    seq_of = {
        r.rollout_id: i + 1
        for i, e in enumerate(projected.events)
        if isinstance(e.body, ev.RolloutsScored)
        for r in e.body.rollouts
    }
    for step, st in projected.truth.steps.items():
        rows = queries.step_rollouts(store, "q", step)
        assert [r.rollout_id for r in rows] == st["rollout_ids"]
        assert [r.position for r in rows] == list(range(len(rows)))
        # What replay needs: where each scored rollout sits in the log.
        assert [r.scored_seq for r in rows] == [seq_of[r] for r in st["rollout_ids"]]
    assert queries.step_rollouts(store, "q", 999) == []


def test_policy_versions_workers_dead_letters(store: Store, projected: SyntheticRun) -> None:
    t = projected.truth
    latest = queries.latest_policy_version(store, "q", ready=True)
    assert latest is not None and latest.version == 10 and latest.ready
    assert latest.weights_checksum == t.versions[10]
    assert latest.location_uri == t.weights_uri[10]
    assert [v.version for v in queries.policy_versions(store, "q")] == list(range(1, 11))
    ws = {w.worker_id: w for w in queries.workers(store, "q")}
    assert set(ws) == set(t.workers)
    for wid, w in t.workers.items():
        assert (ws[wid].kind, ws[wid].loaded_version) == (w["kind"], w.get("loaded_version"))
    assert queries.dead_letters(store, "q") == []
    assert queries.latest_policy_version(store, "nope") is None
