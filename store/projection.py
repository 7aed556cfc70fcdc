"""Events → rows: the projection of a run's log, applied in batches.

:func:`apply_batch` is the one write path. In a single transaction it reads the tracking row
(stream, consumer, last_seq), drops every event at or below it (already applied: redelivery,
a restart after a crash between commit and ack), folds the rest into at most one row per
table key, upserts them, and moves the tracking row to the batch's last sequence. A crash
before the commit leaves nothing; a crash after it leaves rows and offset together.

The upserts are idempotent on their own as well: each group of columns carries the sequence
of the event that wrote it and is written "first fact wins" or "last state wins" against that
sequence, so applying the same events twice, or the groups of a batch in any order, yields the
same row (docs/store.md, "Exactness").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from jetrl.bus import events as ev
from jetrl.store import schema as sc
from jetrl.store.specs import (
    DEAD_LETTERS,
    GENERATIONS,
    POLICY_VERSIONS,
    ROLLOUTS,
    RUNS,
    SPECS,
    STEP_ROLLOUTS,
    STEPS,
    TASKS,
    WORKERS,
    Group,
    Spec,
)

__all__ = ["ApplyResult", "LogItem", "apply_batch", "fold", "read_offset", "upsert_rows"]


@dataclass(frozen=True, slots=True)
class LogItem:
    """One event of the log as the projection sees it."""

    seq: int
    subject: str
    event: ev.Event


@dataclass(frozen=True)
class ApplyResult:
    applied: int
    skipped: int
    last_seq: int
    rows: int


# ----------------------------------------------------------------------------- event → partial rows


@dataclass(slots=True)
class Partial:
    """Part of a row: the key, the group it writes (None: a whole fact) and insert defaults."""

    spec: Spec
    key: tuple[Any, ...]
    seq: int
    values: dict[str, Any]
    group: str | None = None
    defaults: dict[str, Any] = field(default_factory=dict)


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    # JSON (and PostgreSQL's jsonb) has no NaN/Infinity: keep them readable as strings.
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, float) and not math.isfinite(v):
            out[k] = str(v)
        else:
            out[k] = v
    return out


_ITEMSIZE = {
    "uint8": 1,
    "uint16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
}


def _ref(a: ev.ArrayRef | None) -> dict[str, Any] | None:
    if a is None:
        return None
    if isinstance(a, ev.InlineArray):
        # The bytes stay in the log (the event's seq finds them); the store keeps the shape.
        return {"inline": True, "dtype": a.dtype, "shape": list(a.shape), "size": len(a.data)}
    out: dict[str, Any] = {
        "store": a.store,
        "bucket": a.bucket,
        "name": a.name,
        "size": a.size,
        "sha256": a.sha256,
    }
    if a.dtype is not None:
        out["dtype"] = a.dtype
    if a.shape is not None:
        out["shape"] = list(a.shape)
    return out


def _length(a: ev.ArrayRef) -> int | None:
    shape = a.shape
    if shape:
        return int(shape[0])
    if isinstance(a, ev.PayloadRef) and a.dtype in _ITEMSIZE:
        return a.size // _ITEMSIZE[a.dtype]
    return None


def _location_uri(loc: ev.PayloadRef) -> str:
    return f"{loc.store}://{loc.bucket}/{loc.name}"


def partials(item: LogItem) -> list[Partial]:
    """The row parts one event writes (empty for an event with no projection)."""
    e, seq = item.event, item.seq
    run = e.run_id
    b = e.body
    match b:
        case ev.RunStarted():
            return [
                Partial(
                    RUNS,
                    (run,),
                    seq,
                    {
                        "tenant": e.tenant,
                        "config": b.config,
                        "code_version": b.code_version,
                        "host": b.host,
                        "library_versions": dict(b.library_versions),
                        "started_at": e.time,
                        "started_event_id": e.event_id,
                    },
                    "started_seq",
                    {"status": "running"},
                )
            ]
        case ev.RunFinished():
            return [
                Partial(
                    RUNS,
                    (run,),
                    seq,
                    {"status": b.status, "steps": b.steps, "finish_reason": b.reason, "finished_at": e.time},
                    "finished_seq",
                    {"tenant": e.tenant},
                )
            ]
        case ev.TaskSubmitted():
            return [
                Partial(
                    TASKS,
                    (run, b.task_id),
                    seq,
                    {
                        "tenant": e.tenant,
                        "env": b.env,
                        "group_size": b.group_size,
                        "prompt_len": len(b.prompt_tokens),
                        "prompt_text": b.prompt_text,
                        "max_tokens": b.max_tokens,
                        "episode_id": b.episode_id,
                        "turn": b.turn,
                        "info": b.info,
                        "submitted_at": e.time,
                        "event_id": e.event_id,
                        "seq": seq,
                    },
                )
            ]
        case ev.GenerationCompleted():
            return [
                Partial(
                    GENERATIONS,
                    (run, e.event_id),
                    seq,
                    {
                        "generation_id": b.generation_id,
                        "task_id": b.task_id,
                        "tenant": e.tenant,
                        "env": b.env,
                        "group_id": b.group_id,
                        "sample_index": b.sample_index,
                        "worker_id": b.worker_id,
                        "finish_reason": b.finish_reason,
                        "policy_version_start": b.policy_version_start,
                        "policy_version_end": b.policy_version_end,
                        "prompt_tokens": _length(b.prompt_tokens),
                        "completion_tokens": _length(b.completion_tokens),
                        "queued_s": b.timings.queued_s,
                        "generate_s": b.timings.generate_s,
                        "load_wait_s": b.timings.load_wait_s,
                        "episode_id": b.episode_id,
                        "turn": b.turn,
                        "completed_at": e.time,
                        "seq": seq,
                    },
                )
            ]
        case ev.RolloutScored():
            return [
                Partial(
                    ROLLOUTS,
                    (run, b.rollout_id),
                    seq,
                    {
                        "tenant": e.tenant,
                        "env": b.env,
                        "group_id": b.group_id,
                        "task_id": b.task_id,
                        "generation_event_id": b.generation_event_id,
                        "sample_index": b.sample_index,
                        "group_size": b.group_size,
                        "reward": b.reward,
                        "reward_parts": _finite(dict(b.reward_parts)),
                        "policy_version_start": b.policy_version_start,
                        "policy_version_end": b.policy_version_end,
                        "prompt_tokens": _length(b.prompt_tokens),
                        "completion_tokens": _length(b.completion_tokens),
                        "payloads": {
                            "prompt_tokens": _ref(b.prompt_tokens),
                            "completion_tokens": _ref(b.completion_tokens),
                            "logprobs": _ref(b.logprobs),
                            "routing_trace": _ref(b.routing_trace),
                        },
                        "scored_at": e.time,
                        "scored_event_id": e.event_id,
                    },
                    "scored_seq",
                )
            ]
        case ev.RolloutWithheld():
            return [
                Partial(
                    ROLLOUTS,
                    (run, b.rollout_id),
                    seq,
                    {
                        "withheld_reason": b.reason,
                        "withheld_detail": b.detail,
                        "withheld_step": b.trainer_step,
                        "withheld_policy_version": b.policy_version,
                        "withheld_staleness": b.staleness,
                        "withheld_at": e.time,
                    },
                    "withheld_seq",
                    {"tenant": e.tenant, "env": b.env, "group_id": b.group_id},
                )
            ]
        case ev.StepCompleted():
            seqs = list(b.rollout_seqs)
            out = [
                Partial(
                    STEPS,
                    (run, b.step),
                    seq,
                    {
                        "policy_version": b.policy_version,
                        "num_rollouts": len(b.rollout_ids),
                        "metrics": _finite(dict(b.metrics)),
                        "tokens": b.tokens,
                        "duration_s": b.duration_s,
                        "completed_at": e.time,
                        "event_id": e.event_id,
                        "seq": seq,
                    },
                )
            ]
            for pos, rid in enumerate(b.rollout_ids):
                out.append(
                    Partial(
                        STEP_ROLLOUTS,
                        (run, b.step, pos),
                        seq,
                        {"rollout_id": rid, "rollout_seq": seqs[pos] if pos < len(seqs) else None},
                    )
                )
                out.append(
                    Partial(
                        ROLLOUTS,
                        (run, rid),
                        seq,
                        {"trained_step": b.step, "train_position": pos},
                        "trained_seq",
                    )
                )
            return out
        case ev.PolicyVersionPublished():
            return [
                Partial(
                    POLICY_VERSIONS,
                    (run, b.version),
                    seq,
                    {
                        "step": b.step,
                        "weights_checksum": b.weights_checksum,
                        "parent_version": b.parent_version,
                        "published_at": e.time,
                    },
                    "published_seq",
                )
            ]
        case ev.WeightsReady():
            loc = b.location
            return [
                Partial(
                    POLICY_VERSIONS,
                    (run, b.version),
                    seq,
                    {
                        "location": _ref(loc),
                        "location_store": loc.store,
                        "location_uri": _location_uri(loc),
                        "size": loc.size,
                        "sha256": loc.sha256,
                        "format": b.format,
                        "ready_checksum": b.weights_checksum,
                        "ready_at": e.time,
                    },
                    "ready_seq",
                )
            ]
        case ev.WorkerHeartbeat():
            out = [
                Partial(
                    WORKERS,
                    (run, b.worker_id),
                    seq,
                    {
                        "kind": b.kind,
                        "status": b.status,
                        "inflight": b.inflight,
                        "stats": _finite(dict(b.stats)),
                        "last_heartbeat_at": e.time,
                    },
                    "heartbeat_seq",
                )
            ]
            if b.loaded_version is not None:
                out.append(
                    Partial(
                        WORKERS,
                        (run, b.worker_id),
                        seq,
                        {"loaded_version": b.loaded_version, "loaded_at": e.time},
                        "loaded_seq",
                        {"kind": b.kind},
                    )
                )
            return out
        case ev.WeightsLoaded():
            kind = _worker_kind(item.subject)
            return [
                Partial(
                    WORKERS,
                    (run, b.worker_id),
                    seq,
                    {"loaded_version": b.version, "loaded_at": e.time},
                    "loaded_seq",
                    {"kind": kind},
                ),
                Partial(
                    WORKERS,
                    (run, b.worker_id),
                    seq,
                    {"last_load_s": b.load_s, "checksum_verified": b.checksum_verified},
                    "load_seq",
                    {"kind": kind},
                ),
            ]
        case ev.DeadLettered():
            return [
                Partial(
                    DEAD_LETTERS,
                    (run, e.event_id),
                    seq,
                    {
                        "reason": b.reason,
                        "detail": b.detail,
                        "consumer": b.consumer,
                        "original_subject": b.original_subject,
                        "original_seq": b.original_stream_seq,
                        "original_type": b.original_type,
                        "original_event_id": b.original_event_id,
                        "delivery_count": b.delivery_count,
                        "original_size": len(b.original_data),
                        "original_data": bytes(b.original_data),
                        "dead_lettered_at": e.time,
                        "seq": seq,
                    },
                )
            ]
    return []


def _worker_kind(subject: str) -> str:
    # jetrl.<run>.worker.<kind>.<id>: WeightsLoaded carries no kind of its own.
    parts = subject.split(".")
    return parts[3] if len(parts) == 5 and parts[2] == "worker" else "inference"


# ----------------------------------------------------------------------------- fold


def _derive_staleness(row: dict[str, Any]) -> None:
    ts, pv = row.get("trained_step"), row.get("policy_version_start")
    row["staleness"] = ts - pv if ts is not None and pv is not None else row.get("withheld_staleness")


_DERIVE: dict[str, Callable[[dict[str, Any]], None]] = {"staleness": _derive_staleness}


def fold(items: Iterable[LogItem]) -> dict[str, list[dict[str, Any]]]:
    """Fold events (in seq order) into at most one full row per table key.

    Within the batch the same rules hold as in SQL: a whole-row fact or a "first" group keeps
    its first writer, a "last" group its latest; insert defaults fill only empty columns."""
    acc: dict[Spec, dict[tuple[Any, ...], dict[str, Any]]] = {s: {} for s in SPECS}
    for item in items:
        for p in partials(item):
            rows = acc[p.spec]
            row = rows.get(p.key)
            if p.group is None:
                if row is None:
                    rows[p.key] = {**dict(zip(p.spec.key, p.key, strict=True)), **p.values}
                continue
            if row is None:
                row = dict.fromkeys(p.spec.columns)
                row.update(zip(p.spec.key, p.key, strict=True))
                rows[p.key] = row
            g = p.spec.group(p.group)
            current = row[g.seq_col]
            if current is None or (g.mode == "last" and p.seq > current):
                row.update(p.values)
                row[g.seq_col] = p.seq
            for k, v in p.defaults.items():
                if row[k] is None:
                    row[k] = v
    out: dict[str, list[dict[str, Any]]] = {}
    for spec, rows in acc.items():
        if not rows:
            continue
        for d in spec.derived:
            for row in rows.values():
                _DERIVE[d](row)
        out[spec.table.name] = list(rows.values())
    return out


# ----------------------------------------------------------------------------- SQL


def _dialect_insert(dialect: str, table: sa.Table) -> Any:
    if dialect == "postgresql":
        return postgresql.insert(table)
    if dialect == "sqlite":
        return sqlite.insert(table)
    raise NotImplementedError(f"the store supports sqlite and postgresql, not {dialect}")


def _group_applies(t: sa.Table, x: Any, g: Group) -> sa.ColumnElement[bool]:
    new, old = x[g.seq_col], t.c[g.seq_col]
    if g.mode == "first":
        return sa.and_(new.is_not(None), old.is_(None))
    return sa.and_(new.is_not(None), sa.or_(old.is_(None), new > old))


def _upsert_statement(dialect: str, spec: Spec) -> Any:
    t = spec.table
    stmt = _dialect_insert(dialect, t)
    if not spec.groups:
        return stmt.on_conflict_do_nothing(index_elements=list(spec.key))
    x = stmt.excluded
    set_: dict[str, Any] = {}
    effective: dict[str, Any] = {}
    for g in spec.groups:
        cond = _group_applies(t, x, g)
        for col in (*g.cols, g.seq_col):
            expr = sa.case((cond, x[col]), else_=t.c[col])
            set_[col] = expr
            effective[col] = expr
    if "staleness" in spec.derived:
        ts, pv = effective["trained_step"], effective["policy_version_start"]
        set_["staleness"] = sa.case(
            (sa.and_(ts.is_not(None), pv.is_not(None)), ts - pv),
            else_=effective["withheld_staleness"],
        )
    return stmt.on_conflict_do_update(index_elements=list(spec.key), set_=set_)


_STATEMENTS: dict[tuple[str, str], Any] = {}


def upsert_rows(conn: sa.Connection, table: str, rows: Sequence[dict[str, Any]]) -> None:
    if not rows:
        return
    dialect = conn.dialect.name
    stmt = _STATEMENTS.get((dialect, table))
    if stmt is None:
        spec = next(s for s in SPECS if s.table.name == table)
        stmt = _STATEMENTS[(dialect, table)] = _upsert_statement(dialect, spec)
    conn.execute(stmt, list(rows))


def read_offset(conn: sa.Connection, stream: str, consumer: str, *, lock: bool = False) -> int:
    o = sc.OFFSETS
    q = sa.select(o.c.last_seq).where(o.c.stream == stream, o.c.consumer == consumer)
    if lock and conn.dialect.name == "postgresql":
        q = q.with_for_update()
    return int(conn.execute(q).scalar_one_or_none() or 0)


def _write_offset(
    conn: sa.Connection, stream: str, consumer: str, run_id: str, last_seq: int, last_event_at: float | None
) -> None:
    o = sc.OFFSETS
    stmt = _dialect_insert(conn.dialect.name, o)
    values = {
        "stream": stream,
        "consumer": consumer,
        "run_id": run_id,
        "last_seq": last_seq,
        "last_event_at": last_event_at,
        "updated_at": time.time(),
    }
    stmt = stmt.values(**values).on_conflict_do_update(
        index_elements=["stream", "consumer"],
        set_={
            "last_seq": stmt.excluded.last_seq,
            # A batch of nothing but dead-lettered messages keeps the last recorded event's time.
            "last_event_at": sa.func.coalesce(stmt.excluded.last_event_at, o.c.last_event_at),
            "updated_at": stmt.excluded.updated_at,
        },
    )
    conn.execute(stmt)


def apply_batch(
    conn: sa.Connection,
    *,
    run_id: str,
    stream: str,
    consumer: str,
    items: Sequence[LogItem],
    through_seq: int | None = None,
) -> ApplyResult:
    """Apply ``items`` and move the tracking row, inside the caller's transaction (use
    ``Store.write()``). Events at or below the tracking row are skipped. ``through_seq`` moves
    the tracking row past sequences that carried nothing to record (dead-lettered messages)."""
    last = read_offset(conn, stream, consumer, lock=True)
    fresh = sorted((i for i in items if i.seq > last), key=lambda i: i.seq)
    top_seq = max([last, *(i.seq for i in fresh), *([through_seq] if through_seq is not None else [])])
    if top_seq == last:
        return ApplyResult(applied=0, skipped=len(items), last_seq=last, rows=0)
    rows = fold(fresh)
    n = 0
    for spec in SPECS:
        batch = rows.get(spec.table.name)
        if batch:
            upsert_rows(conn, spec.table.name, batch)
            n += len(batch)
    _write_offset(conn, stream, consumer, run_id, top_seq, fresh[-1].event.time if fresh else None)
    return ApplyResult(applied=len(fresh), skipped=len(items) - len(fresh), last_seq=top_seq, rows=n)
