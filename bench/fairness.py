"""Fairness benchmark: a tenant that floods the run against one that does not, equal weights.

One private nats-server; each phase is a run of its own (its own stream) with one inference
worker (consumers/inference/worker.py) and two tenants, A and B, whose tasks the worker takes
from one durable consumer each by deficit round robin (bus/fair.py). The engine is a paced one
(below): a batch takes ``--batch-ms`` plus ``--sample-ms`` per sample, nearly flat in its size as
on a GPU, so the figures are the scheduler's and the bus's, in about half a minute on 2 cores.

* share: A submits ``10 x --tasks`` tasks at once, then B ``--tasks``, all queued before the worker
  starts; B's share of the samples generated up to B's last completion (while both have work).
  Target 0.5 (its weight's share) within 10%. The baseline, in the same run of the bench: the
  same submissions to one shared FIFO consumer (a run without tenants), where B waits for A's
  whole flood.
* latency: B alone submits ``--tasks`` tasks one every ``--pace-ms``; its median task latency
  (TaskSubmitted's time to its CompletionsGenerated) is the baseline. Then A floods
  ``10 x --tasks`` tasks and B submits the same paced tasks; B's median latency over its tasks
  submitted while A still had work queued, against the baseline. Target <= 2x: a task of B waits
  for the batch in flight and joins the next.

    python bench/fairness.py [--tasks 40] [--group 4] [--batch-tasks 8] [--batch-ms 200]
                             [--sample-ms 0.5] [--pace-ms 80] [--in-flight 2]

The engine takes ``--in-flight`` batches at once (2: continuous batching, as vLLM; jetrl's vLLM
engine takes 4). With 1, as the embedded engine, a task of B waits for the batch in flight and then
generates in a full batch: about 1.5 full batches against one small batch alone, plus the bus's
cost of a full batch's completions.
"""

from __future__ import annotations

import os

os.environ.setdefault("JETRL_LOG_LEVEL", "warning")

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from jetrl.bus import events as ev
from jetrl.bus import subjects
from jetrl.bus.client import Bus
from jetrl.bus.log import configure
from jetrl.bus.payloads import Payloads
from jetrl.bus.server import EmbeddedServer
from jetrl.bus.settings import EnvRoute, TenantSettings
from jetrl.bus.streams import GiB, StreamLimits
from jetrl.consumers.inference.engine import GroupRequest, Limits, Sample
from jetrl.consumers.inference.settings import InferencePart, InferenceSettings
from jetrl.consumers.inference.worker import InferenceWorker

LIMITS = StreamLimits(max_bytes=GiB, payload_max_bytes=GiB)
STALL_S = 60.0  # a phase that sees no completion for this long ends, reported as not measured
PACE = {"batch_s": 0.06, "sample_s": 0.0005, "in_flight": 2.0}  # set from the command line


class PacedEngine:
    """Answers two fixed tokens per sample after ``batch_s + sample_s * samples`` of sleep: a
    stand-in for a GPU batch, whose time grows little with its size."""

    # Vocabulary and context the worker's edge checks use (no model, so no torch).
    limits: Limits | None = Limits(vocab_size=64, max_context=256)

    def __init__(self, part: InferencePart, worker_id: str) -> None:
        self._version: int | None = None
        # Batches it takes at once: it batches continuously, as vLLM does (jetrl's vLLM engine
        # takes 4); 1 is the embedded engine's way, where a task waits for the batch in flight.
        self.batches_in_flight = int(PACE["in_flight"])

    @property
    def loaded_version(self) -> int | None:
        return self._version

    async def generate(self, groups: Sequence[GroupRequest]) -> list[list[Sample]]:
        n = sum(g.n for g in groups)
        await asyncio.sleep(PACE["batch_s"] + PACE["sample_s"] * n)
        ids = np.asarray([5, 2], np.int32)
        return [[Sample(ids, np.zeros(2, np.float32), "stop") for _ in range(g.n)] for g in groups]

    async def load_weights(self, ready: ev.WeightsReady, payloads: Payloads) -> None:
        self._version = ready.version

    async def close(self) -> None:
        pass


@dataclass
class Phase:
    submitted: dict[str, tuple[str, float]] = field(default_factory=dict)  # task id: tenant, time
    done: dict[str, float] = field(default_factory=dict)  # task id: its last completion's time
    samples: list[tuple[float, str, int]] = field(default_factory=list)  # time, tenant, samples
    stalled: bool = False


