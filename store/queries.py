"""Read side of the store, for the rest of jetrl (CLI, replay, supervisor).

Every function takes a :class:`~jetrl.store.db.Store` or an open ``Connection`` and returns
plain frozen dataclasses, so callers never depend on the schema's columns directly.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import sqlalchemy as sa

from jetrl.bus import subjects
from jetrl.store import schema as sc
from jetrl.store.db import Store

__all__ = [
    "AlertRow",
    "DeadLetterRow",
    "EvaluationRow",
    "EvaluationSummary",
    "PolicyVersionRow",
    "RunSummary",
    "ScopeStats",
    "StepRolloutRow",
    "StepRow",
    "TenantSummary",
    "WorkerRow",
    "alert_counts",
    "alerts",
    "dead_letters",
    "env_stats",
    "evaluation_summary",
    "evaluations",
    "latest_and_best",
    "latest_policy_version",
    "list_runs",
    "policy_versions",
    "recorded_seq",
    "run_summary",
    "scope_stats",
    "step_history",
    "step_rollouts",
    "summarize_evaluations",
    "tenant_stats",
    "tenant_summaries",
    "tenant_summary",
    "workers",
]

Source = Store | sa.Connection

R = sc.Rollout.__table__
T = sc.Task.__table__
G = sc.Generation.__table__
S = sc.Step.__table__
SR = sc.StepRollout.__table__
PV = sc.PolicyVersion.__table__
W = sc.Worker.__table__
DL = sc.DeadLetter.__table__
EV = sc.Evaluation.__table__
AL = sc.Alert.__table__
RUNS = sc.Run.__table__
OFF = sc.OFFSETS


@contextmanager
def _conn(src: Source) -> Iterator[sa.Connection]:
    if isinstance(src, sa.Connection):
        yield src
    else:
        with src.read() as conn:
            yield conn


def _f(v: Any) -> float | None:
    return None if v is None else float(v)


# ----------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    status: str
    started_at: float | None
    finished_at: float | None
    config: dict[str, Any] | None
    code_version: str | None
    steps: int
    last_step: int | None
    latest_version: int | None
    rollouts: int
    trained: int
    withheld: int
    reward_mean: float | None
    staleness_mean: float | None
    tokens: int
    dead_letters: int
    workers: int
    recorded_seq: int
    last_event_at: float | None

    @property
    def pending(self) -> int:
        """Scored rollouts neither trained on nor withheld (yet)."""
        return self.rollouts - self.trained - self.withheld


def _summaries(conn: sa.Connection, run_ids: Sequence[str] | None) -> list[RunSummary]:
    runs_q = sa.select(RUNS).order_by(RUNS.c.started_at.desc().nulls_last(), RUNS.c.run_id)
    if run_ids is not None:
        runs_q = runs_q.where(RUNS.c.run_id.in_(run_ids))
    runs = conn.execute(runs_q).mappings().all()
    if not runs:
        return []
    ids = [r["run_id"] for r in runs]

    def by_run(q: sa.Select[Any]) -> dict[str, Any]:
        return {row[0]: row[1:] for row in conn.execute(q)}

    steps = by_run(
        sa.select(
            S.c.run_id, sa.func.count(), sa.func.max(S.c.step), sa.func.coalesce(sa.func.sum(S.c.tokens), 0)
        )
        .where(S.c.run_id.in_(ids))
        .group_by(S.c.run_id)
    )
    rolls = by_run(
        sa.select(
            R.c.run_id,
            sa.func.count(R.c.scored_seq),
            sa.func.count(R.c.trained_seq),
            sa.func.count(R.c.withheld_seq),
            sa.func.avg(R.c.reward),
            sa.func.avg(R.c.staleness),
        )
        .where(R.c.run_id.in_(ids))
        .group_by(R.c.run_id)
    )
    versions = by_run(
        sa.select(PV.c.run_id, sa.func.max(PV.c.version)).where(PV.c.run_id.in_(ids)).group_by(PV.c.run_id)
    )
    dls = by_run(sa.select(DL.c.run_id, sa.func.count()).where(DL.c.run_id.in_(ids)).group_by(DL.c.run_id))
    wks = by_run(sa.select(W.c.run_id, sa.func.count()).where(W.c.run_id.in_(ids)).group_by(W.c.run_id))
    offs = by_run(
        sa.select(OFF.c.run_id, sa.func.max(OFF.c.last_seq), sa.func.max(OFF.c.last_event_at))
        .where(OFF.c.run_id.in_(ids))
        .group_by(OFF.c.run_id)
    )
    out = []
    for r in runs:
        rid = r["run_id"]
        st = steps.get(rid, (0, None, 0))
        ro = rolls.get(rid, (0, 0, 0, None, None))
        of = offs.get(rid, (0, None))
        out.append(
            RunSummary(
                run_id=rid,
                status=r["status"],
                started_at=r["started_at"],
                finished_at=r["finished_at"],
                config=r["config"],
                code_version=r["code_version"],
                steps=int(st[0]),
                last_step=st[1],
                latest_version=versions.get(rid, (None,))[0],
                rollouts=int(ro[0]),
                trained=int(ro[1]),
                withheld=int(ro[2]),
                reward_mean=_f(ro[3]),
                staleness_mean=_f(ro[4]),
                tokens=int(st[2]),
                dead_letters=int(dls.get(rid, (0,))[0]),
                workers=int(wks.get(rid, (0,))[0]),
                recorded_seq=int(of[0] or 0),
                last_event_at=of[1],
            )
        )
    return out


def list_runs(src: Source) -> list[RunSummary]:
    """Every run in the store, newest first."""
    with _conn(src) as conn:
        return _summaries(conn, None)


def run_summary(src: Source, run_id: str) -> RunSummary | None:
    with _conn(src) as conn:
        rows = _summaries(conn, [run_id])
    return rows[0] if rows else None


def recorded_seq(src: Source, run_id: str, consumer: str = "recorder") -> int:
    """The last log sequence the named projection consumer has committed for the run."""
    with _conn(src) as conn:
        v = conn.execute(
            sa.select(OFF.c.last_seq).where(OFF.c.run_id == run_id, OFF.c.consumer == consumer)
        ).scalar()
    return int(v or 0)


# ----------------------------------------------------------------------------- steps


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
    with _conn(src) as conn:
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
            reward_mean=_f(r["reward_mean"]),
            staleness_mean=_f(r["staleness_mean"]),
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
    log sequence of each RolloutScored: what a replay of the step reads back."""
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
    with _conn(src) as conn:
        return [StepRolloutRow(**dict(r)) for r in conn.execute(q).mappings()]


