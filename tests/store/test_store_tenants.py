"""Per-tenant views of a run: the store's tenant summaries and tenant-filtered step history,
checked against figures computed from a synthetic two-tenant log (SQLite and PostgreSQL), and
``jetrl history RUN --tenant T`` / ``--tenants`` on a log recorded through a real nats-server."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
from collections import defaultdict
from dataclasses import dataclass, field
from statistics import mean

import msgspec
import pytest

from jetrl.bus import events as ev
from jetrl.bus import ids
from jetrl.bus.client import Bus
from jetrl.bus.server import EmbeddedServer
from jetrl.bus.streams import StreamLimits
from jetrl.consumers.recorder import Recorder
from jetrl.deploy import store_cmd
from jetrl.store import queries
from jetrl.store.db import Store, open_store
from jetrl.store.projection import LogItem, apply_batch
from tests.support.synthetic import log_items, publish_events, synthetic_run

TENANTS = ("acme", "globex")
# (tenant of the original's subject, original subject's kind and env, reason, how many)
REJECTIONS = (
    ("acme", "task.acme.math", "quota", 3),
    ("acme", "task.acme.math", "unknown_env", 1),
    ("globex", "rollout.globex.code", "malformed", 2),
    ("jetrl", "step", "malformed", 1),  # a run-wide event: tenant "jetrl"
)


@dataclass
class TenantLog:
    """A synthetic run's events with extra later turns, varied queue times and dead letters."""

    run_id: str
    events: list[ev.Event]
    legacy: ev.Event  # a dead letter on the old subject jetrl.<run>.dlq.<reason>
    rejections: dict[str, dict[str, int]] = field(default_factory=dict)

    def items(self) -> list[LogItem]:
        items = log_items(self.events)
        seq = len(items) + 1
        return [*items, LogItem(seq, f"jetrl.{self.run_id}.dlq.malformed", self.legacy)]


def tenant_log(run_id: str, *, steps: int = 6, seed: int = 5) -> TenantLog:
    rng = random.Random(seed)
    base = synthetic_run(run_id, steps=steps, seed=seed, tenants=TENANTS)
    t = base.events[-1].time
    events: list[ev.Event] = []
    for e in base.events[:-1]:  # RunFinished goes last again
        if isinstance(e.body, ev.CompletionsGenerated):
            timings = msgspec.structs.replace(e.body.timings, queued_s=round(rng.uniform(0.0, 5.0), 4))
            e = msgspec.structs.replace(e, body=msgspec.structs.replace(e.body, timings=timings))
        events.append(e)

    def emit(body: ev.EventBody, tenant: str) -> ev.Event:
        nonlocal t
        t += 0.01
        e = ev.new_event(body, run_id=run_id, tenant=tenant, time=t, event_id=f"x{len(events)}")
        events.append(e)
        return e

    # Later turns of episodes (no generations: only the tasks are counted by turn).
    for tenant, turns in (("acme", 2), ("globex", 1)):
        for turn in range(1, turns + 1):
            body = ev.TaskSubmitted(
                task_id=ids.task_id("math", tenant, f"ep{turn}"),
                env="math",
                group_size=2,
                prompt_tokens=[1, 2, 3],
                episode_id=f"{tenant}-ep",
                turn=turn,
            )
            emit(body, tenant)
    rejections: dict[str, dict[str, int]] = defaultdict(dict)
    for tenant, rest, reason, n in REJECTIONS:
        for i in range(n):
            original = f"jetrl.{run_id}.{rest}"
            dl = ev.DeadLettered(
                reason=reason,
                detail=f"{reason} #{i}",
                consumer="inference",
                original_subject=original,
                original_stream_seq=1000 + len(events),
                original_data=b"\x00garbage",
            )
            emit(dl, tenant)
            rejections[tenant][reason] = rejections[tenant].get(reason, 0) + 1
    # A log older than dlq.<tenant>: the tenant is still the original subject's.
    legacy = ev.new_event(
        ev.DeadLettered(
            reason="malformed",
            detail="old",
            consumer="trainer",
            original_subject=f"jetrl.{run_id}.rollout.globex.math",
            original_stream_seq=99,
        ),
        run_id=run_id,
        tenant="default",
        time=t + 1,
        event_id="legacy-dl",
    )
    rejections["globex"]["malformed"] += 1
    events.append(base.events[-1])
    return TenantLog(run_id, events, legacy, dict(rejections))


def _nearest_rank(values: list[float], p: int) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[math.ceil(p * len(values) / 100) - 1]


@dataclass
class Want:
    tasks: int = 0
    later: int = 0
    tasks_by_env: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    generations: int = 0
    queued: list[float] = field(default_factory=list)
    rewards: dict[str, tuple[str, float]] = field(default_factory=dict)  # rollout -> env, reward
    withheld: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    trained: int = 0
    submitted: dict[str, float] = field(default_factory=dict)  # task -> time
    scored: dict[str, float] = field(default_factory=dict)  # task -> last scored time


