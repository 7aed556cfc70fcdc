"""The store's CLI commands (deploy/store_cmd.py) on a recorded run."""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
from pathlib import Path

import pytest
import sqlalchemy as sa

from jetrl.bus.client import Bus
from jetrl.bus.server import EmbeddedServer
from jetrl.consumers.recorder import Recorder
from jetrl.deploy import store_cmd
from jetrl.store import schema as sc
from jetrl.store.db import open_store
from tests.support.synthetic import SyntheticRun, publish_events, synthetic_run

TEST_LIMITS_BYTES = 64 * 1024**2


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    store_cmd.add_store_commands(p.add_subparsers(dest="command", required=True))
    return p.parse_args(argv)


def record(nats_url: str, run: SyntheticRun, db: str) -> None:
    from jetrl.bus.streams import StreamLimits

    async def go() -> None:
        bus = await Bus.connect(nats_url)
        await bus.ensure_run(
            run.run_id, StreamLimits(max_bytes=TEST_LIMITS_BYTES, payload_max_bytes=TEST_LIMITS_BYTES)
        )
        await publish_events(bus, run.events)
        with open_store(db) as store:
            rec = Recorder(bus, store, run.run_id, batch=200)
            await rec.catch_up(timeout=60)
            rec.close()
        await bus.close()

    asyncio.run(go())


@pytest.fixture
def recorded(nats_server: EmbeddedServer, run_id: str, db_url: str) -> tuple[SyntheticRun, str]:
    run = synthetic_run(run_id, steps=5, seed=41)
    record(nats_server.url, run, db_url)
    return run, db_url


def test_runs_and_history(recorded: tuple[SyntheticRun, str], capsys: pytest.CaptureFixture[str]) -> None:
    run, db = recorded
    args = parse(["runs", "--db", db, "--json"])
    assert args.func(args) == 0
    runs = json.loads(capsys.readouterr().out)
    assert [(r["run_id"], r["steps"], r["status"]) for r in runs] == [(run.run_id, 5, "completed")]
    args = parse(["history", run.run_id, "--db", db, "--json"])
    assert args.func(args) == 0
    steps = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert [s["num_rollouts"] for s in steps] == [len(run.truth.steps[i]["rollout_ids"]) for i in range(1, 6)]
    args = parse(["history", run.run_id, "--db", db])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "completed, 5 steps" in out and "reward" in out


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_export(recorded: tuple[SyntheticRun, str], tmp_path: Path, fmt: str) -> None:
    run, db = recorded
    out = tmp_path / "export"
    args = parse(["export", run.run_id, "--db", db, "--format", fmt, "--out", str(out)])
    assert args.func(args) == 0
    want = {"rollouts": len(run.truth.rewards), "steps": 5, "policy_versions": 5, "tasks": run.truth.tasks}
    for table, n in want.items():
        path = out / f"{table}.{fmt}"
        if fmt == "jsonl":
            rows = [json.loads(line) for line in path.read_text().splitlines()]
        elif fmt == "csv":
            with path.open() as f:
                rows = list(csv.DictReader(f))
        else:
            import pyarrow.parquet as pq

            rows = pq.read_table(path).to_pylist()
        assert len(rows) == n, table
        assert all(r["run_id"] == run.run_id for r in rows)
    assert {p.name for p in out.iterdir()} == {f"{t.name}.{fmt}" for t in sc.PROJECTION_TABLES}


def test_rebuild_proves_equality_and_catches_a_tampered_store(
    nats_server: EmbeddedServer, recorded: tuple[SyntheticRun, str], capsys: pytest.CaptureFixture[str]
) -> None:
    run, db = recorded
    args = parse(["rebuild", run.run_id, "--db", db, "--nats-url", nats_server.url])
    assert args.func(args) == 0
    assert "identical" in capsys.readouterr().out
    # A store that drifted from its log is caught (and repaired by the rebuild).
    with open_store(db) as store, store.write() as conn:
        t = sc.table_of(sc.Rollout)
        conn.execute(sa.update(t).where(t.c.run_id == run.run_id).values(reward=-1.0))
    assert args.func(args) == 1
    assert "DIFFERENT" in capsys.readouterr().out
    assert args.func(args) == 0


def test_default_store_is_the_run_directory_sqlite_file(
    nats_server: EmbeddedServer, run_id: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = synthetic_run(run_id, steps=2, seed=42)
    record(nats_server.url, run, f"sqlite:///{tmp_path / run_id / 'store.db'}")
    args = parse(["runs", "--runs-dir", str(tmp_path)])
    assert args.func(args) == 0
    assert run_id in capsys.readouterr().out
    args = parse(["history", run_id, "--runs-dir", str(tmp_path), "--json"])
    assert args.func(args) == 0
    assert len(json.loads(capsys.readouterr().out)) == 2
    with pytest.raises(SystemExit, match="no store"):
        store_cmd.cmd_history(parse(["history", "missing", "--runs-dir", str(tmp_path)]))