# ----------------------------------------------------------------------------- tenants and envs


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
    with _conn(src) as conn:
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
                    reward_mean=_f(rew),
                    staleness_mean=_f(stl),
                    completion_tokens=int(tok),
                )
            )
    return out


def tenant_stats(src: Source, run_id: str) -> list[ScopeStats]:
    return scope_stats(src, run_id, ("tenant",))


def env_stats(src: Source, run_id: str) -> list[ScopeStats]:
    return scope_stats(src, run_id, ("env",))


# ----------------------------------------------------------------------------- policy, workers, dead letters


@dataclass(frozen=True)
class PolicyVersionRow:
    version: int
    step: int | None
    weights_checksum: str | None
    parent_version: int | None
    published_at: float | None
    location_uri: str | None
    location: dict[str, Any] | None
    sha256: str | None
    size: int | None
    format: str | None
    ready_at: float | None

    @property
    def ready(self) -> bool:
        return self.location_uri is not None


def _pv_query(run_id: str) -> sa.Select[Any]:
    return sa.select(
        PV.c.version,
        PV.c.step,
        PV.c.weights_checksum,
        PV.c.parent_version,
        PV.c.published_at,
        PV.c.location_uri,
        PV.c.location,
        PV.c.sha256,
        PV.c.size,
        PV.c.format,
        PV.c.ready_at,
    ).where(PV.c.run_id == run_id)


