"""Withholding scored rollouts: the trainer's consumer and events, and the end of a run, when
every scored rollout must be trained or withheld. Torch-free (the supervisor calls it).

When a run finishes, rollouts scored after the trainer's last step remain in its log, neither
trained nor withheld. :func:`close_out` binds the trainer's durable consumer once every part
has stopped and withholds each rollout it still holds, with reason ``run_finished``, so that a
reader of the log accounts for every rollout (docs/events.md). A redelivered rollout that the
log says was trained is only acked. It ends when the durable has none left, pending or
unacknowledged: a rollout the trainer returned (nak) comes at once, one held by a trainer that
died comes after the ack wait.
"""

from __future__ import annotations

import asyncio

from jetrl.bus import events as ev
from jetrl.bus import ids, subjects
from jetrl.bus.client import Bus
from jetrl.bus.consumer import ConsumerSpec, Delivery
from jetrl.bus.log import get_logger
from jetrl.bus.streams import stream_name
from jetrl.consumers.trainer.settings import TrainerSettings

ScoredDelivery = Delivery[ev.RolloutsScored]


def rollout_consumer_spec(run_id: str, settings: TrainerSettings) -> ConsumerSpec:
    """The trainer's durable consumer of scored rollouts (the close-out binds the same one)."""
    return ConsumerSpec(
        run_id=run_id,
        durable="trainer",
        filter_subjects=[subjects.rollout_subject(run_id)],
        ack_wait=settings.ack_wait_s,
        max_deliver=5,
        max_ack_pending=100_000,
        skip_types=("RolloutWithheld",),  # the trainer's own output, on the same subjects
    )


def withheld_event(
    run_id: str,
    d: ScoredDelivery,
    r: ev.ScoredRollout,
    reason: ev.WithheldReason,
    detail: str,
    version: int,
) -> ev.Event:
    """RolloutWithheld for rollout ``r`` of ``d`` at trainer version ``version``: its id derives
    from the rollout's, so a rollout withheld twice (a retry, a restart) is stored once."""
    b = d.body
    return ev.new_event(
        ev.RolloutWithheld(
            rollout_id=r.rollout_id,
            group_id=b.group_id,
            env=b.env,
            reason=reason,
            trainer_step=version,
            policy_version=version,
            staleness=version - r.policy_version_start,
            detail=detail,
        ),
        run_id=run_id,
        tenant=d.event.tenant,
        causation_id=d.event.event_id,
        event_id=ids.withheld_event_id(run_id, r.rollout_id),
    )


async def close_out(bus: Bus, run_id: str, settings: TrainerSettings, *, idle_s: float = 0.1) -> int:
    """Withhold what the trainer never settled; returns how many rollouts were withheld. Call it
    only when no trainer runs (it takes the trainer's consumer) and the run will not resume."""
    trained: set[str] = set()
    version = 0
    for item in await bus.read_log(run_id, filter_subject=subjects.step_subject(run_id)):
        if item.event is not None and isinstance(item.event.body, ev.StepCompleted):
            trained.update(item.event.body.rollout_ids)
            version = max(version, item.event.body.policy_version)
    spec = rollout_consumer_spec(run_id, settings)
    consumer = await bus.consumer(spec, ev.RolloutsScored)
    log = get_logger(__name__, run_id=run_id)
    loop = asyncio.get_running_loop()
    # Past the ack wait every rollout a dead holder had is delivered again.
    deadline = loop.time() + settings.ack_wait_s + 5.0
    withheld = 0
    try:
        while True:
            batch = await consumer.fetch(256, timeout=idle_s)
            pub = bus.publisher(max_inflight=256)
            for d in batch:
                for r in d.body.rollouts:
                    if r.rollout_id not in trained:
                        detail = f"the run finished at version {version} before it was trained"
                        await pub.publish(withheld_event(run_id, d, r, "run_finished", detail, version))
                        withheld += 1
            await pub.flush()
            for d in batch:
                await d.ack()
            # The durable's state after every fetch, which waits only ``idle_s``: what is left
            # unacknowledged may be the acks of the events a fetch passed over (the withheld
            # ones just published) still on their way, or a dead holder's, back after the ack
            # wait; a run's end waits for neither longer than it takes.
            info = await bus.js.consumer_info(stream_name(run_id), spec.durable)
            if not info.num_pending and not info.num_ack_pending:
                break
            if batch:
                continue
            if loop.time() >= deadline:
                log.warning("close_out_incomplete", pending=info.num_pending, unacked=info.num_ack_pending)
                break
    finally:
        await consumer.unsubscribe()
    log.info("run_closed_out", withheld=withheld, version=version)
    return withheld
