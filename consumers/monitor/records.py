"""What the monitor keeps of each event: small records, made from the log or from the store.

Both sources give the same records for the same run (the store's rows hold every field used
here), so the fold in series.py never knows which one it reads. Heartbeats are the exception
by nature: the store keeps a worker's last one only.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from jetrl.bus import events as ev
from jetrl.bus import subjects


@dataclass(frozen=True, slots=True)
class Started:
    seq: int
    t: float
    config: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Resumed:
    """The run goes on, with this config (a resume's overrides in it)."""

    seq: int
    t: float
    config: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Finished:
    seq: int
    t: float
    status: str
    steps: int


@dataclass(frozen=True, slots=True)
class Tasked:
    seq: int
    t: float
    tenant: str
    env: str
    samples: int


@dataclass(frozen=True, slots=True)
class Generated:
    seq: int
    t: float
    event_id: str
    worker_id: str
    finish_reason: str
    length: int
    load_wait_s: float
    generate_s: float


@dataclass(frozen=True, slots=True)
class Scored:
    seq: int
    t: float
    rollout_id: str
    tenant: str
    env: str
    reward: float
    version_start: int
    length: int
    generation_event_id: str


@dataclass(frozen=True, slots=True)
class Withheld:
    seq: int
    t: float
    rollout_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Stepped:
    seq: int
    t: float
    step: int
    version: int
    tokens: int
    metrics: dict[str, float]
    rollout_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Dead:
    seq: int
    t: float
    tenant: str
    reason: str


@dataclass(frozen=True, slots=True)
class Beat:
    seq: int
    t: float
    worker_id: str
    kind: str
    status: str
    loaded_version: int | None
    inflight: int
    stats: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Loaded:
    seq: int
    t: float
    worker_id: str
    version: int


@dataclass(frozen=True, slots=True)
class Alerted:
    seq: int
    t: float
    rule: str
    key: str
    state: str
    severity: str
    message: str
    step: int


Record = (
    Started
    | Resumed
    | Finished
    | Tasked
    | Generated
    | Scored
    | Withheld
    | Stepped
    | Dead
    | Beat
    | Loaded
    | Alerted
)


def _length(a: ev.ArrayRef) -> int:
    shape = a.shape
    return int(shape[0]) if shape else 0


def _float(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")  # the store keeps NaN and infinities as strings (JSON has none)


def of_event(seq: int, event: ev.Event) -> Record | None:
    """The record of one event of the log, or None for the kinds the monitor does not fold."""
    b, t = event.body, event.time
    match b:
        case ev.TaskSubmitted():
            return Tasked(seq, t, event.tenant, b.env, b.group_size)
        case ev.GenerationCompleted():
            return Generated(
                seq,
                t,
                event.event_id,
                b.worker_id,
                b.finish_reason,
                _length(b.completion_tokens),
                b.timings.load_wait_s,
                b.timings.generate_s,
            )
        case ev.RolloutScored():
            return Scored(
                seq,
                t,
                b.rollout_id,
                event.tenant,
                b.env,
                b.reward,
                b.policy_version_start,
                _length(b.completion_tokens),
                b.generation_event_id,
            )
        case ev.RolloutWithheld():
            return Withheld(seq, t, b.rollout_id, b.reason)
        case ev.StepCompleted():
            metrics = {k: _float(v) for k, v in b.metrics.items()}
            return Stepped(seq, t, b.step, b.policy_version, b.tokens, metrics, tuple(b.rollout_ids))
        case ev.DeadLettered():
            return Dead(seq, t, event.tenant, b.reason)
        case ev.WorkerHeartbeat():
            return Beat(seq, t, b.worker_id, b.kind, b.status, b.loaded_version, b.inflight, dict(b.stats))
        case ev.WeightsLoaded():
            return Loaded(seq, t, b.worker_id, b.version)
        case ev.AlertRaised():
            return Alerted(seq, t, b.rule, b.key, b.state, b.severity, b.message, b.step)
        case ev.RunStarted():
            return Started(seq, t, dict(b.config))
        case ev.RunResumed():
            return Resumed(seq, t, dict(b.config))
        case ev.RunFinished():
            return Finished(seq, t, b.status, b.steps)
    return None


def of_store(conn: sa.Connection, run_id: str) -> Iterator[Record]:
    """The records of a recorded run, in log order, from its store rows."""
    from jetrl.store import schema as sc

    def rows(model: type[sc.Base], *where: sa.ColumnElement[bool]) -> Any:
        t = sc.table_of(model)
        return conn.execute(sa.select(t).where(t.c.run_id == run_id, *where)).mappings()

    out: list[Record] = []
    for r in rows(sc.Run):
        if r["started_seq"] is not None:
            out.append(Started(r["started_seq"], r["started_at"], dict(r["config"] or {})))
        if r["finished_seq"] is not None and r["status"] != "running":  # not resumed since
            out.append(Finished(r["finished_seq"], r["finished_at"], r["status"], r["steps"] or 0))
    for r in rows(sc.Task):
        out.append(Tasked(r["seq"], r["submitted_at"], r["tenant"], r["env"], r["group_size"]))
    for r in rows(sc.Generation):
        out.append(
            Generated(
                r["seq"],
                r["completed_at"],
                r["event_id"],
                r["worker_id"],
                r["finish_reason"],
                r["completion_tokens"] or 0,
                r["load_wait_s"],
                r["generate_s"],
            )
        )
    rt = sc.table_of(sc.Rollout)
    for r in rows(sc.Rollout, rt.c.scored_seq.is_not(None)):
        out.append(
            Scored(
                r["scored_seq"],
                r["scored_at"],
                r["rollout_id"],
                r["tenant"],
                r["env"],
                r["reward"],
                r["policy_version_start"],
                r["completion_tokens"] or 0,
                r["generation_event_id"],
            )
        )
    for r in rows(sc.Rollout, rt.c.withheld_seq.is_not(None)):
        out.append(Withheld(r["withheld_seq"], r["withheld_at"], r["rollout_id"], r["withheld_reason"]))
    srt = sc.table_of(sc.StepRollout)
    ids: dict[int, list[str]] = {}
    for r in conn.execute(
        sa.select(srt.c.step, srt.c.rollout_id).where(srt.c.run_id == run_id).order_by(srt.c.position)
    ):
        ids.setdefault(r.step, []).append(r.rollout_id)
    for r in rows(sc.Step):
        metrics = {k: _float(v) for k, v in (r["metrics"] or {}).items()}
        out.append(
            Stepped(
                r["seq"],
                r["completed_at"],
                r["step"],
                r["policy_version"],
                r["tokens"],
                metrics,
                tuple(ids.get(r["step"], ())),
            )
        )
    for r in rows(sc.DeadLetter):
        tenant = subjects.tenant_of(r["original_subject"]) or subjects.RUN_TENANT
        out.append(Dead(r["seq"], r["dead_lettered_at"], tenant, r["reason"]))
    for r in rows(sc.Worker):
        # One heartbeat that reported the loaded version is one record (one log position).
        same = r["loaded_seq"] is not None and r["loaded_seq"] == r["heartbeat_seq"]
        if r["heartbeat_seq"] is not None:
            out.append(
                Beat(
                    r["heartbeat_seq"],
                    r["last_heartbeat_at"],
                    r["worker_id"],
                    r["kind"],
                    r["status"] or "ready",
                    r["loaded_version"] if same else None,
                    r["inflight"] or 0,
                    dict(r["stats"] or {}),
                )
            )
        if not same and r["loaded_seq"] is not None and r["loaded_version"] is not None:
            out.append(Loaded(r["loaded_seq"], r["loaded_at"], r["worker_id"], r["loaded_version"]))
    for r in rows(sc.Alert):
        out.append(
            Alerted(
                r["seq"],
                r["raised_at"],
                r["rule"],
                r["key"],
                r["state"],
                r["severity"],
                r["message"],
                r["step"],
            )
        )
    out.sort(key=lambda x: x.seq)
    yield from out