def policy_versions(src: Source, run_id: str) -> list[PolicyVersionRow]:
    with _conn(src) as conn:
        return [
            PolicyVersionRow(**dict(r))
            for r in conn.execute(_pv_query(run_id).order_by(PV.c.version)).mappings()
        ]


def latest_policy_version(src: Source, run_id: str, *, ready: bool = False) -> PolicyVersionRow | None:
    """The newest published policy version; with ``ready``, the newest whose weights are
    readable (WeightsReady seen), which is what a worker can load."""
    q = _pv_query(run_id).where(PV.c.published_seq.is_not(None))
    if ready:
        q = q.where(PV.c.ready_seq.is_not(None))
    with _conn(src) as conn:
        r = conn.execute(q.order_by(PV.c.version.desc()).limit(1)).mappings().first()
    return PolicyVersionRow(**dict(r)) if r else None


@dataclass(frozen=True)
class WorkerRow:
    worker_id: str
    kind: str
    status: str | None
    last_heartbeat_at: float | None
    loaded_version: int | None
    inflight: int | None


def workers(src: Source, run_id: str) -> list[WorkerRow]:
    q = (
        sa.select(
            W.c.worker_id, W.c.kind, W.c.status, W.c.last_heartbeat_at, W.c.loaded_version, W.c.inflight
        )
        .where(W.c.run_id == run_id)
        .order_by(W.c.kind, W.c.worker_id)
    )
    with _conn(src) as conn:
        return [WorkerRow(**dict(r)) for r in conn.execute(q).mappings()]


@dataclass(frozen=True)
class DeadLetterRow:
    event_id: str
    seq: int
    reason: str
    detail: str
    consumer: str
    original_subject: str
    original_seq: int
    original_type: str | None
    dead_lettered_at: float


def dead_letters(src: Source, run_id: str) -> list[DeadLetterRow]:
    q = (
        sa.select(
            DL.c.event_id,
            DL.c.seq,
            DL.c.reason,
            DL.c.detail,
            DL.c.consumer,
            DL.c.original_subject,
            DL.c.original_seq,
            DL.c.original_type,
            DL.c.dead_lettered_at,
        )
        .where(DL.c.run_id == run_id)
        .order_by(DL.c.seq)
    )
    with _conn(src) as conn:
        return [DeadLetterRow(**dict(r)) for r in conn.execute(q).mappings()]


# ----------------------------------------------------------------------------- evaluations


@dataclass(frozen=True)
class EvaluationRow:
    tenant: str
    env: str
    policy_version: int
    n_tasks: int
    samples: int
    pass_at_1: float
    pass_at_k: float
    reward_mean: float
    version_min: int
    version_max: int
    temperature: float
    successes: list[int]
    reported_at: float


def evaluations(src: Source, run_id: str, *, env: str | None = None) -> list[EvaluationRow]:
    """The run's held-out evaluations (EvaluationReported), by tenant, env and version."""
    cols = [c for c in EV.c if c.name not in ("run_id", "event_id", "seq")]
    q = sa.select(*cols).where(EV.c.run_id == run_id).order_by(EV.c.tenant, EV.c.env, EV.c.policy_version)
    if env is not None:
        q = q.where(EV.c.env == env)
    with _conn(src) as conn:
        return [EvaluationRow(**{**r, "successes": list(r["successes"])}) for r in conn.execute(q).mappings()]


@dataclass(frozen=True)
class EvaluationSummary:
    """Per tenant and env: the newest evaluation and the best pass@1 and pass@k, with the
    versions that scored them (the earliest on a tie)."""

    tenant: str
    env: str
    evaluations: int
    samples: int  # k of the latest
    latest_version: int
    latest_pass_at_1: float
    latest_pass_at_k: float
    best_pass_at_1: float
    best_pass_at_1_version: int
    best_pass_at_k: float
    best_pass_at_k_version: int


