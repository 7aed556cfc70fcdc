"""Held-out evaluations summed up: per tenant and env, the latest and the best of each figure.

One summary for every reader: the store's queries (``jetrl evals``, ``history``) over its rows,
and the run's report (``summary.json``, the progress line) over the log's events.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

__all__ = ["Evaluation", "EvaluationSummary", "summarize", "summarize_evaluations"]


class Evaluation(Protocol):
    """What a summary reads of one evaluation: an Evaluated fact, a store row or the event body."""

    @property
    def policy_version(self) -> int: ...
    @property
    def samples(self) -> int: ...
    @property
    def pass_at_1(self) -> float: ...
    @property
    def pass_at_k(self) -> float: ...


class ScopedEvaluation(Evaluation, Protocol):
    @property
    def tenant(self) -> str: ...
    @property
    def env(self) -> str: ...


E = TypeVar("E", bound=Evaluation)


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


def _latest_and_best(rows: Sequence[E]) -> tuple[E, E, E]:
    """Of one env's evaluations in version order: the latest, the best pass@1 and the best
    pass@k (the earliest version on a tie)."""
    b1 = max(rows, key=lambda r: (r.pass_at_1, -r.policy_version))
    bk = max(rows, key=lambda r: (r.pass_at_k, -r.policy_version))
    return rows[-1], b1, bk


def summarize(tenant: str, env: str, rows: Sequence[Evaluation]) -> EvaluationSummary:
    """The summary of one tenant's env, from its evaluations in version order (one each)."""
    last, b1, bk = _latest_and_best(rows)
    return EvaluationSummary(
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


def summarize_evaluations(evals: Iterable[ScopedEvaluation]) -> list[EvaluationSummary]:
    """Per tenant and env (in the order first seen), from evaluations in version order."""
    by_scope: dict[tuple[str, str], list[ScopedEvaluation]] = {}
    for row in evals:
        by_scope.setdefault((row.tenant, row.env), []).append(row)
    return [summarize(tenant, env, rows) for (tenant, env), rows in by_scope.items()]
