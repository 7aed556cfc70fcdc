"""`jetrl part KIND`: each part started on its own, configured from the run's log, and
`jetrl run --parts none` coordinating a run whose parts all run elsewhere."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jetrl.bus.server import EmbeddedServer
from jetrl.consumers.trainer.settings import TrainerSettings
from jetrl.deploy.config import ConfigError, load_config
from jetrl.deploy.parts import Nodes, torchrun
from jetrl.deploy.run_cmd import local_parts
from jetrl.deploy.supervisor import Supervisor
from jetrl.store import queries
from jetrl.store.db import open_store
from tests.support.invariants import assert_run_invariants
from tests.support.runlog import read_log

STEPS = 4
MAX_OFF = 1


def test_a_trainer_over_two_nodes_numbers_its_ranks_by_node() -> None:
    trainer = TrainerSettings.model_validate({"parallelism": {"dp_shard": 4}})
    argv = [sys.executable, "-m", "jetrl.consumers.trainer", "--run", "r"]
    got = torchrun(argv, trainer, Nodes(nnodes=2, node_rank=1, master="10.0.0.1:29500"))
    head = got[: got.index("--max-restarts")]
    assert head[1:3] == ["-m", "torch.distributed.run"]
    flags = dict(zip(head[3::2], head[4::2], strict=True))
    assert flags == {
        "--nnodes": "2",
        "--node-rank": "1",
        "--nproc-per-node": "2",
        "--master-addr": "10.0.0.1",
        "--master-port": "29500",
    }
    assert got[-4:] == ["--", "jetrl.consumers.trainer", "--run", "r"]
    # One machine: standalone, every rank local.
    assert "--standalone" in torchrun(argv, trainer)


@pytest.mark.parametrize(
    ("nodes", "why"),
    [
        (Nodes(nnodes=3, node_rank=0, master="h:1"), "do not split evenly"),
        (Nodes(nnodes=2, node_rank=2, master="h:1"), "is not one of"),
        (Nodes(nnodes=2, node_rank=0), "needs --rdzv-endpoint"),
    ],
)
def test_a_trainer_over_nodes_refuses_what_cannot_work(nodes: Nodes, why: str) -> None:
    trainer = TrainerSettings.model_validate({"parallelism": {"dp_shard": 4}})
    with pytest.raises(ConfigError, match=why):
        torchrun(["python", "-m", "m"], trainer, nodes)


def test_parts_option() -> None:
    assert local_parts("none") == frozenset()
    assert local_parts("all") == {"producer", "inference", "trainer", "recorder", "monitor"}
    assert local_parts("trainer, recorder") == {"trainer", "recorder"}
    with pytest.raises(ValueError, match="unknown kind"):
        local_parts("trainer,gpu")


def part(
    kind: str, url: str, run_id: str, run_dir: Path, logs: Path, *extra: str, name: str | None = None
) -> subprocess.Popen[bytes]:
    out = (logs / f"{name or kind}.out").open("wb")
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "jetrl.deploy.cli", "part", kind),
            *("--nats-url", url, "--run", run_id, "--run-dir", str(run_dir), *extra),
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, JETRL_LOG_JSON="1"),
    )


def wait_for_text(path: Path, text: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {path}: {path.read_text(errors='replace')[-2000:]}")


@pytest.mark.slow
async def test_parts_started_before_the_run_wait_then_run_it_and_end_with_it(tmp_path: Path) -> None:
    run_id = "split"
    run_dir = tmp_path / run_id
    logs = tmp_path / "parts"
    logs.mkdir()
    db = f"sqlite:///{tmp_path / 'store.db'}"
    with EmbeddedServer(tmp_path / "nats") as srv:
        url = srv.url
        procs = {
            "producer": part("producer", url, run_id, run_dir, logs),
            "inference": part("inference", url, run_id, run_dir, logs, "--worker-id", "inf-a"),
            "trainer": part("trainer", url, run_id, run_dir, logs),
            "recorder": part("recorder", url, run_id, run_dir, logs, "--db", db),
        }
        try:
            for kind in procs:  # started first, each says what it waits for
                await asyncio.to_thread(wait_for_text, logs / f"{kind}.out", f"waiting for run {run_id}")
            cfg = load_config(
                None,
                [
                    *("--trainer.max_steps", str(STEPS), "--trainer.batch_groups", "2"),
                    *("--trainer.max_off_policy_steps", str(MAX_OFF), "--trainer.checkpoint_every", "2"),
                    *("--envs.0.name", "reverse", "--envs.0.group_size", "4"),
                    *("--bus.max_gib", "0.25", "--bus.payload_max_gib", "0.5"),
                ],
            )
            sup = Supervisor(cfg, run_id, run_dir, nats_url=url, db_url=db, quiet=True, local=frozenset())
            assert await asyncio.wait_for(sup.run(), 300) == 0
            assert sup.parts == []  # it started nothing itself
            # Every part ends with the run, on its own and cleanly.
            for kind, p in procs.items():
                code = await asyncio.to_thread(p.wait, 90)
                assert code == 0, f"{kind} exited {code}: {(logs / f'{kind}.out').read_text()[-3000:]}"
            # One started after the run completed has nothing to do, and says so.
            late = part("inference", url, run_id, run_dir, logs, "--worker-id", "inf-b", name="late")
            assert await asyncio.to_thread(late.wait, 60) == 0
            assert f"run {run_id} has completed; nothing to do" in (logs / "late.out").read_text()
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
        log = await read_log(url, run_id)
    assert_run_invariants(log, steps=STEPS, rollouts_per_step=2 * 4, max_off=MAX_OFF)
    store = open_store(db)
    try:
        assert [h.step for h in queries.step_history(store, run_id)] == list(range(STEPS))
        # Every event of the log, RunFinished included, is recorded (sequences are 1..len).
        assert queries.recorded_seq(store, run_id) == len(log)
    finally:
        store.close()
    assert "inf-a" in (logs / "inference.out").read_text()
