"""Alerts: each raised and resolved, and their counts per rule."""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa

from jetrl.store.queries._source import (
    AL,
    Source,
    connection,
)


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
    with connection(src) as conn:
        return [AlertRow(**dict(r)) for r in conn.execute(q).mappings()]


def alert_counts(src: Source, run_id: str) -> dict[str, dict[str, int]]:
    """Per rule (by name), how many times it fired and resolved: ``{"firing": n, "resolved": m}``."""
    q = (
        sa.select(AL.c.rule, AL.c.state, sa.func.count())
        .where(AL.c.run_id == run_id)
        .group_by(AL.c.rule, AL.c.state)
    )
    out: dict[str, dict[str, int]] = {}
    with connection(src) as conn:
        for rule, state, n in conn.execute(q):
            out.setdefault(rule, {"firing": 0, "resolved": 0})[state] = int(n)
    return dict(sorted(out.items()))  # by code point: the same on both backends (not collation)
