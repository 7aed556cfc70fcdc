"""Every part of a run may die at any moment (SIGKILL): the supervisor restarts it, it rebuilds
itself from the log, and the run's invariants hold. The trainer has its own test in
test_replay.py."""

from __future__ import annotations

import asyncio
import random
import signal
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest

from jetrl.bus import events as ev
from jetrl.bus.server import EmbeddedServer
from jetrl.deploy.config import load_config
from jetrl.deploy.replay_cmd import replay
from jetrl.deploy.supervisor import Supervisor
from jetrl.store import queries
from jetrl.store.db import open_store
from tests.support.runlog import read_log, scored_rollouts

pytestmark = [pytest.mark.slow, pytest.mark.fault]

MAX_STEPS = 60
FAST_REDELIVERY = [
    "--trainer.ack_wait_s",
    "2",
    "--inference.ack_wait_s",
    "2",
    "--envs.0.ack_wait_s",
    "2",
]


@pytest.mark.parametrize(
    ("victim", "env"),
    [
        ("inference-0", "modsum"),
        ("env-default-modsum-0", "modsum"),
        ("env-default-chainsum-0", "chainsum"),  # killed with two-turn episodes in flight
        ("recorder", "modsum"),
        ("nats-server", "modsum"),
        # The producer and the worker as tasks of one process ([run] host_together): killed,
        # both rebuild from the log.
        ("host-producer-inference", "modsum"),
    ],
)
async def test_part_killed_twice_mid_run(victim: str, env: str, tmp_path: Path) -> None:
    run_id = f"kill-{victim.split('-')[0]}-{env}"
    rng = random.Random(run_id)
    # MAX_STEPS only bounds the run: it is ended once the part has come back from its second
    # kill and the run has gone on without it, however fast the machine makes its steps.
    args = f"--trainer.max_steps {MAX_STEPS} --trainer.batch_groups 2 --trainer.checkpoint_every 4 "
    args += f"--inference.workers 1 --envs.0.name {env} --envs.0.group_size 4 "
    args += "--bus.max_gib 0.25 --bus.payload_max_gib 0.5"
    if victim.startswith("host-"):
        args += ' --run.host_together ["producer","inference"]'
    cfg = load_config(None, [*args.split(), *FAST_REDELIVERY])
    # Its own embedded server: the nats-server is one of the victims.
    sup = Supervisor(cfg, run_id, tmp_path / run_id, quiet=True)
    run = asyncio.create_task(sup.run())

    async def until(done: Callable[[], bool], what: str) -> None:
        while not done():
            assert not run.done(), f"the run ended while waiting for {what}: {run.result()}"
            await asyncio.sleep(0.05)

    def restarted(kills: int) -> bool:  # the victim is up again after ``kills`` kills
        if victim == "nats-server":
            return sup.server_restarts >= kills and sup.server is not None
        part = next(p for p in sup.parts if p.name == victim)
        return part.restarts >= kills and part.proc is not None and part.proc.poll() is None

    first = rng.randint(1, 3)
    await until(lambda: len(sup.progress.steps) >= first, "the first kill's step")
    for kills in range(2):
        await until(partial(restarted, kills), f"{victim} to be up before kill {kills + 1}")
        if victim == "nats-server":
            assert sup.server is not None
            sup.server.kill()
        else:
            part = next(p for p in sup.parts if p.name == victim)
            assert part.proc is not None
            part.proc.send_signal(signal.SIGKILL)
        await asyncio.sleep(rng.uniform(0.5, 1.5))
    await until(lambda: restarted(2), f"{victim} to be up after its second kill")
    back = len(sup.progress.steps)
    await until(lambda: len(sup.progress.steps) >= back + 2, "two steps after the second restart")
    sup.end("the victim came back twice")
    assert await asyncio.wait_for(run, 240) == 0
    restarts = (
        sup.server_restarts
        if victim == "nats-server"
        else next(p for p in sup.parts if p.name == victim).restarts
    )
    assert restarts == 2

    with EmbeddedServer(tmp_path / run_id / "nats") as srv:
        log = await read_log(srv.url, run_id)
        steps = [e.body for e in log if isinstance(e.body, ev.StepCompleted)]
        assert len(steps) >= back + 2
        assert sorted(s.step for s in steps) == list(range(len(steps)))
        trained = Counter(rid for s in steps for rid in s.rollout_ids)
        assert all(n == 1 for n in trained.values()), "a rollout was trained twice"
        scored = {r.rollout_id for _, r in scored_rollouts(log)}
        assert set(trained) <= scored
        withheld = {e.body.rollout_id for e in log if isinstance(e.body, ev.RolloutWithheld)}
        assert not withheld & set(trained)
        assert (
            await replay(
                srv.url, run_id, tmp_path / run_id, from_step=0, to_step=None, verify=True, quiet=True
            )
            == 0
        )
    store = open_store(sup.db_url)
    try:
        assert [h.step for h in queries.step_history(store, run_id)] == list(range(len(steps)))
    finally:
        store.close()
