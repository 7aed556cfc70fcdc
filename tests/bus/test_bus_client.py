"""The client against a real nats-server: publish, dedupe, consume, redeliver, dead-letter."""

from __future__ import annotations

import asyncio

import pytest

from jetrl.bus import events as ev
from jetrl.bus import subjects
from jetrl.bus.client import Bus
from jetrl.bus.consumer import Batch, ConsumerSpec, Delivery, Reject
from jetrl.bus.publisher import PublishError
from jetrl.bus.server import EmbeddedServer
from tests.support.catalog_samples import sample_bodies


async def drain(consumer, expect: int, *, timeout: float = 10.0) -> list[Delivery[ev.EventBody]]:
    got: list[Delivery[ev.EventBody]] = []
    deadline = asyncio.get_running_loop().time() + timeout
    while len(got) < expect and asyncio.get_running_loop().time() < deadline:
        for d in await consumer.fetch(64, timeout=0.5):
            await d.ack()
            got.append(d)
    return got


async def dead_letters(bus: Bus, run_id: str, expect: int) -> list[ev.DeadLettered]:
    out: list[ev.DeadLettered] = []
    async for item in bus.tail(run_id, filter_subject=subjects.all_dlq_subjects(run_id), idle_timeout=2.0):
        assert item.event is not None and isinstance(item.event.body, ev.DeadLettered)
        out.append(item.event.body)
        if len(out) >= expect:
            break
    return out


async def test_every_event_type_round_trips_through_the_stream(bus: Bus, run_id: str) -> None:
    sent = [ev.new_event(b, run_id=run_id, tenant="acme") for b in sample_bodies()]
    for e in sent:
        await bus.publish(e)
    c = await bus.consumer(
        ConsumerSpec(run_id=run_id, durable="all", filter_subjects=[subjects.all_subjects(run_id)])
    )
    got = await drain(c, len(sent))
    # Dead letters published by the catalog sample are ordinary events here.
    assert [d.event for d in got] == sent
    assert [d.seq for d in got] == list(range(1, len(sent) + 1))


async def test_duplicate_publish_is_stored_once(bus: Bus, run_id: str) -> None:
    e = ev.new_event(ev.RunStarted(config={}, code_version="t"), run_id=run_id)
    a1 = await bus.publish(e)
    a2 = await bus.publish(e)
    assert a2.duplicate and a2.seq == a1.seq
    pub = bus.publisher(max_inflight=8)
    for _ in range(5):
        await pub.publish(e)
    await pub.flush()
    assert pub.duplicates == 5
    assert await bus.last_seq(run_id) == 1


async def test_pipelined_publisher_bounds_inflight_and_delivers_all(bus: Bus, run_id: str) -> None:
    pub = bus.publisher(max_inflight=16)
    peak = 0
    ids = set()
    for i in range(2000):
        e = ev.new_event(
            ev.WorkerHeartbeat(worker_id=f"w{i % 4}", kind="inference", inflight=i), run_id=run_id
        )
        ids.add(e.event_id)
        await pub.publish(e)
        peak = max(peak, pub.inflight)
    await pub.flush()
    assert peak <= 16
    assert pub.published == 2000 and pub.duplicates == 0
    seen = {it.event.event_id async for it in bus.tail(run_id, idle_timeout=1.0) if it.event}
    assert seen == ids


async def test_publisher_surfaces_failures(bus: Bus, run_id: str) -> None:
    # A subject no stream captures: the server answers "no responders" to each retry.
    pub = bus.publisher(max_inflight=4, ack_timeout=0.5, retries=1, retry_s=0.0)
    await pub.publish_encoded("nostream.x", b"x", {ev.HEADER_MSG_ID: "lost-1"})
    with pytest.raises(PublishError) as info:
        await pub.flush(timeout=30)
    assert set(info.value.failed) == {"lost-1"}


