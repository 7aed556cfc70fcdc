"""Event → row parts: one projector per event body type, chosen from :data:`PROJECTORS`.

A projector turns one event of the log into the parts of rows it writes (:class:`Partial`): the
table spec and key, the group of columns it owns (or none for a whole-row fact) and defaults
for columns still empty on insert. Merging parts into rows is the fold's job
(store/projection.py); which columns make a group is the specs' (store/specs.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, TypeVar, cast

from jetrl.bus import events as ev
from jetrl.store.specs import (
    ALERTS,
    DEAD_LETTERS,
    EVALUATIONS,
    GENERATIONS,
    POLICY_VERSIONS,
    ROLLOUTS,
    RUNS,
    STEP_ROLLOUTS,
    STEPS,
    TASKS,
    WORKERS,
    Spec,
)

__all__ = ["PROJECTORS", "LogItem", "Logged", "Partial", "partials"]


class Logged(Protocol):
    """One event of the log as the projection sees it: its stream sequence, the subject it was
    published on and the decoded event (a :class:`LogItem`, or a bus delivery as it is)."""

    @property
    def seq(self) -> int: ...
    @property
    def subject(self) -> str: ...
    @property
    def event(self) -> ev.Event: ...


@dataclass(frozen=True, slots=True)
class LogItem:
    """One event of the log as the projection sees it."""

    seq: int
    subject: str
    event: ev.Event


@dataclass(slots=True)
class Partial:
    """Part of a row: the key, the group it writes (None: a whole fact) and insert defaults."""

    spec: Spec
    key: tuple[Any, ...]
    seq: int
    values: dict[str, Any]
    group: str | None = None
    defaults: Mapping[str, Any] | None = None


# ----------------------------------------------------------------------------- value helpers


def _finite(d: Mapping[str, Any]) -> dict[str, Any]:
    # JSON (and PostgreSQL's jsonb) has no NaN/Infinity: keep them readable as strings.
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, float) and not math.isfinite(v):
            out[k] = str(v)
        else:
            out[k] = v
    return out


def _number(v: float) -> float | None:
    # SQLite stores NaN as NULL (a NOT NULL column refuses it): NULL on both backends.
    return None if math.isnan(v) else v


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
    if isinstance(a, ev.LogArray):
        # Another event's inline array (a rollout's is its generation's): where it lies.
        return {"log_seq": a.seq, "field": a.field, "dtype": a.dtype, "shape": list(a.shape)}
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


def _worker_kind(subject: str) -> str:
    # jetrl.<run>.worker.<kind>.<id>: WeightsLoaded carries no kind of its own.
    parts = subject.split(".")
    return parts[3] if len(parts) == 5 and parts[2] == "worker" else "inference"


# ----------------------------------------------------------------------------- projectors


def _run_started(item: Logged, b: ev.RunStarted) -> list[Partial]:
    e = item.event
    values = {
        "tenant": e.tenant,
        "config": b.config,
        "code_version": b.code_version,
        "host": b.host,
        "library_versions": dict(b.library_versions),
        "started_at": e.time,
        "started_event_id": e.event_id,
    }
    return [Partial(RUNS, (e.run_id,), item.seq, values, "started_seq", {"status": "running"})]


def _run_resumed(item: Logged, b: ev.RunResumed) -> list[Partial]:
    # The run is running again: its lifecycle group (last wins) until it finishes anew. Its
    # config stays RunStarted's; the resume's is in the log.
    e = item.event
    values = {"status": "running", "steps": None, "finish_reason": None, "finished_at": None}
    return [Partial(RUNS, (e.run_id,), item.seq, values, "finished_seq", {"tenant": e.tenant})]


def _run_finished(item: Logged, b: ev.RunFinished) -> list[Partial]:
    e = item.event
    values = {"status": b.status, "steps": b.steps, "finish_reason": b.reason, "finished_at": e.time}
    return [Partial(RUNS, (e.run_id,), item.seq, values, "finished_seq", {"tenant": e.tenant})]


def _task_submitted(item: Logged, b: ev.TaskSubmitted) -> list[Partial]:
    e = item.event
    values = {
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
        "seq": item.seq,
    }
    return [Partial(TASKS, (e.run_id, b.task_id), item.seq, values)]


def _generation_completed(item: Logged, b: ev.GenerationCompleted) -> list[Partial]:
    e = item.event
    values = {
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
        "seq": item.seq,
    }
    return [Partial(GENERATIONS, (e.run_id, e.event_id), item.seq, values)]


def _rollout_scored(item: Logged, b: ev.RolloutScored) -> list[Partial]:
    e = item.event
    values = {
        "tenant": e.tenant,
        "env": b.env,
        "group_id": b.group_id,
        "task_id": b.task_id,
        "generation_event_id": b.generation_event_id,
        "sample_index": b.sample_index,
        "group_size": b.group_size,
        "reward": b.reward,
        "reward_parts": _finite(b.reward_parts),
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
    }
    return [Partial(ROLLOUTS, (e.run_id, b.rollout_id), item.seq, values, "scored_seq")]


def _rollout_withheld(item: Logged, b: ev.RolloutWithheld) -> list[Partial]:
    e = item.event
    values = {
        "withheld_reason": b.reason,
        "withheld_detail": b.detail,
        "withheld_step": b.trainer_step,
        "withheld_policy_version": b.policy_version,
        "withheld_staleness": b.staleness,
        "withheld_at": e.time,
    }
    # A rollout withheld before its score arrives still shows where it belongs.
    defaults = {"tenant": e.tenant, "env": b.env, "group_id": b.group_id}
    return [Partial(ROLLOUTS, (e.run_id, b.rollout_id), item.seq, values, "withheld_seq", defaults)]


def _step_completed(item: Logged, b: ev.StepCompleted) -> list[Partial]:
    e, seq, run = item.event, item.seq, item.event.run_id
    values = {
        "policy_version": b.policy_version,
        "num_rollouts": len(b.rollout_ids),
        "metrics": _finite(b.metrics),
        "tokens": b.tokens,
        "duration_s": b.duration_s,
        "completed_at": e.time,
        "event_id": e.event_id,
        "seq": seq,
    }
    out = [Partial(STEPS, (run, b.step), seq, values)]
    seqs = list(b.rollout_seqs)
    for pos, rid in enumerate(b.rollout_ids):
        placed = {"rollout_id": rid, "rollout_seq": seqs[pos] if pos < len(seqs) else None}
        out.append(Partial(STEP_ROLLOUTS, (run, b.step, pos), seq, placed))
        trained = {"trained_step": b.step, "train_position": pos}
        out.append(Partial(ROLLOUTS, (run, rid), seq, trained, "trained_seq"))
    return out


def _policy_version_published(item: Logged, b: ev.PolicyVersionPublished) -> list[Partial]:
    e = item.event
    values = {
        "step": b.step,
        "weights_checksum": b.weights_checksum,
        "parent_version": b.parent_version,
        "published_at": e.time,
    }
    return [Partial(POLICY_VERSIONS, (e.run_id, b.version), item.seq, values, "published_seq")]


def _weights_ready(item: Logged, b: ev.WeightsReady) -> list[Partial]:
    e, loc = item.event, b.location
    values = {
        "location": _ref(loc),
        "location_store": loc.store,
        "location_uri": _location_uri(loc),
        "size": loc.size,
        "sha256": loc.sha256,
        "format": b.format,
        "ready_checksum": b.weights_checksum,
        "ready_at": e.time,
    }
    return [Partial(POLICY_VERSIONS, (e.run_id, b.version), item.seq, values, "ready_seq")]


def _worker_heartbeat(item: Logged, b: ev.WorkerHeartbeat) -> list[Partial]:
    e, seq, key = item.event, item.seq, (item.event.run_id, b.worker_id)
    values = {
        "kind": b.kind,
        "status": b.status,
        "inflight": b.inflight,
        "stats": _finite(b.stats),
        "last_heartbeat_at": e.time,
    }
    out = [Partial(WORKERS, key, seq, values, "heartbeat_seq")]
    if b.loaded_version is not None:
        loaded = {"loaded_version": b.loaded_version, "loaded_at": e.time}
        out.append(Partial(WORKERS, key, seq, loaded, "loaded_seq", {"kind": b.kind}))
    return out


def _weights_loaded(item: Logged, b: ev.WeightsLoaded) -> list[Partial]:
    e, seq, key = item.event, item.seq, (item.event.run_id, b.worker_id)
    kind = _worker_kind(item.subject)
    loaded = {"loaded_version": b.version, "loaded_at": e.time}
    load = {"last_load_s": b.load_s, "checksum_verified": b.checksum_verified}
    return [
        Partial(WORKERS, key, seq, loaded, "loaded_seq", {"kind": kind}),
        Partial(WORKERS, key, seq, load, "load_seq", {"kind": kind}),
    ]


def _dead_lettered(item: Logged, b: ev.DeadLettered) -> list[Partial]:
    e = item.event
    values = {
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
        "seq": item.seq,
    }
    return [Partial(DEAD_LETTERS, (e.run_id, e.event_id), item.seq, values)]


def _evaluation_reported(item: Logged, b: ev.EvaluationReported) -> list[Partial]:
    e = item.event
    values = {
        "n_tasks": b.n_tasks,
        "samples": b.samples,
        "pass_at_1": b.pass_at_1,
        "pass_at_k": b.pass_at_k,
        "reward_mean": b.reward_mean,
        "version_min": b.version_min,
        "version_max": b.version_max,
        "temperature": b.temperature,
        "successes": list(b.successes),
        "reported_at": e.time,
        "event_id": e.event_id,
        "seq": item.seq,
    }
    return [Partial(EVALUATIONS, (e.run_id, e.tenant, b.env, b.policy_version), item.seq, values)]


def _alert_raised(item: Logged, b: ev.AlertRaised) -> list[Partial]:
    e = item.event
    values = {
        "rule": b.rule,
        "key": b.key,
        "state": b.state,
        "severity": b.severity,
        "message": b.message,
        "step": b.step,
        "value": _number(b.value),
        "threshold": _number(b.threshold),
        "raised_at": e.time,
        "seq": item.seq,
    }
    return [Partial(ALERTS, (e.run_id, e.event_id), item.seq, values)]


# ----------------------------------------------------------------------------- the table

B = TypeVar("B", bound=ev.EventBody)
Projector: TypeAlias = Callable[[Logged, B], list[Partial]]


def _entry(body: type[B], projector: Projector[B]) -> tuple[type[ev.EventBody], Projector[ev.EventBody]]:
    # Checks that a projector takes the body it is filed under; the lookup is by exact type,
    # so the widened signature is never called with another body.
    return body, cast("Projector[ev.EventBody]", projector)


PROJECTORS: dict[type[ev.EventBody], Projector[ev.EventBody]] = dict(
    [
        _entry(ev.RunStarted, _run_started),
        _entry(ev.RunResumed, _run_resumed),
        _entry(ev.RunFinished, _run_finished),
        _entry(ev.TaskSubmitted, _task_submitted),
        _entry(ev.GenerationCompleted, _generation_completed),
        _entry(ev.RolloutScored, _rollout_scored),
        _entry(ev.RolloutWithheld, _rollout_withheld),
        _entry(ev.StepCompleted, _step_completed),
        _entry(ev.PolicyVersionPublished, _policy_version_published),
        _entry(ev.WeightsReady, _weights_ready),
        _entry(ev.WorkerHeartbeat, _worker_heartbeat),
        _entry(ev.WeightsLoaded, _weights_loaded),
        _entry(ev.DeadLettered, _dead_lettered),
        _entry(ev.EvaluationReported, _evaluation_reported),
        _entry(ev.AlertRaised, _alert_raised),
    ]
)


def partials(item: Logged) -> list[Partial]:
    """The row parts one event writes (empty for an event with no projection)."""
    body = item.event.body
    projector = PROJECTORS.get(type(body))
    return projector(item, body) if projector is not None else []
