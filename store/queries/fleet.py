"""Policy versions, workers and dead letters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from jetrl.store.queries._source import (
    DL,
    PV,
    Source,
    W,
    connection,
)


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
    with connection(src) as conn:
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
    with connection(src) as conn:
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
    with connection(src) as conn:
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
    with connection(src) as conn:
        return [DeadLetterRow(**dict(r)) for r in conn.execute(q).mappings()]
