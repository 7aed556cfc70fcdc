"""deploy/cores.py: the trainer's cores and the others', and a run's inference worker,
producer and nats-server kept off the trainer's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from jetrl.bus.server import EmbeddedServer
from jetrl.deploy.config import load_config
from jetrl.deploy.cores import CoreSplit, run_split, split_cores
from jetrl.deploy.supervisor import Supervisor

ROOT = Path(__file__).resolve().parents[2]
CORES = sorted(os.sched_getaffinity(0))


def test_the_trainer_takes_the_lowest_cores_and_leaves_the_others_some() -> None:
    assert split_cores([1, 0], 1) == CoreSplit(frozenset({0}), frozenset({1}))
    assert split_cores([7, 2, 5, 3, 3], 2) == CoreSplit(frozenset({2, 3}), frozenset({5, 7}))
    # Nothing left for the others, or nothing asked: every process left to the kernel.
    assert split_cores([0, 1], 2) is None
    assert split_cores([0], 1) is None
    assert split_cores([0, 1, 2], 0) is None


def test_a_run_splits_only_where_the_trainer_is_a_process_of_its_own() -> None:
    demo = load_config(ROOT / "configs" / "demo.toml")
    expected = split_cores(CORES, 1)
    assert run_split(demo) == expected
    assert (
        run_split(load_config(ROOT / "configs" / "demo.toml", ["--run.trainer_own_cores", "false"])) is None
    )
    hosted = load_config(ROOT / "configs" / "demo.toml", ["--run.host_together", '["trainer", "producer"]'])
    assert run_split(hosted) is None


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to split")
def test_the_supervisor_keeps_the_other_parts_off_the_trainers_cores(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "configs" / "demo.toml")
    sup = Supervisor(cfg, "cores", tmp_path / "run", nats_url="nats://127.0.0.1:1", quiet=True)
    split = split_cores(CORES, 1)
    assert split is not None and sup.cores == split
    parts = {p.name: p.cpus for p in sup.plan("nats://127.0.0.1:1")}
    # The trainer and the parts that only read the log run anywhere; the others keep off its core.
    assert parts.pop("trainer") is None
    assert parts.pop("recorder") is None and parts.pop("monitor") is None
    assert parts and set(parts.values()) == {split.rest}  # the producer and the worker
    # A nats-server given the others' cores (as the supervisor starts its own) runs on them.
    with EmbeddedServer(tmp_path / "nats", cpus=split.rest) as srv:
        assert srv.proc is not None
        assert os.sched_getaffinity(srv.proc.pid) == split.rest
