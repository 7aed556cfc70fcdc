"""Where a step's time goes: the CPU each process of a `jetrl run` spends per training step.

Runs the demo (configs/demo.toml, recorder off unless ``--recorder``) on its own nats-server,
and from step ``--from-step`` to the end reads every process's CPU time (user + system, from
/proc: the parts, the nats-server, the supervisor) and the wall time. Per step it prints the
wall milliseconds, each process's CPU milliseconds and their sum against the cores' capacity
(wall x cores): what the machine spends a step on, and who spends it. The trainer's own split
of its step (the StepCompleted metrics ``step_s``; ``trainer_read_s``, reading and checking the
batch's arrays; ``trainer_wait_s``, waiting for a batch of fresh groups; and the rest of the
wall time, which no metric times: the step's events and weights going out while the groups
that came meanwhile are admitted) follows. Extra config overrides may be given after ``--``.

    python bench/step_time.py [--steps 200] [--from-step 20] [-- --inference.workers 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from jetrl.bus.log import configure
from jetrl.deploy.config import load_config
from jetrl.deploy.supervisor import Supervisor

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a live process (None once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK


def processes(sup: Supervisor) -> dict[str, int]:
    out = {p.name: p.proc.pid for p in sup.parts if p.proc is not None}
    if sup.server is not None and sup.server.proc is not None:
        out["nats-server"] = sup.server.proc.pid
    out["supervisor"] = os.getpid()
    return out


async def run(sup: Supervisor, from_step: int) -> tuple[dict[str, float], float, int, int]:
    """Run to the end; CPU seconds per process and wall seconds between step ``from_step`` and
    the last step, and the two steps' numbers."""
    task = asyncio.create_task(sup.run())
    while len(sup.progress.steps) < from_step and not task.done():
        await asyncio.sleep(0.05)
    start = {name: cpu_s(pid) for name, pid in processes(sup).items()}
    t0, s0 = time.monotonic(), len(sup.progress.steps)
    last: dict[str, float | None] = dict(start)
    t1, s1 = t0, s0
    while not task.done():
        await asyncio.sleep(0.05)
        if len(sup.progress.steps) > s1:  # read at each new step: the parts are gone at the end
            for name, pid in processes(sup).items():
                last[name] = cpu_s(pid) or last.get(name)
            t1, s1 = time.monotonic(), len(sup.progress.steps)
    await task
    used = {n: (last[n] or 0.0) - (start.get(n) or 0.0) for n in last if start.get(n) is not None}
    return used, t1 - t0, s0, s1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--from-step", type=int, default=20)
    ap.add_argument("--recorder", action="store_true")
    ap.add_argument("over", nargs="*", help="config overrides, after --")
    args = ap.parse_args()
    configure("warning")
    over = ["--trainer.max_steps", str(args.steps), "--trainer.stop_at_reward", "2.0"]
    over += ["--store.recorder", "true" if args.recorder else "false", *args.over]
    cfg = load_config(ROOT / "configs" / "demo.toml", over)
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        sup = Supervisor(cfg, "steptime", Path(tmp) / "steptime", quiet=True)
        used, wall, s0, s1 = asyncio.run(run(sup, args.from_step))
        metrics = sup.progress.steps[s0:s1]
    n = max(s1 - s0, 1)
    print(f"the demo, steps {s0}..{s1} ({n} steps), {cores} cores, overrides {args.over or 'none'}")
    print(f"  wall                 {wall / n * 1e3:8.1f} ms a step ({n / wall:.1f} steps/s)")
    for name, s in sorted(used.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<20} {s / n * 1e3:8.1f} ms CPU a step")
    total = sum(used.values())
    share = total / (wall * cores)
    print(f"  all processes        {total / n * 1e3:8.1f} ms CPU a step, {share:.0%} of {cores} cores")
    if metrics:
        step_s = sum(m.get("step_s", 0.0) for m in metrics) / len(metrics)
        wait_s = sum(m.get("trainer_wait_s", 0.0) for m in metrics) / len(metrics)
        read_s = sum(m.get("trainer_read_s", 0.0) for m in metrics) / len(metrics)
        # What no metric times: the step's events and weights going out (StepCompleted is made
        # before), with the groups that came meanwhile admitted, and the acks.
        rest_s = max(wall / n - step_s - read_s - wait_s, 0.0)
        print(
            f"  trainer: step {step_s * 1e3:.1f} ms, reading its batch {read_s * 1e3:.1f} ms, "
            f"waiting for rollouts {wait_s * 1e3:.1f} ms, "
            f"publishing and admitting {rest_s * 1e3:.1f} ms a step"
        )
    print()
    print(
        f"step time {wall / n * 1e3:.1f} ms, CPU {total / n * 1e3:.1f} ms a step ({share:.0%} of the cores)"
    )


if __name__ == "__main__":
    main()
