"""The monitor's fold: every series from a synthetic log against what the log encodes, and the
same series from the run's store (both backends) as from its log."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

import pytest
import sqlalchemy as sa

from jetrl.bus import events as ev
from jetrl.consumers.monitor.reader import from_store
from jetrl.consumers.monitor.series import MonitorState
from jetrl.store import readmodel as rec
from jetrl.store import schema as sc
from jetrl.store.db import Store, open_store
from jetrl.store.projection import apply_batch
from tests.support.synthetic import SyntheticRun, log_items, synthetic_run


def fold(run: SyntheticRun, **kw: Any) -> MonitorState:
    state = MonitorState(run.run_id, **kw)
    for item in log_items(run.events):
        r = rec.fact_of(item.seq, item.subject, item.event)
        if r is not None:
            state.apply(r)
    return state


def test_series_match_what_the_log_encodes() -> None:
    run = synthetic_run("mon1", steps=12, tasks_per_step=6, group_size=4)
    state = fold(run)
    t = run.truth
    assert [p.step for p in state.steps] == sorted(t.steps)
    scored = {
        r.rollout_id: r for e in run.events if isinstance(e.body, ev.RolloutsScored) for r in e.body.rollouts
    }
    for p in state.steps:
        ids = t.steps[p.step]["rollout_ids"]
        assert p.rollouts == len(ids)
        assert p.tokens == t.steps[p.step]["tokens"]
        assert p.reward_mean == pytest.approx(statistics.fmean(t.rewards[r] for r in ids))
        for env in {t.rollout_scope[r][1] for r in ids}:
            mine = [t.rewards[r] for r in ids if t.rollout_scope[r][1] == env]
            assert p.reward_by_env[env] == pytest.approx(statistics.fmean(mine))
        for tenant in {t.rollout_scope[r][0] for r in ids}:
            mine = [t.rewards[r] for r in ids if t.rollout_scope[r][0] == tenant]
            assert p.reward_by_tenant[tenant] == pytest.approx(statistics.fmean(mine))
        assert p.staleness_mean == pytest.approx(statistics.fmean(t.staleness[r] for r in ids))
        assert p.staleness_max == max(t.staleness[r] for r in ids)
        lengths = [(scored[r].completion_tokens.shape or (-1,))[0] for r in ids]
        assert p.seq_len_mean == pytest.approx(statistics.fmean(lengths))
        # Each trained rollout's own sample's finish reason (its generation holds the group's).
        truncated = [t.samples[r][2] == "length" for r in ids]  # a first turn's rollout id is its sample's
        assert p.truncated_frac == pytest.approx(statistics.fmean(truncated))
    last_step_at = max(i for i, e in enumerate(run.events) if isinstance(e.body, ev.StepCompleted))
    before_last = sum(1 for e in run.events[:last_step_at] if isinstance(e.body, ev.RolloutWithheld))
    assert sum(p.withheld for p in state.steps) == before_last > 0
    assert sum(state.withheld_by_reason.values()) == len(t.withheld)
    assert state.withheld_by_reason == dict(Counter(t.withheld.values()))
    for wid, w in t.workers.items():
        assert state.workers[wid].kind == w["kind"]
        if "loaded_version" in w:
            assert state.workers[wid].loaded_version == w["loaded_version"]
    # Tokens per second: the step's tokens over the time since the step before.
    a, b = state.steps[3], state.steps[4]
    assert b.tokens_per_s == pytest.approx(b.tokens / (b.t - a.t))


def _records(*rs: rec.Fact) -> MonitorState:
    state = MonitorState("hand")
    for r in rs:
        state.apply(r)
    return state


def test_truncation_weight_wait_queue_and_dead_letters() -> None:
    state = _records(
        rec.Started(1, 100.0, {}),
        rec.Tasked(2, 101.0, "acme", "math", 5),
        rec.Generated(
            3,
            102.0,
            "g1",
            "inf-0",
            (rec.GeneratedSample("r1", 0, "length", None), rec.GeneratedSample("r3", 0, "stop", None)),
            1.0,
            3.0,
        ),
        rec.Generated(4, 102.5, "g2", "inf-0", (rec.GeneratedSample("r2", 0, "stop", None),), 0.0, 4.0),
        # An episode's last turn: one sample, whose id is not the episode's rollout id.
        rec.Generated(
            5, 102.7, "g3", "inf-1", (rec.GeneratedSample("ep-0.t1-0", 0, "length", None),), 0.0, 1.0
        ),
        rec.Scored(
            6, 103.0, "acme", "math", "g1", (rec.ScoredOne("r1", 1.0, 0, 8), rec.ScoredOne("r3", 0.5, 0, 2))
        ),
        rec.Scored(7, 103.5, "acme", "math", "g2", (rec.ScoredOne("r2", 0.0, 0, 4),)),
        rec.Scored(8, 103.7, "acme", "math", "g3", (rec.ScoredOne("ep-0", 1.0, 0, 6),)),
        rec.Dead(9, 104.0, "acme", "malformed"),
        rec.Stepped(10, 110.0, 0, 1, 16, {"loss": 0.5, "mismatch_kl": 0.01}, ("r1", "r3", "ep-0")),
    )
    (p,) = state.steps
    assert p.rollouts == 3
    assert p.truncated_frac == pytest.approx(2 / 3)  # r1's sample and the episode's last turn hit max_tokens
    assert p.seq_len_mean == pytest.approx((8 + 2 + 6) / 3)
    assert p.reward_mean == pytest.approx(2.5 / 3)
    assert p.inference_weight_wait_frac == pytest.approx(1.0 / 9.0)
    assert p.pending_samples == 1  # 5 asked, 4 generated (samples, not events)
    assert p.pending_rollouts == 1  # r2 still queued
    assert p.queue_staleness_mean == 1.0  # r2 (version 0) would train at step 1
    assert p.dead_letters == 1 and p.withheld == 0
    assert p.tokens_per_s == pytest.approx(16 / 10.0)  # since the run started
    assert p.trainer["loss"] == 0.5 and p.trainer["entropy"] == 0.0
    assert state.apply(rec.Dead(9, 104.0, "acme", "malformed")) is None  # seen already
    assert state.dead_by_reason == {"malformed": 1}


def test_late_samples_are_counted_per_step() -> None:
    one = rec.ScoredOne("r1", 1.0, 0, 2)
    state = _records(
        rec.Started(1, 100.0, {}),
        rec.Scored(2, 101.0, "acme", "math", "g1", (one,), late=3),  # closed on its quorum
        rec.Scored(3, 101.5, "acme", "math", "g2", (rec.ScoredOne("r2", 0.0, 0, 2),)),
        rec.Stepped(4, 102.0, 0, 1, 4, {}, ("r1", "r2")),
        rec.Stepped(5, 103.0, 1, 2, 0, {}, ()),
    )
    assert [p.late_samples for p in state.steps] == [3, 0]
    assert state.steps[0].scalars()["rollouts/late_samples"] == 3.0


def test_from_step_keeps_later_points_equal() -> None:
    run = synthetic_run("mon2", steps=10, tasks_per_step=4, group_size=4, max_off_policy_steps=0)
    full = {p.step: p for p in fold(run).steps}
    later_state = MonitorState(run.run_id)
    later_state.from_step = 6
    for item in log_items(run.events):
        r = rec.fact_of(item.seq, item.subject, item.event)
        if r is not None:
            later_state.apply(r)
    assert [p.step for p in later_state.steps] == [s for s in full if s >= 6]
    assert [p.as_json() for p in later_state.steps] == [full[s].as_json() for s in full if s >= 6]


@pytest.fixture
def store(db_url: str) -> Any:
    s = open_store(db_url)
    yield s
    s.close()


def test_the_store_shows_what_the_log_shows(store: Store) -> None:
    run = synthetic_run("mon3", steps=8, tasks_per_step=5, group_size=4)
    items = log_items(run.events)
    for i in range(0, len(items), 300):
        with store.write() as conn:
            apply_batch(conn, run_id=run.run_id, stream="S", consumer="c", items=items[i : i + 300])
    from_log = fold(run)
    with store.read() as conn:
        from_db = from_store(conn, run.run_id)
    assert [p.as_json() for p in from_db.steps] == [p.as_json() for p in from_log.steps]
    assert from_db.withheld_by_reason == from_log.withheld_by_reason
    assert {w: (s.kind, s.loaded_version, s.status) for w, s in from_db.workers.items()} == {
        w: (s.kind, s.loaded_version, s.status) for w, s in from_log.workers.items()
    }
    assert from_db.snapshot(0)["latest"] == from_log.snapshot(0)["latest"]


def test_a_resumed_run_is_running_again_with_the_resumes_config(store: Store) -> None:
    rid = "mon-resumed"
    lifecycle = [
        ev.RunStarted(config={"trainer": {"max_steps": 3}}, code_version="0"),
        ev.RunFinished(status="completed", steps=3),
        ev.RunResumed(config={"trainer": {"max_steps": 5}}, code_version="0"),
    ]
    items = log_items([ev.new_event(b, run_id=rid) for b in lifecycle])
    state = MonitorState(rid)
    for item in items:
        r = rec.fact_of(item.seq, item.subject, item.event)
        assert r is not None
        state.apply(r)
    assert state.snapshot(0)["status"] == "running" and state.config == {"trainer": {"max_steps": 5}}
    with store.write() as conn:
        apply_batch(conn, run_id=rid, stream="S", consumer="c", items=items)
    with store.read() as conn:
        assert from_store(conn, rid).snapshot(0)["status"] == "running"


def test_the_store_keeps_a_groups_late_samples(store: Store) -> None:
    """A group closed on its quorum: its rollout rows record the samples it left out, and the
    monitor read from the store counts them as the one read from the log does."""
    rid = "mon-late"
    tokens = ev.InlineArray(dtype="int32", shape=(2,), data=b"\x01\x00\x00\x00\x02\x00\x00\x00")
    lps = ev.InlineArray(dtype="float32", shape=(2,), data=b"\x00" * 8)
    group = "modsum.default.0"
    scored = ev.RolloutsScored(
        generation_event_id="g0",
        task_id=group,
        env="modsum",
        group_id=group,
        group_size=2,
        prompt_tokens=tokens,
        rollouts=[
            ev.ScoredRollout(
                rollout_id=f"{group}-{i}",
                sample_index=i,
                reward=1.0,
                completion_tokens=tokens,
                logprobs=lps,
                policy_version_start=0,
                policy_version_end=0,
            )
            for i in (0, 3)
        ],
        late_samples=[1, 2],
    )
    step = ev.StepCompleted(step=0, policy_version=1, rollout_ids=[f"{group}-0", f"{group}-3"])
    events = [ev.new_event(b, run_id=rid) for b in (ev.RunStarted(config={}, code_version="0"), scored, step)]
    items = log_items(events)
    with store.write() as conn:
        apply_batch(conn, run_id=rid, stream="S", consumer="c", items=items)
    from_log = MonitorState(rid)
    for item in items:
        fact = rec.fact_of(item.seq, item.subject, item.event)
        if fact is not None:
            from_log.apply(fact)
    with store.read() as conn:
        from_db = from_store(conn, rid)
        lates = conn.execute(sa.select(sc.Rollout.group_late).where(sc.Rollout.run_id == rid)).scalars().all()
    assert lates == [2, 2]
    assert [p.late_samples for p in from_log.steps] == [p.late_samples for p in from_db.steps] == [2]
