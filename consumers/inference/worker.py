"""The inference consumer: tasks in, completions out, weights loaded between batches.

Tasks come through durable consumers on the run's task subjects that every worker shares, so
each task goes to one worker. With one tenant (and no quota) that is one consumer, ``inference``,
over every tenant's tasks. With several tenants, or any quota, each tenant of ``[[tenants]]`` has
its own, ``inference-<tenant>`` (plus ``inference-default`` for the gateway's tasks of tenant
``default`` when that is not a tenant of the run), and a worker builds each batch from them by
weighted deficit round robin (bus/fair.py), so a tenant that floods cannot starve the others:
under contention each gets its weighted share of the samples generated. The cost of a task is its
group size, the samples it asks for: what the trainer consumes and the fairness is measured in,
and known before generating (token counts are known only after). Tasks are checked at the edge
(consumers/inference/admission.py: unknown envs, impossible values, quotas) and refused ones
dead-lettered with their reason on the tenant's dead-letter subject. A tenant that joins a live
run is not picked up until the workers restart.

A worker has its generation engine (consumers/inference/engine.py) generate the task's
whole group with its current policy, publishes one CompletionsGenerated with every sample of
the task (arrays through the claim-check, put side by side; routing traces for MoE; the prompt
referred to in the task's own event), and acks the task only once that event is durable. A
watcher follows the weights subject; new weights are loaded between batches, checksum-verified,
and announced with WeightsLoaded. The event id derives from the task's event id, so a task
redelivered after a crash yields the same event, which the stream deduplicates.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from jetrl.bus import events as ev
from jetrl.bus import ids, subjects
from jetrl.bus.client import Bus
from jetrl.bus.consumer import ConsumerSpec, Delivery, keep_alive
from jetrl.bus.fair import FairPuller, FairQueue, num_pending
from jetrl.bus.identity import unless_set
from jetrl.bus.log import get_logger
from jetrl.bus.payloads import PayloadError, Payloads, inline_array, token_list_ref
from jetrl.consumers.inference.admission import DEFAULT_TENANT, Admission, Refusal, limits_for
from jetrl.consumers.inference.engine import GenerationEngine, GroupRequest, Sample, make_generation_engine
from jetrl.consumers.inference.settings import InferencePart
from jetrl.policy.tokenizer import tokenizer_for

TaskQueue = FairQueue[ev.TaskSubmitted]
UNREADABLE_RETRY_S = 5.0  # an announcement whose bytes failed is tried again after this


@dataclass(frozen=True)
class TaskSource:
    """One durable consumer the workers share: its name, task subjects and scheduling weight."""

    durable: str
    filter_subject: str
    weight: float = 1.0


def task_sources(run_id: str, part: InferencePart) -> list[TaskSource]:
    """One consumer over every tenant's tasks for a run of one tenant and no quota (as before
    tenants: a run's existing durable keeps its position), else one per tenant."""
    tenants = part.tenants
    if len(tenants) < 2 and not any(t.max_tasks_in_flight for t in tenants):
        return [TaskSource("inference", subjects.task_subject(run_id))]
    out = [
        TaskSource(f"inference-{t.name}", subjects.task_subject(run_id, t.name), t.weight) for t in tenants
    ]
    if DEFAULT_TENANT not in {t.name for t in tenants}:  # the gateway's tasks of tenant "default"
        out.append(TaskSource(f"inference-{DEFAULT_TENANT}", subjects.task_subject(run_id, DEFAULT_TENANT)))
    return out


