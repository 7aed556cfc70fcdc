"""Where a step's time goes: the CPU each process of a `jetrl run` spends per training step.

Runs the demo (configs/demo.toml, recorder off unless ``--recorder``) on its own nats-server,
and from step ``--from-step`` to the end reads every process's CPU time (user + system, from
/proc: the parts with their child processes, live (the recorder's writer) or ended (a
sandbox's programs), the nats-server, the supervisor) and the wall time. Per step it prints the
wall milliseconds, each process's CPU milliseconds and their sum against the cores' capacity
(wall x cores): what the machine spends a step on, and who spends it. The trainer's own split
of its step (the StepCompleted metrics ``step_s``; ``trainer_read_s``, reading and checking the
batch's arrays; ``trainer_wait_s``, waiting for a batch of fresh groups; and the rest of the
wall time, which no metric times: the step's events and weights going out while the groups
that came meanwhile are admitted) follows. The trainer's CPU is also split by thread: its
main thread, the event loop (fetching, admitting, reading and checking the arrays, the step's
events, the acks), against its other threads (the train call, the weights' export). Extra
config overrides may be given after ``--``; ``--json PATH`` writes each round's figures for
bench/ab.py. The demo's learning-rate schedule is kept as its ``max_steps`` sets it: shortened
to ``--steps``, its decay would change what the policy learns by those steps and with it the
steps' costs (completions shorten as the policy learns).

The baseline, measured in the same run (unless ``--no-loop``): the same steps of the demo in
one process with no bus (bench/overhead.py's loop: generate, score, train, synchronous, with
the same torch threads as there), its wall and CPU a step. Against it: jetrl's step, and
jetrl's floor, its CPU a step spread evenly over the cores: the fastest step these parts could
take on this machine however they were scheduled. A floor above the loop's step means the
pipeline must spend less, not only overlap more, to beat the loop; the trainer's CPU a step
above it, that the trainer's own process must.

The model's own work, measured in the same run: the loop again on one torch thread, its
sampling's and its train calls' CPU a step (the code the worker and the trainer run, each on
one thread). jetrl's CPU less that work is the pipeline's own (events, the bus, reading
arrays, weights, scoring, the monitor, the nats-server); the most it may spend for a step as
fast as the loop's is the cores' time in the loop's step less the model's work, all of it
perfectly packed. ``--rounds N`` measures the three N times, one after another, and the summary
takes the medians of each round's figures: a ratio is only taken within a round (this
machine's speed drifts by a quarter within minutes).

    python bench/step_time.py [--steps 200] [--from-step 20] [--rounds 3] [--no-loop] [--json PATH]
                              [-- --inference.workers 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from overhead import LOOP_THREADS, one_process

from jetrl.bus.log import configure
from jetrl.deploy.config import RunConfig, load_config
from jetrl.deploy.supervisor import Supervisor

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")
READ_EVERY_S = 0.5  # how often the processes' CPU is read while the demo runs


def cpu_s(pid: int, thread: int | None = None, *, reaped: bool = False) -> float | None:
    """User + system CPU seconds of a live process, or of its thread ``thread`` (None once it
    is gone); ``reaped``: with its children's that have ended and been waited for."""
    stat = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    try:
        fields = Path(stat).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    used = int(fields[11]) + int(fields[12])
    if reaped:
        used += int(fields[13]) + int(fields[14])
    return used / TICK