async def test_unacked_message_is_redelivered_to_another_consumer(
    nats_server: EmbeddedServer, bus: Bus, run_id: str
) -> None:
    e = ev.new_event(ev.StepCompleted(step=1, policy_version=1, rollout_ids=["a"]), run_id=run_id)
    await bus.publish(e)
    spec = ConsumerSpec(
        run_id=run_id, durable="trainer", filter_subjects=[subjects.step_subject(run_id)], ack_wait=1.0
    )
    # The first worker takes the message and dies before acking.
    doomed = await Bus.connect(nats_server.url, name="doomed")
    c1 = await doomed.consumer(spec)
    first = await c1.fetch(1, timeout=2)
    assert [d.event.event_id for d in first] == [e.event_id]
    await doomed.nc.close()
    # Another worker bound to the same durable gets it once the ack wait expires.
    c2 = await bus.consumer(spec)
    got = await drain(c2, 1, timeout=10)
    assert [d.event.event_id for d in got] == [e.event_id]
    assert got[0].num_delivered == 2


async def test_poison_messages_are_dead_lettered_and_consumer_goes_on(bus: Bus, run_id: str) -> None:
    subj = subjects.rollout_subject(run_id, "acme", "reverse")
    good = [
        ev.new_event(
            ev.RolloutWithheld(
                rollout_id=f"reverse.acme.1-{i}",
                group_id="reverse.acme.1",
                env="reverse",
                reason="stale",
                trainer_step=1,
                policy_version=1,
            ),
            run_id=run_id,
            tenant="acme",
        )
        for i in range(4)
    ]
    await bus.publish(good[0])
    await bus.js.publish(subj, b"\xc1 not msgpack")  # undecodable
    await bus.publish(good[1])
    spoof = ev.new_event(good[2].body, run_id=run_id, tenant="mallory")
    await bus.js.publish(subj, ev.encode_event(spoof), headers=ev.event_headers(spoof))  # tenant spoofed
    await bus.publish(good[2])
    await bus.publish(good[3])

    handled: list[str] = []
    attempts: dict[str, int] = {}

    async def handler(d: Delivery[ev.RolloutWithheld]) -> None:
        rid = d.body.rollout_id
        attempts[rid] = attempts.get(rid, 0) + 1
        if rid == "reverse.acme.1-1":
            raise Reject("reward is NaN", reason="invalid")
        if rid == "reverse.acme.1-2":
            raise RuntimeError("transient failure that never heals")
        handled.append(rid)

    spec = ConsumerSpec(
        run_id=run_id,
        durable="scorer",
        filter_subjects=[subjects.rollout_subject(run_id)],
        max_deliver=3,
        backoff=(0.1,),
    )
    c = await bus.consumer(spec, ev.RolloutWithheld)
    stop = asyncio.Event()
    task = asyncio.create_task(c.run(handler, batch=8, fetch_timeout=0.3, stop=stop))
    for _ in range(100):
        if c.stats.dead_lettered >= 4 and len(handled) >= 2:
            break
        await asyncio.sleep(0.1)
    stop.set()
    await task
    assert handled == ["reverse.acme.1-0", "reverse.acme.1-3"]
    assert attempts["reverse.acme.1-2"] == 3
    assert c.stats.by_reason == {"malformed": 1, "spoofed": 1, "invalid": 1, "max_deliver": 1}
    dls = await dead_letters(bus, run_id, 4)
    by_reason = {d.reason: d for d in dls}
    assert set(by_reason) == {"malformed", "spoofed", "invalid", "max_deliver"}
    assert by_reason["malformed"].original_data == b"\xc1 not msgpack"
    assert by_reason["malformed"].original_stream_seq == 2
    assert "mallory" in by_reason["spoofed"].detail
    assert by_reason["max_deliver"].delivery_count == 3
    # Nothing is left pending on the consumer: every message was settled.
    info = await c.info()
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_message_that_kills_its_worker_is_parked_after_max_deliver(
    nats_server: EmbeddedServer, bus: Bus, run_id: str
) -> None:
    e = ev.new_event(ev.StepCompleted(step=7, policy_version=7, rollout_ids=[]), run_id=run_id)
    await bus.publish(e)
    spec = ConsumerSpec(
        run_id=run_id,
        durable="crashy",
        filter_subjects=[subjects.step_subject(run_id)],
        ack_wait=0.5,
        max_deliver=2,
    )
    for _ in range(2):  # two workers fetch it and die
        w = await Bus.connect(nats_server.url)
        got = await (await w.consumer(spec)).fetch(1, timeout=3)
        assert len(got) == 1
        await w.nc.close()
    c = await bus.consumer(spec)
    deadline = asyncio.get_running_loop().time() + 10
    while c.stats.dead_lettered == 0 and asyncio.get_running_loop().time() < deadline:
        assert await c.fetch(1, timeout=0.5) == []
    dls = await dead_letters(bus, run_id, 1)
    assert dls[0].reason == "max_deliver" and dls[0].original_event_id == e.event_id


