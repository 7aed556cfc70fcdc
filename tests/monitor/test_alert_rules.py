"""Alert rules: each fires when its condition holds, resolves when it stops, and says so once."""

from __future__ import annotations

from jetrl.consumers.monitor.alerts import Alerts
from jetrl.consumers.monitor.series import MonitorState
from jetrl.consumers.monitor.settings import AlertSettings
from jetrl.store import readmodel as rec


def state_with(*rs: rec.Fact) -> MonitorState:
    s = MonitorState("r")
    for r in rs:
        s.apply(r)
    return s


def step(seq: int, t: float, n: int, reward: float = 0.5, **metrics: float) -> list[rec.Fact]:
    rid = f"r{n}"
    return [
        rec.Scored(seq, t - 0.5, "default", "math", f"g{n}", (rec.ScoredOne(rid, reward, n, 4),)),
        rec.Stepped(seq + 1, t, n, n + 1, 4, dict(metrics), (rid,)),
    ]


def fired(alerts: Alerts, state: MonitorState, now: float) -> set[tuple[str, str, str]]:
    return {(a.rule, a.key, a.state) for a in alerts.check(state, now)}


def test_trainer_stall_fires_once_and_resolves() -> None:
    s = state_with(rec.Started(1, 0.0, {}), *[r for n in range(5) for r in step(10 + 2 * n, 10.0 + n, n)])
    a = Alerts(AlertSettings(trainer_stall_s=30))
    assert fired(a, s, 20.0) == set()
    assert fired(a, s, 60.0) == {("trainer_stalled", "trainer", "firing")}
    assert fired(a, s, 61.0) == set()  # still firing: not raised again
    for r in step(40, 62.0, 5):
        s.apply(r)
    assert fired(a, s, 62.5) == {("trainer_stalled", "trainer", "resolved")}


def test_worker_heartbeat_lost_and_stale_version() -> None:
    s = state_with(
        rec.Started(1, 0.0, {"trainer": {"max_off_policy_steps": 1}}),
        rec.Beat(2, 1.0, "inf-0", "inference", "ready", 0, 0),
        rec.Beat(3, 1.0, "inf-1", "inference", "ready", 0, 0),
        *[r for n in range(4) for r in step(10 + 2 * n, 2.0 + n, n)],
        rec.Beat(30, 9.0, "inf-0", "inference", "ready", 3, 0),
    )
    a = Alerts(AlertSettings(heartbeat_lost_s=5))
    got = fired(a, s, 10.0)
    # inf-1 is silent for 9 s and still on v0 (4 behind v4): lost, and a lost worker is not
    # also called stale; inf-0 is on v3, within the bound of 1.
    assert got == {("heartbeat_lost", "inf-1", "firing")}
    s.apply(rec.Beat(31, 10.5, "inf-1", "inference", "ready", 0, 0))
    assert fired(a, s, 11.0) == {
        ("heartbeat_lost", "inf-1", "resolved"),
        ("stale_version", "inf-1", "firing"),
    }
    s.apply(rec.Finished(40, 12.0, "completed", 4))
    assert fired(a, s, 100.0) == {("stale_version", "inf-1", "resolved")}  # a finished run: none


def test_dead_letters_mismatch_and_reward_collapse() -> None:
    rs: list[rec.Fact] = [rec.Started(1, 0.0, {})]
    seq = 10
    for n in range(20):
        rs += step(seq, 10.0 + n, n, reward=1.0 if n < 10 else 0.2, mismatch_kl=0.2 if n == 19 else 0.001)
        seq += 2
    rs += [rec.Dead(100 + i, 29.0, "acme", "malformed") for i in range(5)]
    s = state_with(*rs)
    a = Alerts(AlertSettings(dead_letters_per_min=5, mismatch_kl=0.05, reward_window=5, reward_drop=0.5))
    got = fired(a, s, 30.0)
    assert ("dead_letters_rising", "run", "firing") in got
    assert ("mismatch_kl", "trainer", "firing") in got
    assert ("reward_collapse", "run", "firing") in got
    assert fired(a, s, 200.0) >= {("dead_letters_rising", "run", "resolved")}


