"""Held-out evaluations: each one, and the latest and best per environment (summed up by the
read model, store/readmodel/evaluations.py, as the run's report does)."""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa

from jetrl.store.queries._source import (
    EV,
    Source,
    connection,
)
from jetrl.store.readmodel.evaluations import EvaluationSummary, summarize_evaluations


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


def evaluation_summary(src: Source, run_id: str) -> list[EvaluationSummary]:
    """Per tenant and env, the latest evaluation and the best of each figure."""
    return summarize_evaluations(evaluations(src, run_id))