def part_of(args: argparse.Namespace, fair: bool) -> InferencePart:
    tenants = [TenantSettings(name="a"), TenantSettings(name="b")]
    return InferencePart(
        inference=InferenceSettings(engine="__main__:PacedEngine", max_batch_tasks=args.batch_tasks),
        tenants=tenants if fair else [],  # none: one shared FIFO consumer, as before tenants
        envs=[EnvRoute(tenant=t.name, env="bench", group_size=args.group) for t in tenants] if fair else [],
    )


async def run_phase(
    bus: Bus,
    run_id: str,
    args: argparse.Namespace,
    *,
    fair: bool,
    flood: int,
    b_tasks: int,
    b_pace_s: float,
) -> Phase:
    """A floods ``flood`` tasks at once, then B submits ``b_tasks``, ``b_pace_s`` apart (0: at
    once); one worker serves them. Returns when every task is done, or after a stall."""
    await bus.ensure_run(run_id, LIMITS)
    payloads = await Payloads.for_run(bus.js, run_id)
    ref = await payloads.default.put("weights-v0", b"weights")
    await bus.publish(
        ev.new_event(ev.WeightsReady(version=0, location=ref, weights_checksum="0" * 64), run_id=run_id)
    )
    ph = Phase()

    async def submit(tenant: str, i: int) -> None:
        body = ev.TaskSubmitted(
            task_id=f"bench.{tenant}.{i}",
            env="bench",
            group_size=args.group,
            prompt_tokens=[1, 9, 10, 8],
            max_tokens=2,
        )
        e = ev.new_event(body, run_id=run_id, tenant=tenant)
        ph.submitted[body.task_id] = (tenant, e.time)
        await bus.publish(e)

    async def producers() -> None:
        pub = bus.publisher()
        for i in range(flood):
            body = ev.TaskSubmitted(
                task_id=f"bench.a.{i}",
                env="bench",
                group_size=args.group,
                prompt_tokens=[1, 9, 10, 8],
                max_tokens=2,
            )
            e = ev.new_event(body, run_id=run_id, tenant="a")
            ph.submitted[body.task_id] = ("a", e.time)
            await pub.publish(e)
        await pub.flush()
        for i in range(b_tasks):
            await submit("b", i)
            if b_pace_s:
                await asyncio.sleep(b_pace_s)

    if b_pace_s:
        feeding = asyncio.create_task(producers())
    else:  # both queued before the worker starts: both have work from its first batch on
        await producers()
        feeding = asyncio.create_task(asyncio.sleep(0))
    worker = InferenceWorker(bus, run_id, "w0", part_of(args, fair))
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    got: dict[str, int] = {}
    try:
        async for item in bus.tail(
            run_id, filter_subject=subjects.generation_subject(run_id), idle_timeout=STALL_S
        ):
            g = item.event.body if item.event else None
            if not isinstance(g, ev.CompletionsGenerated) or item.event is None:
                continue
            ph.samples.append((item.event.time, item.event.tenant, len(g.samples)))
            got[g.task_id] = got.get(g.task_id, 0) + len(g.samples)
            if got[g.task_id] >= args.group:
                ph.done[g.task_id] = item.event.time
            if len(ph.done) == flood + b_tasks:
                break
        else:
            ph.stalled = True
    finally:
        await feeding
        stop.set()
        await asyncio.wait_for(running, 120)
    if len(ph.done) < flood + b_tasks:
        ph.stalled = True
    return ph


def b_share(ph: Phase) -> float | None:
    """B's share of the samples generated up to B's last task done (all were queued before the
    worker started: both had work all along)."""
    b_sub = [t for tenant, t in ph.submitted.values() if tenant == "b"]
    b_done = [t for tid, t in ph.done.items() if ph.submitted[tid][0] == "b"]
    if not b_sub or len(b_done) < len(b_sub):
        return None
    end = max(b_done)
    window = [(tenant, n) for t, tenant, n in ph.samples if t <= end]
    total = sum(n for _, n in window)
    return sum(n for tenant, n in window if tenant == "b") / total if total else None


def b_latencies(ph: Phase, *, while_a_queued: bool) -> list[float]:
    a_last = max((t for tid, t in ph.done.items() if ph.submitted[tid][0] == "a"), default=0.0)
    out = []
    for tid, (tenant, t) in ph.submitted.items():
        if tenant == "b" and tid in ph.done and (not while_a_queued or t < a_last):
            out.append(ph.done[tid] - t)
    return out


