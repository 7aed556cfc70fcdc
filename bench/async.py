"""Synchronous vs asynchronous RL on an environment with long-tailed latency.

Same model (4 layers, dim 256, 8 experts top-2; weights shared through the run directory), same
batch, same environment (modular addition, whose scoring sleeps a lognormal
time per rollout: median ``--latency`` seconds, sigma 1.3, so about 1% of episodes take more
than 20x the median, like sandboxes and tool calls). Each mode is a real `jetrl run` (all
processes, one private nats-server) for the same wall-clock budget:

    max_off_policy_steps = 0 (synchronous on-policy), 1, 2, 4

and reports steps per minute, the trainer's idle fraction, mean staleness and the reward reached,
and how long a group took from its task to its scored rollouts (read off the log) against the
time between steps: a group sampled by version v can be trained until step v + k, so at k=1 a
group slower than about two steps is withheld however idle the trainer. The recorder is off so
that the two cores go to the loop itself.

    python bench/async.py [--seconds 45] [--latency 0.05] [--quorum 0.875]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from jetrl.bus import events as ev
from jetrl.bus.client import Bus
from jetrl.bus.log import configure
from jetrl.bus.server import EmbeddedServer
from jetrl.deploy.config import load_config
from jetrl.deploy.cores import others_cores
from jetrl.deploy.supervisor import Supervisor

# --stream-groups: [trainer] stream_groups.
STREAM_GROUPS = {"on": "true", "off": "false", "auto": "auto"}
# Steady state: the first steps (process start-up, first weights) are not timed.
WARMUP_STEPS = 3
# Timed steps a mode needs for a rate (two intervals between them) and for the idle fraction.
MIN_TIMED_STEPS = 3


@dataclass(frozen=True)
class ModeFigures:
    """One mode's figures; a figure is None where the mode took too few steps to measure it."""

    steps: int
    seconds: float  # the mode's wall-clock budget
    steps_per_min: float | None
    idle: float | None
    staleness: float | None
    reward: float | None
    withheld: int
    streamed: int = 0  # steps the trainer took as their groups came ([trainer] stream_groups)
    late: int = 0  # samples left out of their groups by the quorum ([[envs]] group_quorum)

    def too_few(self) -> str:
        """Why a figure is missing, for the lines that would have shown it."""
        noun = "step" if self.steps == 1 else "steps"
        return (
            f"too few steps to measure ({self.steps} {noun} in {self.seconds:.0f} s; "
            f"{WARMUP_STEPS + MIN_TIMED_STEPS} needed: {WARMUP_STEPS} warm-up, {MIN_TIMED_STEPS} timed)"
        )


def mode_figures(steps: list[dict[str, float]], seconds: float) -> ModeFigures:
    """The figures of one mode from its StepCompleted metrics (``step``, ``t``, ...)."""
    timed = [s for s in steps if s["step"] >= WARMUP_STEPS]
    span = timed[-1]["t"] - timed[0]["t"] if len(timed) >= MIN_TIMED_STEPS else 0.0
    waits = [s.get("trainer_wait_s", 0.0) for s in timed[1:]]
    # The trainer's time: waiting for a batch, reading and checking it, and its step.
    busy = sum(waits) + sum(s.get("trainer_read_s", 0.0) + s.get("step_s", 0.0) for s in timed[1:])
    last = steps[-10:]
    return ModeFigures(
        steps=len(steps),
        seconds=seconds,
        steps_per_min=(len(timed) - 1) / span * 60 if span > 0 else None,
        idle=sum(waits) / busy if len(timed) >= MIN_TIMED_STEPS and busy > 0 else None,
        staleness=sum(s.get("staleness_mean", 0.0) for s in steps) / len(steps) if steps else None,
        reward=sum(s.get("reward_mean", 0.0) for s in last) / len(last) if last else None,
        withheld=int(steps[-1].get("withheld_total", 0)) if steps else 0,
        streamed=int(sum(s.get("streamed", 0.0) for s in steps)),
    )


