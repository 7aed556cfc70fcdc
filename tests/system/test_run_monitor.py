"""A run with its monitor part feeding the trackers ([monitor] wandb, tensorboard): the monitor
is SIGKILLed mid-run and restarted by the supervisor, and each tracker still holds every step
once, with the store's values; an alert it raised is on the log and counted in the store."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest

from jetrl.bus import events as ev
from jetrl.bus.server import EmbeddedServer
from jetrl.consumers.monitor.reader import from_store
from jetrl.deploy.config import load_config
from jetrl.deploy.supervisor import Supervisor
from jetrl.store import queries
from jetrl.store.db import open_store
from tests.support.runlog import bodies, read_log
from tests.support.trackers import check_once

pytestmark = pytest.mark.slow
pytest.importorskip("wandb")
pytest.importorskip("tensorboard")

# Enough steps after the kill for the supervisor to restart the monitor before the run ends,
# however fast the machine (12 were not, once).
STEPS = 30
KILL_AT = 4


async def test_trackers_hold_every_step_once_across_a_killed_monitor(
    nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    cfg = load_config(
        None,
        [
            *("--trainer.max_steps", str(STEPS), "--trainer.batch_groups", "2"),
            *("--trainer.checkpoint_every", "100", "--inference.workers", "1"),
            *("--envs.0.group_size", "4", "--store.recorder", "true"),
            *("--monitor.wandb", "true", "--monitor.tensorboard", "true"),
            # Any mismatch at all: the alert fires at the first step and stays firing. Sampled
            # in bf16 and trained in fp32 there is one at every step (in fp32 on both sides, as
            # `auto` samples on a CPU, it can be below any threshold).
            *("--monitor.rules.mismatch_kl", "1e-12", "--inference.precision", "bf16"),
            *("--bus.max_gib", "0.25", "--bus.payload_max_gib", "0.5"),
        ],
    )
    run_id = "monrun"
    sup = Supervisor(cfg, run_id, tmp_path / run_id, nats_url=nats_server.url, quiet=True)
    run = asyncio.create_task(sup.run())
    killed = False
    while not run.done():
        await asyncio.sleep(0.1)
        mon = next((p for p in sup.parts if p.name == "monitor"), None)
        if not killed and mon is not None and mon.proc is not None and len(sup.progress.steps) >= KILL_AT:
            # Off the training's path, the monitor yields the cores ([run] follower_nice).
            nice = os.getpriority(os.PRIO_PROCESS, mon.proc.pid)
            assert nice == min(19, os.getpriority(os.PRIO_PROCESS, 0) + cfg.run.follower_nice) > 0
            mon.proc.send_signal(signal.SIGKILL)  # mid-run: no close, no flush
            killed = True
    assert await run == 0
    assert killed, "the run ended before the monitor could be killed"
    assert next(p for p in sup.parts if p.name == "monitor").restarts >= 1

    store = open_store(sup.db_url)
    try:
        with store.read() as conn:
            expected = list(from_store(conn, run_id).steps)
        assert [p.step for p in expected] == list(range(STEPS))
        check_once(tmp_path / run_id / "monitor", run_id, expected)
        counts = queries.alert_counts(store, run_id)
    finally:
        store.close()
    # The alert is a fact of the log, raised once though two monitor processes saw it fire.
    log = await read_log(nats_server.url, run_id)
    fired = [a for a in bodies(log, ev.AlertRaised) if a.rule == "mismatch_kl" and a.state == "firing"]
    assert len(fired) == 1
    assert counts["mismatch_kl"]["firing"] == len(fired)
    summary = json.loads((tmp_path / run_id / "summary.json").read_text())
    assert summary["alerts"]["mismatch_kl"] == len(fired)
