"""A `jetrl run` whose trainer is 2 ranks under torchrun (FSDP2 with the experts split over the
ranks), every part its own process: the run's invariants hold, a rank SIGKILLed mid-run takes
the whole trainer group down and the supervisor's restart rebuilds it from its newest DCP
checkpoint and the log, and `jetrl replay --verify` re-takes every step with 2 ranks."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from jetrl.bus import events as ev
from jetrl.bus.server import EmbeddedServer
from jetrl.deploy.config import load_config
from jetrl.deploy.supervisor import Supervisor
from tests.support.runlog import bodies, read_log, scored_rollouts

pytestmark = [pytest.mark.slow, pytest.mark.fault]

STEPS = 8
ROOT = Path(__file__).resolve().parents[2]


def rank_pid(torchrun_pid: int, rank: int) -> int | None:
    """The pid of one rank torchrun started (its children carry RANK in their environment)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(") ", 1)[1].split()[1])
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == torchrun_pid and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    return None


async def test_two_rank_trainer_survives_a_killed_rank(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    args = f"--trainer.max_steps {STEPS} --trainer.batch_groups 2 --trainer.checkpoint_every 2 "
    args += "--trainer.parallelism.dp_shard 2 --trainer.parallelism.ep 2 --trainer.ack_wait_s 2 "
    args += "--inference.workers 1 --envs.0.name reverse --envs.0.group_size 4 "
    args += "--bus.max_gib 0.25 --bus.payload_max_gib 0.5"
    cfg = load_config(None, args.split())
    run_id = "par2"
    run_dir = tmp_path / "runs" / run_id
    sup = Supervisor(cfg, run_id, run_dir, nats_url=nats_server.url, quiet=True)
    run = asyncio.create_task(sup.run())
    while len(sup.progress.steps) < 3 and not run.done():  # past the first checkpoint
        await asyncio.sleep(0.05)
    trainer = next(p for p in sup.parts if p.name == "trainer")
    assert trainer.proc is not None and trainer.proc.poll() is None
    victim = rank_pid(trainer.proc.pid, 1)
    assert victim is not None, "rank 1 is not a child of the trainer's torchrun"
    os.kill(victim, signal.SIGKILL)
    assert await asyncio.wait_for(run, 300) == 0
    # torchrun ended the group (exit != 0) and the supervisor started it again, once.
    assert trainer.restarts == 1

    log = await read_log(nats_server.url, run_id)
    steps = bodies(log, ev.StepCompleted)
    assert sorted(s.step for s in steps) == list(range(STEPS))  # contiguous, each once
    trained = Counter(rid for s in steps for rid in s.rollout_ids)
    assert all(n == 1 for n in trained.values()), "a rollout was trained twice"
    scored = Counter(r.rollout_id for _, r in scored_rollouts(log))
    assert set(trained) <= set(scored) and all(n == 1 for n in scored.values())
    withheld = {w.rollout_id for w in bodies(log, ev.RolloutWithheld)}
    assert not withheld & set(trained)
    assert set(scored) == set(trained) | withheld
    versions = sorted({p.version for p in bodies(log, ev.PolicyVersionPublished)})
    assert versions == list(range(STEPS + 1))
    assert bodies(log, ev.RunStarted)[0].config["trainer"]["parallelism"]["dp_shard"] == 2
    assert bodies(log, ev.RunFinished)[-1].status == "completed"
    assert not bodies(log, ev.DeadLettered)
    # Sharded checkpoints: one file per rank, the layout recorded beside them.
    ckpts = sorted((run_dir / "trainer").glob("ckpt-v*"))
    assert ckpts and all({p.name for p in c.iterdir()} >= {"__0_0.distcp", "__1_0.distcp"} for c in ckpts)
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert trainer_log.count('"trainer_recovered"') == 1
    # Rebuilt from a checkpoint (the kill came after the first), not from step 0.
    assert re.search(r'"from_checkpoint": [1-9]', trainer_log)

    # Replay re-takes the steps with the recorded 2 ranks and checks every checksum.
    proc = await asyncio.to_thread(
        subprocess.run,
        [
            *(sys.executable, "-m", "jetrl.deploy.cli", "replay", run_id, "--verify"),
            *("--runs-dir", str(tmp_path / "runs"), "--nats-url", nats_server.url),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "2 ranks as recorded" in proc.stdout
    assert f"verified {STEPS} checksums, all equal" in proc.stdout
