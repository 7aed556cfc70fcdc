"""`jetrl part KIND`'s trainer over several nodes and `jetrl run --parts`. The parts started on
their own against a run coordinated by `jetrl run --parts none`, before the run and after it,
are tests/system/test_multihost.py's (over hosts made of network namespaces)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from jetrl.bus import events as ev
from jetrl.bus import ids
from jetrl.bus.client import Bus
from jetrl.consumers.trainer.settings import TrainerSettings
from jetrl.deploy.config import ConfigError, RunConfig
from jetrl.deploy.part_cmd import commands, read_run
from jetrl.deploy.parts import Nodes, torchrun
from jetrl.deploy.run_cmd import local_parts


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
