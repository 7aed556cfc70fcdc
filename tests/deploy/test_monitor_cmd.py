"""`jetrl monitor RUN`: one frame of a finished run from its store, of a live one from its
server, and the errors a user can act on."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jetrl.bus.client import Bus
from jetrl.bus.server import EmbeddedServer
from jetrl.deploy.monitor_cmd import parse_time
from jetrl.store.db import open_store, sqlite_url
from jetrl.store.projection import apply_batch
from tests.support.synthetic import log_items, publish_events, synthetic_run


def test_parse_time() -> None:
    now = 1_000_000.0
    assert parse_time("now", now) == now
    assert parse_time("-30m", now) == now - 1800
    assert parse_time("-2h", now) == now - 7200
    assert parse_time("1760000000", now) == 1_760_000_000.0
    assert parse_time("2026-01-02T03:04:05+00:00", now) == 1767323045.0
    with pytest.raises(SystemExit, match="--from-time"):
        parse_time("yesterday", now)


def jetrl(*args: str) -> subprocess.CompletedProcess[str]:
    """The command in a process of its own (it configures logging and signals as it runs)."""
    return subprocess.run(
        [sys.executable, "-m", "jetrl.deploy.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_a_finished_run_is_shown_from_its_store(tmp_path: Path) -> None:
    run = synthetic_run("cmdmon", steps=6, tasks_per_step=3, group_size=4)
    (tmp_path / "cmdmon").mkdir()
    store = open_store(sqlite_url(tmp_path / "cmdmon" / "store.db"))
    with store.write() as conn:
        apply_batch(conn, run_id="cmdmon", stream="S", consumer="c", items=log_items(run.events))
    store.close()
    done = jetrl("monitor", "cmdmon", "--runs-dir", str(tmp_path), "--once")
    assert done.returncode == 0, done.stderr
    assert "from the store" in done.stdout and "completed" in done.stdout
    assert "step 6  version v6" in done.stdout
    later = jetrl("monitor", "cmdmon", "--runs-dir", str(tmp_path), "--once", "--from-step", "4")
    assert later.returncode == 0 and "step 6" in later.stdout


def test_no_server_and_no_store_says_so(tmp_path: Path) -> None:
    done = jetrl("monitor", "nothere", "--runs-dir", str(tmp_path), "--once")
    assert done.returncode == 2
    assert "no live server for nothere and no store" in done.stderr


def test_a_database_that_is_not_a_store_is_named_and_not_migrated(tmp_path: Path) -> None:
    (tmp_path / "other.db").touch()  # an empty SQLite database, not a jetrl store
    db = f"sqlite:///{tmp_path / 'other.db'}"
    done = jetrl("monitor", "r", "--db", db, "--runs-dir", str(tmp_path), "--once")
    assert done.returncode == 2
    assert f"jetrl monitor: not a jetrl store: {db} has no tables" in done.stderr
    assert "Traceback" not in done.stderr
    assert (tmp_path / "other.db").stat().st_size == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.db"]


async def test_a_live_run_is_shown_from_its_server(
    nats_server: EmbeddedServer, run_id: str, tmp_path: Path
) -> None:
    bus = await Bus.connect(nats_server.url)
    await bus.ensure_run(run_id)
    now = time.time()
    run = synthetic_run(run_id, steps=4, tasks_per_step=2, group_size=2, t0=now - 60)
    await publish_events(bus, run.events[:-1])  # not finished: no RunFinished
    await bus.close()
    args = ["monitor", run_id, "--nats-url", nats_server.url, "--runs-dir", str(tmp_path), "--once"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "jetrl.deploy.cli", *args, stdout=asyncio.subprocess.PIPE
    )
    stdout, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0
    out = stdout.decode()
    assert "live" in out and "running" in out and "step 4  version v4" in out
    # The backlog of the run's durable consumers comes from the server (none here).
    assert "log: rollouts scored, not trained" in out


@pytest.mark.slow
async def test_a_finished_runs_inspector_reads_the_runs_own_log_files(tmp_path: Path) -> None:
    from jetrl.consumers.monitor.service import Monitor
    from jetrl.deploy.config import load_config
    from jetrl.deploy.monitor_cmd import private_log
    from jetrl.deploy.supervisor import Supervisor

    cfg = load_config(
        None,
        [
            *("--trainer.max_steps", "3", "--trainer.batch_groups", "2", "--inference.workers", "1"),
            *("--envs.0.group_size", "4", "--monitor.alerts", "false"),
            *("--bus.max_gib", "0.25", "--bus.payload_max_gib", "0.5"),
        ],
    )
    run_dir = tmp_path / "fin"
    assert await Supervisor(cfg, "fin", run_dir, quiet=True).run() == 0  # its own server, now gone
    store = open_store(sqlite_url(run_dir / "store.db"))
    try:
        async with private_log(run_dir) as log_bus:
            assert log_bus is not None
            monitor = Monitor("fin", store=store, log_bus=log_bus)
            monitor.load_store()
            assert [p.step for p in monitor.state.steps] == [0, 1, 2]
            view = await monitor.inspect(1)
    finally:
        store.close()
    assert view is not None and view["recorded"] and len(view["rollouts"]) == 8
    assert all(t["train_lp"] is not None for r in view["rollouts"] for t in r["tokens"])
    async with private_log(tmp_path / "nolog") as none:
        assert none is None
