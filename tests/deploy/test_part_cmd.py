"""`jetrl part KIND`'s trainer over several nodes and `jetrl run --parts`. The parts started on
their own against a run coordinated by `jetrl run --parts none`, before the run and after it,
are tests/system/test_multihost.py's (over hosts made of network namespaces)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import pytest

from jetrl.bus import events as ev
from jetrl.bus import ids
from jetrl.bus.client import Bus
from jetrl.bus.server import EmbeddedServer
from jetrl.consumers.trainer.engine import Nodes
from jetrl.consumers.trainer.settings import TrainerSettings
from jetrl.deploy.config import ConfigError, RunConfig
from jetrl.deploy.part_cmd import commands, goal_reached, read_run, serve
from jetrl.deploy.parts import trainer_command
from jetrl.deploy.run_cmd import local_parts


def test_a_trainer_over_two_nodes_numbers_its_ranks_by_node() -> None:
    trainer = TrainerSettings.model_validate({"parallelism": {"dp_shard": 4}})
    argv = [sys.executable, "-m", "jetrl.consumers.trainer", "--run", "r"]
    got = trainer_command(argv, trainer, Nodes(nnodes=2, node_rank=1, master="10.0.0.1:29500"))
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
    assert "--standalone" in trainer_command(argv, trainer)


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
        trainer_command(["python", "-m", "m"], trainer, nodes)


def test_parts_option() -> None:
    assert local_parts("none") == frozenset()
    assert local_parts("all") == {"producer", "inference", "trainer", "recorder", "monitor"}
    assert local_parts("trainer, recorder") == {"trainer", "recorder"}
    with pytest.raises(ValueError, match="unknown kind"):
        local_parts("trainer,gpu")


def test_a_worker_id_no_subject_can_carry_is_refused() -> None:
    args = argparse.Namespace(
        kind="inference", run="r", nats_url="nats://h:4222", creds=None, worker_id="a.b"
    )
    with pytest.raises(ValueError, match="worker id"):
        commands(args, RunConfig(), Path("/tmp/r"))


async def test_a_part_waits_for_the_run_then_refuses_a_config_it_cannot_read(bus: Bus, run_id: str) -> None:
    assert await read_run(bus, run_id) is None  # the log is there, no RunStarted yet
    started = ev.RunStarted(config={"trainer": {"no_such_setting": 1}}, code_version="0", host="h")
    await bus.publish(ev.new_event(started, run_id=run_id, event_id=ids.run_started_id(run_id)))
    with pytest.raises(ConfigError, match="is not one this jetrl reads"):
        await read_run(bus, run_id)


def config_of(max_steps: int) -> dict[str, object]:
    cfg = RunConfig()
    cfg.trainer.max_steps = max_steps
    return cfg.model_dump(mode="json")


async def say(bus: Bus, run_id: str, body: ev.EventBody, event_id: str) -> int:
    return int((await bus.publish(ev.new_event(body, run_id=run_id, event_id=event_id))).seq)


async def test_a_completed_run_resumed_with_more_steps_is_served_with_the_resumes_config(
    bus: Bus, run_id: str
) -> None:
    started = ev.RunStarted(config=config_of(3), code_version="0", host="h")
    await say(bus, run_id, started, ids.run_started_id(run_id))
    last = ev.StepCompleted(
        step=2,
        policy_version=3,
        rollout_ids=[],
        rollout_seqs=[],
        metrics={},
        tokens=0,
        duration_s=0.1,
        final=True,
    )
    await say(bus, run_id, last, ids.step_event_id(run_id, 2))
    finished = await say(
        bus, run_id, ev.RunFinished(status="completed", steps=3), ids.run_finished_id(run_id, "c", 3, 1)
    )
    found = await read_run(bus, run_id)
    assert found is not None and found[0].finished_seq == finished and found[0].finished_status == "completed"
    resumed = ev.RunResumed(config=config_of(5), code_version="0", overrides=["--trainer.max_steps", "5"])
    seq = await say(bus, run_id, resumed, ids.run_resumed_id(run_id, finished))
    found = await read_run(bus, run_id)
    assert found is not None
    state, _ = found
    assert state.config is not None and state.config.trainer.max_steps == 5
    assert (state.finished_seq, state.resumed_seq) == (None, seq)
    # The old run's final step is behind the resume: not the resumed run's goal.
    assert await goal_reached(bus, run_id) and not await goal_reached(bus, run_id, state.resumed_seq)


async def test_a_part_restarts_its_child_when_the_run_is_resumed_with_another_config(
    nats_server: EmbeddedServer, bus: Bus, run_id: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    db = f"sqlite:///{tmp_path / 'store.db'}"
    args = argparse.Namespace(
        kind="recorder", run=run_id, nats_url=nats_server.url, creds=None, run_dir=str(tmp_path), db=db
    )
    await say(bus, run_id, ev.RunStarted(config=config_of(3), code_version="0"), ids.run_started_id(run_id))
    stopped = await say(bus, run_id, ev.RunFinished(status="cancelled", steps=1), "stopped")
    out: list[str] = []

    async def until(text: str) -> None:
        for _ in range(1200):
            out.append(capfd.readouterr().out)
            if text in "".join(out):
                return
            assert not part.done(), "".join(out)
            await asyncio.sleep(0.1)
        raise AssertionError(f"never said {text!r}: {''.join(out)}")

    part = asyncio.create_task(serve(args, bus, asyncio.Event()))
    await until("started recorder")
    assert "stopped (cancelled); serving it as resumed" in "".join(out)
    same = ev.RunResumed(config=config_of(3), code_version="0")
    await say(bus, run_id, same, ids.run_resumed_id(run_id, stopped))
    more = ev.RunResumed(config=config_of(6), code_version="0", overrides=["--trainer.max_steps", "6"])
    resumed = await say(bus, run_id, more, ids.run_resumed_id(run_id, stopped + 1))
    await until("resumed with another config; restarting")
    done = await say(
        bus, run_id, ev.RunFinished(status="completed", steps=6), ids.run_finished_id(run_id, "c", 6, resumed)
    )
    assert await asyncio.wait_for(part, 180) == 0
    out.append(capfd.readouterr().out)
    assert "".join(out).count("restarting") == 1  # the resume with the same config changed nothing
    assert done > resumed
