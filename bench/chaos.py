"""Chaos: a long run with random SIGKILLs spread over every part, the nats-server included.

A real `jetrl run` (embedded nats-server, SQLite store, every part its own process) of
``--steps`` steps. Every few steps a randomly chosen part is killed with SIGKILL: the trainer,
an inference worker, the environment producer, the recorder or the nats-server itself. The
supervisor restarts it and it rebuilds its state from the log. Afterwards the log is audited:

* recovery time per part: from the kill to the next completed step;
* rollouts lost: scored, but neither trained nor withheld nor still deliverable to the trainer
  (every unacked message is fetched back from the trainer's durable consumer to check);
* rollouts trained twice (in two steps, or twice in one);
* whether `jetrl replay --verify` reproduces every step's checksum from the log.

    python bench/chaos.py [--steps 200] [--kills 22] [--seed 0] [-- CONFIG OVERRIDES]

(e.g. ``-- --trainer.stream_groups true --envs.0.latency_median_s 0.02``: a streaming trainer
killed while a step's groups are under way.)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import TypedDict

from jetrl.bus import events as ev
from jetrl.bus import subjects
from jetrl.bus.client import Bus
from jetrl.bus.consumer import ConsumerSpec
from jetrl.bus.log import configure
from jetrl.bus.server import EmbeddedServer
from jetrl.deploy.config import load_config
from jetrl.deploy.replay_cmd import replay
from jetrl.deploy.supervisor import Supervisor

ACK_WAIT = 3.0


async def read_log(url: str, run_id: str) -> list[tuple[int, ev.Event]]:
    """The run's events with their sequences."""
    bus = await Bus.connect(url)
    try:
        return [(item.seq, item.event) for item in await bus.read_log(run_id) if item.event is not None]
    finally:
        await bus.close()


async def deliverable_to_trainer(url: str, run_id: str) -> set[str]:
    """Every rollout the trainer's durable consumer would still deliver (nothing is acked)."""
    await asyncio.sleep(ACK_WAIT + 0.5)  # unacked deliveries become deliverable again
    bus = await Bus.connect(url)
    c = await bus.consumer(
        ConsumerSpec(
            run_id=run_id,
            durable="trainer",
            filter_subjects=[subjects.rollout_subject(run_id)],
            ack_wait=60.0,
            max_deliver=1_000_000,
            max_ack_pending=1_000_000,
        )
    )
    out: set[str] = set()
    # An empty fetch is a timeout, which a loaded machine can give while messages remain: only a
    # few in a row end the scan.
    empty = 0
    while empty < 3:
        batch = await c.fetch(1000, timeout=2.0)
        empty = 0 if batch else empty + 1
        for d in batch:
            if isinstance(d.event.body, ev.RolloutsScored):
                out.update(r.rollout_id for r in d.event.body.rollouts)
    await bus.close()
    return out


class ChaosResult(TypedDict):
    status: int
    steps: int
    steps_contiguous: bool
    streamed: int  # steps taken as their groups came ([trainer] stream_groups)
    injected: list[tuple[str, float, int]]  # (victim, time, steps done at the kill)
    recovery: dict[str, list[float]]  # seconds from a kill to the next step, per kind of part
    scored: int
    trained: int
    withheld: int
    pending: int
    lost: int
    lost_why: dict[str, int]  # the lost rollouts by the reason they were dead-lettered
    trained_twice: int
    replay_verified: bool
    restarts: dict[str, int]


