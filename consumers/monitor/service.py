"""One monitor of one run: the fold kept current, alerts checked, listeners told.

A :class:`Monitor` reads a live run's log (``bus``) or, when the run is over and its server
gone, the run's store (``store_url``). Dashboards (terminal, web), the trackers and the
Prometheus endpoint are its listeners: each new step point goes to every listener, and each
reads ``snapshot()`` for the rest. With ``publish_alerts`` (the supervisor's monitor part)
alert transitions are published on the run's log, which every monitor folds back in.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from jetrl.bus import events as ev
from jetrl.bus import ids
from jetrl.bus.client import Bus
from jetrl.bus.identity import PermissionDenied, cancel_and_wait
from jetrl.bus.log import get_logger
from jetrl.consumers.monitor import reader
from jetrl.consumers.monitor.alerts import Alerts
from jetrl.consumers.monitor.inspector import Inspector
from jetrl.consumers.monitor.series import STEP_EVENTS, MonitorState, StepPoint
from jetrl.consumers.monitor.settings import MonitorSettings
from jetrl.store.db import Store

log = get_logger(__name__)

Listener = Callable[[StepPoint], None]
CHECK_EVERY_S = 1.0  # alerts and queue depths


class Monitor:
    def __init__(
        self,
        run_id: str,
        *,
        bus: Bus | None = None,
        store: Store | None = None,
        settings: MonitorSettings | None = None,
        start: reader.Start | None = None,
        publish_alerts: bool = False,
        keep_steps: int | None = None,
        log_bus: Bus | None = None,
        rollouts: bool = True,
    ) -> None:
        """``log_bus``: a finished run's log served apart from its store (by a private server
        on the run's own log files), read by the inspector only: the series come from the store.
        ``rollouts``: fold the tasks, generations and rollouts too; without (a monitor that only
        raises alerts), their events are passed over undecoded (series.STEP_FACTS)."""
        if bus is None and store is None:
            raise ValueError("a monitor reads a run's log (bus) or its store (store)")
        self.run_id = run_id
        self.bus = bus
        self.store = store
        self.s = settings or MonitorSettings()
        self.start = start or reader.Start()
        self.publish_alerts = publish_alerts
        self.state = MonitorState(run_id, keep_steps=keep_steps, rollouts=rollouts)
        self.types = None if rollouts else STEP_EVENTS
        self.alerts = Alerts(self.s.rules)
        self.listeners: list[Listener] = []
        self.queues: list[reader.QueueDepth] = []
        self.caught_up = asyncio.Event()
        self.inspector = Inspector(run_id, bus=bus or log_bus, store=store)

    @property
    def live(self) -> bool:
        return self.bus is not None

    def now(self) -> float:
        """The dashboard's clock: the wall clock while the run is live, else the log's last time."""
        return time.time() if self.live and self.state.finished is None else self.state.last_t

    def tell(self, point: StepPoint) -> None:
        for listener in list(self.listeners):
            try:
                listener(point)
            except Exception:  # one listener's failure must not stop the others or the fold
                log.exception("monitor_listener_failed", run_id=self.run_id, step=point.step)

    # ------------------------------------------------------------------ running

    def load_store(self) -> None:
        """Fold a recorded run from its store (no bus needed)."""
        assert self.store is not None
        with self.store.engine.connect() as conn:
            self.state = reader.from_store(conn, self.run_id, start=self.start)
        for p in self.state.steps:
            self.tell(p)
        self.check_alerts()
        self.caught_up.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the log until ``stop`` (or fold the store once, without a bus)."""
        if self.bus is None:
            self.load_store()
            await stop.wait()
            return
        checks = asyncio.create_task(self._checks(stop))
        try:
            # Catch up with what the log holds, then follow it.
            await reader.follow(
                self.bus, self.state, start=self.start, on_point=self.tell, to_head=True, types=self.types
            )
            self.caught_up.set()
            log.info(
                "monitor_caught_up", run_id=self.run_id, events=self.state.events, seq=self.state.last_seq
            )
            follow = asyncio.create_task(
                reader.follow(
                    self.bus,
                    self.state,
                    start=reader.Start(),
                    on_point=self.tell,
                    from_seq=self.state.last_seq + 1,
                    types=self.types,
                )
            )
            waiter = asyncio.create_task(stop.wait())
            await asyncio.wait({follow, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if follow.done():
                follow.result()  # the log reader's error, if it ended on one
            await cancel_and_wait(follow)
        finally:
            await cancel_and_wait(checks)

    async def _checks(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), CHECK_EVERY_S)
            if self.caught_up.is_set():
                await self.publish(self.check_alerts())
                if self.bus is not None:
                    try:
                        self.queues = await reader.queue_depths(self.bus, self.run_id)
                    except Exception as exc:  # a permission or a server gone: the dashboard says so
                        log.debug("monitor_queue_depths_failed", error=str(exc))

    def check_alerts(self) -> list[ev.AlertRaised]:
        """Evaluate the rules now: transitions are in the state at once, and on the log once
        ``publish`` has sent them."""
        out = self.alerts.check(self.state, self.now())
        for a in out:
            log.warning(
                "alert",
                run_id=self.run_id,
                step=a.step,
                rule=a.rule,
                key=a.key,
                state=a.state,
                message=a.message,
            )
        return out

    async def publish(self, raised: list[ev.AlertRaised]) -> None:
        if not (self.publish_alerts and self.bus is not None):
            return
        for a in raised:
            event = ev.new_event(
                a,
                run_id=self.run_id,
                event_id=ids.alert_event_id(self.run_id, a.rule, a.key, a.state, a.step),
            )
            try:
                await self.bus.publish(event)
            except PermissionDenied as exc:
                log.error("alert_not_published", run_id=self.run_id, rule=a.rule, error=str(exc))

    # ------------------------------------------------------------------ views

    def snapshot(self) -> dict[str, Any]:
        out = self.state.snapshot(self.now())
        out["live"] = self.live
        out["queues"] = [
            {"consumer": q.consumer, "pending": q.pending, "ack_pending": q.ack_pending} for q in self.queues
        ]
        return out

    def points(self, after_step: int = -1) -> list[dict[str, Any]]:
        return [p.as_json() for p in self.state.steps if p.step > after_step]

    async def inspect(self, step: int) -> dict[str, Any] | None:
        """The rollouts a step trained on, token by token (consumers/monitor/inspector.py)."""
        seq = next((p.seq for p in reversed(self.state.steps) if p.step == step), None)
        return await self.inspector.step(step, seq, self.state.config)