def descendants(pid: int) -> list[int]:
    """A process's live children, theirs, and so on (the recorder's writer process, say)."""
    out, todo = [], [pid]
    while todo:
        for listing in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            try:
                kids = [int(k) for k in listing.read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def processes(sup: Supervisor) -> dict[str, int]:
    out = {p.name: p.proc.pid for p in sup.parts if p.proc is not None}
    if sup.server is not None and sup.server.proc is not None:
        out["nats-server"] = sup.server.proc.pid
    out["supervisor"] = os.getpid()
    if "trainer" in out:
        out[TRAINER_LOOP] = out["trainer"]
    return out


# The trainer's main thread: its event loop (fetching, admitting, reading and checking the
# arrays, the step's events, the acks), the pipeline's own work in the trainer's process; the
# train call and the weights' export run on other threads.
TRAINER_LOOP = "trainer's event loop"


def cpu_of(name: str, pid: int) -> float | None:
    """A part's CPU seconds with its descendants': the live ones', and through its own count
    those it has reaped (a sandbox that ran a program, say: without it their CPU would leave the
    count as they end); the supervisor's alone (the parts are not its children); the trainer's
    main thread's (:data:`TRAINER_LOOP`); None once it is gone."""
    if name == TRAINER_LOOP:
        return cpu_s(pid, pid)  # a process's main thread has the process's id
    if name == "supervisor":
        return cpu_s(pid)
    own = cpu_s(pid, reaped=True)
    if own is None:
        return None
    return own + sum(c for k in descendants(pid) if (c := cpu_s(k, reaped=True)) is not None)


async def run(sup: Supervisor, from_step: int) -> tuple[dict[str, float], float, int, int]:
    """Run to the end; CPU seconds per process and wall seconds between step ``from_step`` and
    the last step, and the two steps' numbers."""
    task = asyncio.create_task(sup.run())
    while len(sup.progress.steps) < from_step and not task.done():
        await asyncio.sleep(0.05)
    start = {name: cpu_of(name, pid) for name, pid in processes(sup).items()}
    t0, s0 = time.monotonic(), len(sup.progress.steps)
    last: dict[str, float | None] = dict(start)
    t1, s1 = t0, s0
    read_at = t0
    while not task.done():
        await asyncio.sleep(0.05)
        # Read at a new step (the parts are gone at the end), at most every READ_EVERY_S: this
        # process is the supervisor's, and reading /proc at every step was half of its CPU.
        now = time.monotonic()
        if len(sup.progress.steps) > s1 and now - read_at >= READ_EVERY_S:
            for name, pid in processes(sup).items():
                last[name] = cpu_of(name, pid) or last.get(name)
            t1, s1 = time.monotonic(), len(sup.progress.steps)
            read_at = now
    await task
    used = {n: (last[n] or 0.0) - (start.get(n) or 0.0) for n in last if start.get(n) is not None}
    return used, t1 - t0, s0, s1


class Round(NamedTuple):
    """One round's headline figures, a step's: jetrl's wall and CPU, the loop's wall, the
    trainer's CPU, and the model's work (None where not measured)."""

    wall_s: float
    cpu_s: float
    trainer_s: float | None
    loop_s: float | None
    work_s: float | None
    trainer_loop_s: float | None = None  # the trainer's event loop's CPU a step


def jetrl_round(
    cfg: RunConfig, steps: int, from_step: int, over: list[str], cores: int
) -> tuple[float, float, float | None, float | None, dict[str, float]]:
    """The demo under `jetrl run`, its figures printed; wall, CPU, the trainer's CPU and its
    event loop's a step, and each process's CPU a step."""
    with tempfile.TemporaryDirectory() as tmp:
        print(f"running the demo for {steps} steps (jetrl run, each part a process)...", flush=True)
        sup = Supervisor(cfg, "steptime", Path(tmp) / "steptime", quiet=True)
        used, wall, s0, s1 = asyncio.run(run(sup, from_step))
        metrics = sup.progress.steps[s0:s1]
    n = max(s1 - s0, 1)
    print(f"the demo, steps {s0}..{s1} ({n} steps), {cores} cores, overrides {over or 'none'}")
    print(f"  wall                 {wall / n * 1e3:8.1f} ms a step ({n / wall:.1f} steps/s)")
    loop_s = used.pop(TRAINER_LOOP, None)  # a part of the trainer's, not a process of its own
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
        if loop_s is not None and "trainer" in used:
            print(
                f"  trainer's CPU: its event loop {loop_s / n * 1e3:.1f} ms a step (reading, checking, "
                f"events, acks), its other threads {(used['trainer'] - loop_s) / n * 1e3:.1f} ms "
                "(the train call, the weights' export)"
            )
        streamed = int(sum(m.get("streamed", 0.0) for m in sup.progress.steps))
        print(f"  steps taken as their groups came ([trainer] stream_groups): {streamed} of {s1}")
    trainer = used["trainer"] / n if "trainer" in used else None
    parts = {name: s / n for name, s in used.items()}
    return wall / n, total / n, trainer, None if loop_s is None else loop_s / n, parts


def demo_schedule() -> list[str]:
    """Overrides that keep the demo's learning-rate schedule where ``max_steps`` is changed (its
    decay's length is otherwise resolved from the changed ``max_steps``)."""
    demo = load_config(ROOT / "configs" / "demo.toml", []).trainer
    if demo.lr_decay_steps is None:
        return []
    return ["--trainer.lr_decay_steps", str(demo.lr_decay_steps)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--from-step", type=int, default=20)
    ap.add_argument("--recorder", action="store_true")
    ap.add_argument("--no-loop", dest="loop", action="store_false", help="skip the one-process baseline")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="jetrl, the loop and the model's work measured this many times, one after another: "
        "the summary is of the rounds' medians (this machine's speed drifts within minutes)",
    )
    ap.add_argument(
        "--json",
        type=Path,
        help="also write each round's figures here (a step's seconds: wall, CPU, each process's, "
        "the trainer's event loop's): bench/ab.py reads them",
    )
    ap.add_argument("over", nargs="*", help="config overrides, after --")
    args = ap.parse_args()
    configure("warning")
    over = ["--trainer.max_steps", str(args.steps), "--trainer.stop_at_reward", "2.0", *demo_schedule()]
    over += ["--store.recorder", "true" if args.recorder else "false", *args.over]
    cfg = load_config(ROOT / "configs" / "demo.toml", over)
    cores = os.cpu_count() or 1
    rounds: list[Round] = []
    figures: list[dict[str, object]] = []
    for r in range(max(args.rounds, 1)):
        if args.rounds > 1:
            print(f"--- round {r + 1} of {args.rounds}")
        got = jetrl_round(cfg, args.steps, args.from_step, args.over, cores)
        wall, cpu, trainer, trainer_loop, parts = got
        figures.append({"wall_s": wall, "cpu_s": cpu, "trainer_loop_s": trainer_loop, "parts": parts})
        loop = work = None
        if args.loop:
            with tempfile.TemporaryDirectory() as tmp:
                print(f"running the same {args.steps} steps in one process (the baseline)...", flush=True)
                loop = loop_step(cfg, Path(tmp), args.from_step, LOOP_THREADS)
            if loop is not None:
                print(
                    f"the one-process loop, steps {args.from_step}..{args.steps} ({LOOP_THREADS} torch "
                    f"threads): {loop.wall_s * 1e3:.1f} ms a step, {loop.cpu_s * 1e3:.1f} ms CPU a step"
                )
            with tempfile.TemporaryDirectory() as tmp:
                print("the same steps on one torch thread, timing the model's work...", flush=True)
                work = model_work(cfg, Path(tmp), args.from_step)
            if work is not None:
                print(
                    f"the model's work a step, one thread each: sampling {work.sample_s * 1e3:.1f} ms, "
                    f"the train call {work.train_s * 1e3:.1f} ms, {work.total_s * 1e3:.1f} ms in all"
                )
        rounds.append(
            Round(
                wall,
                cpu,
                trainer,
                None if loop is None else loop.wall_s,
                None if work is None else work.total_s,
                trainer_loop,
            )
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"rounds": figures}, indent=1))
    summarise(rounds, cores, args.loop)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarise(rounds: list[Round], cores: int, with_loop: bool) -> None:
    """The headline lines: medians over the rounds of each round's figure (a ratio is taken
    within its round, whose parts ran minutes apart at most)."""
    of = f" (median of {len(rounds)} rounds)" if len(rounds) > 1 else ""
    wall = statistics.median(r.wall_s for r in rounds)
    cpu = statistics.median(r.cpu_s for r in rounds)
    print()
    print(
        f"step time {wall * 1e3:.1f} ms, CPU {cpu * 1e3:.1f} ms a step "
        f"({cpu / wall / cores:.0%} of the cores){of}"
    )
    trainer_loop = _median([r.trainer_loop_s for r in rounds if r.trainer_loop_s is not None])
    if trainer_loop is not None:
        print(
            f"trainer's event loop {trainer_loop * 1e3:.1f} ms CPU a step (its process's work beside "
            f"the train call and the export: reading, checking, events, acks){of}"
        )
    timed = [(r, r.loop_s) for r in rounds if r.loop_s]  # the rounds with a baseline
    if not timed:
        if with_loop:
            print("step time jetrl/one-process: the loop took too few steps to time")
        return
    ratio = statistics.median(r.wall_s / loop for r, loop in timed)
    floor = statistics.median(r.cpu_s / cores / loop for r, loop in timed)
    print(f"step time jetrl/one-process {ratio:.2f}x (target <= 1.0x){of}")
    print(
        f"floor jetrl/one-process {floor:.2f}x (jetrl's CPU a step over {cores} cores against the loop's "
        f"step: the least a step could take; above 1.0x no scheduling meets the target){of}"
    )
    trainer = _median([r.trainer_s / loop for r, loop in timed if r.trainer_s is not None])
    if trainer is not None:
        print(
            f"trainer jetrl/one-process {trainer:.2f}x (the trainer's CPU a step, on its one core, "
            f"against the loop's whole step){of}"
        )
    worked = [(r.cpu_s - r.work_s, cores * loop - r.work_s) for r, loop in timed if r.work_s is not None]
    if worked:
        own = statistics.median(o for o, _ in worked)
        allowed = statistics.median(a for _, a in worked)
        verdict = f"{own / allowed:.2f}x of it" if allowed > 0 else "none: the model's work fills the cores"
        print(
            f"pipeline's own CPU {own * 1e3:.1f} ms a step (jetrl's CPU less the model's work), "
            f"allowed {allowed * 1e3:.1f} ms for the loop's step time: {verdict} (target <= 1.0){of}"
        )