async def chaos(root: Path, steps: int, kills: int, seed: int, over: list[str] | None = None) -> ChaosResult:
    run_id = "chaos"
    cfg = load_config(
        None,
        [
            "--run.seed",
            str(seed),
            "--trainer.max_steps",
            str(steps),
            "--trainer.batch_groups",
            "4",
            "--trainer.checkpoint_every",
            "10",
            "--trainer.ack_wait_s",
            str(ACK_WAIT),
            "--inference.workers",
            "2",
            "--inference.ack_wait_s",
            str(ACK_WAIT),
            "--envs.0.group_size",
            "8",
            "--envs.0.ack_wait_s",
            str(ACK_WAIT),
            "--trainer.entropy_coef",
            "0.02",
            *(over or []),
        ],
    )
    sup = Supervisor(cfg, run_id, root / run_id, quiet=True)
    run = asyncio.create_task(sup.run())
    rng = random.Random(seed)
    victims = ["trainer", "inference-0", "inference-1", "env-default-modsum-0", "recorder", "nats-server"]
    every = max(1, steps // (kills + 2))
    injected: list[tuple[str, float, int]] = []  # (victim, time, steps done at the kill)
    next_at = every
    while not run.done() and len(injected) < kills:
        done = len(sup.progress.steps)
        if done >= next_at:
            victim = rng.choice(victims)
            # Only a running process is killed: one the supervisor has not restarted yet (slow on
            # a loaded machine) is not a fault injected; another victim is drawn.
            if victim == "nats-server":
                server = sup.server
                if server is None or server.proc is None or server.proc.poll() is not None:
                    await asyncio.sleep(0.1)
                    continue
                server.kill()
            else:
                part = next((p for p in sup.parts if p.name == victim), None)
                if part is None or part.proc is None or part.proc.poll() is not None:
                    await asyncio.sleep(0.1)
                    continue
                part.proc.send_signal(signal.SIGKILL)
            injected.append((victim, time.monotonic(), done))
            print(f"  kill {len(injected):>2}: {victim:<22} at step {done}", flush=True)
            next_at = done + every
        await asyncio.sleep(0.05)
    status = await run
    t_steps = [(s["step"], sup.progress.started + s["t"]) for s in sup.progress.steps]

    recovery: dict[str, list[float]] = defaultdict(list)
    for victim, t_kill, _ in injected:
        after = [t for _, t in t_steps if t > t_kill]
        if after:
            recovery[part_kind(victim)].append(after[0] - t_kill)

    with EmbeddedServer(root / run_id / "nats") as srv:
        logged = await read_log(srv.url, run_id)
        log = [e for _, e in logged]
        step_bodies = [e.body for e in log if isinstance(e.body, ev.StepCompleted)]
        trained = Counter(rid for s in step_bodies for rid in s.rollout_ids)
        scored = {r.rollout_id for e in log if isinstance(e.body, ev.RolloutsScored) for r in e.body.rollouts}
        withheld = {e.body.rollout_id for e in log if isinstance(e.body, ev.RolloutWithheld)}
        pending = await deliverable_to_trainer(srv.url, run_id)
        lost = scored - set(trained) - withheld - pending
        # Why: a lost rollout dead-lettered (its DeadLettered keeps it whole, with the reason).
        groups = [(seq, e.body) for seq, e in logged if isinstance(e.body, ev.RolloutsScored)]
        group_seq = {r.rollout_id: seq for seq, body in groups for r in body.rollouts}
        dead = {e.body.original_stream_seq: e.body.reason for e in log if isinstance(e.body, ev.DeadLettered)}
        lost_why = Counter(dead.get(group_seq[rid], "not dead-lettered") for rid in lost)
        verified = await replay(
            srv.url, run_id, root / run_id, from_step=0, to_step=None, verify=True, quiet=True
        )
    return {
        "status": status,
        "steps": len({s.step for s in step_bodies}),
        "steps_contiguous": sorted({s.step for s in step_bodies})
        == list(range(len({s.step for s in step_bodies}))),
        "streamed": len({s.step for s in step_bodies if s.micro_batches}),
        "injected": injected,
        "recovery": recovery,
        "scored": len(scored),
        "trained": len(trained),
        "withheld": len(withheld),
        "pending": len(pending - set(trained) - withheld),
        "lost": len(lost),
        "lost_why": dict(lost_why),
        "trained_twice": sum(1 for n in trained.values() if n > 1),
        "replay_verified": verified == 0,
        "restarts": {p.name: p.restarts for p in sup.parts if p.restarts}
        | {"nats-server": sup.server_restarts},
    }


def part_kind(victim: str) -> str:
    """The kind of part a victim is, as the recovery table groups them (both workers: inference)."""
    return "inference" if victim.startswith("inference") else victim


def summary_lines(r: ChaosResult, planned_kills: int) -> list[str]:
    """The recovery table and the headline lines, each with a clear line where a run too short
    or too slow left nothing to measure."""
    injected = r["injected"]
    by_kind = Counter(part_kind(v) for v, _, _ in injected)
    out = [f"{'part':<22}{'kills':>6}{'recovered':>10}{'recovery median':>17}{'max':>8}"]
    for kind, kills in sorted(by_kind.items()):
        times = r["recovery"].get(kind, [])
        median = f"{statistics.median(times):.1f}s" if times else "-"
        longest = f"{max(times):.1f}s" if times else "-"
        out.append(f"{kind:<22}{kills:>6}{len(times):>10}{median:>17}{longest:>8}")
    out.append("")
    short = (
        f" (the run ended after {r['steps']} steps, before the {planned_kills} planned kills)"
        if len(injected) < planned_kills
        else ""
    )
    victims = len({v for v, _, _ in injected})
    out.append(f"faults injected {len(injected)} over {victims} kinds of part (target >= 20){short}")
    all_times = [t for ts in r["recovery"].values() for t in ts]
    if all_times:
        out.append(
            f"recovery time median {statistics.median(all_times):.1f} s, max {max(all_times):.1f} s"
            f" ({len(all_times)} of {len(injected)} kills followed by a step)"
        )
    else:
        out.append(
            f"recovery time: too few recoveries to measure (no step completed after any of "
            f"{len(injected)} kills)"
        )
    why = ", ".join(f"{n} {reason}" for reason, n in sorted(r["lost_why"].items()))
    out.append(f"rollouts lost {r['lost']} (target 0){f': {why}' if why else ''}")
    out.append(f"rollouts trained twice {r['trained_twice']} (target 0)")
    if r["steps"] == 0:
        out.append("replay verified: too few steps to verify (0 steps) (target yes)")
    else:
        out.append(f"replay verified {'yes' if r['replay_verified'] else 'NO'} (target yes)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--kills", type=int, default=22)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("over", nargs="*", help="config overrides, after --")
    args = ap.parse_args()
    configure(level="error")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        r = asyncio.run(chaos(Path(tmp), args.steps, args.kills, args.seed, args.over))
    wall = time.perf_counter() - t0
    print()
    print(
        f"run: {r['steps']} steps (contiguous: {r['steps_contiguous']}, {r['streamed']} streamed), "
        f"status code {r['status']}, {wall:.0f}s"
    )
    print(
        f"rollouts: {r['scored']} scored, {r['trained']} trained, {r['withheld']} withheld, "
        f"{r['pending']} still deliverable at the end"
    )
    print(f"restarts seen by the supervisor: {r['restarts']}")
    for line in summary_lines(r, args.kills):
        print(line)


if __name__ == "__main__":
    main()