class InferenceWorker:
    # Delays of the hand-backs of a task asking for a version far ahead, before it is refused.
    future_delays: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)

    def __init__(self, bus: Bus, run_id: str, worker_id: str, part: InferencePart) -> None:
        self.bus = bus
        self.run_id = run_id
        self.worker_id = worker_id
        self.part = part
        self.s = part.inference
        self.stop_ids = tokenizer_for(part.model).stop_ids
        self.engine: GenerationEngine = make_generation_engine(part, worker_id)
        self.latest: ev.WeightsReady | None = None
        self.unreadable: dict[str, float] = {}  # announced weights that failed: name -> when
        self.new_weights = asyncio.Event()
        self.payloads: Payloads | None = None
        # Engines that batch continuously (vLLM) take several batches at once; weights are only
        # loaded when none is in flight, so a batch generates under one version.
        self.batches_in_flight = max(1, self.engine.batches_in_flight)
        self.generating = 0
        self.quiet = asyncio.Event()
        self.quiet.set()
        self.gate = asyncio.Lock()  # held by a load, and briefly by a batch that starts
        self.stats = {
            "tasks": 0,
            "samples": 0,
            "tokens": 0,
            "generate_s": 0.0,
            "weight_loads": 0,
            "weights_unreadable": 0,  # announcements whose bytes could not be read (writer gone)
            "affinity_hits": 0,  # later turns this worker served again
            "affinity_deferred": 0,  # handed back for the worker named
            "affinity_misses": 0,  # taken after waiting: the worker named did not
            "refused": 0,  # dead-lettered at the edge (admission.py)
        }
        self.admission = Admission(part, limits_for(part, self.engine))
        self.puller: FairPuller[ev.TaskSubmitted] | None = None
        self.held: Counter[str] = Counter()  # per tenant: tasks buffered or generating here
        self.refused: Counter[tuple[str, str]] = Counter()  # (tenant, reason)
        self.log = get_logger(__name__, run_id=run_id, worker_id=worker_id)

    @property
    def loaded_version(self) -> int | None:
        return self.engine.loaded_version

    @property
    def busy(self) -> bool:
        return self.generating > 0

    # ---------------------------------------------------------------- weights

    async def watch_weights(self, stop: asyncio.Event) -> None:
        async for item in self.bus.tail(self.run_id, filter_subject=subjects.weights_subject(self.run_id)):
            if stop.is_set():
                return
            body = item.event.body if item.event else None
            # The newest version; for the same version, the newest announcement (a restarted
            # trainer announces weights held in its memory anew: the old ones died with it).
            if isinstance(body, ev.WeightsReady) and (
                self.latest is None or body.version >= self.latest.version
            ):
                self.latest = body
                self.new_weights.set()

    async def load_latest(self) -> None:
        if self._is_current():
            return
        async with self.gate:
            await self.quiet.wait()  # batches in flight finish on the version they started on
            if not self._is_current():
                await self._load(self.latest)

    def _is_current(self) -> bool:
        ready = self.latest
        if ready is None or (self.loaded_version is not None and ready.version <= self.loaded_version):
            return True
        # Weights that could not be read are tried again only after a while: a newer
        # announcement (a restarted trainer's) replaces them at once.
        failed = self.unreadable.get(ready.location.name)
        return failed is not None and time.monotonic() - failed < UNREADABLE_RETRY_S

    async def _load(self, ready: ev.WeightsReady | None) -> None:
        assert self.payloads is not None and ready is not None
        t0 = time.perf_counter()
        try:
            await self.engine.load_weights(ready, self.payloads)
        except PayloadError as exc:
            # Weights held by a writer that died with them (the restarted trainer announces
            # them anew), or bytes that fail their checksum: keep what is loaded and wait.
            self.unreadable[ready.location.name] = time.monotonic()
            self.stats["weights_unreadable"] += 1
            self.log.warning(
                "weights_unreadable", version=ready.version, location=ready.location.name, error=str(exc)
            )
            return
        self.stats["weight_loads"] += 1
        load_s = time.perf_counter() - t0
        await self.bus.publish(
            ev.new_event(
                ev.WeightsLoaded(version=ready.version, worker_id=self.worker_id, load_s=load_s),
                run_id=self.run_id,
                event_id=ids.loaded_event_id(self.run_id, self.worker_id, ready.version),
            )
        )
        self.log.info("weights_loaded", version=ready.version, load_s=round(load_s, 3))

    async def wait_for_version(
        self, version: int, deliveries: list[Delivery[ev.TaskSubmitted]], stop: asyncio.Event
    ) -> bool:
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

    def leave_to_its_worker(self, d: Delivery[ev.TaskSubmitted]) -> bool:
        """Prefix-aware routing: a later turn whose previous turn another worker served goes
        back to the queue for that worker, unless it has come round often enough already."""
        hint = d.body.worker_hint
        if not hint:
            return False
        if hint == self.worker_id:
            self.stats["affinity_hits"] += 1
            return False
        if d.num_delivered <= self.s.affinity_deliveries:
            self.stats["affinity_deferred"] += 1
            return True
        self.stats["affinity_misses"] += 1
        return False

    async def handle_batch(self, deliveries: list[Delivery[ev.TaskSubmitted]], stop: asyncio.Event) -> None:
        tasks = [(d, d.body) for d in deliveries]
        need = max(t.min_policy_version for _, t in tasks)
        t_wait = time.perf_counter()
        if not await self.wait_for_version(need, deliveries, stop):
            for d in deliveries:
                await d.nak(delay=0.5)  # stopping: let another worker take them
            return
        await self.load_latest()  # between batches, take anything newer
        load_wait = time.perf_counter() - t_wait
        async with self.gate:  # no load starts between here and the version read
            self.generating += 1
            self.quiet.clear()
        version = self.loaded_version or 0
        try:
            await self._generate_and_publish(tasks, version, load_wait)
        finally:
            self.generating -= 1
            if not self.generating:
                self.quiet.set()
        for d in deliveries:
            await d.ack()

    async def _generate_and_publish(
        self, tasks: list[tuple[Delivery[ev.TaskSubmitted], ev.TaskSubmitted]], version: int, load_wait: float
    ) -> None:
        assert self.payloads is not None
        requests = [
            GroupRequest(
                prompt_tokens=t.prompt_tokens,
                n=t.group_size,
                max_tokens=max(1, t.max_tokens),  # as docs/events.md says, for every engine
                temperature=t.temperature,
                top_p=self.s.top_p,
                stop_token_ids=self.stop_ids,
            )
            for _, t in tasks
        ]
        t0 = time.perf_counter()
        async with keep_alive([d for d, _ in tasks], self.s.ack_wait_s / 3):
            groups = await self.engine.generate(requests)
        gen_s = time.perf_counter() - t0
        self.stats["generate_s"] += gen_s
        pub = self.bus.publisher(max_inflight=256)
        events = await asyncio.gather(
            *(
                self._completions_event(d, t, samples, version, gen_s, load_wait)
                for (d, t), samples in zip(tasks, groups, strict=True)
            )
        )
        for event, samples in zip(events, groups, strict=True):
            await pub.publish(event)
            self.stats["tasks"] += 1
            self.stats["samples"] += len(samples)
            self.stats["tokens"] += sum(len(g.completion_tokens) for g in samples)
        await pub.flush()

    def inline_bytes(self, tenant: str) -> int | None:
        """How large an array of ``tenant``'s generations may ride inline: the tenant's own
        limit when its producer cannot read the payload store, else the store's default."""
        return self.part.tenant_inline_bytes if tenant in self.part.inline_tenants else None

    async def _completions_event(
        self,
        d: Delivery[ev.TaskSubmitted],
        t: ev.TaskSubmitted,
        samples: list[Sample],
        version: int,
        gen_s: float,
        load_wait: float,
    ) -> ev.Event:
        """One CompletionsGenerated for the task's samples. Its arrays that go to a payload
        store are put side by side; its prompt is referred to where it lies in the log (the
        task's own event)."""
        task_event = d.event
        eid = ids.generation_event_id(self.run_id, task_event.event_id)
        # A task generated again (its first worker died) samples other tokens under the same
        # event id; its objects get names of their own, so they never overwrite the bytes the
        # first copy of the event, the one the log keeps, refers to.
        name = f"{eid}-{d.num_delivered}"
        inline = self.inline_bytes(task_event.tenant)
        assert self.payloads is not None
        payloads = self.payloads

        traces = self.part.bus.traces_store
        # Small arrays ride inline at once; those for a store are put side by side, as tasks
        # only when there are any (a step of the demo has 768 arrays, every one inline).
        refs: dict[tuple[int, str], ev.ArrayRef] = {}
        puts: dict[tuple[int, str], Coroutine[Any, Any, ev.ArrayRef]] = {}
        for i, g in enumerate(samples):
            # (name, array, inline threshold, store): None for the defaults.
            arrays: list[tuple[str, np.ndarray, int | None, str | None]] = [
                ("tokens", g.completion_tokens, inline, None),
                ("logprobs", g.logprobs, inline, None),
            ]
            if g.routing_trace is not None:
                arrays.append(("trace", g.routing_trace, None, traces))
            for key, arr, threshold, store in arrays:
                data = inline_array(arr)  # serialised once, whether it rides inline or not
                if payloads.fits_inline(data, inline_threshold=threshold):
                    refs[(i, key)] = data
                else:
                    puts[(i, key)] = payloads.put_inline(f"{key}-{name}-{i}", data, store=store)
        if puts:
            refs.update(zip(puts, await asyncio.gather(*puts.values()), strict=True))
        completions = [
            ev.Completion(
                generation_id=ids.generation_id(t.task_id, i),
                sample_index=i,
                completion_tokens=refs[(i, "tokens")],
                logprobs=refs[(i, "logprobs")],
                finish_reason=g.finish_reason,
                routing_trace=refs.get((i, "trace")),
            )
            for i, g in enumerate(samples)
        ]
        body = ev.CompletionsGenerated(
            task_id=t.task_id,
            env=t.env,
            prompt_tokens=token_list_ref(d.seq, "prompt_tokens", t.prompt_tokens),
            samples=list(completions),
            policy_version_start=version,
            policy_version_end=version,
            worker_id=self.worker_id,
            timings=ev.GenerationTimings(
                queued_s=max(0.0, time.time() - task_event.time), generate_s=gen_s, load_wait_s=load_wait
            ),
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

    async def admit(self, q: TaskQueue, d: Delivery[ev.TaskSubmitted]) -> bool:
        """Whether a task just fetched joins this worker's buffer; otherwise it is settled here:
        refused (dead-lettered through the consumer that delivered it), or handed back."""
        t, tenant = d.body, d.event.tenant
        refusal = self.admission.check(tenant, t) or self.admission.over_quota(
            tenant, num_pending(d), self.held[tenant]
        )
        if refusal is None and self.admission.too_far_ahead(t, self.latest.version if self.latest else None):
            if d.num_delivered < q.consumer.spec.max_deliver:
                delays = self.future_delays
                await d.nak(delay=delays[min(d.num_delivered - 1, len(delays) - 1)])
                return False
            latest = self.latest.version if self.latest else None
            refusal = Refusal(
                "future_version",
                f"task {t.task_id}: min_policy_version {t.min_policy_version}, newest {latest}",
            )
        if refusal is not None:
            await q.consumer.dead_letter(d, refusal.reason, refusal.detail)
            self.refused[(tenant, refusal.reason)] += 1
            self.stats["refused"] += 1
            self.log.warning("task_refused", tenant=tenant, task_id=t.task_id, reason=refusal.reason)
            return False
        if self.leave_to_its_worker(d):
            await d.nak(delay=self.s.affinity_delay_s)
            return False
        self.held[tenant] += 1
        return True

    async def run(self, stop: asyncio.Event) -> None:
        self.payloads = await Payloads.for_run(
            self.bus.js, self.run_id, weights_dir=self.part.weights_dir, bus=self.part.bus
        )
        weights: dict[str, float] = {}
        queues: list[TaskQueue] = []
        for src in task_sources(self.run_id, self.part):
            consumer = await self.bus.consumer(
                ConsumerSpec(
                    run_id=self.run_id,
                    durable=src.durable,
                    filter_subjects=[src.filter_subject],
                    ack_wait=self.s.ack_wait_s,
                    max_deliver=5,
                    max_ack_pending=4096,
                ),
                ev.TaskSubmitted,
            )
            queues.append(FairQueue(src.durable, consumer, src.weight))
            weights[src.durable] = src.weight
        puller = FairPuller(
            queues,
            cost=lambda d: float(d.body.group_size),
            admit=self.admit,
            # Twice a batch: a backlogged tenant still has work here when the next batch is built.
            depth=2 * self.s.max_batch_tasks,
            keep_alive_s=self.s.ack_wait_s / 3,
        )
        self.puller = puller
        structlog.contextvars.bind_contextvars(run_id=self.run_id, worker_id=self.worker_id)
        watcher = asyncio.create_task(self.watch_weights(stop))
        beat = asyncio.create_task(self.heartbeat(stop))
        self.log.info(
            "inference_worker_started",
            precision=self.s.precision,
            pid=os.getpid(),
            host=socket.gethostname(),
            consumers=weights,
        )

        in_flight: set[asyncio.Task[None]] = set()

        async def run_batch(got: list[tuple[TaskQueue, Delivery[ev.TaskSubmitted]]]) -> None:
            try:
                await self.handle_batch([d for _, d in got], stop)
            except Exception as exc:  # retried with backoff, or parked, by its own consumer
                self.log.exception("batch_failed", events=len(got))
                for q, d in got:
                    if not d.settled:
                        await q.consumer.settle_failure(d, exc)
            finally:
                for _, d in got:
                    self.held[d.event.tenant] -= 1

        await puller.start()
        try:
            while not stop.is_set():
                if self.new_weights.is_set():
                    self.new_weights.clear()
                    # A first load waits for the engine's server to start (vLLM's: tens of
                    # seconds): a stop meanwhile ends it, not the supervisor's kill 15 s later.
                    await unless_set(stop, self.load_latest())
                    if stop.is_set():
                        break
                if len(in_flight) >= self.batches_in_flight:
                    # Take tasks only for a free slot: ones taken wait unkept otherwise.
                    await asyncio.wait(in_flight, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                    continue
                got = await unless_set(stop, puller.next_batch(self.s.max_batch_tasks, timeout=0.5))
                if not got:
                    continue
                if self.batches_in_flight == 1:
                    await run_batch(got)
                    continue
                task = asyncio.create_task(run_batch(got))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
        finally:
            await puller.close()
            if in_flight:
                await asyncio.gather(*in_flight, return_exceptions=True)
            watcher.cancel()
            stop.set()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher
            with contextlib.suppress(Exception):
                await beat
            await self.engine.close()
            served = {q.name: q.served for q in queues}
            refused = {f"{t}/{r}": n for (t, r), n in self.refused.items()}
            self.log.info("inference_worker_stopped", served_samples=served, refused_by=refused, **self.stats)