def latency_line(k: int, mode: ModeFigures, latencies: list[float]) -> str:
    """How long groups took from their task to their scored rollouts, against the time
    between steps (the window a group has at ``k`` is about ``1 + k`` of them)."""
    head = f"groups k={k}:"
    if not latencies:
        return f"{head} none scored"
    cuts = statistics.quantiles(latencies, n=10) if len(latencies) > 1 else [latencies[0]] * 9
    out = f"{head} task to scored p50 {cuts[4]:.2f} s, p90 {cuts[8]:.2f} s ({len(latencies)} groups)"
    if mode.steps_per_min is None:
        return out

    def slower(step: float) -> str:
        share = sum(1 for t in latencies if t > (1 + k) * step) / len(latencies)
        return f"{100 * share:.0f}% longer than {1 + k} steps"

    step = 60 / mode.steps_per_min
    out += f"; a step every {step:.2f} s: {slower(step)}"
    if mode.idle is not None and mode.idle > 0:
        # At the trainer's own pace (never waiting) the window would be this much shorter.
        busy = step * (1 - mode.idle)
        out += f"; at the trainer's busy pace ({busy:.2f} s a step): {slower(busy)}"
    return out


async def group_latencies(url: str, run_id: str) -> tuple[list[float], int]:
    """Seconds from each group's TaskSubmitted to its RolloutsScored, from the run's log, and
    the samples its groups left out as late."""
    bus = await Bus.connect(url)
    try:
        items = await bus.read_log(run_id)
    finally:
        await bus.close()
    tasked: dict[str, float] = {}
    out = []
    late = 0
    for item in items:
        e = item.event
        if e is None:
            continue
        if isinstance(e.body, ev.TaskSubmitted):
            tasked.setdefault(e.body.task_id, e.time)
        elif isinstance(e.body, ev.RolloutsScored) and e.body.task_id in tasked:
            out.append(e.time - tasked[e.body.task_id])
            late += len(e.body.late_samples)
    return out, late


def speedup_line(k: int, mode: ModeFigures, base: ModeFigures | None) -> str:
    """The headline async/sync line of mode ``k``, or why it cannot be given."""
    head = f"async/sync steps-per-minute k={k}"
    if mode.steps_per_min is None:
        return f"{head}: {mode.too_few()}"
    if base is None:
        return f"{head}: no sync baseline (mode 0 was not run)"
    if base.steps_per_min is None:
        return f"{head}: no sync baseline to compare with (sync: {base.too_few()})"
    return f"{head} {mode.steps_per_min / base.steps_per_min:.2f}x (target >= 2x)"


def idle_line(k: int, mode: ModeFigures) -> str:
    if mode.idle is None:
        return f"trainer idle k={k}: {mode.too_few()}"
    return f"trainer idle k={k} {100 * mode.idle:.1f}% (target < 10%)"


def _num(x: float | None, fmt: str, width: int, suffix: str = "") -> str:
    return f"{x:{fmt}}{suffix}".rjust(width) if x is not None else "-".rjust(width)


