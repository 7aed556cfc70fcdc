"""Reading the trackers' files back with their own readers (TensorBoard's EventAccumulator,
wandb's ``wandb leet inspect``), and the check that each holds every step point once."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from jetrl.consumers.monitor.series import StepPoint


def tensorboard_series(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(log_dir), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_history(wandb_dir: Path, run_id: str) -> list[dict[str, float]]:
    """Every history row of the run's offline sessions, read by wandb's own reader
    (``wandb leet inspect --json``, wandb-core's transaction-log reader)."""
    exe = Path(sys.executable).parent / "wandb"
    rows = []
    for path in sorted(wandb_dir.glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb")):
        out = subprocess.run(
            [str(exe), "leet", "inspect", "--json", str(path)], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        for line in out.stdout.splitlines():
            r = json.loads(line)
            if r.get("type") == "history":
                item = dict(r["history"]["item"])
                assert item["_step"] == r["history"]["step"]["num"]
                rows.append(item)
    return rows


def check_once(out_dir: Path, run_id: str, expected: list[StepPoint]) -> None:
    """Each tracker holds every expected point, once, with its values."""
    tb = tensorboard_series(out_dir / "tensorboard")
    for tag, series in tb.items():
        steps = [s for s, _ in series]
        assert steps == sorted(set(steps)), f"tensorboard {tag}: steps written twice or out of order"
    for p in expected:
        for k, v in p.scalars().items():
            assert dict(tb[k])[p.step] == pytest.approx(v, rel=1e-6, abs=1e-7), (k, p.step)  # float32
    assert {s for series in tb.values() for s, _ in series} == {p.step for p in expected}

    rows = wandb_history(out_dir / "wandb", run_id)
    counts = Counter(int(r["_step"]) for r in rows)
    assert sorted(counts) == [p.step for p in expected]
    assert set(counts.values()) == {1}, f"W&B steps written twice: {counts}"
    by_step = {int(r["_step"]): r for r in rows}
    for p in expected:
        row = by_step[p.step]
        for k, v in p.scalars().items():
            assert float(row[k]) == pytest.approx(v, rel=1e-12), (k, p.step)
