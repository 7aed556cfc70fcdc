"""Tenants and environments: rollouts, rewards and staleness per (tenant, env) scope."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa

from jetrl.store.queries._source import (
    R,
    Source,
    as_float,
    connection,
)


@dataclass(frozen=True)
class ScopeStats:
    tenant: str | None
    env: str | None
    rollouts: int
    trained: int
    withheld: int
    stale: int
    reward_mean: float | None
    staleness_mean: float | None
    completion_tokens: int


def scope_stats(src: Source, run_id: str, by: Sequence[str] = ("tenant", "env")) -> list[ScopeStats]:
    """Rollout statistics grouped by tenant, env, or both (``by``)."""
    if not by or any(b not in ("tenant", "env") for b in by):
        raise ValueError("group by 'tenant', 'env' or both")
    keys = [R.c[b] for b in by]
    q = (
        sa.select(
            *keys,
            sa.func.count(R.c.scored_seq),
            sa.func.count(R.c.trained_seq),
            sa.func.count(R.c.withheld_seq),
            sa.func.count(sa.case((R.c.withheld_reason == "stale", 1))),
            sa.func.avg(R.c.reward),
            sa.func.avg(R.c.staleness),
            sa.func.coalesce(sa.func.sum(R.c.completion_tokens), 0),
        )
        .where(R.c.run_id == run_id)
        .group_by(*keys)
        .order_by(*keys)
    )
    out = []
    with connection(src) as conn:
        for row in conn.execute(q):
            k = dict(zip(by, row[: len(by)], strict=True))
            n, tr, wh, stale, rew, stl, tok = row[len(by) :]
            out.append(
                ScopeStats(
                    tenant=k.get("tenant"),
                    env=k.get("env"),
                    rollouts=int(n),
                    trained=int(tr),
                    withheld=int(wh),
                    stale=int(stale),
                    reward_mean=as_float(rew),
                    staleness_mean=as_float(stl),
                    completion_tokens=int(tok),
                )
            )
    return out


def tenant_stats(src: Source, run_id: str) -> list[ScopeStats]:
    return scope_stats(src, run_id, ("tenant",))


def env_stats(src: Source, run_id: str) -> list[ScopeStats]:
    return scope_stats(src, run_id, ("env",))