class ModelWork(NamedTuple):
    sample_s: float  # the sampling's CPU a step, one torch thread
    train_s: float  # the train call's CPU a step, one torch thread

    @property
    def total_s(self) -> float:
        return self.sample_s + self.train_s


def model_work(cfg: RunConfig, root: Path, from_step: int) -> ModelWork | None:
    """The loop on one torch thread over the run's steps: its sampling's and its train calls'
    CPU a step from step ``from_step`` (None with too few steps)."""
    phases: dict[str, float] = {}
    marks: list[tuple[float, float]] = []

    def on_step(rewards: object, metrics: object) -> None:
        marks.append((phases["sample"], phases["train"]))

    one_process(cfg, root, 1, on_step=on_step, phase_cpu=phases)
    got = per_step(marks, from_step)
    return None if got is None else ModelWork(*got)


class LoopStep(NamedTuple):
    wall_s: float  # a step, from step ``from_step`` to the last
    cpu_s: float  # this process's CPU a step over the same steps (every thread)


def loop_step(cfg: RunConfig, root: Path, from_step: int, threads: int) -> LoopStep | None:
    """The one-process loop's wall and CPU a step over the same steps as the run (its
    ``max_steps``; the reward target is off in ``cfg``). None with too few steps to time."""
    marks: list[tuple[float, float]] = []

    def on_step(rewards: object, metrics: object) -> None:
        marks.append((time.monotonic(), time.process_time()))

    one_process(cfg, root, threads, on_step=on_step)
    got = per_step(marks, from_step)
    return None if got is None else LoopStep(*got)


def per_step(marks: list[tuple[float, float]], from_step: int) -> tuple[float, float] | None:
    """Two running totals marked after each step, as amounts a step from step ``from_step`` to
    the last (None with fewer than two marks to difference)."""
    timed = marks[from_step - 1 :] if from_step >= 1 else marks
    if len(timed) < 2:
        return None
    n = len(timed) - 1
    return (timed[-1][0] - timed[0][0]) / n, (timed[-1][1] - timed[0][1]) / n


if __name__ == "__main__":
    main()
