"""Weighted batch filling: each environment's share of a batch (largest remainder), filled in
arrival order, slots it cannot fill given to the others (work-conserving); and a trainer on a
real server whose flooding tenant gets only its share while the other has ready groups."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import numpy as np

from jetrl.bus import events as ev
from jetrl.bus.client import Bus
from jetrl.bus.payloads import inline_array
from jetrl.bus.settings import EnvRoute
from jetrl.consumers.trainer.batching import fill_batch, more_groups, split_slots
from jetrl.consumers.trainer.groups import StreamChoice, share_without_signal
from jetrl.consumers.trainer.settings import TrainerPart, TrainerSettings
from jetrl.consumers.trainer.trainer import Trainer

# ------------------------------------------------------------------------ pure functions


def test_slots_split_by_share_with_largest_remainder() -> None:
    assert split_slots(4, {"a": 1.0, "b": 1.0}) == {"a": 2, "b": 2}
    assert split_slots(4, {"a": 3.0, "b": 1.0}) == {"a": 3, "b": 1}
    assert split_slots(5, {"a": 0.5, "b": 0.3, "c": 0.2}) == {"a": 3, "b": 1, "c": 1}  # 2.5, 1.5, 1
    assert split_slots(7, {"a": 0.1, "b": 0.2, "c": 0.7}) == {"a": 1, "b": 1, "c": 5}  # 0.7, 1.4, 4.9
    # Equal remainders: in order from `rotate`, so they take turns batch by batch.
    assert split_slots(4, {"a": 1.0, "b": 1.0, "c": 1.0}) == {"a": 2, "b": 1, "c": 1}
    assert split_slots(4, {"a": 1.0, "b": 1.0, "c": 1.0}, rotate=1) == {"a": 1, "b": 2, "c": 1}
    assert split_slots(4, {"a": 1.0, "b": 1.0, "c": 1.0}, rotate=5) == {"a": 1, "b": 1, "c": 2}
    assert split_slots(0, {"a": 1.0}) == {"a": 0}
    assert split_slots(3, {}) == {}


def test_slots_always_add_up_and_stay_within_one_of_the_exact_share() -> None:
    for slots, shares in itertools.product(range(1, 13), [(1, 1), (1, 2, 3), (0.1, 0.7, 5.0, 2.2), (9, 1)]):
        named = {f"e{i}": float(s) for i, s in enumerate(shares)}
        for rotate in range(3):
            got = split_slots(slots, named, rotate)
            assert sum(got.values()) == slots
            total = sum(named.values())
            assert all(abs(got[k] - slots * v / total) < 1 for k, v in named.items())


def env_of(g: str) -> str:
    return g[0]


def test_a_flooding_env_gets_only_its_share_while_others_have_work() -> None:
    ready = [f"a{i}" for i in range(10)] + ["b0", "b1", "a10"]
    got = fill_batch(ready, 4, {"a": 1.0, "b": 1.0}, key=env_of)
    assert got == ["a0", "a1", "b0", "b1"]  # arrival order within and across envs


def test_slots_an_env_cannot_fill_go_to_the_others_in_arrival_order() -> None:
    ready = ["a0", "b0", "a1", "a2", "a3", "a4"]
    assert fill_batch(ready, 4, {"a": 1.0, "b": 1.0}, key=env_of) == ["a0", "b0", "a1", "a2"]
    assert fill_batch(["b0", "a0"], 4, {"a": 1.0, "b": 1.0}, key=env_of) == ["b0", "a0"]  # all there is
    # An env of no share only takes what is left over.
    assert fill_batch(["x0", "a0", "b0", "x1"], 3, {"a": 1.0, "b": 1.0}, key=env_of) == ["x0", "a0", "b0"]
    assert fill_batch(["x0", "x1", "a0", "b0"], 2, {"a": 1.0, "b": 1.0}, key=env_of) == ["a0", "b0"]


def test_without_shares_the_batch_is_the_first_in_arrival_order() -> None:
    assert fill_batch(["a0", "a1", "b0"], 2, {}, key=env_of) == ["a0", "a1"]


def test_unequal_shares() -> None:
    ready = ["b0", "b1", "b2"] + [f"a{i}" for i in range(8)]
    assert fill_batch(ready, 4, {"a": 3.0, "b": 1.0}, key=env_of) == ["b0", "a0", "a1", "a2"]


def test_a_step_filled_as_groups_come_keeps_each_env_to_its_share_until_it_can_be_completed() -> None:
    shares = {"a": 1.0, "b": 1.0}
    # A flood of a's fills a's half; b's half waits for b's groups...
    assert more_groups(["a0", "a1", "a2"], [], 4, shares, key=env_of) == ["a0", "a1"]
    assert more_groups(["a2", "a3"], ["a0", "a1"], 4, shares, key=env_of) == ["a2", "a3"]  # ...unless it
    # can be completed now: then the slots b cannot fill go to the others (work-conserving).
    assert more_groups(["a2", "b0"], ["a0", "a1"], 4, shares, key=env_of) == ["a2", "b0"]
    assert more_groups(["a2"], ["a0", "a1"], 4, shares, key=env_of) == []
    assert more_groups(["b0", "a2", "b1"], ["a0", "a1"], 4, shares, key=env_of) == ["b0", "b1"]
    assert more_groups(["a2"], ["a0", "a1", "b0", "b1"], 4, shares, key=env_of) == []  # whole already
    # An env of no share only takes what is left over once the step can be completed.
    assert more_groups(["x0", "a0"], [], 3, shares, key=env_of) == ["a0"]
    # Without shares: whatever is ready, up to the step's slots.
    assert more_groups(["a0", "a1", "b0"], ["c0"], 3, {}, key=env_of) == ["a0", "a1"]


def test_a_step_filled_from_nothing_with_enough_ready_is_the_batch_fill_batch_gives() -> None:
    envs = "abx"
    for n, slots in itertools.product(range(1, 9), range(1, 6)):
        for arrival in itertools.islice(itertools.product(envs, repeat=n), 0, None, 7):
            ready = [f"{e}{i}" for i, e in enumerate(arrival)]
            for shares in ({"a": 1.0, "b": 1.0}, {"a": 3.0, "b": 1.0}, {}):
                got = more_groups(ready, [], slots, shares, key=env_of, rotate=n)
                if len(ready) >= slots:
                    assert got == fill_batch(ready, slots, shares, key=env_of, rotate=n)
                # Taken a few at a time, a step never gives an env more than its share while
                # it cannot be completed.
                quota = split_slots(slots, shares, n) if shares else None
                if quota is not None and len(ready) < slots:
                    for k, q in quota.items():
                        assert sum(env_of(g) == k for g in got) <= q


def test_the_auto_choice_streams_while_recent_batches_were_incomplete_late_in_their_cycle() -> None:
    c = StreamChoice(window=4, threshold=0.1)
    assert not c.streams()  # no step seen: whole batches
    c.note(0.0, 1.0)
    assert not c.streams()
    c.note(0.5, 1.0)  # mean share 0.25
    assert c.streams()
    for _ in range(3):
        c.note(0.0, 1.0)
    assert c.streams()  # the last 4: 0.5 / 4 still >= 0.1
    c.note(0.0, 1.0)  # the late step leaves the window
    assert not c.streams()
    c.note(3.0, 0.0)  # a cycle of no length says nothing
    assert not c.streams()
    for _ in range(4):
        c.note(0.2, 2.0)  # exactly the threshold
    assert c.streams()


# ------------------------------------------------------------------------ a trainer on a real server


def scored(
    run_id: str, tenant: str, env: str, n: int, indexes: tuple[int, ...] = (0, 1), version: int = 0
) -> ev.Event:
    """Rollouts ``indexes`` of the tenant's group ``n`` (of 2) in one RolloutsScored, sampled by
    policy ``version``."""
    group = f"{env}.{tenant}.{n}"
    prompt = [1, 2, 3]
    body = ev.RolloutsScored(
        generation_event_id=f"gen-{group}-{indexes}",
        task_id=group,
        env=env,
        group_id=group,
        group_size=2,
        prompt_tokens=inline_array(np.asarray(prompt, np.int32)),
        rollouts=[
            ev.ScoredRollout(
                rollout_id=f"{group}-{i}",
                sample_index=i,
                reward=float(i),
                completion_tokens=inline_array(np.asarray([4 + i, 5], np.int32)),
                logprobs=inline_array(np.full(2, -0.5, np.float32)),
                routing_trace=inline_array(np.broadcast_to(np.asarray([0, 1], np.uint8), (4, 2, 2)).copy()),
                policy_version_start=version,
                policy_version_end=version,
            )
            for i in indexes
        ],
    )
    return ev.new_event(body, run_id=run_id, tenant=tenant)


async def test_a_trainer_fills_batches_by_share_and_never_waits_for_a_slow_tenant(
    bus: Bus, run_id: str, tmp_path: Path
) -> None:
    # acme floods (6 groups first, each in one event), globex has 2 (each in two events, as an
    # episode environment's rollouts come): the first batch of 4 is 2 and 2; the second is
    # acme's alone, since globex has nothing ready. Batches count groups, not events.
    for n in range(6):
        await bus.publish(scored(run_id, "acme", "math", n))
    for n in range(2):
        for i in (1, 0):
            await bus.publish(scored(run_id, "globex", "code", n, (i,)))
    part = TrainerPart(
        trainer=TrainerSettings(batch_groups=4, max_steps=10, checkpoint_every=0),
        envs=[
            EnvRoute(tenant="acme", env="math", group_size=2),
            EnvRoute(tenant="globex", env="code", group_size=2),
        ],
    )
    trainer = Trainer(bus, run_id, part, tmp_path)
    consumer = await trainer.start()
    # Everything admitted before any step, so what a step takes does not depend on fetch sizes.
    held = 0
    for _ in range(200):
        got = await consumer.fetch(64, timeout=0.5)
        for d in got:
            await trainer.admit(consumer, d)
        held += len(got)
        if held >= 10:
            break
    assert held == 10  # deliveries
    assert sum(len(g.members) for g in trainer.buffer.groups.values()) == 16  # rollouts
    assert len(trainer.buffer.ready()) == 8  # groups

    assert await trainer.train_ready(consumer)
    assert await trainer.train_ready(consumer)
    assert not await trainer.train_ready(consumer)  # nothing left
    log = await bus.read_log(run_id)
    steps = {
        i.event.body.step: i.event.body for i in log if i.event and isinstance(i.event.body, ev.StepCompleted)
    }
    groups = {s: sorted({r.rsplit("-", 1)[0] for r in b.rollout_ids}) for s, b in steps.items()}
    assert groups == {
        0: ["code.globex.0", "code.globex.1", "math.acme.0", "math.acme.1"],
        1: ["math.acme.2", "math.acme.3", "math.acme.4", "math.acme.5"],
    }
    # Training order is arrival order, and the step says how many groups each env had.
    assert [r.rsplit("-", 1)[0] for r in steps[0].rollout_ids][::2] == [
        "math.acme.0",
        "math.acme.1",
        "code.globex.0",
        "code.globex.1",
    ]
    # Samples by index, whatever order their events came in.
    assert steps[0].rollout_ids[4:] == [
        "code.globex.0-0",
        "code.globex.0-1",
        "code.globex.1-0",
        "code.globex.1-1",
    ]
    assert steps[0].metrics["groups.acme.math"] == 2 and steps[0].metrics["groups.globex.code"] == 2
    assert steps[0].metrics["groups_no_signal"] == 0.0  # each group's rewards are 0 and 1
    assert steps[1].metrics["groups.acme.math"] == 4 and steps[1].metrics["groups.globex.code"] == 0


async def test_groups_scored_while_a_step_trains_are_admitted_by_that_step(
    bus: Bus, run_id: str, tmp_path: Path
) -> None:
    # The step's events and weights go out while it fetches what came meanwhile: the next batch
    # is held when the step ends, with no fetch of the loop's in between.
    for n in range(2):
        await bus.publish(scored(run_id, "acme", "math", n))
    part = TrainerPart(
        trainer=TrainerSettings(batch_groups=2, max_steps=10, checkpoint_every=0),
        envs=[EnvRoute(tenant="acme", env="math", group_size=2)],
    )
    trainer = Trainer(bus, run_id, part, tmp_path)
    consumer = await trainer.start()
    for _ in range(200):
        for d in await consumer.fetch(64, timeout=0.5):
            await trainer.admit(consumer, d)
        if len(trainer.buffer.ready()) == 2:
            break
    for n in range(2, 5):  # in the log before the step: as if scored during its train call
        await bus.publish(scored(run_id, "acme", "math", n))
    assert await trainer.train_ready(consumer)
    assert sorted(g.group_id for g in trainer.buffer.ready()) == ["math.acme.2", "math.acme.3", "math.acme.4"]
    assert trainer.version == 1
    # Its own rollouts are trained, not held again; the next step takes two of the three.
    assert not any(g.group_id in ("math.acme.0", "math.acme.1") for g in trainer.buffer.groups.values())
    assert await trainer.train_ready(consumer)
    assert len(trainer.buffer.ready()) == 1


async def test_an_auto_trainer_streams_once_a_batch_is_still_incomplete_late_in_its_cycle(
    bus: Bus, run_id: str, tmp_path: Path
) -> None:
    # stream_groups = "auto" (the default): whole batches while each is ready when the trainer
    # is free; a batch still incomplete late in the step's cycle turns streaming on, and the
    # next step takes its groups as they come.
    part = TrainerPart(
        trainer=TrainerSettings(batch_groups=2, max_steps=10, checkpoint_every=0),
        envs=[EnvRoute(tenant="acme", env="math", group_size=2)],
    )
    assert part.trainer.stream_groups == "auto"
    trainer = Trainer(bus, run_id, part, tmp_path)
    consumer = await trainer.start()

    async def arrive(*groups: int) -> None:
        for n in groups:
            await bus.publish(scored(run_id, "acme", "math", n, version=trainer.version))
        want = len(trainer.buffer.ready()) + len(groups)
        for _ in range(200):
            for d in await consumer.fetch(64, timeout=0.5):
                await trainer.admit(consumer, d)
            if len(trainer.buffer.ready()) >= want:
                return
        raise AssertionError(f"groups {groups} not admitted")

    await arrive(0, 1, 2, 3)
    assert await trainer.train_ready(consumer)  # step 0: this process's first (its wait is start-up)
    assert await trainer.train_ready(consumer)  # step 1: its batch ready the moment the trainer was free
    assert trainer.version == 2 and not trainer.streams()
    assert not await trainer.train_ready(consumer)  # nothing ready: the trainer is free, waiting
    await asyncio.sleep(0.5)
    assert not await trainer.train_ready(consumer)  # still waiting half a second in (it polls)
    await arrive(4, 5)
    assert await trainer.train_ready(consumer)  # step 2: its batch incomplete until late in its cycle
    assert trainer.version == 3 and trainer.streams()
    await arrive(6)
    assert await trainer.train_ready(consumer)  # into step 3, under way
    assert trainer.version == 3 and [g.group_id for g in trainer.under_way.groups] == ["math.acme.6"]
    await arrive(7)
    assert await trainer.train_ready(consumer)
    assert trainer.version == 4 and not trainer.under_way.groups
    log = await bus.read_log(run_id)
    split = {
        i.event.body.step: i.event.body.micro_batches
        for i in log
        if i.event and isinstance(i.event.body, ev.StepCompleted)
    }
    assert split == {0: [], 1: [], 2: [], 3: [2, 2]}


def test_the_share_of_groups_without_signal_counts_those_whose_rewards_are_all_equal() -> None:
    assert share_without_signal([[0.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.5, 0.5, 0.25]]) == 0.5
    assert share_without_signal([[0.3, 0.3]]) == 1.0
    assert share_without_signal([]) == 0.0
