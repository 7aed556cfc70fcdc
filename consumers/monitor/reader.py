"""Feeding the fold: a live run's log through an ordered consumer, a finished run's store.

``follow`` tails the log from a point (the start, a step, a time) and folds every event as it
arrives; ``queue_depths`` asks the server how far behind each durable consumer of the run is
(the pending tasks of inference and rollouts of the trainer, from the consumers' own state).
``from_store`` rebuilds the same state from a recorded run's rows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import sqlalchemy as sa

from jetrl.bus import events as ev
from jetrl.bus import subjects
from jetrl.bus.client import Bus
from jetrl.bus.log import get_logger
from jetrl.bus.streams import stream_name
from jetrl.consumers.monitor.series import MonitorState, StepPoint
from jetrl.store.readmodel import fact_of
from jetrl.store.readmodel.stored import facts_of_store

log = get_logger(__name__)

OnPoint = Callable[[StepPoint], Awaitable[None] | None]


@dataclass(frozen=True)
class Start:
    """Where a reader starts in the log: its beginning (the default), a trainer step or a time."""

    step: int | None = None
    time: float | None = None


async def start_seq(bus: Bus, run_id: str, step: int) -> tuple[int, float | None] | None:
    """Where to read from for the series to start at ``step``, and the time of the step before
    (for its tokens per second): just after the step before, or earlier at the first rollout
    the step trained on (so its rewards, lengths and what happened since the step before are
    all known). Found from the step subject alone. None when the run has not reached that step."""
    before, before_seq = None, 0
    async for item in bus.tail(run_id, filter_subject=subjects.step_subject(run_id), to_head=True):
        if item.event is not None and isinstance(item.event.body, ev.StepCompleted):
            b = item.event.body
            if b.step >= step:
                return min(before_seq + 1, *b.rollout_seqs), before
            before, before_seq = item.event.time, item.seq
    return None


async def follow(
    bus: Bus,
    state: MonitorState,
    *,
    start: Start = Start(),
    from_seq: int | None = None,
    on_point: OnPoint | None = None,
    to_head: bool = False,
    stop: asyncio.Event | None = None,
    types: frozenset[str] | None = None,
) -> None:
    """Fold the run's log into ``state`` from ``start`` (or exactly ``from_seq``), forever (or
    ``to_head``: until caught up). Undecodable messages are counted and skipped: they are the
    dead-letter path's to keep. ``types``: only events of these types are decoded (a state that
    folds the steps alone passes the rest over: ``series.STEP_EVENTS``)."""
    run_id = state.run_id
    if from_seq is None and start.step is not None:
        state.from_step = start.step
        found = await start_seq(bus, run_id, start.step)
        if found is None:
            from_seq = await bus.last_seq(run_id) + 1
        else:
            from_seq, state.last_step_t = found
    from_time = start.time if from_seq is None else None
    tail = bus.tail(run_id, from_seq=from_seq, from_time=from_time, to_head=to_head, types=types)
    async for item in tail:
        if item.event is None:
            state.undecodable += 1
            continue
        fact = fact_of(item.seq, item.subject, item.event, payloads=False)
        if fact is None:
            continue
        point = state.apply(fact)
        if point is not None and on_point is not None:
            got = on_point(point)
            if got is not None:
                await got
        if stop is not None and stop.is_set():
            return


@dataclass(frozen=True)
class QueueDepth:
    consumer: str
    pending: int  # in the stream, not delivered yet
    ack_pending: int  # delivered, not acknowledged yet


async def queue_depths(bus: Bus, run_id: str) -> list[QueueDepth]:
    """Each durable consumer of the run's stream and its backlog (inference durables: tasks;
    the trainer's: scored rollouts; the recorder's: everything)."""
    out = []
    for info in await bus.js.consumers_info(stream_name(run_id)):
        name = info.config.durable_name
        if not name:
            continue  # an ordered consumer (a monitor, a tail): no backlog of its own
        out.append(QueueDepth(name, int(info.num_pending or 0), int(info.num_ack_pending or 0)))
    return sorted(out, key=lambda q: q.consumer)


def from_store(conn: sa.Connection, run_id: str, *, start: Start | None = None) -> MonitorState:
    """A recorded run's state, from its store rows: what ``follow`` folds from its log. From a
    time: the events stamped at or after it (the log's reader starts at the first message the
    server stored then; the two differ only by the moments between stamping and storing)."""
    start = start or Start()
    state = MonitorState(run_id)
    state.from_step = start.step
    for fact in facts_of_store(conn, run_id):
        if start.time is None or fact.t >= start.time:
            state.apply(fact)
    return state
