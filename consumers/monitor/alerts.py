"""Alert rules over the monitor's state: what fires, what resolves, as AlertRaised bodies.

Each rule looks at the state at a moment ``now`` (the wall clock for a live run, the newest
event's time when folding history) and says, per key, whether its condition holds and the
value it measured. :class:`Alerts` remembers which alerts are firing and returns only the
transitions, so an alert is raised once and resolved once; the monitor part publishes them
under ids derived from (rule, key, state, step), so two monitors of one run raise each once.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from jetrl.bus import events as ev
from jetrl.bus.settings import MAX_OFF_POLICY_STEPS
from jetrl.consumers.monitor.series import AlertView, MonitorState
from jetrl.consumers.monitor.settings import AlertSettings


@dataclass(frozen=True)
class Condition:
    rule: str
    key: str
    holds: bool
    value: float
    threshold: float
    severity: Literal["warning", "critical"]
    message: str


def _version_lag(state: MonitorState, s: AlertSettings) -> int:
    if s.max_version_lag is not None:
        return s.max_version_lag
    lag = _trainer_setting(state, "max_off_policy_steps")
    return int(lag) if lag is not None else MAX_OFF_POLICY_STEPS


def _trainer_setting(state: MonitorState, key: str) -> float | None:
    """A number of the run's [trainer] settings as RunStarted recorded them (None if absent)."""
    value = state.config.get("trainer", {}).get(key)
    return float(value) if isinstance(value, int | float) else None


def conditions(state: MonitorState, s: AlertSettings, now: float) -> Iterator[Condition]:
    running = state.finished is None
    steps = list(state.steps)

    # The trainer stalled: no step for long, once it has stepped.
    if state.last_step_t is not None:
        gaps = [b.t - a.t for a, b in itertools.pairwise(steps)]
        limit = max(s.trainer_stall_s, 10 * statistics.median(gaps)) if gaps else s.trainer_stall_s
        idle = now - state.last_step_t
        yield Condition(
            "trainer_stalled",
            "trainer",
            running and idle > limit,
            idle,
            limit,
            "critical",
            f"no trainer step for {idle:.0f} s (limit {limit:.0f} s)",
        )

    lag_limit = _version_lag(state, s)
    for w in state.workers.values():
        age = now - w.last_seen
        lost = running and w.status != "stopping" and age > s.heartbeat_lost_s
        yield Condition(
            "heartbeat_lost",
            w.worker_id,
            lost,
            age,
            s.heartbeat_lost_s,
            "critical",
            f"worker {w.worker_id} silent for {age:.0f} s",
        )
        if w.kind == "inference" and w.loaded_version is not None:
            lag = state.latest_version - w.loaded_version
            yield Condition(
                "stale_version",
                w.worker_id,
                running and not lost and lag > lag_limit,
                float(lag),
                float(lag_limit),
                "warning",
                f"worker {w.worker_id} serves v{w.loaded_version}, {lag} behind v{state.latest_version}",
            )

    recent = state.dead_letters_since(now - 60.0)
    yield Condition(
        "dead_letters_rising",
        "run",
        recent >= s.dead_letters_per_min,
        float(recent),
        float(s.dead_letters_per_min),
        "warning",
        f"{recent} dead letters in the last minute",
    )

    if steps:
        last = steps[-1]
        kl = last.trainer.get("mismatch_kl", 0.0)
        yield Condition(
            "mismatch_kl",
            "trainer",
            kl > s.mismatch_kl,
            kl,
            s.mismatch_kl,
            "warning",
            f"train/inference mismatch KL {kl:.4f} at step {last.step} (threshold {s.mismatch_kl})",
        )

    if steps:
        last = steps[-1]
        bad = [k for k in ("loss", "grad_norm") if not math.isfinite(last.trainer.get(k, 0.0))]
        yield Condition(
            "loss_not_finite",
            "trainer",
            bool(bad),
            float(len(bad)),
            0.0,
            "critical",
            f"{' and '.join(bad) or 'loss'} not finite at step {last.step}",
        )

    n = s.reward_window
    if len(steps) >= 2 * n:
        rewards = [p.reward_mean for p in steps]
        means = [sum(rewards[i - n : i]) / n for i in range(n, len(rewards) + 1)]
        best, now_mean = max(means), means[-1]
        drop = (best - now_mean) / abs(best) if best else 0.0
        yield Condition(
            "reward_collapse",
            "run",
            best > 0 and drop >= s.reward_drop,
            now_mean,
            best * (1 - s.reward_drop),
            "critical",
            f"reward ({n}-step mean) {now_mean:.3f}, down {100 * drop:.0f}% from its best {best:.3f}",
        )

    # Groups whose rewards are all alike teach nothing: most of them, for a window, below the
    # run's target, is a policy that no longer varies its answers (a collapse; the entropy says).
    if len(steps) >= n:
        share = sum(p.trainer.get("groups_no_signal", 0.0) for p in steps[-n:]) / n
        reward = sum(p.reward_mean for p in steps[-n:]) / n
        target = _trainer_setting(state, "stop_at_reward")
        entropy = steps[-1].trainer.get("entropy", float("nan"))
        yield Condition(
            "no_signal",
            "run",
            running and share >= s.no_signal and (target is None or reward < target),
            share,
            s.no_signal,
            "warning",
            f"{100 * share:.0f}% of the last {n} steps' groups had rewards all alike, so no advantage "
            f"to learn from (reward {reward:.3f}, entropy {entropy:.3f}): the policy may have collapsed",
        )


class Alerts:
    """``check`` returns the transitions from the state's alerts (those this monitor raised, and
    those on the log: another monitor's, or its own before a restart, so an alert firing on the
    log is not raised again) and notes them in the state."""

    def __init__(self, settings: AlertSettings) -> None:
        self.s = settings

    def check(self, state: MonitorState, now: float) -> list[ev.AlertRaised]:
        step = state.steps[-1].step if state.steps else -1
        firing = state.firing()
        out = []
        for c in conditions(state, self.s, now):
            if c.holds == ((c.rule, c.key) in firing):
                continue
            raised = ev.AlertRaised(
                rule=c.rule,
                key=c.key,
                state="firing" if c.holds else "resolved",
                severity=c.severity,
                message=c.message if c.holds else f"resolved: {c.message}",
                step=step,
                value=round(c.value, 6),
                threshold=round(c.threshold, 6),
            )
            state.note_alert(
                AlertView(raised.rule, raised.key, raised.state, raised.severity, raised.message, step, now)
            )
            out.append(raised)
        return out