def run_mode(
    url: str,
    root: Path,
    k: int,
    seconds: float,
    latency: float,
    sigma: float,
    workers: int,
    model: list[str],
    inflight: float | None = None,
    stream: str = "auto",
    quorum: float = 1.0,
) -> tuple[ModeFigures, list[float]]:
    args = (
        f"--run.max_wall_s {seconds} --run.seed 0 --trainer.max_off_policy_steps {k} "
        "--trainer.max_steps 100000 "
        "--trainer.batch_groups 8 --trainer.lr 5e-4 --trainer.entropy_coef 0.01 --trainer.checkpoint_every 0 "
        f"--inference.workers {workers} --inference.max_batch_tasks 8 "
        "--envs.0.name modsum --envs.0.group_size 16 "
        f"--envs.0.latency_median_s {latency} --envs.0.latency_sigma {sigma} --store.recorder false "
        "--bus.max_gib 1 --bus.payload_max_gib 1"
    ).split()
    if inflight is not None:
        args += ["--envs.0.inflight_groups", str(round(inflight * (1 + k) * 8))]
    args += ["--envs.0.group_quorum", str(quorum)]
    # The synchronous baseline takes whole batches, as it always has here.
    args += ["--trainer.stream_groups", STREAM_GROUPS[stream] if k else "false"]
    cfg = load_config(None, [*args, *model])
    run_id = f"async-k{k}"
    sup = Supervisor(cfg, run_id, root / run_id, nats_url=url, quiet=True)
    asyncio.run(sup.run())
    latencies, late = asyncio.run(group_latencies(url, run_id))
    return dataclasses.replace(mode_figures(sup.progress.steps, seconds), late=late), latencies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=45.0, help="wall-clock budget of each mode")
    ap.add_argument("--latency", type=float, default=0.05, help="median environment latency (s)")
    ap.add_argument("--sigma", type=float, default=1.3, help="lognormal sigma of the latency")
    ap.add_argument("--modes", default="0,1,2,4", help="max_off_policy_steps values; 0 is the baseline")
    ap.add_argument("--workers", type=int, default=1, help="inference workers")
    ap.add_argument(
        "--oversubscribe",
        type=float,
        default=None,
        help="groups in flight = this x (1 + k) x batch groups (default: 1, the producer's rule)",
    )
    ap.add_argument(
        "--stream-groups",
        choices=list(STREAM_GROUPS),
        default="auto",
        help="whether the asynchronous modes' trainer takes each group as it comes "
        "([trainer] stream_groups; auto, the default, where its batches come late)",
    )
    ap.add_argument(
        "--quorum",
        type=float,
        default=1.0,
        help="[envs] group_quorum: a group's scores go out once this share of its samples is "
        "scored, the rest left out as late (default 1: every sample)",
    )
    # A trainer step that is not trivially cheap next to generation (about 0.25 s here), as on
    # real clusters; with the 2-layer dim-64 demo model the event path, not the trainer, is the
    # bottleneck on two cores (docs/running.md).
    ap.add_argument("--model", default="tiny-moe-4l")
    ap.add_argument("--weights-store", default="file", choices=["objstore", "file"])
    ap.add_argument(
        "--model-overrides",
        default="{ dim = 256, moe_hidden_dim = 512, head_dim = 64 }",
        help='TOML inline table, e.g. "{ dim = 256 }"',
    )
    args = ap.parse_args()
    configure(level="warning")
    modes = [int(m) for m in args.modes.split(",")]
    results: dict[int, ModeFigures] = {}
    latencies: dict[int, list[float]] = {}
    # The server runs where `jetrl run` would run its own: off the trainer's cores (deploy/cores.py).
    server_cpus = others_cores(load_config(None, []))
    with tempfile.TemporaryDirectory() as tmp, EmbeddedServer(Path(tmp) / "nats", cpus=server_cpus) as srv:
        for k in modes:
            model = [
                "--model.name",
                args.model,
                "--model.overrides",
                args.model_overrides,
                "--bus.weights_store",
                args.weights_store,
            ]
            r, lat = run_mode(
                srv.url,
                Path(tmp),
                k,
                args.seconds,
                args.latency,
                args.sigma,
                args.workers,
                model,
                args.oversubscribe,
                args.stream_groups,
                args.quorum,
            )
            results[k], latencies[k] = r, lat
            rate = f"{r.steps_per_min:.1f} steps/min" if r.steps_per_min is not None else "steps/min -"
            idle = f"{100 * r.idle:.1f}%" if r.idle is not None else "-"
            print(
                f"max_off_policy_steps={k}: {r.steps} steps, {rate}, trainer idle {idle}, "
                f"staleness {_num(r.staleness, '.2f', 0)}, reward {_num(r.reward, '.3f', 0)}, "
                f"withheld {r.withheld}, late samples {r.late}, streamed {r.streamed} of {r.steps} steps",
                flush=True,
            )
            print(f"  {latency_line(k, r, lat)}", flush=True)
    print()
    print(f"{'mode':<12}{'steps':>6}{'steps/min':>10}{'x sync':>8}{'idle':>8}{'stale':>7}{'reward':>8}")
    base = results.get(0)
    for k, r in results.items():
        ratio = None
        if base is not None and base.steps_per_min and r.steps_per_min is not None:
            ratio = r.steps_per_min / base.steps_per_min
        name = "sync" if k == 0 else f"async k={k}"
        print(
            f"{name:<12}{r.steps:>6}{_num(r.steps_per_min, '.1f', 10)}{_num(ratio, '.2f', 8)}"
            f"{_num(None if r.idle is None else 100 * r.idle, '.1f', 8, '%')}"
            f"{_num(r.staleness, '.2f', 7)}{_num(r.reward, '.3f', 8)}"
        )
    print()
    for k, r in results.items():
        if k:
            print(speedup_line(k, r, base))
    for k, r in results.items():
        if k:
            print(idle_line(k, r))
    for k, r in results.items():
        print(latency_line(k, r, latencies[k]))


if __name__ == "__main__":
    main()
