"""Per-tenant views: a tenant's summary (its tasks, rollouts, rejections, latencies, quota)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from jetrl.bus import subjects
from jetrl.store.queries._source import (
    DL,
    G,
    R,
    Source,
    T,
    connection,
)


@dataclass(frozen=True)
class TenantSummary:
    """One tenant's part of a run (``jetrl history RUN --tenant T``). Tenant ``jetrl`` holds only
    the rejections of run-wide events (dead letters of subjects that carry no tenant)."""

    tenant: str
    tasks: int  # every TaskSubmitted, each turn of an episode counted
    tasks_first_turn: int
    tasks_later_turns: int
    tasks_by_env: dict[str, int]
    generations: int
    completion_tokens: int
    rollouts: int  # scored
    trained: int
    withheld: int
    withheld_by_reason: dict[str, int]
    reward_mean: float | None
    reward_by_env: dict[str, float | None]
    staleness_mean: float | None
    rejections: int
    rejections_by_reason: dict[str, int]
    # Nearest-rank percentiles: a generation's time queued at inference (GenerationTimings),
    # and a task's time from submission to its last scored rollout (tasks with any scored).
    queued_s_p50: float | None
    queued_s_p95: float | None
    task_to_scored_s_p50: float | None
    task_to_scored_s_p95: float | None

    @property
    def pending(self) -> int:
        """Scored rollouts neither trained on nor withheld (yet)."""
        return self.rollouts - self.trained - self.withheld


def _percentiles(
    conn: sa.Connection, sub: sa.Subquery, value: sa.ColumnElement[Any]
) -> dict[str, tuple[float | None, float | None]]:
    """Per tenant, the nearest-rank p50 and p95 of ``value`` over ``sub``'s rows, ranked in SQL
    with window functions (SQLite and PostgreSQL alike: neither percentile_cont on SQLite nor
    every value sent to the client)."""
    ranked = sa.select(
        sub.c.tenant,
        value.label("v"),
        sa.func.row_number().over(partition_by=sub.c.tenant, order_by=value).label("rn"),
        sa.func.count().over(partition_by=sub.c.tenant).label("n"),
    ).subquery()
    # ceil(p * n) in integer arithmetic, the same on both backends.
    k50 = (ranked.c.n * 50 + 99) // 100
    k95 = (ranked.c.n * 95 + 99) // 100
    q = sa.select(ranked.c.tenant, ranked.c.rn, ranked.c.v, k50.label("k50"), k95.label("k95")).where(
        sa.or_(ranked.c.rn == k50, ranked.c.rn == k95)
    )
    out: dict[str, tuple[float | None, float | None]] = {}
    for tenant, rn, v, a, b in conn.execute(q):
        p50, p95 = out.get(tenant, (None, None))
        if rn == int(a):
            p50 = float(v)
        if rn == int(b):
            p95 = float(v)
        out[tenant] = (p50, p95)
    return out


def _rejections(conn: sa.Connection, run_id: str) -> dict[str, dict[str, int]]:
    """Dead letters per tenant and reason. The tenant is the original subject's (what the dead
    letter's own subject and envelope carry, and what logs older than dlq.<tenant> lack): few
    distinct subjects, so the group by is by subject in SQL and the subject parsed here."""
    q = (
        sa.select(DL.c.original_subject, DL.c.reason, sa.func.count())
        .where(DL.c.run_id == run_id)
        .group_by(DL.c.original_subject, DL.c.reason)
    )
    out: dict[str, dict[str, int]] = {}
    for subject, reason, n in conn.execute(q):
        tenant = subjects.tenant_of(subject) or subjects.RUN_TENANT
        by = out.setdefault(tenant, {})
        by[reason] = by.get(reason, 0) + int(n)
    return out


def tenant_summaries(src: Source, run_id: str, *, tenant: str | None = None) -> list[TenantSummary]:
    """Each tenant's tasks, generations, rollouts (trained, withheld by reason), rewards (by
    env), rejections by reason and latencies, by tenant name; ``tenant`` keeps only that one
    (an empty list when it has nothing in the run)."""

    def only(q: sa.Select[Any], col: sa.ColumnElement[Any]) -> sa.Select[Any]:
        return q if tenant is None else q.where(col == tenant)

    tasks_q = only(
        # By turn (a few values per env): one bound expression in both SELECT and GROUP BY
        # would be two parameters to PostgreSQL, which then refuses it.
        sa.select(T.c.tenant, T.c.env, T.c.turn, sa.func.count())
        .where(T.c.run_id == run_id)
        .group_by(T.c.tenant, T.c.env, T.c.turn),
        T.c.tenant,
    )
    gens_q = only(
        sa.select(G.c.tenant, sa.func.count(), sa.func.coalesce(sa.func.sum(G.c.completion_tokens), 0))
        .where(G.c.run_id == run_id)
        .group_by(G.c.tenant),
        G.c.tenant,
    )
    # Sums and counts, not averages, so that the per-env groups add up to the tenant's means.
    rolls_q = only(
        sa.select(
            R.c.tenant,
            R.c.env,
            R.c.withheld_reason,
            sa.func.count(R.c.scored_seq),
            sa.func.count(R.c.trained_seq),
            sa.func.count(R.c.withheld_seq),
            sa.func.sum(R.c.reward),
            sa.func.count(R.c.reward),
            sa.func.sum(R.c.staleness),
            sa.func.count(R.c.staleness),
        )
        .where(R.c.run_id == run_id, R.c.tenant.is_not(None))
        .group_by(R.c.tenant, R.c.env, R.c.withheld_reason),
        R.c.tenant,
    )
    queued = only(sa.select(G.c.tenant, G.c.queued_s).where(G.c.run_id == run_id), G.c.tenant).subquery()
    task_lat = only(
        sa.select(T.c.tenant, (sa.func.max(R.c.scored_at) - T.c.submitted_at).label("lat"))
        .join(R, sa.and_(R.c.run_id == T.c.run_id, R.c.task_id == T.c.task_id))
        .where(T.c.run_id == run_id, R.c.scored_at.is_not(None))
        .group_by(T.c.tenant, T.c.task_id, T.c.submitted_at),
        T.c.tenant,
    ).subquery()

    acc: dict[str, dict[str, Any]] = {}

    def of(t: str) -> dict[str, Any]:
        return acc.setdefault(
            t,
            {
                "tasks_by_env": {},
                "first": 0,
                "later": 0,
                "gens": 0,
                "ctoks": 0,
                "scored": 0,
                "trained": 0,
                "withheld": 0,
                "withheld_by_reason": {},
                "rsum": 0.0,
                "rn": 0,
                "env_reward": {},
                "ssum": 0.0,
                "sn": 0,
            },
        )

    with connection(src) as conn:
        for t, env, turn, n in conn.execute(tasks_q):
            a = of(t)
            a["tasks_by_env"][env] = a["tasks_by_env"].get(env, 0) + int(n)
            a["later" if turn > 0 else "first"] += int(n)
        for t, n, tok in conn.execute(gens_q):
            a = of(t)
            a["gens"], a["ctoks"] = int(n), int(tok)
        for t, env, reason, scored, trained, withheld, rsum, rn, ssum, sn in conn.execute(rolls_q):
            a = of(t)
            a["scored"] += int(scored)
            a["trained"] += int(trained)
            a["withheld"] += int(withheld)
            if reason is not None and withheld:
                a["withheld_by_reason"][reason] = a["withheld_by_reason"].get(reason, 0) + int(withheld)
            a["rsum"] += float(rsum or 0.0)
            a["rn"] += int(rn)
            a["ssum"] += float(ssum or 0.0)
            a["sn"] += int(sn)
            if env is not None:
                es, en = a["env_reward"].get(env, (0.0, 0))
                a["env_reward"][env] = (es + float(rsum or 0.0), en + int(rn))
        rejections = _rejections(conn, run_id)
        if tenant is not None:
            rejections = {k: v for k, v in rejections.items() if k == tenant}
        for t in rejections:
            of(t)
        queue_p = _percentiles(conn, queued, queued.c.queued_s)
        lat_p = _percentiles(conn, task_lat, task_lat.c.lat)

    out = []
    for t in sorted(acc):
        a = acc[t]
        rej = rejections.get(t, {})
        out.append(
            TenantSummary(
                tenant=t,
                tasks=a["first"] + a["later"],
                tasks_first_turn=a["first"],
                tasks_later_turns=a["later"],
                tasks_by_env=dict(sorted(a["tasks_by_env"].items())),
                generations=a["gens"],
                completion_tokens=a["ctoks"],
                rollouts=a["scored"],
                trained=a["trained"],
                withheld=a["withheld"],
                withheld_by_reason=dict(sorted(a["withheld_by_reason"].items())),
                reward_mean=a["rsum"] / a["rn"] if a["rn"] else None,
                reward_by_env={e: (s / n if n else None) for e, (s, n) in sorted(a["env_reward"].items())},
                staleness_mean=a["ssum"] / a["sn"] if a["sn"] else None,
                rejections=sum(rej.values()),
                rejections_by_reason=dict(sorted(rej.items())),
                queued_s_p50=queue_p.get(t, (None, None))[0],
                queued_s_p95=queue_p.get(t, (None, None))[1],
                task_to_scored_s_p50=lat_p.get(t, (None, None))[0],
                task_to_scored_s_p95=lat_p.get(t, (None, None))[1],
            )
        )
    return out


def tenant_summary(src: Source, run_id: str, tenant: str) -> TenantSummary | None:
    rows = tenant_summaries(src, run_id, tenant=tenant)
    return rows[0] if rows else None
