"""Replay from the log reproduces every step's weights; a trainer killed mid-run recovers by
replay and the run goes on as if nothing happened."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from jetrl.bus import events as ev
from jetrl.bus import ids
from jetrl.bus.client import Bus
from jetrl.bus.payloads import Payloads, inline_array
from jetrl.bus.server import EmbeddedServer
from jetrl.consumers.trainer.core import TrainCore
from jetrl.consumers.trainer.replay import (
    Replayer,
    ReplayError,
    divergence_hints,
    read_rollouts,
    read_run_log,
)
from jetrl.deploy.config import RunConfig, load_config
from jetrl.deploy.replay_cmd import replay
from jetrl.deploy.supervisor import Supervisor
from tests.support.runlog import read_log, scored_rollouts

pytestmark = pytest.mark.slow

OVERRIDES = [
    "--trainer.batch_groups",
    "2",
    "--trainer.max_off_policy_steps",
    "1",
    "--trainer.checkpoint_every",
    "3",
    "--inference.workers",
    "1",
    "--envs.0.group_size",
    "4",
    "--store.recorder",
    "false",
    "--bus.max_gib",
    "0.25",
    "--bus.payload_max_gib",
    "0.5",
    # A learning rate that changes at every step: recovery and replay, from the start or from a
    # checkpoint, must each take every step at the rate the run took it.
    "--trainer.lr_warmup_steps",
    "2",
    "--trainer.lr_decay",
    '"cosine"',
    "--trainer.lr_min_ratio",
    "0.1",
]


async def test_replay_verifies_every_step_and_names_a_divergence(
    nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    run_id = "replay1"
    # An entropy bonus gives step 0 a gradient whatever its rewards: sampled in fp32, the KL
    # term's gradient is zero, and a batch whose groups hold equal rewards would teach nothing,
    # so that no learning rate could change its weights.
    entropy = ["--trainer.entropy_coef", "0.02"]
    cfg = load_config(None, ["--trainer.max_steps", "7", *entropy, *OVERRIDES])
    sup = Supervisor(cfg, run_id, tmp_path / run_id, nats_url=nats_server.url, quiet=True)
    assert await sup.run() == 0
    run_dir = tmp_path / run_id
    assert (
        await replay(nats_server.url, run_id, run_dir, from_step=0, to_step=None, verify=True, quiet=True)
        == 0
    )
    # From the checkpoint at version 3 (weights and optimizer state) to the end.
    assert (run_dir / "trainer" / "ckpt-v00000003" / "meta.json").exists()
    assert (
        await replay(nats_server.url, run_id, run_dir, from_step=3, to_step=None, verify=True, quiet=True)
        == 0
    )
    # No checkpoint at version 2: refused with a clear exit code, not a wrong answer.
    assert (
        await replay(nats_server.url, run_id, run_dir, from_step=2, to_step=None, verify=True, quiet=True)
        == 2
    )

    # A replay under another learning rate diverges at the first step, and says why.
    bus = await Bus.connect(nats_server.url)
    log = await read_run_log(bus, run_id)
    part = RunConfig.model_validate(log.config).trainer_part(run_dir)
    changed = part.trainer.model_copy(update={"lr": part.trainer.lr * 2})
    core = TrainCore(part.model_copy(update={"trainer": changed}))
    replayer = Replayer(core, await Payloads.for_run(bus.js, run_id), log)
    await replayer.start_at(0)
    rollouts, _ = await read_rollouts(bus, run_id, set(log.steps[0].rollout_ids))
    checks = await replayer.run(rollouts, to_step=0)
    assert len(checks) == 1 and not checks[0].ok
    assert any("trainer.lr" in h for h in divergence_hints(log, changed, {}))
    await bus.close()


# A streaming trainer (each group trained as it comes) beside an environment slow enough that a
# step's groups come apart: its steps are micro-batched, and recovery and replay take them so.
STREAMING = [
    "--trainer.stream_groups",
    "true",
    "--envs.0.latency_median_s",
    "0.05",
    "--envs.0.latency_sigma",
    "1",
]


@pytest.mark.fault
@pytest.mark.parametrize("streaming", [False, True], ids=["batch", "streaming"])
async def test_trainer_killed_mid_run_recovers_by_replay(
    nats_server: EmbeddedServer, tmp_path: Path, streaming: bool
) -> None:
    run_id = "trainerkill-stream" if streaming else "trainerkill"
    steps = 12  # steps after the second kill: a fast machine must not end the run before it
    extra = STREAMING if streaming else ["--trainer.stream_groups", "false"]
    cfg = load_config(
        None, ["--trainer.max_steps", str(steps), "--trainer.ack_wait_s", "2", *OVERRIDES, *extra]
    )
    sup = Supervisor(cfg, run_id, tmp_path / run_id, nats_url=nats_server.url, quiet=True)
    run = asyncio.create_task(sup.run())
    kills = 0
    for target in (2, 5):  # once before a checkpoint, once after
        while len(sup.progress.steps) < target and not run.done():
            await asyncio.sleep(0.05)
        trainer = next(p for p in sup.parts if p.name == "trainer")
        if trainer.proc and trainer.proc.poll() is None:
            trainer.proc.send_signal(signal.SIGKILL)
            kills += 1
            while trainer.restarts < kills and not run.done():  # the supervisor restarts it
                await asyncio.sleep(0.05)
    assert await run == 0
    assert kills == 2
    assert next(p for p in sup.parts if p.name == "trainer").restarts == 2

    log = await read_log(nats_server.url, run_id)
    step_events = [e.body for e in log if isinstance(e.body, ev.StepCompleted)]
    # A step re-published after a crash has the same event id: the log holds each step once.
    assert sorted(s.step for s in step_events) == list(range(steps))
    trained = Counter(rid for s in step_events for rid in s.rollout_ids)
    assert all(n == 1 for n in trained.values()), "a rollout was trained twice"
    split = [s.micro_batches for s in step_events if s.micro_batches]
    assert all(sum(m) == len(s.rollout_ids) for s in step_events if (m := s.micro_batches))
    assert bool(split) == streaming, f"micro-batched steps: {split}"
    scored = Counter(r.rollout_id for _, r in scored_rollouts(log))
    assert set(trained) <= set(scored) and all(n == 1 for n in scored.values()), "a rollout was scored twice"
    withheld = {e.body.rollout_id for e in log if isinstance(e.body, ev.RolloutWithheld)}
    assert not withheld & set(trained)
    versions = [e.body.version for e in log if isinstance(e.body, ev.PolicyVersionPublished)]
    assert sorted(set(versions)) == list(range(steps + 1))
    # The final weights are exactly what replaying the whole log gives.
    run_dir = tmp_path / run_id
    assert (
        await replay(nats_server.url, run_id, run_dir, from_step=0, to_step=None, verify=True, quiet=True)
        == 0
    )
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert trainer_log.count('"trainer_recovered"') == 2


@pytest.mark.fault
async def test_weights_lost_with_the_machine_are_put_again_by_the_recovered_trainer(
    nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    """Weights files after version 0 are written without a flush to disk. Here the trainer and
    the worker die and the newest announced file loses its bytes, as a machine's crash would
    lose them: the recovered trainer finds it unreadable and puts it again, so the restarted
    worker loads it and the run finishes (else that worker can only wait for a newer version,
    which a trainer with no rollouts left to train on never makes)."""
    run_id = "weightslost"
    steps = 8
    args = ["--trainer.max_steps", str(steps), "--trainer.ack_wait_s", "2", "--trainer.checkpoint_every", "3"]
    cfg = load_config(None, [*args, *OVERRIDES, "--bus.weights_store", "file"])
    sup = Supervisor(cfg, run_id, tmp_path / run_id, nats_url=nats_server.url, quiet=True)
    run = asyncio.create_task(sup.run())
    while len(sup.progress.steps) < 4 and not run.done():
        await asyncio.sleep(0.05)
    dead = [p for p in sup.parts if p.name in ("trainer", "inference-0") and p.proc is not None]
    for p in dead:
        assert p.proc is not None and p.proc.poll() is None
        p.proc.send_signal(signal.SIGKILL)
    for p in dead:
        assert p.proc is not None
        p.proc.wait(10)
    # The version the trainer recovers to: the one after its last logged step.
    before = await read_log(nats_server.url, run_id)
    current = 1 + max(e.body.step for e in before if isinstance(e.body, ev.StepCompleted))
    announced = any(isinstance(e.body, ev.WeightsReady) and e.body.version == current for e in before)
    (lost,) = (tmp_path / run_id).rglob(f"weights-v{current}") if announced else [None]
    if lost is not None:
        lost.write_bytes(b"\0" * lost.stat().st_size)  # the bytes the page cache held, gone
    assert await asyncio.wait_for(run, 120) == 0
    trainer_log = (tmp_path / run_id / "logs" / "trainer.log").read_text()
    log = await read_log(nats_server.url, run_id)
    if lost is not None:
        assert '"announced_weights_restored"' in trainer_log
    else:  # killed between the step and its weights: the recovered trainer announces them
        assert sum(isinstance(e.body, ev.WeightsReady) and e.body.version == current for e in log) == 1
    assert sorted(e.body.step for e in log if isinstance(e.body, ev.StepCompleted)) == list(range(steps))


async def test_a_rollout_is_read_at_the_sequence_its_step_recorded(bus: Bus, run_id: str) -> None:
    """A rollout id is only a name: a hostile event published first under it (and refused by
    the trainer) must not be what a restarted trainer reads back as that rollout, nor the
    group mate it came with."""

    def group(rewards: dict[int, float], sample_index: dict[int, int] | None = None) -> ev.Event:
        """A RolloutsScored of group math.acme.0: rollout ``-i`` with reward ``rewards[i]``,
        under sample index ``sample_index[i]`` (``i`` by default)."""
        arr = inline_array(np.arange(3, dtype=np.int32))
        return ev.new_event(
            ev.RolloutsScored(
                generation_event_id="g",
                task_id="math.acme.0",
                env="math",
                group_id="math.acme.0",
                group_size=2,
                prompt_tokens=arr,
                rollouts=[
                    ev.ScoredRollout(
                        rollout_id=f"math.acme.0-{i}",
                        sample_index=(sample_index or {}).get(i, i),
                        reward=reward,
                        completion_tokens=arr,
                        logprobs=inline_array(np.zeros(3, np.float32)),
                        policy_version_start=0,
                        policy_version_end=0,
                    )
                    for i, reward in rewards.items()
                ],
            ),
            run_id=run_id,
            tenant="acme",
        )

    await bus.publish(group({0: 7.0, 1: 8.0}, {0: 1, 1: 0}))  # the squatter, first in the log
    real = (await bus.publish(group({1: 2.0, 0: 1.0}))).seq
    wanted = {"math.acme.0-0", "math.acme.0-1"}
    first, _ = await read_rollouts(bus, run_id, wanted)
    recorded, _ = await read_rollouts(bus, run_id, wanted, dict.fromkeys(wanted, real))
    # What "the first of each id" would replay.
    assert (first["math.acme.0-0"].reward, first["math.acme.0-1"].reward) == (7.0, 8.0)
    assert {v.rollout.sample_index for v in first.values()} == {0, 1}
    for i, reward in ((0, 1.0), (1, 2.0)):
        view = recorded[f"math.acme.0-{i}"]
        assert (view.reward, view.rollout.sample_index, view.group_id) == (reward, i, "math.acme.0")
        assert view.rollout_id == f"math.acme.0-{i}" and view.prompt_owner == ids.task_event_id(
            run_id, "math.acme.0"
        )
    with pytest.raises(ReplayError, match="not in the log"):
        await read_rollouts(bus, run_id, {"math.acme.0-2"})
