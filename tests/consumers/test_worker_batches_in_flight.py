"""An engine that batches continuously gets several batches at once, and never a weights load
while one is in flight: every batch generates under one version (real nats-server)."""

from __future__ import annotations

import asyncio

from jetrl.bus import events as ev
from jetrl.bus import subjects
from jetrl.bus.client import Bus
from jetrl.bus.payloads import Payloads
from jetrl.consumers.inference.settings import InferencePart, InferenceSettings
from jetrl.consumers.inference.worker import InferenceWorker
from jetrl.policy.tokenizer import CharTokenizer
from tests.support.engines import ConcurrentOracleEngine

TASKS = 16


async def test_batches_in_flight_never_span_a_weights_load(bus: Bus, run_id: str) -> None:
    part = InferencePart(
        inference=InferenceSettings(engine="tests.support.engines:ConcurrentOracleEngine", max_batch_tasks=2)
    )
    payloads = await Payloads.for_run(bus.js, run_id)

    async def announce(version: int) -> None:
        ref = await payloads.default.put(f"weights-v{version}", b"weights %d" % version)
        body = ev.WeightsReady(version=version, location=ref, weights_checksum="0" * 64)
        await bus.publish(ev.new_event(body, run_id=run_id))

    await announce(0)
    worker = InferenceWorker(bus, run_id, "w0", part)
    engine = worker.engine
    assert isinstance(engine, ConcurrentOracleEngine) and worker.batches_in_flight == 3
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    tok = CharTokenizer()
    for i in range(TASKS):
        prompt = tok.encode(f"{i % 5}+{(i * 3) % 5}=")
        body = ev.TaskSubmitted(
            task_id=f"modsum.default.{i}", env="modsum", group_size=2, prompt_tokens=prompt, max_tokens=2
        )
        await bus.publish(ev.new_event(body, run_id=run_id))
        if i in (5, 10):  # new versions while batches are generating
            await announce(1 if i == 5 else 2)
    got: list[ev.CompletionsGenerated] = []
    async for item in bus.tail(run_id, filter_subject=subjects.generation_subject(run_id), idle_timeout=30):
        if item.event is not None and isinstance(item.event.body, ev.CompletionsGenerated):
            got.append(item.event.body)
            if sum(len(g.samples) for g in got) >= 2 * TASKS:
                break
    stop.set()
    await asyncio.wait_for(running, 60)

    samples = [(g.task_id, s.sample_index) for g in got for s in g.samples]
    assert len(samples) == 2 * TASKS and len(set(samples)) == 2 * TASKS
    assert len(got) == TASKS  # one event a task, its whole group in it
    assert engine.most_active > 1, "batches were never in flight together"
    assert engine.loads_while_generating == 0
    assert all(start == end for start, end in engine.spans), engine.spans
    assert max(g.policy_version_start for g in got) == 2  # the new versions were taken up
