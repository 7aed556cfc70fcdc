"""A group closed on its quorum ([[envs]] group_quorum) on a real nats-server and inference
worker: once enough of a group's samples are scored its RolloutsScored goes out with them, the
rest listed as late, whether the environment's scoring awaits (a sample held on a gate) or the
simulated latency decides which samples are in time."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from jetrl.bus import events as ev
from jetrl.bus import subjects
from jetrl.bus.client import Bus
from jetrl.bus.server import EmbeddedServer
from jetrl.consumers.inference.settings import InferencePart, InferenceSettings
from jetrl.consumers.inference.worker import InferenceWorker
from jetrl.policy.tokenizer import CharTokenizer
from jetrl.producers.environments import FollowUp, ModSumEnv, Score
from jetrl.producers.producer import EnvProducer, scored_by_quorum
from jetrl.producers.settings import EnvSettings, ProducerPart
from tests.support.engines import ZeroEngine
from tests.support.runlog import bodies, publish_version, wait_for

TOK = CharTokenizer()
GROUP = 4
WINDOW = 4  # 2 groups a step, one step off-policy
# A model-free engine to construct the worker with (replaced by ZeroEngine below).
WORKER = InferencePart(inference=InferenceSettings(engine="tests.support.engines:OracleEngine"))


class TwoQuick(ModSumEnv):
    """modsum whose scoring answers the first two samples of each group at once and holds the
    others on a gate (a group's samples share their task's ``info``)."""

    def __init__(self) -> None:
        super().__init__(TOK, modulus=5)
        self.gate = asyncio.Event()
        self.calls: dict[int, int] = {}

    async def areact(self, info: dict[str, Any], turn: int, completion_tokens: list[int]) -> Score | FollowUp:
        n = self.calls[id(info)] = self.calls.get(id(info), 0) + 1
        if n > 2:
            await self.gate.wait()
        return self.react(info, turn, completion_tokens)


async def run_parts(
    bus: Bus, run_id: str, env: EnvSettings
) -> tuple[EnvProducer, asyncio.Event, list[asyncio.Task[None]]]:
    await publish_version(bus, run_id, 0)
    stop = asyncio.Event()
    worker = InferenceWorker(bus, run_id, "inf-0", WORKER)
    worker.engine = ZeroEngine()
    producer = EnvProducer(bus, run_id, ProducerPart(env=env, groups_per_step=2, max_off_policy_steps=1))
    return producer, stop, [asyncio.create_task(worker.run(stop))]


async def closed_groups(bus: Bus, run_id: str) -> list[ev.RolloutsScored]:
    """The window's groups as scored, each closed on 2 of its 4 samples, the other 2 late."""
    log = await wait_for(
        bus,
        run_id,
        subjects.rollout_subject(run_id),
        lambda log: len(bodies(log, ev.RolloutsScored)) >= WINDOW,
        timeout=30.0,
    )
    scored = bodies(log, ev.RolloutsScored)
    for b in scored:
        kept = [r.sample_index for r in b.rollouts]
        assert b.group_size == len(kept) == 2
        assert len(b.late_samples) == 2
        assert sorted(kept + b.late_samples) == list(range(GROUP))
    return scored


async def test_a_group_closes_once_its_quorum_is_scored(
    nats_server: EmbeddedServer, bus: Bus, run_id: str
) -> None:
    env = EnvSettings(name="quorum", kind="modsum", group_size=GROUP, group_quorum=0.5)
    producer, stop, tasks = await run_parts(bus, run_id, env)
    slow = producer.env = TwoQuick()
    tasks.append(asyncio.create_task(producer.run(stop)))
    try:
        # The gate stays shut: the groups go out on their two quick samples alone.
        scored = await closed_groups(bus, run_id)
        assert all(b.late_samples == [2, 3] for b in scored)  # the ones held on the gate
        assert producer.late_samples == 2 * len(scored)
    finally:
        slow.gate.set()
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)


async def test_the_simulated_latency_decides_which_samples_are_in_time(
    nats_server: EmbeddedServer, bus: Bus, run_id: str
) -> None:
    env = EnvSettings(name="quorum", kind="modsum", group_size=GROUP, group_quorum=0.5, latency_median_s=1.0)
    producer, stop, tasks = await run_parts(bus, run_id, env)
    # Each group's samples: 1 and 3 quick, 0 and 2 would take a minute.
    latencies = itertools.cycle([60.0, 0.01, 60.0, 0.02])
    producer.latency = lambda: next(latencies)  # type: ignore[method-assign]
    tasks.append(asyncio.create_task(producer.run(stop)))
    try:
        scored = await closed_groups(bus, run_id)
        assert all(b.late_samples == [0, 2] for b in scored)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)


async def scoring(result: Score | FollowUp, gate: asyncio.Event | None = None) -> Score | FollowUp:
    if gate is not None:
        await gate.wait()
    return result


async def test_scorings_close_on_the_quorum_and_the_late_ones_run_on() -> None:
    gate = asyncio.Event()
    ran: list[int] = []

    async def late(i: int) -> Score:
        await gate.wait()
        ran.append(i)
        return Score(reward=float(i))

    got = await scored_by_quorum(
        [scoring(Score(reward=0.0)), late(1), scoring(Score(reward=2.0)), late(3)], quorum=2
    )
    assert [None if r is None else r.reward for r in got if not isinstance(r, FollowUp)] == [
        0.0,
        None,
        2.0,
        None,
    ]
    gate.set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert sorted(ran) == [1, 3]  # not cancelled: they ended their own way, unread


async def test_a_reply_or_no_quorum_waits_for_every_scoring() -> None:
    gate = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, gate.set)
    reply = FollowUp(text="more")
    got = await scored_by_quorum(
        [scoring(reply), scoring(Score(reward=1.0)), scoring(Score(reward=2.0), gate)], quorum=1
    )
    assert got[0] is reply and all(r is not None for r in got)
    gate.clear()
    asyncio.get_running_loop().call_later(0.05, gate.set)
    got = await scored_by_quorum([scoring(Score(reward=1.0)), scoring(Score(reward=2.0), gate)], quorum=None)
    assert all(isinstance(r, Score) for r in got)
