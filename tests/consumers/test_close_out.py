"""The close-out at a run's end: every rollout left in the trainer's durable is withheld, those
the trainer returned (nak) and those a trainer that died still held (after the ack wait)."""

from __future__ import annotations

import msgspec

from jetrl.bus import events as ev
from jetrl.bus import ids
from jetrl.bus.client import Bus
from jetrl.consumers.trainer.settings import TrainerSettings
from jetrl.consumers.trainer.withholding import close_out, rollout_consumer_spec
from tests.support.catalog_samples import sample_bodies


async def test_the_close_out_withholds_what_the_trainer_returned_and_what_a_dead_one_held(
    bus: Bus, run_id: str
) -> None:
    scored = next(b for b in sample_bodies() if isinstance(b, ev.RolloutsScored))
    size = len(scored.rollouts)
    assert size >= 2  # a group's rollouts in one event: each of them is withheld
    for i in range(6):
        group = f"reverse.acme.{i}"
        rollouts = [
            msgspec.structs.replace(r, rollout_id=ids.rollout_id(group, r.sample_index))
            for r in scored.rollouts
        ]
        body = msgspec.structs.replace(scored, task_id=group, group_id=group, rollouts=rollouts)
        event = ev.new_event(
            body, run_id=run_id, tenant="acme", event_id=ids.derived_id(run_id, f"scored/{i}")
        )
        await bus.publish(event)
    settings = TrainerSettings(ack_wait_s=3.0)
    trainer = await bus.consumer(rollout_consumer_spec(run_id, settings), ev.RolloutsScored)
    got = await trainer.fetch(6, timeout=5.0)
    assert len(got) == 6
    await got[0].ack()  # trained
    for d in got[1:3]:
        await d.nak()  # returned when it stopped
    await trainer.unsubscribe()  # and groups 3..5 held by it when it died: back after the ack wait
    withheld = await close_out(bus, run_id, settings, idle_s=0.5)
    assert withheld == 5 * size  # rollouts, not events
    out = [
        i.event.body
        for i in await bus.read_log(run_id)
        if i.event and isinstance(i.event.body, ev.RolloutWithheld)
    ]
    want = sorted(
        ids.rollout_id(f"reverse.acme.{i}", r.sample_index) for i in range(1, 6) for r in scored.rollouts
    )
    assert sorted(w.rollout_id for w in out) == want
    assert {w.reason for w in out} == {"run_finished"}
    assert {w.group_id for w in out} == {f"reverse.acme.{i}" for i in range(1, 6)}