class Scored(Protocol):
    @property
    def policy_version(self) -> int: ...
    @property
    def pass_at_1(self) -> float: ...
    @property
    def pass_at_k(self) -> float: ...


ScoredT = TypeVar("ScoredT", bound=Scored)


def latest_and_best(rows: Sequence[ScoredT]) -> tuple[ScoredT, ScoredT, ScoredT]:
    """Of one env's evaluations in version order: the latest, the best pass@1 and the best
    pass@k (the earliest version on a tie). The store's summary and the run report share it."""
    b1 = max(rows, key=lambda r: (r.pass_at_1, -r.policy_version))
    bk = max(rows, key=lambda r: (r.pass_at_k, -r.policy_version))
    return rows[-1], b1, bk


def evaluation_summary(src: Source, run_id: str) -> list[EvaluationSummary]:
    return summarize_evaluations(evaluations(src, run_id))


def summarize_evaluations(evals: Sequence[EvaluationRow]) -> list[EvaluationSummary]:
    """Per tenant and env, the latest evaluation and the best of each figure."""
    by_scope: dict[tuple[str, str], list[EvaluationRow]] = {}
    for row in evals:
        by_scope.setdefault((row.tenant, row.env), []).append(row)
    out = []
    for (tenant, env), rows in by_scope.items():  # each in version order
        last, b1, bk = latest_and_best(rows)
        out.append(
            EvaluationSummary(
                tenant=tenant,
                env=env,
                evaluations=len(rows),
                samples=last.samples,
                latest_version=last.policy_version,
                latest_pass_at_1=last.pass_at_1,
                latest_pass_at_k=last.pass_at_k,
                best_pass_at_1=b1.pass_at_1,
                best_pass_at_1_version=b1.policy_version,
                best_pass_at_k=bk.pass_at_k,
                best_pass_at_k_version=bk.policy_version,
            )
        )
    return out


# ----------------------------------------------------------------------------- alerts


@dataclass(frozen=True)
class AlertRow:
    event_id: str
    seq: int
    rule: str
    key: str
    state: str  # "firing" | "resolved"
    severity: str  # "warning" | "critical"
    message: str
    step: int
    value: float | None  # None: the event's was NaN
    threshold: float | None
    raised_at: float


def alerts(src: Source, run_id: str, *, rule: str | None = None) -> list[AlertRow]:
    """The run's alerts (AlertRaised), firing and resolved, in log order; ``rule`` keeps one rule's."""
    q = (
        sa.select(
            AL.c.event_id,
            AL.c.seq,
            AL.c.rule,
            AL.c.key,
            AL.c.state,
            AL.c.severity,
            AL.c.message,
            AL.c.step,
            AL.c.value,
            AL.c.threshold,
            AL.c.raised_at,
        )
        .where(AL.c.run_id == run_id)
        .order_by(AL.c.seq)
    )
    if rule is not None:
        q = q.where(AL.c.rule == rule)
    with _conn(src) as conn:
        return [AlertRow(**dict(r)) for r in conn.execute(q).mappings()]


def alert_counts(src: Source, run_id: str) -> dict[str, dict[str, int]]:
    """Per rule (by name), how many times it fired and resolved: ``{"firing": n, "resolved": m}``."""
    q = (
        sa.select(AL.c.rule, AL.c.state, sa.func.count())
        .where(AL.c.run_id == run_id)
        .group_by(AL.c.rule, AL.c.state)
    )
    out: dict[str, dict[str, int]] = {}
    with _conn(src) as conn:
        for rule, state, n in conn.execute(q):
            out.setdefault(rule, {"firing": 0, "resolved": 0})[state] = int(n)
    return dict(sorted(out.items()))  # by code point: the same on both backends (not collation)


# ----------------------------------------------------------------------------- per-tenant views


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

    with _conn(src) as conn:
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
