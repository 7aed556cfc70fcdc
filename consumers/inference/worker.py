"""The inference consumer: tasks in, completions out, weights loaded between batches.

Many workers share one durable consumer on the run's task subjects, so each task goes to one of
them. A worker generates the task's whole group with its current policy, publishes one
GenerationCompleted per sample (arrays through the claim-check, routing traces for MoE), and acks
the task only once every completion is durable. A watcher follows the weights subject; new
weights are loaded between batches, checksum-verified, and announced with WeightsLoaded.
Completion event ids derive from the task's event id, so a task redelivered after a crash yields
the same events, which the stream deduplicates.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from typing import Any

import numpy as np
import structlog
import torch

from jetrl.bus import events as ev
from jetrl.bus import subjects
from jetrl.bus.client import Bus, ConsumerSpec, Delivery, keep_alive
from jetrl.bus.log import get_logger
from jetrl.bus.payloads import ObjectStorePayloads, Payloads, weight_stores
from jetrl.consumers.inference.settings import InferencePart
from jetrl.policy.models import build_model, get_config
from jetrl.policy.sampling import SamplingConfig, generate, inference_copy
from jetrl.policy.tokenizer import CharTokenizer
from jetrl.policy.weights import load_into, weights_from_bytes


class InferenceWorker:
    def __init__(self, bus: Bus, run_id: str, worker_id: str, part: InferencePart) -> None:
        self.bus = bus
        self.run_id = run_id
        self.worker_id = worker_id
        self.part = part
        self.s = settings = part.inference
        self.tok = CharTokenizer()
        mcfg = get_config(part.model.name, **part.model.overrides)
        # Weights come from WeightsReady events; the seed here only shapes the module.
        self.model = inference_copy(build_model(mcfg, seed=0), settings.precision)  # type: ignore[arg-type]
        self.loaded_version: int | None = None
        self.latest: ev.WeightsReady | None = None
        self.new_weights = asyncio.Event()
        seed = (part.seed * 1_000_003 + (uuid.uuid5(uuid.NAMESPACE_URL, worker_id).int % 1_000_003)) % 2**63
        self.generator = torch.Generator().manual_seed(seed)
        self.payloads: Payloads | None = None
        self.busy = False
        self.stats = {"tasks": 0, "samples": 0, "tokens": 0, "generate_s": 0.0, "weight_loads": 0}
        self.log = get_logger(__name__, run_id=run_id, worker_id=worker_id)

    # ---------------------------------------------------------------- weights

    async def watch_weights(self, stop: asyncio.Event) -> None:
        async for item in self.bus.tail(self.run_id, filter_subject=subjects.weights_subject(self.run_id)):
            if stop.is_set():
                return
            body = item.event.body if item.event else None
            if isinstance(body, ev.WeightsReady) and (
                self.latest is None or body.version > self.latest.version
            ):
                self.latest = body
                self.new_weights.set()

    async def load_latest(self) -> None:
        ready = self.latest
        if ready is None or (self.loaded_version is not None and ready.version <= self.loaded_version):
            return
        assert self.payloads is not None
        t0 = time.perf_counter()
        data = await self.payloads.get_bytes(ready.location)  # size and SHA-256 checked
        tensors, _ = weights_from_bytes(data, expected_checksum=ready.weights_checksum)
        load_into(self.model, tensors)
        self.loaded_version = ready.version
        self.stats["weight_loads"] += 1
        load_s = time.perf_counter() - t0
        await self.bus.publish(
            ev.new_event(
                ev.WeightsLoaded(version=ready.version, worker_id=self.worker_id, load_s=load_s),
                run_id=self.run_id,
                event_id=ev.derived_id(self.run_id, f"loaded/{self.worker_id}/{ready.version}"),
            )
        )
        self.log.info("weights_loaded", version=ready.version, load_s=round(load_s, 3))

    async def wait_for_version(self, version: int, deliveries: list[Delivery], stop: asyncio.Event) -> bool:
        """Block until weights >= ``version`` are loaded, keeping the tasks' leases alive."""
        async with keep_alive(deliveries, self.s.ack_wait_s / 3):
            while self.loaded_version is None or self.loaded_version < version:
                if stop.is_set():
                    return False
                await self.load_latest()
                if self.loaded_version is not None and self.loaded_version >= version:
                    break
                self.new_weights.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.new_weights.wait(), timeout=1.0)
        return True

    # ---------------------------------------------------------------- generation

    async def handle_batch(self, deliveries: list[Delivery], stop: asyncio.Event) -> None:
        tasks = [(d, d.event.body) for d in deliveries]
        need = max(t.min_policy_version for _, t in tasks)  # type: ignore[attr-defined]
        t_wait = time.perf_counter()
        if not await self.wait_for_version(need, deliveries, stop):
            for d in deliveries:
                await d.nak(delay=0.5)  # stopping: let another worker take them
            return
        await self.load_latest()  # between batches, take anything newer
        load_wait = time.perf_counter() - t_wait
        version = self.loaded_version or 0
        # One generate() call per temperature/max_tokens combination: groups batched together.
        by_cfg: dict[tuple[float, int], list[tuple[Delivery, ev.TaskSubmitted]]] = {}
        for d, t in tasks:
            assert isinstance(t, ev.TaskSubmitted)
            by_cfg.setdefault((t.temperature, t.max_tokens), []).append((d, t))
        assert self.payloads is not None
        pub = self.bus.publisher(max_inflight=256)
        self.busy = True
        for (temperature, max_tokens), items in by_cfg.items():
            prompts = [t.prompt_tokens for _, t in items for _ in range(t.group_size)]
            cfg = SamplingConfig(
                max_tokens=max(1, max_tokens),
                temperature=temperature,
                top_p=self.s.top_p,
                stop_token_ids=(self.tok.eos_id,),
            )
            t0 = time.perf_counter()
            async with keep_alive([d for d, _ in items], self.s.ack_wait_s / 3):
                gens = await asyncio.to_thread(generate, self.model, prompts, cfg, generator=self.generator)
            gen_s = time.perf_counter() - t0
            self.stats["generate_s"] += gen_s
            k = 0
            for d, t in items:
                queued = max(0.0, time.time() - d.event.time)
                # The group shares its prompt: stored once per task, referenced by every sample.
                prompt = await self.payloads.put_array(
                    f"prompt-{d.event.event_id}", np.asarray(gens[k].prompt_ids, dtype=np.int32)
                )
                for i in range(t.group_size):
                    g = gens[k]
                    k += 1
                    await pub.publish(
                        await self._completion_event(
                            d.event, t, i, g, prompt, version, queued, gen_s, load_wait
                        )
                    )
                    self.stats["samples"] += 1
                    self.stats["tokens"] += len(g.completion_ids)
                self.stats["tasks"] += 1
        await pub.flush()
        self.busy = False
        for d in deliveries:
            await d.ack()

    async def _completion_event(
        self,
        task_event: ev.Event,
        t: ev.TaskSubmitted,
        i: int,
        g: Any,
        prompt: ev.ArrayRef,
        version: int,
        queued: float,
        gen_s: float,
        load_wait: float,
    ) -> ev.Event:
        assert self.payloads is not None
        gen_id = f"{t.task_id}-{i}"
        eid = ev.derived_id(self.run_id, f"gen/{task_event.event_id}/{i}")
        trace = None
        if g.routing is not None:
            trace = await self.payloads.put_array(f"trace-{eid}", g.routing.numpy())
        body = ev.GenerationCompleted(
            generation_id=gen_id,
            task_id=t.task_id,
            env=t.env,
            group_id=t.task_id,
            sample_index=i,
            group_size=t.group_size,
            prompt_tokens=prompt,
            completion_tokens=await self.payloads.put_array(
                f"tokens-{eid}", np.asarray(g.completion_ids, dtype=np.int32)
            ),
            logprobs=await self.payloads.put_array(f"logprobs-{eid}", g.logprobs.numpy().astype(np.float32)),
            routing_trace=trace,
            policy_version_start=version,
            policy_version_end=version,
            worker_id=self.worker_id,
            finish_reason=g.finish_reason,
            timings=ev.GenerationTimings(queued_s=queued, generate_s=gen_s, load_wait_s=load_wait),
            episode_id=t.episode_id,
            turn=t.turn,
        )
        return ev.new_event(
            body, run_id=self.run_id, tenant=task_event.tenant, causation_id=task_event.event_id, event_id=eid
        )

    # ---------------------------------------------------------------- loop

    async def heartbeat(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            body = ev.WorkerHeartbeat(
                worker_id=self.worker_id,
                kind="inference",
                status="busy" if self.busy else "ready",
                loaded_version=self.loaded_version,
                stats={k: float(v) for k, v in self.stats.items()},
            )
            with contextlib.suppress(Exception):
                await self.bus.publish(ev.new_event(body, run_id=self.run_id), retries=0)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.s.heartbeat_s)

    async def run(self, stop: asyncio.Event) -> None:
        torch.set_num_threads(self.s.threads)
        objstore = await ObjectStorePayloads.for_run(self.bus.js, self.run_id)
        self.payloads = Payloads(objstore, *weight_stores(self.part.weights_dir, objstore.bucket))
        consumer = await self.bus.consumer(
            ConsumerSpec(
                run_id=self.run_id,
                durable="inference",
                filter_subjects=[subjects.task_subject(self.run_id)],
                ack_wait=self.s.ack_wait_s,
                max_deliver=5,
                max_ack_pending=4096,
            )
        )
        structlog.contextvars.bind_contextvars(run_id=self.run_id, worker_id=self.worker_id)
        watcher = asyncio.create_task(self.watch_weights(stop))
        beat = asyncio.create_task(self.heartbeat(stop))
        self.log.info(
            "inference_worker_started", precision=self.s.precision, pid=os.getpid(), host=socket.gethostname()
        )
        try:
            while not stop.is_set():
                batch = await consumer.fetch(self.s.max_batch_tasks, timeout=0.5)
                good: list[Delivery] = []
                for d in batch:
                    if not isinstance(d.event.body, ev.TaskSubmitted) or d.event.body.group_size < 1:
                        await consumer.dead_letter(d, "invalid", f"not a generatable task: {d.event.type}")
                    else:
                        good.append(d)
                if good:
                    try:
                        await self.handle_batch(good, stop)
                    except Exception as exc:  # a failed batch is retried (or parked after max_deliver)
                        self.busy = False
                        self.log.exception("batch_failed", tasks=len(good))
                        for d in good:
                            if not d.settled:
                                await consumer.settle_failure(d, exc)
                elif self.new_weights.is_set():
                    self.new_weights.clear()
                    await self.load_latest()
        finally:
            watcher.cancel()
            stop.set()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher
            with contextlib.suppress(Exception):
                await beat
            self.log.info("inference_worker_stopped", **self.stats)
