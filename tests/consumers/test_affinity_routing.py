"""Prefix-aware routing through the shared task queue: a later turn that names the worker of the
turn before goes to that worker when it is there, and to any worker when it is not (real
nats-server, two workers on one durable consumer)."""

from __future__ import annotations

import asyncio
from collections import Counter

from jetrl.bus import events as ev
from jetrl.bus import subjects
from jetrl.bus.client import Bus
from jetrl.bus.payloads import Payloads
from jetrl.consumers.inference.settings import InferencePart, InferenceSettings
from jetrl.consumers.inference.worker import InferenceWorker
from jetrl.policy.tokenizer import CharTokenizer

TASKS = 24


async def _served_by(bus: Bus, run_id: str, hints: list[str]) -> tuple[Counter[str], list[InferenceWorker]]:
    part = InferencePart(
        inference=InferenceSettings(engine="tests.support.engines:OracleEngine", max_batch_tasks=2)
    )
    payloads = await Payloads.for_run(bus.js, run_id)
    ref = await payloads.default.put("weights-v0", b"weights")
    await bus.publish(
        ev.new_event(ev.WeightsReady(version=0, location=ref, weights_checksum="0" * 64), run_id=run_id)
    )
    workers = [InferenceWorker(bus, run_id, w, part) for w in ("w0", "w1")]
    stop = asyncio.Event()
    running = [asyncio.create_task(w.run(stop)) for w in workers]
    tok = CharTokenizer()
    for i, hint in enumerate(hints):
        body = ev.TaskSubmitted(
            task_id=f"modsum.default.{i}",
            env="modsum",
            group_size=1,
            prompt_tokens=tok.encode(f"{i % 5}+1="),
            max_tokens=2,
            turn=1,
            worker_hint=hint,
        )
        await bus.publish(ev.new_event(body, run_id=run_id))
    served: Counter[str] = Counter()
    seen: set[str] = set()
    async for item in bus.tail(run_id, filter_subject=subjects.generation_subject(run_id), idle_timeout=30):
        done = item.event.body if item.event else None
        if isinstance(done, ev.CompletionsGenerated) and done.task_id not in seen:
            assert [s.sample_index for s in done.samples] == [0]  # the later turn's one sample
            seen.add(done.task_id)
            served[done.worker_id] += 1
            if len(seen) == len(hints):
                break
    stop.set()
    await asyncio.gather(*running)
    assert len(seen) == len(hints), "a task was lost"
    return served, workers


async def test_a_later_turn_goes_to_the_worker_named(bus: Bus, run_id: str) -> None:
    served, workers = await _served_by(bus, run_id, ["w1"] * TASKS)
    # w0 hands each back twice before taking it: w1 gets it unless w0 drew it three times running.
    assert served["w1"] >= 0.6 * TASKS, served
    assert workers[1].stats["affinity_hits"] == served["w1"]
    assert workers[0].stats["affinity_deferred"] > 0


async def test_a_turn_whose_worker_is_gone_is_taken_by_another(bus: Bus, run_id: str) -> None:
    served, workers = await _served_by(bus, run_id, ["w9"] * 8)
    assert sum(served.values()) == 8
    assert sum(w.stats["affinity_misses"] for w in workers) == 8