async def test_run_handles_up_to_concurrency_events_at_once(bus: Bus, run_id: str) -> None:
    """Four handlers must be running together before any may finish: with less concurrency
    than that the run would wait forever (bounded here)."""
    for i in range(4):
        await bus.publish(
            ev.new_event(ev.StepCompleted(step=i, policy_version=i, rollout_ids=[]), run_id=run_id)
        )
    running, all_in = 0, asyncio.Event()

    async def handler(d: Delivery[ev.EventBody]) -> None:
        nonlocal running
        running += 1
        if running == 4:
            all_in.set()
        await all_in.wait()

    spec = ConsumerSpec(run_id=run_id, durable="wide", filter_subjects=[subjects.step_subject(run_id)])
    c = await bus.consumer(spec)
    stop = asyncio.Event()
    task = asyncio.create_task(c.run(handler, batch=8, fetch_timeout=0.3, stop=stop, concurrency=4))
    await asyncio.wait_for(all_in.wait(), timeout=20)
    while c.stats.acked < 4:
        await asyncio.sleep(0.05)
    stop.set()
    await task
    # An ack is a publish with no reply, on the consumer's own connection: the server may count
    # it a moment after this connection's request for the consumer's state.
    deadline = asyncio.get_running_loop().time() + 10
    while (pending := (await c.info()).num_ack_pending) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    assert pending == 0


async def test_in_progress_keeps_long_work_from_redelivery(bus: Bus, run_id: str) -> None:
    e = ev.new_event(ev.StepCompleted(step=1, policy_version=1, rollout_ids=[]), run_id=run_id)
    await bus.publish(e)
    spec = ConsumerSpec(
        run_id=run_id, durable="slow", filter_subjects=[subjects.step_subject(run_id)], ack_wait=1.0
    )
    c = await bus.consumer(spec)
    (d,) = await c.fetch(1, timeout=2)
    async with d.keep_alive(every=0.3):
        await asyncio.sleep(2.5)  # longer than ack_wait
        # Without the in-progress acks the message would be handed out again here.
        assert await c.fetch(1, timeout=0.5) == []
        info = await c.info()
        assert info.num_redelivered == 0
    await d.ack()


async def test_a_fetch_that_does_not_wait_takes_only_what_the_server_has(bus: Bus, run_id: str) -> None:
    spec = ConsumerSpec(run_id=run_id, durable="ready", filter_subjects=[subjects.step_subject(run_id)])
    c = await bus.consumer(spec)
    # Answered at once on an empty stream: a waiting fetch would linger past the bound.
    assert (await asyncio.wait_for(c.fetch_batch(64, timeout=300.0, wait=False), 60)).deliveries == []
    for n in range(3):
        await bus.publish(
            ev.new_event(ev.StepCompleted(step=n, policy_version=n, rollout_ids=[]), run_id=run_id)
        )
    got = (await c.fetch_batch(64, timeout=300.0, wait=False)).deliveries
    assert [d.body.step for d in got] == [0, 1, 2]  # type: ignore[attr-defined]
    for d in got:
        await d.ack()
    assert (await c.fetch_batch(64, wait=False)).deliveries == []