def truth(log: TenantLog) -> dict[str, Want]:
    want: dict[str, Want] = defaultdict(Want)
    tenant_of_rollout: dict[str, str] = {}
    for e in log.events:
        b, w = e.body, want[e.tenant]
        if isinstance(b, ev.TaskSubmitted):
            w.tasks += 1
            w.later += b.turn > 0
            w.tasks_by_env[b.env] += 1
            w.submitted[b.task_id] = e.time
        elif isinstance(b, ev.CompletionsGenerated):
            # The store keeps a row per sample: generations count samples, each with its
            # task's time queued.
            w.generations += len(b.samples)
            w.queued.extend([b.timings.queued_s] * len(b.samples))
        elif isinstance(b, ev.RolloutsScored):
            for r in b.rollouts:
                w.rewards[r.rollout_id] = (b.env, r.reward)
                tenant_of_rollout[r.rollout_id] = e.tenant
            w.scored[b.task_id] = max(w.scored.get(b.task_id, 0.0), e.time)
        elif isinstance(b, ev.RolloutWithheld):
            w.withheld[b.reason] += 1
        elif isinstance(b, ev.StepCompleted):
            for rid in b.rollout_ids:
                want[tenant_of_rollout[rid]].trained += 1
    return {t: want[t] for t in TENANTS}


def _same(a: queries.TenantSummary | None, b: queries.TenantSummary) -> None:
    # Sums of floats: PostgreSQL adds them in no fixed order.
    assert a is not None
    da, db = dataclasses.asdict(a), dataclasses.asdict(b)
    assert da.keys() == db.keys()
    for k, v in db.items():
        if isinstance(v, float) or (isinstance(v, dict) and k.startswith("reward")):
            assert da[k] == pytest.approx(v), k
        else:
            assert da[k] == v, k


@pytest.fixture
def log_in_store(store: Store) -> TenantLog:
    log = tenant_log("mt")
    with store.write() as conn:
        apply_batch(conn, run_id="mt", stream="JETRL_mt", consumer="recorder", items=log.items())
    return log


def test_tenant_summaries_match_the_log(store: Store, log_in_store: TenantLog) -> None:
    want = truth(log_in_store)
    rows = {s.tenant: s for s in queries.tenant_summaries(store, "mt")}
    assert sorted(rows) == ["acme", "globex", "jetrl"]
    for tenant, w in want.items():
        s = rows[tenant]
        assert (s.tasks, s.tasks_first_turn, s.tasks_later_turns) == (w.tasks, w.tasks - w.later, w.later)
        assert w.later in (1, 2) and s.tasks_by_env == dict(sorted(w.tasks_by_env.items()))
        assert s.generations == w.generations
        assert (s.rollouts, s.trained, s.withheld) == (len(w.rewards), w.trained, sum(w.withheld.values()))
        assert s.withheld_by_reason == dict(sorted(w.withheld.items()))
        assert s.pending == 0
        assert s.reward_mean == pytest.approx(mean(r for _, r in w.rewards.values()))
        by_env: dict[str, list[float]] = defaultdict(list)
        for env, r in w.rewards.values():
            by_env[env].append(r)
        assert s.reward_by_env == pytest.approx({env: mean(rs) for env, rs in by_env.items()})
        assert s.rejections_by_reason == log_in_store.rejections[tenant]
        assert s.rejections == sum(log_in_store.rejections[tenant].values())
        assert s.queued_s_p50 == pytest.approx(_nearest_rank(w.queued, 50))
        assert s.queued_s_p95 == pytest.approx(_nearest_rank(w.queued, 95))
        lat = [w.scored[k] - w.submitted[k] for k in w.scored]
        assert s.task_to_scored_s_p50 == pytest.approx(_nearest_rank(lat, 50))
        assert s.task_to_scored_s_p95 == pytest.approx(_nearest_rank(lat, 95))
    assert rows["acme"].rejections_by_reason == {"quota": 3, "unknown_env": 1}
    assert rows["globex"].rejections_by_reason == {"malformed": 3}  # the legacy one included
    run_wide = rows["jetrl"]
    assert (run_wide.rejections_by_reason, run_wide.tasks, run_wide.rollouts) == ({"malformed": 1}, 0, 0)
    assert run_wide.reward_mean is None and run_wide.queued_s_p50 is None

    # One tenant alone gives the same figures as in the list; an unknown one, nothing.
    _same(queries.tenant_summary(store, "mt", "acme"), rows["acme"])
    [globex] = queries.tenant_summaries(store, "mt", tenant="globex")
    _same(globex, rows["globex"])
    assert queries.tenant_summary(store, "mt", "nobody") is None
    assert queries.tenant_summaries(store, "other-run") == []


