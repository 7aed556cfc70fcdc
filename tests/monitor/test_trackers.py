"""The tracker bridge (consumers/monitor/trackers.py): step points into W&B (offline) and
TensorBoard, read back with each tracker's own reader, and written once across restarts and
crashes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jetrl.consumers.monitor.series import MonitorState, StepPoint
from jetrl.consumers.monitor.settings import MonitorSettings
from jetrl.consumers.monitor.trackers import open_trackers
from jetrl.store import readmodel as rec
from tests.support.trackers import check_once

pytest.importorskip("wandb")
pytest.importorskip("tensorboard")

RUN = "trk-run"
BOTH = MonitorSettings(wandb=True, wandb_mode="offline", tensorboard=True, alerts=False)


def records(steps: int) -> list[rec.Fact]:
    """A run's log: each step trains on four rollouts of two envs and two tenants."""
    out: list[rec.Fact] = []
    seq, t = 0, 1_000.0

    def nxt() -> tuple[int, float]:
        nonlocal seq, t
        seq += 1
        t += 0.25
        return seq, t

    out.append(rec.Started(*nxt(), config={"trainer": {"max_off_policy_steps": 2}}))
    for step in range(steps):
        out.append(rec.Tasked(*nxt(), tenant="run", env="add", samples=4))
        ids = []
        for g, (env, tenant) in enumerate((("add", "run"), ("mul", "acme"))):  # two groups of two
            gen = f"g{step}-{g}"
            members = [2 * k + g for k in range(2)]
            out.append(
                rec.Generated(
                    *nxt(),
                    event_id=gen,
                    worker_id="w0",
                    samples=tuple(
                        rec.GeneratedSample(f"r{step}-{i}", i, "length" if i == 3 else "stop", None)
                        for i in members
                    ),
                    load_wait_s=0.01 * g,
                    generate_s=0.1,
                )
            )
            rollouts = tuple(
                rec.ScoredOne(
                    rollout_id=f"r{step}-{i}",
                    reward=((step * 7 + i * 3) % 10) / 10,
                    version_start=max(0, step - i % 2),
                    length=10 + i,
                )
                for i in members
            )
            out.append(rec.Scored(*nxt(), tenant=tenant, env=env, generation_event_id=gen, rollouts=rollouts))
            ids += [r.rollout_id for r in rollouts]
        metrics = {"loss": 1.0 / (step + 1), "entropy": 2.0 - 0.1 * step, "grad_norm": 0.5 + step}
        out.append(
            rec.Stepped(
                *nxt(), step=step, version=step + 1, tokens=400, metrics=metrics, rollout_ids=tuple(ids)
            )
        )
    return out


def points(steps: int) -> list[StepPoint]:
    state = MonitorState(RUN)
    got = [p for r in records(steps) if (p := state.apply(r)) is not None]
    assert [p.step for p in got] == list(range(steps))
    return got


def test_points_reach_both_trackers(tmp_path: Path) -> None:
    pts = points(5)
    bridge = open_trackers(BOTH, RUN, tmp_path)
    assert bridge is not None
    for p in pts:
        bridge.listener(p)
    pos = json.loads((tmp_path / "position.json").read_text())
    assert (pos["step"], pos["seq"]) == (4, pts[-1].seq)
    assert pos["trackers"] == {
        "tensorboard": {"step": 4, "seq": pts[-1].seq},
        "wandb": {"step": 4, "seq": pts[-1].seq},
    }
    bridge.close()
    check_once(tmp_path, RUN, pts)
    assert any(pts[0].scalars()[k] != pts[1].scalars()[k] for k in pts[0].scalars())  # values vary


def test_no_tracker_no_bridge(tmp_path: Path) -> None:
    assert open_trackers(MonitorSettings(), RUN, tmp_path) is None
    assert not any(tmp_path.iterdir())


def test_restart_writes_each_point_once(tmp_path: Path) -> None:
    pts = points(8)
    first = open_trackers(BOTH, RUN, tmp_path)
    assert first is not None
    for p in pts[:5]:
        first.listener(p)
    first.close()

    # A restart: the monitor folds the log from the start, every point comes again.
    again = open_trackers(BOTH, RUN, tmp_path)
    assert again is not None
    assert again.done == {"tensorboard": 4, "wandb": 4}
    for p in pts:
        again.listener(p)
    assert (again.written, again.skipped) == (3, 5)
    again.close()
    check_once(tmp_path, RUN, pts)

    # A crash after the trackers took step 7 and before position.json said so: the trackers'
    # own files say where each one is, so step 7 is not written again.
    (tmp_path / "position.json").write_text(json.dumps({"step": 6, "seq": pts[6].seq}))
    third = open_trackers(BOTH, RUN, tmp_path)
    assert third is not None
    assert third.done == {"tensorboard": 7, "wandb": 7}
    for p in pts:
        third.listener(p)
    assert third.written == 0
    third.close()
    check_once(tmp_path, RUN, pts)


def test_crash_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    """A monitor killed mid-run (os._exit: no close, no flush of wandb-core's buffer): W&B's
    transaction log lacks the points position.json counts, TensorBoard's holds them all; the
    restarted bridge writes exactly the missing ones to each."""
    child = textwrap.dedent(
        f"""
        import os, sys
        from pathlib import Path
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_trackers import BOTH, RUN, points
        from jetrl.consumers.monitor.trackers import open_trackers
        bridge = open_trackers(BOTH, RUN, Path({str(tmp_path)!r}))
        for p in points(4):
            bridge.listener(p)
        os._exit(3)
        """
    )
    # Not this process's wandb-core (WANDB_SERVICE): the child's dies with it, as in a crash.
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert json.loads((tmp_path / "position.json").read_text())["step"] == 3

    pts = points(6)
    bridge = open_trackers(BOTH, RUN, tmp_path)
    assert bridge is not None
    assert bridge.done["tensorboard"] == 3
    # wandb-core drops its unflushed buffer with its parent (all 4 points, when it had not
    # flushed yet): the bridge resumes W&B from what its transaction log holds.
    assert bridge.done["wandb"] <= 3
    for p in pts:
        bridge.listener(p)
    bridge.close()
    check_once(tmp_path, RUN, pts)