async def test_a_stop_ends_a_consumer_loop_waiting_for_events_and_what_it_was_brought_goes_back(
    bus: Bus, run_id: str
) -> None:
    spec = ConsumerSpec(
        run_id=run_id, durable="stopped", filter_subjects=[subjects.step_subject(run_id)], ack_wait=300.0
    )
    c = await bus.consumer(spec)
    handled: list[Delivery[ev.EventBody]] = []

    async def handle(batch: Batch[ev.EventBody]) -> None:
        handled.extend(batch.deliveries)

    stop = asyncio.Event()
    loop = asyncio.create_task(c.run_batches(handle, fetch_timeout=300.0, stop=stop))
    await asyncio.sleep(0.5)  # its fetch is waiting for a first event
    stop.set()
    # The stop ends the loop, not the fetch's 300 s.
    await asyncio.wait_for(loop, 60)
    # The request the stopped fetch left open still brings an event here: handed back when the
    # consumer is let go, another consumer of the durable has it at once, not after the ack wait.
    e = ev.new_event(ev.StepCompleted(step=7, policy_version=7, rollout_ids=[]), run_id=run_id)
    await bus.publish(e)
    for _ in range(100):
        if not c.channel.queue.empty():
            break
        await asyncio.sleep(0.05)
    assert not c.channel.queue.empty()
    await c.unsubscribe()
    other = await bus.consumer(spec)
    got = await other.fetch(1, timeout=60.0)
    assert [d.event.event_id for d in got] == [e.event_id] and handled == []


async def test_tail_from_any_point(bus: Bus, run_id: str) -> None:
    for i in range(10):
        await bus.publish(
            ev.new_event(ev.StepCompleted(step=i, policy_version=i, rollout_ids=[]), run_id=run_id)
        )
    items = [it async for it in bus.tail(run_id, from_seq=6, idle_timeout=1.0)]
    assert [it.seq for it in items] == [6, 7, 8, 9, 10]
    steps = [it.event.body for it in items if it.event and isinstance(it.event.body, ev.StepCompleted)]
    assert [s.step for s in steps] == [5, 6, 7, 8, 9]


async def test_tail_to_head_ends_where_the_log_ends(bus: Bus, run_id: str) -> None:
    """`to_head` ends on the last matching message, with no idle wait (none is given: a reader
    that did not end would hit the bound below), also when the filter's last message is not the
    log's last, and at once when nothing matches."""
    for i in range(6):
        await bus.publish(
            ev.new_event(ev.StepCompleted(step=i, policy_version=i, rollout_ids=[]), run_id=run_id)
        )
        await bus.publish(ev.new_event(ev.RunFinished(status="completed", steps=i), run_id=run_id))

    async def read(filter_subject: str | None = None, from_seq: int | None = None) -> list[int]:
        async def go() -> list[int]:
            tail = bus.tail(run_id, from_seq=from_seq, filter_subject=filter_subject, to_head=True)
            return [it.seq async for it in tail]

        return await asyncio.wait_for(go(), timeout=20)

    assert await read() == list(range(1, 13))
    assert await read(filter_subject=subjects.step_subject(run_id)) == [1, 3, 5, 7, 9, 11]
    assert await read(filter_subject=subjects.step_subject(run_id), from_seq=8) == [9, 11]
    assert await read(filter_subject=subjects.weights_subject(run_id)) == []
    assert await read(from_seq=13) == []


async def test_a_consumer_takes_its_body_type_and_passes_over_skipped_types(bus: Bus, run_id: str) -> None:
    """Typed by body: another type on its subjects is dead-lettered as invalid, a type it skips
    (its own output) is acked without a dead letter, and neither reaches the handler."""
    step = ev.new_event(ev.StepCompleted(step=0, policy_version=1, rollout_ids=[]), run_id=run_id)
    fin = ev.new_event(ev.RunFinished(status="completed", steps=1), run_id=run_id)
    policy = ev.new_event(
        ev.PolicyVersionPublished(version=1, step=1, weights_checksum="0" * 64), run_id=run_id
    )
    for e in (step, fin, policy):
        await bus.publish(e)
    spec = ConsumerSpec(
        run_id=run_id,
        durable="steps-only",
        filter_subjects=[subjects.all_subjects(run_id)],
        skip_types=("RunFinished",),
    )
    c = await bus.consumer(spec, ev.StepCompleted)
    got: list[ev.StepCompleted] = []

    async def keep(batch: Batch[ev.StepCompleted]) -> None:
        for d in batch.deliveries:
            got.append(d.body)
            await d.ack()

    async def until_three() -> bool:
        return c.stats.delivered >= 3

    await asyncio.wait_for(c.run_batches(keep, batch=8, fetch_timeout=0.3, after=until_three), timeout=20)
    assert got == [step.body]
    assert c.stats.dead_lettered == 1 and c.stats.by_reason == {"invalid": 1}
    dead = [
        i.event.body
        for i in await bus.read_log(run_id)
        if i.event and isinstance(i.event.body, ev.DeadLettered)
    ]
    assert [d.original_type for d in dead] == ["PolicyVersionPublished"]


