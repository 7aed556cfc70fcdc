"""Steps: the step history (rewards, loss, staleness, timings per step) and each step's rollouts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from jetrl.store.queries._source import (
    SR,
    R,
    S,
    Source,
    as_float,
    connection,
)


@dataclass(frozen=True)
class StepRow:
    step: int
    policy_version: int
    completed_at: float
    duration_s: float
    tokens: int
    num_rollouts: int
    metrics: dict[str, float]
    reward_mean: float | None
    staleness_mean: float | None
    staleness_max: int | None
    withheld: int
    # With step_history(tenant=...): how many of the step's rollouts were the tenant's (the
    # reward, staleness and withheld columns are then the tenant's too).
    tenant_rollouts: int | None = None


def step_history(
    src: Source,
    run_id: str,
    *,
    from_step: int | None = None,
    to_step: int | None = None,
    limit: int | None = None,
    tenant: str | None = None,
) -> list[StepRow]:
    """Steps in order with their metrics, and the reward and staleness of what each trained
    on; ``withheld`` counts the rollouts the trainer withheld at that step. With ``tenant``:
    only the steps that trained on or withheld rollouts of that tenant, with its figures."""
    mine = [] if tenant is None else [R.c.tenant == tenant]
    trained = (
        sa.select(
            R.c.trained_step.label("step"),
            sa.func.count().label("n"),
            sa.func.avg(R.c.reward).label("reward_mean"),
            sa.func.avg(R.c.staleness).label("staleness_mean"),
            sa.func.max(R.c.staleness).label("staleness_max"),
        )
        .where(R.c.run_id == run_id, R.c.trained_step.is_not(None), *mine)
        .group_by(R.c.trained_step)
        .subquery()
    )
    withheld = (
        sa.select(R.c.withheld_step.label("step"), sa.func.count().label("n"))
        .where(R.c.run_id == run_id, R.c.withheld_seq.is_not(None), *mine)
        .group_by(R.c.withheld_step)
        .subquery()
    )
    q = (
        sa.select(
            S,
            trained.c.n.label("tenant_rollouts"),
            trained.c.reward_mean,
            trained.c.staleness_mean,
            trained.c.staleness_max,
            sa.func.coalesce(withheld.c.n, 0).label("withheld"),
        )
        .outerjoin(trained, trained.c.step == S.c.step)
        .outerjoin(withheld, withheld.c.step == S.c.step)
        .where(S.c.run_id == run_id)
        .order_by(S.c.step)
    )
    if tenant is not None:
        q = q.where(sa.or_(trained.c.n.is_not(None), withheld.c.n.is_not(None)))
    if from_step is not None:
        q = q.where(S.c.step >= from_step)
    if to_step is not None:
        q = q.where(S.c.step <= to_step)
    if limit is not None:
        q = q.limit(limit)
    with connection(src) as conn:
        rows = conn.execute(q).mappings().all()
    return [
        StepRow(
            step=r["step"],
            policy_version=r["policy_version"],
            completed_at=r["completed_at"],
            duration_s=r["duration_s"],
            tokens=r["tokens"],
            num_rollouts=r["num_rollouts"],
            metrics=dict(r["metrics"] or {}),
            reward_mean=as_float(r["reward_mean"]),
            staleness_mean=as_float(r["staleness_mean"]),
            staleness_max=r["staleness_max"],
            withheld=int(r["withheld"]),
            tenant_rollouts=None if tenant is None else int(r["tenant_rollouts"] or 0),
        )
        for r in rows
    ]


@dataclass(frozen=True)
class StepRolloutRow:
    position: int
    rollout_id: str
    rollout_seq: int | None
    scored_seq: int | None
    tenant: str | None
    env: str | None
    group_id: str | None
    task_id: str | None
    reward: float | None
    policy_version_start: int | None
    policy_version_end: int | None
    staleness: int | None
    completion_tokens: int | None
    payloads: dict[str, Any] | None


def step_rollouts(src: Source, run_id: str, step: int) -> list[StepRolloutRow]:
    """The rollouts a step trained on, in training order (StepCompleted.rollout_ids), with the
    log sequence of each RolloutsScored: what a replay of the step reads back."""
    q = (
        sa.select(
            SR.c.position,
            SR.c.rollout_id,
            SR.c.rollout_seq,
            R.c.scored_seq,
            R.c.tenant,
            R.c.env,
            R.c.group_id,
            R.c.task_id,
            R.c.reward,
            R.c.policy_version_start,
            R.c.policy_version_end,
            R.c.staleness,
            R.c.completion_tokens,
            R.c.payloads,
        )
        .outerjoin(R, sa.and_(R.c.run_id == SR.c.run_id, R.c.rollout_id == SR.c.rollout_id))
        .where(SR.c.run_id == run_id, SR.c.step == step)
        .order_by(SR.c.position)
    )
    with connection(src) as conn:
        return [StepRolloutRow(**dict(r)) for r in conn.execute(q).mappings()]
