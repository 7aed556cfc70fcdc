"""Runs: one summary per run (status, steps, rewards, counts) and what the recorder has read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from jetrl.store.queries._source import (
    DL,
    OFF,
    PV,
    RUNS,
    R,
    S,
    Source,
    W,
    as_float,
    connection,
)


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
                reward_mean=as_float(ro[3]),
                staleness_mean=as_float(ro[4]),
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
    with connection(src) as conn:
        return _summaries(conn, None)


def run_summary(src: Source, run_id: str) -> RunSummary | None:
    with connection(src) as conn:
        rows = _summaries(conn, [run_id])
    return rows[0] if rows else None


def recorded_seq(src: Source, run_id: str, consumer: str = "recorder") -> int:
    """The last log sequence the named projection consumer has committed for the run."""
    with connection(src) as conn:
        v = conn.execute(
            sa.select(OFF.c.last_seq).where(OFF.c.run_id == run_id, OFF.c.consumer == consumer)
        ).scalar()
    return int(v or 0)