@pytest.mark.parametrize("gather_s", [0.0, 0.5])
async def test_a_consumer_keeping_up_gathers_what_comes_into_fewer_batches(
    bus: Bus, run_id: str, gather_s: float
) -> None:
    """30 events published 20 ms apart to a consumer that keeps up: one or two a batch, or,
    with ``gather_s``, what came meanwhile in one batch (a transaction each for the recorder);
    every event handled once, in order, either way."""
    spec = ConsumerSpec(
        run_id=run_id, durable=f"gather-{int(gather_s * 10)}", filter_subjects=[subjects.step_subject(run_id)]
    )
    c = await bus.consumer(spec, ev.StepCompleted)
    sizes: list[int] = []
    steps: list[int] = []

    async def keep(batch: Batch[ev.StepCompleted]) -> None:
        sizes.append(len(batch.deliveries))
        for d in batch.deliveries:
            steps.append(d.body.step)
            await d.ack()

    async def until_all() -> bool:
        return len(steps) >= 30

    async def publish() -> None:
        for k in range(30):
            await bus.publish(
                ev.new_event(ev.StepCompleted(step=k, policy_version=k + 1, rollout_ids=[]), run_id=run_id)
            )
            await asyncio.sleep(0.02)

    feeding = asyncio.create_task(publish())
    await asyncio.wait_for(
        c.run_batches(keep, batch=100, fetch_timeout=0.5, after=until_all, prefetch=True, gather_s=gather_s),
        timeout=20,
    )
    await feeding
    assert steps == list(range(30))
    if gather_s:
        assert len(sizes) <= 6, sizes  # ~0.6 s of publishing, 0.5 s gathered a batch
    else:
        assert len(sizes) >= 10, sizes


async def test_large_events_arrive_once_without_waiting_out_an_ack_wait(bus: Bus, run_id: str) -> None:
    """2,500 events of 64 KiB fetched 256 at a time: each is delivered once, none waits out the
    ack wait (60 s; the reader gives up at 40 s). Requests that left more than the server's
    64 MiB per-client buffer in flight got the connection closed as a slow consumer, and what
    it carried came back only after the ack wait."""
    n = 2500
    tokens = list(range(16_000))  # ~64 KiB of msgpack per event
    pub = bus.publisher(max_inflight=64)
    for i in range(n):
        body = ev.TaskSubmitted(task_id=f"big.default.{i}", env="big", group_size=2, prompt_tokens=tokens)
        await pub.publish(ev.new_event(body, run_id=run_id))
    await pub.flush()
    spec = ConsumerSpec(
        run_id=run_id,
        durable="big",
        filter_subjects=[subjects.task_subject(run_id)],
        ack_wait=60.0,
        max_ack_pending=4096,
    )
    c = await bus.consumer(spec, ev.TaskSubmitted)
    got: dict[str, int] = {}
    deadline = asyncio.get_running_loop().time() + 40.0
    while len(got) < n and asyncio.get_running_loop().time() < deadline:
        for d in await c.fetch(256, timeout=5.0):
            got[d.body.task_id] = max(got.get(d.body.task_id, 0), d.num_delivered)
            await d.ack()
    assert len(got) == n, f"{n - len(got)} of {n} events did not arrive within 40 s"
    assert set(got.values()) == {1}, "an event was delivered twice"
