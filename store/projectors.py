"""Fact → row parts: one projector per fact of the read model, chosen from :data:`PROJECTORS`.

An event of the log is read as its fact (store/readmodel: what the event means is said there
once), and a projector turns the fact into the parts of rows it writes (:class:`Partial`): the
table spec and key, the group of columns it owns (or none for a whole-row fact) and defaults
for columns still empty on insert. What is left here is storage: column names and the values
SQL and JSON can hold. Merging parts into rows is the fold's job (store/projection.py); which
columns make a group is the specs' (store/specs.py); reading the rows back as facts is
store/readmodel/stored.py's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, TypeVar, cast

from jetrl.bus import events as ev
from jetrl.store import readmodel as rm
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


def _location_uri(loc: ev.PayloadRef) -> str:
    return f"{loc.store}://{loc.bucket}/{loc.name}"


# ----------------------------------------------------------------------------- projectors


def _started(run: str, f: rm.Started) -> list[Partial]:
    values = {
        "tenant": f.tenant,
        "config": f.config,
        "code_version": f.code_version,
        "host": f.host,
        "library_versions": dict(f.library_versions),
        "started_at": f.t,
        "started_event_id": f.event_id,
    }
    return [Partial(RUNS, (run,), f.seq, values, "started_seq", {"status": "running"})]


def _resumed(run: str, f: rm.Resumed) -> list[Partial]:
    # The run is running again: its lifecycle group (last wins) until it finishes anew. Its
    # config stays RunStarted's; the resume's is in the log.
    values = {"status": "running", "steps": None, "finish_reason": None, "finished_at": None}
    return [Partial(RUNS, (run,), f.seq, values, "finished_seq", {"tenant": f.tenant})]


def _finished(run: str, f: rm.Finished) -> list[Partial]:
    values = {"status": f.status, "steps": f.steps, "finish_reason": f.reason, "finished_at": f.t}
    return [Partial(RUNS, (run,), f.seq, values, "finished_seq", {"tenant": f.tenant})]


def _tasked(run: str, f: rm.Tasked) -> list[Partial]:
    values = {
        "tenant": f.tenant,
        "env": f.env,
        "group_size": f.samples,
        "prompt_len": f.prompt_len,
        "prompt_text": f.prompt_text,
        "max_tokens": f.max_tokens,
        "episode_id": f.episode_id,
        "turn": f.turn,
        "info": f.info,
        "submitted_at": f.t,
        "event_id": f.event_id,
        "seq": f.seq,
    }
    return [Partial(TASKS, (run, f.task_id), f.seq, values)]


def _generated(run: str, f: rm.Generated) -> list[Partial]:
    """One row per sample of the task."""
    shared = {
        "event_id": f.event_id,
        "task_id": f.task_id,
        "tenant": f.tenant,
        "env": f.env,
        "group_id": f.task_id,
        "worker_id": f.worker_id,
        "policy_version_start": f.version_start,
        "policy_version_end": f.version_end,
        "prompt_tokens": f.prompt_length,
        "queued_s": f.queued_s,
        "generate_s": f.generate_s,
        "load_wait_s": f.load_wait_s,
        "episode_id": f.episode_id,
        "turn": f.turn,
        "completed_at": f.t,
        "seq": f.seq,
    }
    return [
        Partial(
            GENERATIONS,
            (run, x.generation_id),
            f.seq,
            {
                **shared,
                "generation_id": x.generation_id,
                "sample_index": x.sample_index,
                "finish_reason": x.finish_reason,
                "completion_tokens": x.length,
            },
        )
        for x in f.samples
    ]


def _scored(run: str, f: rm.Scored) -> list[Partial]:
    """One row per rollout of the group."""
    shared = {
        "tenant": f.tenant,
        "env": f.env,
        "group_id": f.group_id,
        "task_id": f.task_id,
        "generation_event_id": f.generation_event_id,
        "group_size": f.group_size,
        "group_late": f.late,
        "prompt_tokens": f.prompt_length,
        "scored_at": f.t,
        "scored_event_id": f.event_id,
    }
    return [
        Partial(
            ROLLOUTS,
            (run, r.rollout_id),
            f.seq,
            {
                **shared,
                "sample_index": r.sample_index,
                "reward": r.reward,
                "reward_parts": _finite(r.reward_parts),
                "policy_version_start": r.version_start,
                "policy_version_end": r.version_end,
                "completion_tokens": r.length,
                "payloads": r.payloads,
            },
            "scored_seq",
        )
        for r in f.rollouts
    ]


def _withheld(run: str, f: rm.Withheld) -> list[Partial]:
    values = {
        "withheld_reason": f.reason,
        "withheld_detail": f.detail,
        "withheld_step": f.step,
        "withheld_policy_version": f.policy_version,
        "withheld_staleness": f.staleness,
        "withheld_at": f.t,
    }
    # A rollout withheld before its score arrives still shows where it belongs.
    defaults = {"tenant": f.tenant, "env": f.env, "group_id": f.group_id}
    return [Partial(ROLLOUTS, (run, f.rollout_id), f.seq, values, "withheld_seq", defaults)]


def _stepped(run: str, f: rm.Stepped) -> list[Partial]:
    seq = f.seq
    values = {
        "policy_version": f.version,
        "num_rollouts": len(f.rollout_ids),
        "metrics": _finite(f.metrics),
        "tokens": f.tokens,
        "duration_s": f.duration_s,
        "completed_at": f.t,
        "event_id": f.event_id,
        "seq": seq,
        "micro_batches": list(f.micro_batches) or None,
    }
    out = [Partial(STEPS, (run, f.step), seq, values)]
    seqs = f.rollout_seqs
    for pos, rid in enumerate(f.rollout_ids):
        placed = {"rollout_id": rid, "rollout_seq": seqs[pos] if pos < len(seqs) else None}
        out.append(Partial(STEP_ROLLOUTS, (run, f.step, pos), seq, placed))
        trained = {"trained_step": f.step, "train_position": pos}
        out.append(Partial(ROLLOUTS, (run, rid), seq, trained, "trained_seq"))
    return out


def _versioned(run: str, f: rm.Versioned) -> list[Partial]:
    values = {
        "step": f.step,
        "weights_checksum": f.weights_checksum,
        "parent_version": f.parent_version,
        "published_at": f.t,
    }
    return [Partial(POLICY_VERSIONS, (run, f.version), f.seq, values, "published_seq")]


def _ready(run: str, f: rm.Ready) -> list[Partial]:
    loc = f.location
    values = {
        "location": rm.array_json(loc),
        "location_store": loc.store,
        "location_uri": _location_uri(loc),
        "size": loc.size,
        "sha256": loc.sha256,
        "format": f.format,
        "ready_checksum": f.weights_checksum,
        "blake3": f.blake3,
        "ready_at": f.t,
    }
    return [Partial(POLICY_VERSIONS, (run, f.version), f.seq, values, "ready_seq")]


def _beat(run: str, f: rm.Beat) -> list[Partial]:
    seq, key = f.seq, (run, f.worker_id)
    values = {
        "kind": f.kind,
        "status": f.status,
        "inflight": f.inflight,
        "stats": _finite(f.stats),
        "last_heartbeat_at": f.t,
    }
    out = [Partial(WORKERS, key, seq, values, "heartbeat_seq")]
    if f.loaded_version is not None:
        loaded = {"loaded_version": f.loaded_version, "loaded_at": f.t}
        out.append(Partial(WORKERS, key, seq, loaded, "loaded_seq", {"kind": f.kind}))
    return out


def _loaded(run: str, f: rm.Loaded) -> list[Partial]:
    seq, key, kind = f.seq, (run, f.worker_id), {"kind": f.kind}
    loaded = {"loaded_version": f.version, "loaded_at": f.t}
    load = {"last_load_s": f.load_s, "checksum_verified": f.checksum_verified}
    return [
        Partial(WORKERS, key, seq, loaded, "loaded_seq", kind),
        Partial(WORKERS, key, seq, load, "load_seq", kind),
    ]


def _dead(run: str, f: rm.Dead) -> list[Partial]:
    values = {
        "reason": f.reason,
        "detail": f.detail,
        "consumer": f.consumer,
        "original_subject": f.original_subject,
        "original_seq": f.original_seq,
        "original_type": f.original_type,
        "original_event_id": f.original_event_id,
        "delivery_count": f.delivery_count,
        "original_size": len(f.original_data),
        "original_data": f.original_data,
        "dead_lettered_at": f.t,
        "seq": f.seq,
    }
    return [Partial(DEAD_LETTERS, (run, f.event_id), f.seq, values)]


def _evaluated(run: str, f: rm.Evaluated) -> list[Partial]:
    values = {
        "n_tasks": f.n_tasks,
        "samples": f.samples,
        "pass_at_1": f.pass_at_1,
        "pass_at_k": f.pass_at_k,
        "reward_mean": f.reward_mean,
        "version_min": f.version_min,
        "version_max": f.version_max,
        "temperature": f.temperature,
        "successes": list(f.successes),
        "reported_at": f.t,
        "event_id": f.event_id,
        "seq": f.seq,
    }
    return [Partial(EVALUATIONS, (run, f.tenant, f.env, f.policy_version), f.seq, values)]


def _alerted(run: str, f: rm.Alerted) -> list[Partial]:
    values = {
        "rule": f.rule,
        "key": f.key,
        "state": f.state,
        "severity": f.severity,
        "message": f.message,
        "step": f.step,
        "value": _number(f.value),
        "threshold": _number(f.threshold),
        "raised_at": f.t,
        "seq": f.seq,
    }
    return [Partial(ALERTS, (run, f.event_id), f.seq, values)]


# ----------------------------------------------------------------------------- the table

F = TypeVar("F", bound=rm.Fact)
Projector: TypeAlias = Callable[[str, F], list[Partial]]


def _entry(fact: type[F], projector: Projector[F]) -> tuple[type[ev.EventBody], Projector[rm.Fact]]:
    # Filed under the event body the fact is read from, which is also the fact's type: the
    # widened signature is never called with another fact.
    return fact.OF, cast("Projector[rm.Fact]", projector)


# Keyed by event body: every body of the catalog is projected (tests/store checks it).
PROJECTORS: dict[type[ev.EventBody], Projector[rm.Fact]] = dict(
    [
        _entry(rm.Started, _started),
        _entry(rm.Resumed, _resumed),
        _entry(rm.Finished, _finished),
        _entry(rm.Tasked, _tasked),
        _entry(rm.Generated, _generated),
        _entry(rm.Scored, _scored),
        _entry(rm.Withheld, _withheld),
        _entry(rm.Stepped, _stepped),
        _entry(rm.Versioned, _versioned),
        _entry(rm.Ready, _ready),
        _entry(rm.Beat, _beat),
        _entry(rm.Loaded, _loaded),
        _entry(rm.Dead, _dead),
        _entry(rm.Evaluated, _evaluated),
        _entry(rm.Alerted, _alerted),
    ]
)


def partials(item: Logged) -> list[Partial]:
    """The row parts one event writes (empty for an event with no projection)."""
    e = item.event
    fact = rm.fact_of(item.seq, item.subject, e)
    return PROJECTORS[type(e.body)](e.run_id, fact) if fact is not None else []
