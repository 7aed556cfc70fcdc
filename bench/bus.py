"""Bus throughput: jetrl's publish and consume paths against raw nats-py doing the same work.

One private nats-server, one run: each round publishes the same events through
  * raw nats-py: msgspec-encode the event, ``js.publish_async`` with the Nats-Msg-Id header,
    wait for every ack;
  * jetrl: ``Publisher.publish(event)`` (subject from the catalog, type headers, bounded
    window, retry bookkeeping), ``flush()``;
and consumes them back through
  * raw nats-py: ``pull_subscribe`` + ``fetch`` + msgspec decode + ack;
  * jetrl: ``PullConsumer.fetch`` (strict envelope/body decode, tenant/run checks) + ack.
Workloads: small events (heartbeats, ~150 B) and rollout-sized events (a RolloutsScored of one
episode with an 8k-token completion, its logprobs and a 512-token prompt inline, ~66 KB). Rounds alternate
which side goes first; medians are reported, with jetrl/raw ratios.

    python bench/bus.py [--small 20000] [--large 2000] [--rounds 3] [--load N]

``--load N`` runs it all beside N busy CPU processes (bench/load.py).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass

import msgspec
import numpy as np
from load import cpu_load
from nats.js import api

from jetrl.bus import events as ev
from jetrl.bus import subjects
from jetrl.bus.client import Bus
from jetrl.bus.consumer import ConsumerSpec
from jetrl.bus.log import configure
from jetrl.bus.payloads import inline_array
from jetrl.bus.server import EmbeddedServer
from jetrl.bus.streams import GiB, StreamLimits, stream_name

WINDOW = 256
# A consume that gets no event for this long (events that were all published and acked) stops:
# the round is reported as not measured instead of waiting forever.
STALL_S = 60.0
LIMITS = StreamLimits(max_bytes=8 * GiB, payload_max_bytes=GiB)


def small_events(run_id: str, n: int) -> list[ev.Event]:
    return [
        ev.new_event(
            ev.WorkerHeartbeat(
                worker_id=f"inf-{i % 8}", kind="inference", loaded_version=i // 100, inflight=i % 16
            ),
            run_id=run_id,
        )
        for i in range(n)
    ]


def rollout_events(run_id: str, n: int) -> list[ev.Event]:
    rng = np.random.default_rng(0)
    prompt = inline_array(rng.integers(0, 150_000, 512, dtype=np.int32))
    out = []
    for i in range(n):
        # One rollout an event: an agentic episode's, as a multi-turn environment scores it.
        body = ev.RolloutsScored(
            generation_event_id=ev.new_event_id(),
            task_id=f"swe.acme.{i // 8}",
            env="swe",
            group_id=f"swe.acme.{i // 8}",
            group_size=8,
            prompt_tokens=prompt,
            rollouts=[
                ev.ScoredRollout(
                    rollout_id=f"swe.acme.{i // 8}-{i % 8}",
                    sample_index=i % 8,
                    reward=float(i % 2),
                    reward_parts={"tests": float(i % 2)},
                    completion_tokens=inline_array(rng.integers(0, 150_000, 8192, dtype=np.int32)),
                    logprobs=inline_array(-rng.random(8192, dtype=np.float32)),
                    policy_version_start=i // 64,
                    policy_version_end=i // 64,
                )
            ],
        )
        out.append(ev.new_event(body, run_id=run_id, tenant="acme"))
    return out


@dataclass
class Rate:
    events_s: float
    mb_s: float


class Stalled(Exception):
    """A consume round got no event for STALL_S seconds."""


def rate(n: int, nbytes: int, seconds: float) -> Rate:
    # perf_counter differences are positive in practice; a zero must not crash a report.
    seconds = max(seconds, 1e-9)
    return Rate(n / seconds, nbytes / seconds / 1e6)


def ratio_line(label: str, name: str, loaded: str, out: dict[str, Rate] | str, path: str) -> str:
    """A headline jetrl/raw line, or why it was not measured."""
    head = f"{label} ratio {name}{loaded}"
    if isinstance(out, str):
        return f"{head}: not measured ({out}) (target >= 0.8)"
    raw, jet = out[f"{path}_raw"], out[f"{path}_jetrl"]
    if raw.events_s <= 0:
        return f"{head}: not measured (raw nats-py moved no events) (target >= 0.8)"
    return f"{head} {jet.events_s / raw.events_s:.2f} (target >= 0.8)"


async def reset_stream(bus: Bus, run_id: str) -> None:
    await bus.js.purge_stream(stream_name(run_id))


async def publish_raw(bus: Bus, events: list[ev.Event]) -> float:
    js = bus.nc.jetstream(publish_async_max_pending=WINDOW)
    t0 = time.perf_counter()
    for e in events:
        await js.publish_async(
            subjects.subject_for(e), msgspec.msgpack.encode(e), headers={"Nats-Msg-Id": e.event_id}
        )
    await js.publish_async_completed()
    return time.perf_counter() - t0


async def publish_jetrl(bus: Bus, events: list[ev.Event]) -> float:
    pub = bus.publisher(max_inflight=WINDOW)
    t0 = time.perf_counter()
    for e in events:
        await pub.publish(e)
    await pub.flush()
    return time.perf_counter() - t0


async def consume_raw(bus: Bus, run_id: str, n: int, durable: str) -> float:
    cfg = api.ConsumerConfig(ack_policy=api.AckPolicy.EXPLICIT, max_ack_pending=4096)
    sub = await bus.js.pull_subscribe(
        subjects.all_subjects(run_id), durable=durable, stream=stream_name(run_id), config=cfg
    )
    got = 0
    t0 = last = time.perf_counter()
    while got < n:
        try:
            msgs = await sub.fetch(256, timeout=5)
        except TimeoutError:  # nats-py's (and asyncio's): nothing within 5 s, a loaded machine
            msgs = []
        for msg in msgs:
            msgspec.msgpack.decode(msg.data)
            await msg.ack()
            got += 1
        last = _check_stall(bool(msgs), last, got, n)
    elapsed = time.perf_counter() - t0
    await sub.unsubscribe()
    return elapsed


def _check_stall(progressed: bool, last: float, got: int, n: int) -> float:
    """When events last came; raises Stalled after STALL_S seconds without any."""
    now = time.perf_counter()
    if progressed:
        return now
    if now - last > STALL_S:
        raise Stalled(f"consume stalled: {got} of {n} events, none for {STALL_S:.0f} s")
    return last


async def consume_jetrl(bus: Bus, run_id: str, n: int, durable: str) -> float:
    c = await bus.consumer(
        ConsumerSpec(
            run_id=run_id,
            durable=durable,
            filter_subjects=[subjects.all_subjects(run_id)],
            max_ack_pending=4096,
        )
    )
    got = 0
    t0 = last = time.perf_counter()
    while got < n:
        deliveries = await c.fetch(256, timeout=5)  # empty on a timeout
        for d in deliveries:
            await d.ack()
            got += 1
        last = _check_stall(bool(deliveries), last, got, n)
    elapsed = time.perf_counter() - t0
    await c.unsubscribe()
    return elapsed


async def bench_workload(
    bus: Bus, run_id: str, name: str, events: list[ev.Event], rounds: int
) -> dict[str, Rate] | str:
    """The workload's median rates, or why they were not measured."""
    n = len(events)
    if n == 0:
        print(f"\n{name}: skipped (0 events)")
        return "0 events"
    try:
        return await _bench_workload(bus, run_id, name, events, rounds)
    except Stalled as exc:
        print(f"\n{name}: {exc}")
        return str(exc)


