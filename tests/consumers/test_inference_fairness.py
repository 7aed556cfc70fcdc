"""Fair scheduling across tenants: deficit round robin over one durable consumer per tenant, so
that a tenant that floods the run cannot starve the others (real nats-server; shares counted in
tasks served, never timed), and the DRR arithmetic on its own."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, cast

from jetrl.bus import events as ev
from jetrl.bus import subjects
from jetrl.bus.client import Bus
from jetrl.bus.fair import FairPuller, FairQueue
from jetrl.bus.payloads import Payloads
from jetrl.bus.settings import EnvRoute, TenantSettings
from jetrl.consumers.inference.settings import InferencePart, InferenceSettings
from jetrl.consumers.inference.worker import InferenceWorker, task_sources
from jetrl.policy.settings import ModelSettings
from jetrl.policy.tokenizer import CharTokenizer

TOK = CharTokenizer()


def two_tenants(weight_a: float = 1.0, weight_b: float = 1.0) -> InferencePart:
    return InferencePart(
        inference=InferenceSettings(engine="tests.support.engines:OracleEngine", max_batch_tasks=4),
        model=ModelSettings(name="tiny-dense"),
        tenants=[TenantSettings(name="a", weight=weight_a), TenantSettings(name="b", weight=weight_b)],
        envs=[EnvRoute(tenant="a", env="math", group_size=2), EnvRoute(tenant="b", env="code", group_size=2)],
    )


async def announce_v0(bus: Bus, run_id: str) -> None:
    payloads = await Payloads.for_run(bus.js, run_id)
    ref = await payloads.default.put("weights-v0", b"weights")
    await bus.publish(
        ev.new_event(ev.WeightsReady(version=0, location=ref, weights_checksum="0" * 64), run_id=run_id)
    )


async def submit(bus: Bus, run_id: str, tenant: str, env: str, n: int, group_size: int = 2) -> list[str]:
    pub = bus.publisher()
    out = []
    for i in range(n):
        body = ev.TaskSubmitted(
            task_id=f"{env}.{tenant}.{i}",
            env=env,
            group_size=group_size,
            prompt_tokens=TOK.encode(f"{i % 5}+{(i * 3) % 5}="),
            max_tokens=2,
        )
        await pub.publish(ev.new_event(body, run_id=run_id, tenant=tenant))
        out.append(body.task_id)
    await pub.flush()
    return out


async def served_order(bus: Bus, run_id: str, part: InferencePart, total: int) -> list[str]:
    """The tenants of the first ``total`` tasks one worker finished, in the order it did."""
    worker = InferenceWorker(bus, run_id, "w0", part)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    order: list[str] = []
    seen: set[str] = set()
    try:
        async for item in bus.tail(
            run_id, filter_subject=subjects.generation_subject(run_id), idle_timeout=30
        ):
            g = item.event.body if item.event else None
            if isinstance(g, ev.CompletionsGenerated) and g.task_id not in seen:
                seen.add(g.task_id)
                assert item.event is not None
                order.append(item.event.tenant)
                if len(order) == total:
                    break
    finally:
        stop.set()
        await asyncio.wait_for(running, 60)
    assert len(order) == total, f"only {len(order)} of {total} tasks were served"
    return order


def test_one_tenant_keeps_the_one_shared_consumer() -> None:
    part = InferencePart(tenants=[TenantSettings(name="a")])
    assert [s.durable for s in task_sources("r", part)] == ["inference"]
    assert [s.filter_subject for s in task_sources("r", InferencePart())] == ["jetrl.r.task.*.*"]
    srcs = task_sources("r", two_tenants(2.0, 1.0))
    assert [(s.durable, s.filter_subject, s.weight) for s in srcs] == [
        ("inference-a", "jetrl.r.task.a.*", 2.0),
        ("inference-b", "jetrl.r.task.b.*", 1.0),
        ("inference-default", "jetrl.r.task.default.*", 1.0),  # the gateway's tasks
    ]
    quota = InferencePart(tenants=[TenantSettings(name="a", max_tasks_in_flight=3)])
    assert [s.durable for s in task_sources("r", quota)] == ["inference-a", "inference-default"]


async def test_a_flooding_tenant_does_not_starve_another(bus: Bus, run_id: str) -> None:
    await announce_v0(bus, run_id)
    # A's flood is queued first: one shared FIFO consumer would serve all 60 before any of B's.
    await submit(bus, run_id, "a", "math", 60)
    await submit(bus, run_id, "b", "code", 12)
    order = await served_order(bus, run_id, two_tenants(), 72)
    b_done_at = max(i for i, t in enumerate(order) if t == "b") + 1
    a_before = order[:b_done_at].count("a")
    # Equal weights, equal group sizes: A and B alternate while both have work (12 each), with
    # a batch (4 tasks) of slack either way for where the rotation stands.
    assert a_before <= 12 + 4, order
    assert order[:24].count("b") >= 12 - 4, order
    assert order.count("a") == 60


async def test_weights_set_the_shares(bus: Bus, run_id: str) -> None:
    await announce_v0(bus, run_id)
    await submit(bus, run_id, "a", "math", 40)
    await submit(bus, run_id, "b", "code", 40)
    order = await served_order(bus, run_id, two_tenants(3.0, 1.0), 32)
    # 3:1 of 32 tasks is 24:8, within a batch.
    assert 20 <= order.count("a") <= 28, order


# ------------------------------------------------------------------- DRR on its own


class Item:
    def __init__(self, cost: int) -> None:
        self.cost = cost


def queue(name: str, cost: int, n: int, weight: float = 1.0) -> FairQueue[Any]:
    q: FairQueue[Any] = FairQueue(name, cast(Any, None), weight)
    q.buffer = deque(cast(Any, Item(cost)) for _ in range(n))
    return q


def test_deficit_round_robin_shares_samples_not_tasks() -> None:
    a, b = queue("a", cost=8, n=100), queue("b", cost=2, n=400)
    puller: FairPuller[Any] = FairPuller([a, b], cost=lambda d: float(cast(Any, d).cost))
    for _ in range(20):
        puller.take(8)
    # B's tasks are a quarter of A's size: it gets four times the tasks, the same samples.
    assert abs(a.served - b.served) <= 8, (a.served, b.served)
    assert b.served / 2 >= 3 * (a.served / 8), (a.served, b.served)


def test_deficit_round_robin_follows_weights_and_forgets_idle_queues() -> None:
    a, b = queue("a", cost=2, n=1000, weight=2.0), queue("b", cost=2, n=1000)
    puller: FairPuller[Any] = FairPuller([a, b], cost=lambda d: float(cast(Any, d).cost))
    for _ in range(30):
        assert len(puller.take(5)) == 5
    assert abs(a.served / (a.served + b.served) - 2 / 3) < 0.03, (a.served, b.served)
    # An idle queue banks no credit: once B has work again it gets its share, not a burst.
    idle = queue("idle", cost=2, n=0)
    busy = queue("busy", cost=2, n=1000)
    p2: FairPuller[Any] = FairPuller([idle, busy], cost=lambda d: float(cast(Any, d).cost))
    for _ in range(10):
        p2.take(4)
    assert idle.deficit == 0.0 and busy.served == 80
    idle.buffer.extend(cast(Any, Item(2)) for _ in range(100))
    taken = [q.name for q, _ in p2.take(8)]
    assert taken.count("idle") <= 5, taken
