"""``python -m jetrl.consumers.monitor --nats-url URL --run RUN --settings JSON``: the run's
headless monitor part. It follows the log, publishes alert transitions on it, feeds the
trackers ([monitor] wandb, tensorboard) and serves Prometheus' /metrics ([monitor]
prometheus_port). With neither trackers nor Prometheus it folds the steps alone: the alerts
need nothing else, and the rest is most of the log. Stopped, it first folds what the log
holds, so the trackers get every step, and checks the alerts on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path

from jetrl.bus.client import Bus
from jetrl.bus.log import get_logger
from jetrl.bus.runtime import PartEntry
from jetrl.consumers.monitor import reader
from jetrl.consumers.monitor.service import Monitor
from jetrl.consumers.monitor.settings import MonitorPart


async def watch(bus: Bus, run_id: str, part: MonitorPart, stop: asyncio.Event) -> int:
    log = get_logger(__name__, run_id=run_id, worker_id="monitor")
    s = part.monitor
    # Alerts alone need the steps alone: the tasks, generations and rollouts (most of the log)
    # are folded only for the trackers' and Prometheus' series.
    monitor = Monitor(
        run_id, bus=bus, settings=s, publish_alerts=s.alerts, keep_steps=10_000, rollouts=s.series_wanted
    )
    bridge = None
    if s.wandb or s.tensorboard:
        from jetrl.consumers.monitor.trackers import open_trackers

        bridge = open_trackers(s, run_id, Path(part.out_dir))
        if bridge is not None:
            monitor.listeners.append(bridge.listener)
    tasks = []
    if s.prometheus_port is not None:
        from jetrl.consumers.monitor.prometheus import Exporter

        exporter = Exporter(monitor)
        tasks.append(asyncio.create_task(exporter.serve("0.0.0.0", s.prometheus_port, stop)))
    try:
        await monitor.run(stop)
        # Stopped: what the log holds now is folded before the trackers close.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                reader.follow(
                    bus,
                    monitor.state,
                    from_seq=monitor.state.last_seq + 1,
                    on_point=monitor.tell,
                    to_head=True,
                    types=monitor.types,
                ),
                timeout=10.0,
            )
        # ... and its alerts checked once more: a short run can end before the periodic check
        # saw its last steps (or before a restarted monitor caught up at all).
        with contextlib.suppress(Exception):
            await monitor.publish(monitor.check_alerts())
    finally:
        for t in tasks:
            t.cancel()
        if bridge is not None:
            bridge.close()
    log.info("monitor_exit", steps=len(monitor.state.steps), alerts=monitor.state.alert_counts)
    return 0


PART = PartEntry(
    prog="jetrl-monitor",
    settings_model=MonitorPart,
    client_name=lambda args, s: f"monitor-{args.run}",
    body=lambda bus, args, s, stop: watch(bus, args.run, s, stop),
)


def main(argv: list[str] | None = None) -> int:
    return PART.main(argv)


if __name__ == "__main__":
    sys.exit(main())
