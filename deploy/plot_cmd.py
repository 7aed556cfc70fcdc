"""`jetrl plot RUN [--out FILE]`: a run's reward curve and held-out evaluations (deploy/report.py),
drawn from its log: for a run still going, or again for one whose `reward.png` is gone. Each step
and each version's evaluation counts once (the first in the log, as the recorder keeps it)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from jetrl.bus import events as ev
from jetrl.bus.client import Bus
from jetrl.bus.log import configure
from jetrl.deploy.report import RunReport
from jetrl.deploy.run_log import with_run_log


async def report_of(url: str, run_id: str) -> RunReport:
    """A RunReport fed from the run's log: steps timed from its RunStarted."""
    bus = await Bus.connect(url, name="plot")
    try:
        items = await bus.read_log(run_id)
    finally:
        await bus.close()
    report, seen = RunReport(), set()
    start: float | None = None
    for item in items:
        e = item.event
        if e is None:
            continue
        if isinstance(e.body, ev.RunStarted) and start is None:
            start = e.time
        elif isinstance(e.body, ev.StepCompleted) and e.body.step not in seen:
            seen.add(e.body.step)
            report.add(e.body, t=e.time - (start if start is not None else e.time))
        elif isinstance(e.body, ev.EvaluationReported):
            report.add_evaluation(e.body, e.tenant)
    return report


async def plot(url: str, run_id: str, out: Path) -> int:
    report = await report_of(url, run_id)
    if not report.steps:
        print(f"plot: run {run_id} has no steps in its log")
        return 2
    await asyncio.to_thread(report.plot, out, run_id)
    evals = sum(len(v) for v in report.evaluations.values())
    print(f"plot: {out} ({len(report.steps)} steps, {evals} evaluations)")
    return 0


def main(args: argparse.Namespace) -> int:
    configure(level="warning")
    run_dir = Path(args.runs_dir) / args.run
    out = Path(args.out) if args.out else run_dir / "reward.png"
    return with_run_log("plot", run_dir, args.nats_url, lambda url: plot(url, args.run, out))


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("plot", help="draw a run's reward curve and held-out evaluations from its log")
    p.add_argument("run")
    p.add_argument("--out", default=None, help="the PNG (default: <runs dir>/<run>/reward.png)")
    p.add_argument("--nats-url", default=None)
    p.add_argument("--runs-dir", default="runs")
    p.set_defaults(func=main)
