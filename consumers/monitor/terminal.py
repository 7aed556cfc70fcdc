"""The terminal dashboard: the monitor's snapshot and recent steps as rich tables.

``render`` builds one frame from a :class:`Monitor`; ``jetrl monitor RUN`` redraws it every
second with ``rich.live``. Each series shows its latest value and a sparkline of the last
steps, so a trend (reward climbing, mismatch KL growing) is visible without a chart.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from jetrl.consumers.monitor.series import StepPoint
from jetrl.consumers.monitor.service import Monitor

SPARK = "▁▂▃▄▅▆▇█"
SPARK_STEPS = 40

# (label, scalar name, format): the rows of the series table, in the order people read them.
ROWS: tuple[tuple[str, str, str], ...] = (
    ("reward", "reward/mean", "{:.3f}"),
    ("loss", "trainer/loss", "{:.4f}"),
    ("mismatch KL mean", "trainer/mismatch_kl", "{:.2e}"),
    ("mismatch KL max", "trainer/mismatch_kl_max", "{:.2e}"),
    ("entropy", "trainer/entropy", "{:.3f}"),
    ("masked share", "trainer/masked_frac", "{:.3f}"),
    ("grad norm", "trainer/grad_norm", "{:.3f}"),
    ("learning rate", "trainer/lr", "{:.2e}"),
    ("staleness (trained)", "staleness/mean", "{:.2f}"),
    ("staleness max", "staleness/max", "{:.0f}"),
    ("staleness (queued)", "staleness/queued_mean", "{:.2f}"),
    ("sequence length", "rollouts/seq_len_mean", "{:.1f}"),
    ("truncated share", "rollouts/truncated_frac", "{:.3f}"),
    ("tokens/s", "throughput/tokens_per_s", "{:.0f}"),
    ("trainer idle (batch wait)", "trainer/trainer_idle_frac", "{:.1%}"),
    ("inference idle (weight wait)", "inference/weight_wait_frac", "{:.1%}"),
    ("pending samples", "queue/pending_samples", "{:.0f}"),
    ("pending rollouts", "queue/pending_rollouts", "{:.0f}"),
    ("withheld (per step)", "rollouts/withheld", "{:.0f}"),
    ("late samples (per step)", "rollouts/late_samples", "{:.0f}"),
    ("dead letters (per step)", "rollouts/dead_letters", "{:.0f}"),
)


def sparkline(values: Sequence[float]) -> str:
    if not values:
        return ""
    lo, hi = min(values), max(values)
    if hi - lo <= 1e-12:
        return SPARK[0] * len(values)
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / (hi - lo) * len(SPARK)))] for v in values)


def _fmt(fmt: str, v: float | None) -> str:
    return "" if v is None else fmt.format(v)


def _series(points: list[StepPoint]) -> Table:
    t = Table(title="series (latest, last steps)", expand=True)
    t.add_column("series")
    t.add_column("latest", justify="right")
    t.add_column(f"last {SPARK_STEPS} steps", no_wrap=True)
    recent = [p.scalars() for p in points[-SPARK_STEPS:]]
    for label, key, fmt in ROWS:
        vals = [s.get(key, 0.0) for s in recent]
        t.add_row(label, _fmt(fmt, vals[-1] if vals else None), Text(sparkline(vals), style="cyan"))
    return t


def _scopes(last: StepPoint | None) -> Table:
    t = Table(title="reward by environment and tenant (last step)", expand=True)
    t.add_column("scope")
    t.add_column("name")
    t.add_column("reward", justify="right")
    if last is not None:
        for name, v in last.reward_by_env.items():
            t.add_row("env", name, f"{v:.3f}")
        for name, v in last.reward_by_tenant.items():
            t.add_row("tenant", name, f"{v:.3f}")
    return t


def _workers(snap: dict[str, Any]) -> Table:
    t = Table(title="workers", expand=True)
    for col in ("worker", "kind", "status", "loaded version", "heartbeat age"):
        t.add_column(col)
    for w in snap["workers"]:
        age = w["heartbeat_age_s"]
        style = "red" if age > 10 and snap["status"] == "running" else ""
        lv = w["loaded_version"]
        t.add_row(
            w["worker_id"],
            w["kind"],
            w["status"],
            "" if lv is None else f"v{lv}",
            f"{age:.1f} s",
            style=style,
        )
    return t


def _queues(snap: dict[str, Any]) -> Table:
    t = Table(title="queues (consumers' state)", expand=True)
    t.add_column("consumer")
    t.add_column("pending", justify="right")
    t.add_column("unacked", justify="right")
    for q in snap["queues"]:
        t.add_row(q["consumer"], str(q["pending"]), str(q["ack_pending"]))
    t.add_row("log: samples asked, not generated", str(snap["pending_samples"]), "")
    t.add_row("log: rollouts scored, not trained", str(snap["pending_rollouts"]), "")
    return t


def _alerts(snap: dict[str, Any]) -> Table:
    t = Table(title="alerts", expand=True)
    for col in ("state", "rule", "key", "step", "message"):
        t.add_column(col)
    for a in snap["alerts"][:8]:
        style = "bold red" if a["state"] == "firing" else "green"
        t.add_row(a["state"], a["rule"], a["key"], str(a["step"]), a["message"], style=style)
    counts = ", ".join(f"{k} {v}" for k, v in snap["alert_counts"].items()) or "none"
    t.caption = f"raised so far: {counts}"
    return t


def render(monitor: Monitor) -> Group:
    snap = monitor.snapshot()
    points = list(monitor.state.steps)
    last = points[-1] if points else None
    head = Text()
    head.append(f"jetrl run {snap['run_id']}  ", style="bold")
    head.append(snap["status"], style="green" if snap["status"] in ("running", "completed") else "red")
    head.append(
        f"  | step {last.step if last else '-'}  version v{last.policy_version if last else '-'}"
        f"  | {snap['events']} events, log seq {snap['last_seq']}"
        f"  | {'live' if snap['live'] else 'from the store'}  | {time.strftime('%H:%M:%S')}"
    )
    dead = ", ".join(f"{k} {v}" for k, v in snap["dead_letters"].items()) or "none"
    withheld = ", ".join(f"{k} {v}" for k, v in snap["withheld"].items()) or "none"
    foot = Text(f"withheld: {withheld}   dead letters: {dead}")
    return Group(
        Panel(head),
        _series(points),
        _scopes(last),
        _workers(snap),
        _queues(snap),
        _alerts(snap),
        foot,
    )