async def _bench_workload(
    bus: Bus, run_id: str, name: str, events: list[ev.Event], rounds: int
) -> dict[str, Rate]:
    n = len(events)
    nbytes = sum(len(ev.encode_event(e)) for e in events)
    times: dict[str, list[float]] = {"pub_raw": [], "pub_jetrl": [], "con_raw": [], "con_jetrl": []}
    for r in range(rounds):
        order = ["raw", "jetrl"] if r % 2 == 0 else ["jetrl", "raw"]
        for side in order:
            await reset_stream(bus, run_id)
            # Fresh event ids per round so the duplicate window does not turn publishes into no-ops.
            batch = [msgspec.structs.replace(e, event_id=ev.new_event_id()) for e in events]
            pub_t = await (publish_raw if side == "raw" else publish_jetrl)(bus, batch)
            times[f"pub_{side}"].append(pub_t)
            durable = f"bench_{name}_{side}_{r}"
            con_t = await (consume_raw if side == "raw" else consume_jetrl)(bus, run_id, n, durable)
            times[f"con_{side}"].append(con_t)
            await bus.js.delete_consumer(stream_name(run_id), durable)
    out = {k: rate(n, nbytes, statistics.median(v)) for k, v in times.items()}
    print(f"\n{name}: {n} events, {nbytes / n / 1024:.1f} KiB each, median of {rounds} rounds")
    print(f"  {'path':<10}{'raw ev/s':>12}{'jetrl ev/s':>12}{'raw MB/s':>10}{'jetrl MB/s':>12}{'ratio':>8}")
    for path in ("pub", "con"):
        raw, jet = out[f"{path}_raw"], out[f"{path}_jetrl"]
        label = "publish" if path == "pub" else "consume"
        print(
            f"  {label:<10}{raw.events_s:>12,.0f}{jet.events_s:>12,.0f}{raw.mb_s:>10.1f}{jet.mb_s:>12.1f}"
            f"{jet.events_s / raw.events_s if raw.events_s > 0 else float('nan'):>8.2f}"
        )
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", type=int, default=20_000)
    ap.add_argument("--large", type=int, default=2_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--load", type=int, default=0, help="busy CPU processes running beside the bench")
    args = ap.parse_args()
    if args.rounds < 1 or args.small < 0 or args.large < 0:
        ap.error("--rounds must be at least 1, --small and --large at least 0")
    configure(level="warning")
    loaded = f" (load {args.load})" if args.load else ""
    with tempfile.TemporaryDirectory() as tmp, EmbeddedServer(tmp) as srv, cpu_load(args.load):
        bus = await Bus.connect(srv.url, name="bench", max_inflight=WINDOW)
        run_id = "benchbus"
        await bus.ensure_run(run_id, LIMITS)
        results = {
            "small": await bench_workload(
                bus, run_id, "small", small_events(run_id, args.small), args.rounds
            ),
            "rollout": await bench_workload(
                bus, run_id, "rollout", rollout_events(run_id, args.large), args.rounds
            ),
        }
        await bus.close()
    print()
    for name, out in results.items():
        for path, label in (("pub", "publish"), ("con", "consume")):
            print(ratio_line(label, name, loaded, out, path))


if __name__ == "__main__":
    asyncio.run(main())
