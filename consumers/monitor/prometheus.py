"""The monitor's Prometheus endpoint: the newest step's figures and the run's live state.

:class:`Exporter` has a registry of its own (never prometheus_client's global one, so several
monitors in one process, or the tests, never collide) holding one collector that builds every
family at scrape time: from the newest :class:`StepPoint` (what the last step trained on) and
from ``Monitor.snapshot()`` (workers, queues, dead letters, withheld rollouts, alerts), so a
worker that went away or an alert that resolved leaves no stale series behind.

Every series carries ``run``. Names follow Prometheus conventions: the ``jetrl_`` prefix, base
units (``_seconds``), ``_total`` for counts that only grow. The step's figures are
``jetrl_<group>_<name>`` after ``StepPoint.scalars()`` (``trainer/loss`` is
``jetrl_trainer_loss``, ``staleness/mean`` is ``jetrl_staleness_mean``; ``_s`` becomes
``_seconds`` and ``_frac`` ``_ratio``), with the per-env and
per-tenant rewards as labels (``jetrl_reward_env_mean{env}``, ``jetrl_reward_tenant_mean
{tenant}``); the backlog after the step (``queue/*``) is left to the live series
(``jetrl_pending_samples``, ``jetrl_pending_rollouts``), which are fresher.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jetrl.bus.log import get_logger
from jetrl.consumers.monitor.series import StepPoint

if TYPE_CHECKING:
    from jetrl.consumers.monitor.service import Monitor

log = get_logger(__name__)

# Step scalars the live series (from the snapshot) stand for: the backlog after the step.
_LIVE_SCALARS = ("queue/",)
_LABELLED = {
    "reward/env/": ("jetrl_reward_env_mean", "env"),
    "reward/tenant/": ("jetrl_reward_tenant_mean", "tenant"),
}


# Prometheus' base units and names: seconds, and ratios for shares of one.
_UNITS = (("_per_s", "_per_second"), ("_s", "_seconds"), ("_frac", "_ratio"))


def metric_name(scalar: str) -> str:
    """``trainer/loss`` -> ``jetrl_trainer_loss``; ``trainer/trainer_idle_frac`` ->
    ``jetrl_trainer_idle_ratio``; ``throughput/tokens_per_s`` -> ``jetrl_throughput_tokens_per_second``."""
    group, _, rest = scalar.partition("/")
    if rest.startswith(group + "_"):
        rest = rest[len(group) + 1 :]
    name = re.sub(r"[^a-zA-Z0-9_]", "_", f"{group}_{rest}" if rest else group)
    for short, unit in _UNITS:
        if name.endswith(short):
            name = name[: -len(short)] + unit
            break
    return "jetrl_" + name


class _Collector(Collector):
    def __init__(self, exporter: Exporter) -> None:
        self.exporter = exporter

    def collect(self) -> Iterable[Metric]:
        return list(self.exporter.families())


class Exporter:
    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        self.port: int | None = None  # the bound port once serve() listens
        self.serving = asyncio.Event()

    def latest(self) -> StepPoint | None:
        """The newest step point of the monitor's state."""
        steps = self.monitor.state.steps
        return steps[-1] if steps else None

    # ------------------------------------------------------------------ families

    def families(self) -> Iterator[Metric]:
        run = self.monitor.run_id
        snap = self.monitor.snapshot()

        def gauge(name: str, doc: str, value: float, **labels: str) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["run", *labels])
            g.add_metric([run, *labels.values()], value)
            return g

        point = self.latest()
        if point is not None:
            yield gauge("jetrl_step", "The newest trained step.", point.step)
            yield gauge(
                "jetrl_policy_version", "The policy version the newest step made.", point.policy_version
            )
            yield gauge("jetrl_step_time_seconds", "When the newest step completed (epoch).", point.t)
            labelled: dict[str, GaugeMetricFamily] = {}
            for key, value in point.scalars().items():
                if key.startswith(_LIVE_SCALARS):
                    continue
                for prefix, (name, label) in _LABELLED.items():
                    if key.startswith(prefix):
                        fam = labelled.get(name)
                        if fam is None:
                            fam = labelled[name] = GaugeMetricFamily(
                                name, f"{prefix}<{label}> of the newest step.", labels=["run", label]
                            )
                        fam.add_metric([run, key[len(prefix) :]], value)
                        break
                else:
                    yield gauge(metric_name(key), f"{key} of the newest step.", value)
            yield from labelled.values()

        workers = snap["workers"]
        age = GaugeMetricFamily(
            "jetrl_worker_heartbeat_age_seconds",
            "Seconds since the worker's last heartbeat.",
            labels=["run", "worker", "kind"],
        )
        loaded = GaugeMetricFamily(
            "jetrl_worker_loaded_version",
            "The policy version the worker serves.",
            labels=["run", "worker", "kind"],
        )
        inflight = GaugeMetricFamily(
            "jetrl_worker_inflight", "Requests the worker has in flight.", labels=["run", "worker", "kind"]
        )
        for w in workers:
            ids = [run, w["worker_id"], w["kind"]]
            age.add_metric(ids, float(w["heartbeat_age_s"]))
            inflight.add_metric(ids, float(w["inflight"]))
            if w["loaded_version"] is not None:
                loaded.add_metric(ids, float(w["loaded_version"]))
        yield from (age, loaded, inflight)

        pending = GaugeMetricFamily(
            "jetrl_queue_pending_messages",
            "Messages a consumer has not been given yet.",
            labels=["run", "consumer"],
        )
        acks = GaugeMetricFamily(
            "jetrl_queue_ack_pending_messages",
            "Messages a consumer was given and has not acknowledged.",
            labels=["run", "consumer"],
        )
        for q in snap["queues"]:
            pending.add_metric([run, q["consumer"]], float(q["pending"]))
            acks.add_metric([run, q["consumer"]], float(q["ack_pending"]))
        yield from (pending, acks)

        yield gauge(
            "jetrl_pending_samples", "Samples asked for by tasks, not generated yet.", snap["pending_samples"]
        )
        yield gauge(
            "jetrl_pending_rollouts",
            "Scored rollouts neither trained nor withheld.",
            snap["pending_rollouts"],
        )
        yield _counter(
            run, "jetrl_dead_letters", "Dead-lettered messages, by reason.", "reason", snap["dead_letters"]
        )
        yield _counter(
            run,
            "jetrl_withheld_rollouts",
            "Rollouts withheld from training, by reason.",
            "reason",
            snap["withheld"],
        )

        firing: dict[str, int] = {}
        for a in snap["alerts"]:
            firing[a["rule"]] = firing.get(a["rule"], 0) + (1 if a["state"] == "firing" else 0)
        alerts = GaugeMetricFamily(
            "jetrl_alerts_firing", "Alerts firing now, by rule (keys firing).", labels=["run", "rule"]
        )
        for rule, n in sorted(firing.items()):
            alerts.add_metric([run, rule], float(n))
        yield alerts
        yield _counter(
            run,
            "jetrl_alerts_raised",
            "Times an alert started firing, by rule.",
            "rule",
            snap["alert_counts"],
        )

        yield _counter(
            run, "jetrl_events", "Events of the run's log folded by the monitor.", None, {"": snap["events"]}
        )
        yield gauge("jetrl_log_seq", "The sequence number of the newest event folded.", snap["last_seq"])
        yield gauge(
            "jetrl_run_finished", "1 once the run has finished.", 0.0 if snap["status"] == "running" else 1.0
        )

    # ------------------------------------------------------------------ outputs

    def render(self) -> tuple[bytes, str]:
        """The exposition (body, content type); every family is computed now."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    async def _metrics(self, request: web.Request) -> web.Response:
        body, content_type = self.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def serve(self, host: str, port: int, stop: asyncio.Event) -> None:
        """Serve ``/metrics`` until ``stop``; port 0 takes a free port (then ``self.port``)."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, host, port)
            await site.start()
            self.port = _bound_port(runner.addresses, port)
            self.serving.set()
            log.info("prometheus_serving", run_id=self.monitor.run_id, host=host, port=self.port)
            await stop.wait()
        finally:
            self.serving.clear()
            await runner.cleanup()


def _counter(run: str, name: str, doc: str, label: str | None, counts: dict[str, Any]) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc, labels=["run"] if label is None else ["run", label])
    for key, n in sorted(counts.items()):
        c.add_metric([run] if label is None else [run, key], float(n))
    return c


def _bound_port(addresses: list[Any], asked: int) -> int:
    for a in addresses:
        if isinstance(a, tuple) and len(a) >= 2:
            return int(a[1])
    return asked