def test_an_alert_folded_back_from_the_log_is_counted_once() -> None:
    s = state_with(rec.Started(1, 0.0, {}))
    for r in step(10, 10.0, 0):
        s.apply(r)
    a = Alerts(AlertSettings(trainer_stall_s=1))
    (raised,) = a.check(s, 100.0)
    from jetrl.consumers.monitor.series import AlertView

    s.note_alert(
        AlertView(raised.rule, raised.key, raised.state, raised.severity, raised.message, raised.step, 100.0)
    )
    s.apply(
        rec.Alerted(
            20, 100.1, raised.rule, raised.key, raised.state, raised.severity, raised.message, raised.step
        )
    )
    assert s.alert_counts == {"trainer_stalled": 1}
    assert s.snapshot(101.0)["alerts"][0]["state"] == "firing"


def test_a_loss_that_is_not_finite_is_critical_and_shown_as_it_is() -> None:
    s = state_with(rec.Started(1, 0.0, {}), *step(10, 10.0, 0, loss=float("nan"), grad_norm=1.0))
    assert s.steps[-1].scalars()["trainer/loss"] != s.steps[-1].scalars()["trainer/loss"]  # NaN kept
    a = Alerts(AlertSettings())
    assert ("loss_not_finite", "trainer", "firing") in fired(a, s, 11.0)
    for r in step(20, 12.0, 1, loss=0.5, grad_norm=1.0):
        s.apply(r)
    assert ("loss_not_finite", "trainer", "resolved") in fired(a, s, 12.5)


def test_a_config_without_the_bound_is_held_to_the_trainers_default() -> None:
    # The run's config names no [trainer] max_off_policy_steps: the trainer then accepts 1, and
    # a worker 2 versions behind is stale by that bound (it would not be by a bound of 2).
    s = state_with(
        rec.Started(1, 0.0, {}),
        *[r for n in range(4) for r in step(10 + 2 * n, 2.0 + n, n)],
        rec.Beat(30, 9.0, "inf-0", "inference", "ready", 2, 0),
    )
    assert fired(Alerts(AlertSettings(heartbeat_lost_s=60)), s, 10.0) == {
        ("stale_version", "inf-0", "firing")
    }


def test_no_signal_fires_below_the_target_and_resolves_when_groups_vary_again() -> None:
    started = rec.Started(1, 0.0, {"trainer": {"stop_at_reward": 0.9}})
    rs: list[rec.Fact] = [started]
    seq = 10
    for n in range(6):  # groups alike, reward 0.75: collapsed below the target
        rs += step(seq, 10.0 + n, n, reward=0.75, groups_no_signal=0.95, entropy=0.01)
        seq += 2
    s = state_with(*rs)
    a = Alerts(AlertSettings(reward_window=5, no_signal=0.9))
    assert ("no_signal", "run", "firing") in fired(a, s, 16.0)
    for n in range(6, 11):  # the groups vary again
        for r in step(seq, 10.0 + n, n, reward=0.75, groups_no_signal=0.5):
            s.apply(r)
        seq += 2
    assert ("no_signal", "run", "resolved") in fired(a, s, 21.0)


def test_no_signal_does_not_fire_on_a_run_that_reached_its_target() -> None:
    rs: list[rec.Fact] = [rec.Started(1, 0.0, {"trainer": {"stop_at_reward": 0.9}})]
    for n in range(6):  # every group all right: a task learnt, not a stall
        rs += step(10 + 2 * n, 10.0 + n, n, reward=1.0, groups_no_signal=1.0)
    a = Alerts(AlertSettings(reward_window=5, no_signal=0.9))
    assert not {f for f in fired(a, state_with(*rs), 16.0) if f[0] == "no_signal"}
    # Without a target in its config, alike groups are reported whatever the reward.
    rs[0] = rec.Started(1, 0.0, {})
    untargeted = Alerts(AlertSettings(reward_window=5))
    assert ("no_signal", "run", "firing") in fired(untargeted, state_with(*rs), 16.0)