def share_line(share: float | None) -> str:
    if share is None:
        return "fairness share B: not measured (B's tasks did not all finish) (target within 10% of 0.50)"
    return f"fairness share B {share:.2f} (target within 10% of 0.50)"


def latency_line(alone: list[float], contended: list[float]) -> str:
    head = "fairness latency B flooded/alone"
    if len(alone) < 3 or len(contended) < 3:
        return (
            f"{head}: too few tasks to measure ({len(alone)} alone, {len(contended)} while A had work; "
            "3 each needed) (target <= 2x)"
        )
    a, c = statistics.median(alone), statistics.median(contended)
    if a <= 0:
        return f"{head}: not measured (median latency alone {a:.3f} s) (target <= 2x)"
    return f"{head} {c / a:.2f}x (target <= 2x)"


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=40, help="B's tasks per phase; A submits 10x as many")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--batch-tasks", type=int, default=8)
    ap.add_argument("--batch-ms", type=float, default=200.0)
    ap.add_argument("--sample-ms", type=float, default=0.5)
    ap.add_argument("--pace-ms", type=float, default=80.0)
    ap.add_argument("--in-flight", type=int, default=2, help="batches the engine takes at once")
    args = ap.parse_args()
    if (
        min(args.tasks, args.batch_tasks, args.in_flight) < 1
        or args.group < 2
        or min(args.batch_ms, args.sample_ms) < 0
    ):
        ap.error(
            "--tasks, --batch-tasks, --in-flight must be at least 1, --group at least 2, times not negative"
        )
    PACE.update(batch_s=args.batch_ms / 1e3, sample_s=args.sample_ms / 1e3, in_flight=args.in_flight)
    configure(level="warning")
    n, pace = args.tasks, args.pace_ms / 1e3
    print(
        f"fairness: A floods {10 * n} tasks, B submits {n}; groups of {args.group}, batches of "
        f"{args.batch_tasks} tasks, {args.batch_ms:.0f} ms + {args.sample_ms} ms/sample per batch, "
        f"{args.in_flight} batch(es) in flight"
    )
    with tempfile.TemporaryDirectory() as tmp, EmbeddedServer(tmp) as srv:
        bus = await Bus.connect(srv.url, name="bench")
        try:
            t0 = time.perf_counter()
            alone = await run_phase(bus, "fair-alone", args, fair=True, flood=0, b_tasks=n, b_pace_s=pace)
            flooded = await run_phase(
                bus, "fair-paced", args, fair=True, flood=10 * n, b_tasks=n, b_pace_s=pace
            )
            fair = await run_phase(bus, "fair-share", args, fair=True, flood=10 * n, b_tasks=n, b_pace_s=0)
            fifo = await run_phase(bus, "fifo-share", args, fair=False, flood=10 * n, b_tasks=n, b_pace_s=0)
            took = time.perf_counter() - t0
        finally:
            await bus.close()
    lat_alone = b_latencies(alone, while_a_queued=False)
    lat_flooded = b_latencies(flooded, while_a_queued=True)
    fair_share, fifo_share = b_share(fair), b_share(fifo)

    def ms(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 1e3:7.0f} ms" if xs else "      n/a"

    print(f"\n  phases took {took:.1f} s")
    for name, ph in (("alone", alone), ("flooded", flooded), ("fair", fair), ("fifo", fifo)):
        if ph.stalled:
            print(f"  {name}: stalled ({len(ph.done)} of {len(ph.submitted)} tasks done)")
    print(
        f"  B share while both have work:  fair {fair_share if fair_share is not None else float('nan'):.3f}"
        f"   FIFO baseline {fifo_share if fifo_share is not None else float('nan'):.3f}"
    )
    print(f"  B median latency alone:        {ms(lat_alone)}  ({len(lat_alone)} tasks)")
    print(
        f"  B median latency, A flooding:  {ms(lat_flooded)}  ({len(lat_flooded)} submitted while A had work)"
    )
    fifo_lat = b_latencies(fifo, while_a_queued=False)
    fair_lat = b_latencies(fair, while_a_queued=False)
    print(f"  B median latency, burst:       fair {ms(fair_lat)}   FIFO {ms(fifo_lat)}")
    print()
    print(share_line(fair_share))
    print(latency_line(lat_alone, lat_flooded))


if __name__ == "__main__":
    asyncio.run(main())
