"""`jetrl bus-demo`: the event backbone end to end, with no model.

Starts a private nats-server (unless --nats-url), creates a run, and plays a realistic stream of
rollout traffic through it: tasks, generations whose routing traces go through the object store,
scored rollouts (a few of them malformed on purpose), steps, policy versions and weights. A
durable "trainer-like" consumer reads the rollouts back, verifies every payload hash, and the
poison messages land in the dead-letter subject. It prints what happened.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import numpy as np

from jetrl.bus import events as ev
from jetrl.bus import ids, subjects
from jetrl.bus.client import Bus
from jetrl.bus.consumer import ConsumerSpec, Delivery
from jetrl.bus.log import configure
from jetrl.bus.payloads import ObjectStorePayloads, Payloads
from jetrl.bus.server import EmbeddedServer


async def play(url: str, run_id: str, groups: int, group_size: int, seq_len: int) -> dict[str, object]:
    bus = await Bus.connect(url, name="bus-demo")
    await bus.ensure_run(run_id)
    payloads = Payloads(await ObjectStorePayloads.for_run(bus.js, run_id))
    rng = np.random.default_rng(0)
    pub = bus.publisher(max_inflight=128)
    t0 = time.perf_counter()
    await pub.publish(
        ev.new_event(ev.RunStarted(config={"demo": "bus"}, code_version="bus-demo"), run_id=run_id)
    )
    version = 0
    rollouts = 0
    for g in range(groups):
        env = ("reverse", "sort", "modsum")[g % 3]
        tenant = ("acme", "globex")[g % 2]
        task = ev.new_event(
            ev.TaskSubmitted(
                task_id=ids.task_id(env, tenant, g), env=env, group_size=group_size, prompt_tokens=[1, 2, 3]
            ),
            run_id=run_id,
            tenant=tenant,
        )
        await pub.publish(task)
        group = ids.task_id(env, tenant, g)
        scored = []
        for i in range(group_size):
            gid = ids.rollout_id(group, i)
            trace = rng.integers(0, 64, size=(seq_len, 4, 2), dtype=np.uint8)  # [tokens, moe_layers, top_k]
            comp = rng.integers(0, 32, size=seq_len - 3, dtype=np.int32)
            tokens, logprobs, trace_ref = await asyncio.gather(
                payloads.put_array(f"{gid}.tokens", comp),
                payloads.put_array(f"{gid}.logprobs", -rng.random(comp.size, dtype=np.float32)),
                payloads.put_array(f"{gid}.trace", trace),
            )
            scored.append(
                ev.ScoredRollout(
                    rollout_id=gid,
                    sample_index=i,
                    reward=float(rng.random()),
                    policy_version_start=version,
                    policy_version_end=version,
                    completion_tokens=tokens,
                    logprobs=logprobs,
                    routing_trace=trace_ref,
                )
            )
        body = ev.RolloutsScored(
            generation_event_id=uuid.uuid4().hex,
            task_id=group,
            env=env,
            group_id=group,
            group_size=group_size,
            prompt_tokens=await payloads.put_array(f"{group}.prompt", np.array([1, 2, 3], dtype=np.int32)),
            rollouts=scored,
        )
        await pub.publish(ev.new_event(body, run_id=run_id, tenant=tenant, causation_id=task.event_id))
        rollouts += group_size
        if g % 4 == 3:
            version += 1
            await pub.publish(
                ev.new_event(
                    ev.PolicyVersionPublished(version=version, step=version, weights_checksum="0" * 64),
                    run_id=run_id,
                )
            )
    # Poison: garbage bytes and a spoofed tenant, as a broken or malicious client would send.
    await bus.js.publish(subjects.rollout_subject(run_id, "acme", "reverse"), b"\x00garbage")
    spoof = ev.new_event(
        ev.RolloutWithheld(
            rollout_id="sort.globex.x-0",
            group_id="sort.globex.x",
            env="sort",
            reason="invalid",
            trainer_step=0,
            policy_version=0,
        ),
        run_id=run_id,
        tenant="globex",
    )
    await bus.js.publish(subjects.rollout_subject(run_id, "acme", "sort"), ev.encode_event(spoof))
    await pub.flush()
    publish_s = time.perf_counter() - t0

    consumer = await bus.consumer(
        ConsumerSpec(
            run_id=run_id, durable="demo-trainer", filter_subjects=[subjects.rollout_subject(run_id)]
        ),
        ev.RolloutsScored,
    )
    seen: Counter[str] = Counter()
    verified_bytes = 0

    async def handle(d: Delivery[ev.RolloutsScored]) -> None:
        nonlocal verified_bytes
        for r in d.body.rollouts:
            assert r.routing_trace is not None
            trace = await payloads.get_array(r.routing_trace)  # hash-checked
            verified_bytes += trace.nbytes
            seen[d.event.tenant] += 1

    stop = asyncio.Event()
    t1 = time.perf_counter()
    consuming = asyncio.create_task(consumer.run(handle, batch=64, fetch_timeout=0.5, stop=stop))
    while sum(seen.values()) < rollouts or consumer.stats.dead_lettered < 2:
        await asyncio.sleep(0.05)
    stop.set()
    await consuming
    consume_s = time.perf_counter() - t1
    await bus.publish(ev.new_event(ev.RunFinished(status="completed", steps=version), run_id=run_id))
    last = await bus.last_seq(run_id)
    await bus.close()
    return {
        "events in log": last,
        "rollouts published": rollouts,
        "rollouts consumed (payload hashes verified)": sum(seen.values()),
        "per tenant": dict(seen),
        "routing-trace MB verified": round(verified_bytes / 1e6, 1),
        "dead-lettered": dict(consumer.stats.by_reason),
        "publish s": round(publish_s, 2),
        "consume s": round(consume_s, 2),
    }


def main(args: argparse.Namespace) -> int:
    configure(level="warning")
    run_id = args.run or f"busdemo-{uuid.uuid4().hex[:6]}"
    runs_dir = Path(args.runs_dir)

    async def go(url: str) -> dict[str, object]:
        return await play(url, run_id, args.groups, args.group_size, args.seq_len)

    if args.nats_url:
        out = asyncio.run(go(args.nats_url))
    else:
        runs_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=runs_dir) as tmp, EmbeddedServer(tmp) as srv:
            out = asyncio.run(go(srv.url))
    print(f"bus demo, run {run_id}")
    for k, v in out.items():
        print(f"  {k:<45} {v}")
    return 0


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bus-demo", help="play realistic rollout traffic through the event backbone (no model)"
    )
    p.add_argument("--nats-url", default=None, help="use this NATS server instead of a private one")
    p.add_argument("--run", default=None)
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.set_defaults(func=main)