def test_step_history_of_one_tenant(store: Store, log_in_store: TenantLog) -> None:
    tenant_of: dict[str, str] = {}
    reward: dict[str, float] = {}
    withheld_at: dict[tuple[str, int], int] = defaultdict(int)
    per_step: dict[int, list[str]] = {}
    for e in log_in_store.events:
        b = e.body
        if isinstance(b, ev.RolloutsScored):
            for x in b.rollouts:
                tenant_of[x.rollout_id], reward[x.rollout_id] = e.tenant, x.reward
        elif isinstance(b, ev.RolloutWithheld):
            withheld_at[e.tenant, b.trainer_step] += 1
        elif isinstance(b, ev.StepCompleted):
            per_step[b.step] = list(b.rollout_ids)
    everything = {r.step: r for r in queries.step_history(store, "mt")}
    assert all(r.tenant_rollouts is None for r in everything.values())
    for tenant in TENANTS:
        rows = queries.step_history(store, "mt", tenant=tenant)
        mine = {
            step: [r for r in ids if tenant_of[r] == tenant]
            for step, ids in per_step.items()
            if any(tenant_of[r] == tenant for r in ids) or withheld_at[tenant, step]
        }
        assert [r.step for r in rows] == sorted(mine)
        for r in rows:
            ids = mine[r.step]
            assert r.tenant_rollouts == len(ids)
            assert r.num_rollouts == everything[r.step].num_rollouts  # the step's, all tenants
            assert r.reward_mean == (pytest.approx(mean(reward[i] for i in ids)) if ids else None)
            assert r.withheld == withheld_at[tenant, r.step]
    # Every trained rollout is one tenant's: the tenants' rows add up to the steps'.
    total = sum(r.tenant_rollouts or 0 for t in TENANTS for r in queries.step_history(store, "mt", tenant=t))
    assert total == sum(len(v) for v in per_step.values())
    assert queries.step_history(store, "mt", tenant="nobody") == []
    limited = queries.step_history(store, "mt", tenant="acme", from_step=2, limit=2)
    assert len(limited) <= 2 and all(r.step >= 2 for r in limited)


# ----------------------------------------------------------------------------- the CLI


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    store_cmd.add_store_commands(p.add_subparsers(dest="command", required=True))
    return p.parse_args(argv)


def record(nats_url: str, log: TenantLog, db: str) -> None:
    """Publish the log (the legacy dead letter raw, on its old subject) and record it."""

    async def go() -> None:
        bus = await Bus.connect(nats_url)
        await bus.ensure_run(log.run_id, StreamLimits(max_bytes=64 * 1024**2, payload_max_bytes=64 * 1024**2))
        await publish_events(bus, log.events)
        legacy = log.items()[-1]
        await bus.js.publish(
            legacy.subject, ev.encode_event(log.legacy), headers=ev.event_headers(log.legacy)
        )
        with open_store(db) as store:
            rec = Recorder(bus, store, log.run_id, batch=500)
            await rec.catch_up(timeout=60)
            rec.close()
        await bus.close()

    asyncio.run(go())


def test_history_of_a_tenant_and_of_every_tenant(
    nats_server: EmbeddedServer, run_id: str, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tenant_log(run_id, steps=4, seed=9)
    record(nats_server.url, log, db_url)
    want = truth(log)
    with open_store(db_url) as store:
        summaries = {s.tenant: s for s in queries.tenant_summaries(store, run_id)}
        acme_steps = queries.step_history(store, run_id, tenant="acme")
    assert summaries["globex"].rejections_by_reason == {"malformed": 3}  # recorded live too

    args = parse(["history", run_id, "--db", db_url, "--tenant", "acme", "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["tenant"] == "acme"
    assert out["summary"]["tasks"] == want["acme"].tasks
    assert out["summary"]["rejections_by_reason"] == {"quota": 3, "unknown_env": 1}
    assert [s["step"] for s in out["steps"]] == [r.step for r in acme_steps]
    assert [s["tenant_rollouts"] for s in out["steps"]] == [r.tenant_rollouts for r in acme_steps]

    args = parse(["history", run_id, "--db", db_url, "--tenant", "acme"])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert f"run {run_id} — tenant acme" in text
    assert f"{want['acme'].tasks} tasks" in text and "quota 3" in text and "unknown_env 1" in text
    assert "acme rollouts" in text and "acme reward" in text

    args = parse(["history", run_id, "--db", db_url, "--tenants"])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "tenants" in text and "acme" in text and "globex" in text and "jetrl" in text
    args = parse(["history", run_id, "--db", db_url, "--tenants", "--json"])
    assert args.func(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["tenant"] for r in rows] == ["acme", "globex", "jetrl"]
    assert rows[1]["generations"] == want["globex"].generations

    args = parse(["history", run_id, "--db", db_url, "--tenant", "nobody"])
    assert args.func(args) == 1
    assert "no events of tenant 'nobody'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["history", run_id, "--tenant", "acme", "--tenants"])
