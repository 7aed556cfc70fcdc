"""Held-out evaluations: each one, and the latest and best per environment."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import sqlalchemy as sa

from jetrl.store.queries._source import (
    EV,
    Source,
    connection,
)


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
    with connection(src) as conn:
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
