"""`jetrl plot RUN`: the reward curve and held-out evaluations drawn from a run's log on the
session's nats-server, each step once."""

from __future__ import annotations

from pathlib import Path

from jetrl.bus import events as ev
from jetrl.bus.client import Bus
from jetrl.bus.server import EmbeddedServer
from jetrl.deploy.plot_cmd import plot, report_of
from tests.support.report_bodies import evaluation


def _step(n: int, reward: float) -> ev.StepCompleted:
    return ev.StepCompleted(
        step=n, policy_version=n + 1, rollout_ids=[], metrics={"reward_mean": reward}, tokens=10
    )


async def test_a_runs_curve_is_drawn_from_its_log(
    nats_server: EmbeddedServer, bus: Bus, run_id: str, tmp_path: Path
) -> None:
    out = tmp_path / "curve.png"
    assert await plot(nats_server.url, run_id, out) == 2 and not out.exists()  # no steps yet
    bodies: list[ev.EventBody] = [
        ev.RunStarted(config={}, code_version="test"),
        evaluation("parity", 0, 0.25, 0.25, samples=2),
        _step(0, 0.1),
        _step(1, 0.3),
        _step(1, 0.9),  # a step logged twice (a recovered trainer): the first counts
        evaluation("parity", 2, 0.5, 0.5, samples=2),
        _step(2, 0.6),
    ]
    for i, body in enumerate(bodies):
        await bus.publish(ev.new_event(body, run_id=run_id, event_id=f"{run_id}-{i}"))
    report = await report_of(nats_server.url, run_id)
    assert [(s["step"], s["reward_mean"]) for s in report.steps] == [(0, 0.1), (1, 0.3), (2, 0.6)]
    assert all(s["t"] >= 0 for s in report.steps)
    assert {v: e.pass_at_1 for v, e in report.evaluations["parity"].items()} == {0: 0.25, 2: 0.5}
    assert await plot(nats_server.url, run_id, out) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
