"""Parts as tasks of one process (deploy/host.py) and how the supervisor groups them
(deploy/parts.py PartCommands.hosted). A whole run with a host killed twice is in
tests/system/test_faults.py."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from jetrl.consumers.recorder.settings import RecorderPart
from jetrl.deploy.config import ConfigError, load_config
from jetrl.deploy.host import load_parts, run_parts
from jetrl.deploy.parts import PartCommand, PartCommands


async def test_a_failing_part_stops_the_others_and_the_process_fails() -> None:
    seen: list[str] = []

    async def fails(stop: asyncio.Event) -> int:
        await asyncio.sleep(0.05)
        raise RuntimeError("boom")

    async def waits(stop: asyncio.Event) -> int:
        await stop.wait()
        seen.append("stopped")
        return 0

    stop = asyncio.Event()
    code = await asyncio.wait_for(run_parts([("a", fails, False), ("b", waits, False)], stop), 10)
    assert code == 1 and stop.is_set() and seen == ["stopped"]


async def test_parts_that_return_leave_the_others_running_and_the_largest_code_wins() -> None:
    stop = asyncio.Event()

    async def early(stop: asyncio.Event) -> int:
        return 3

    async def late(stop: asyncio.Event) -> int:
        await asyncio.sleep(0.1)
        assert not stop.is_set()  # the early one's return did not stop it
        return 0

    assert await asyncio.wait_for(run_parts([("a", early, False), ("b", late, False)], stop), 10) == 3


async def test_the_part_that_ends_the_process_stops_the_others_when_it_returns() -> None:
    seen: list[str] = []

    async def trainer(stop: asyncio.Event) -> int:
        await asyncio.sleep(0.05)
        return 0

    async def worker(stop: asyncio.Event) -> int:
        await stop.wait()  # would run forever: only the process's stop ends it
        seen.append("stopped")
        return 2

    stop = asyncio.Event()
    code = await asyncio.wait_for(run_parts([("w", worker, False), ("t", trainer, True)], stop), 10)
    assert code == 2 and stop.is_set() and seen == ["stopped"]


def test_a_module_without_a_part_entry_is_refused() -> None:
    with pytest.raises(SystemExit, match="is not a part"):
        load_parts([{"module": "jetrl.deploy.config", "args": []}])
    ((_, task, ends),) = load_parts(
        [{"module": "jetrl.producers", "args": ["--nats-url", "x", "--run", "r"]}]
    )
    assert callable(task) and not ends


def test_hosted_groups_followers_apart_and_keeps_commands_that_cannot_be_hosted(tmp_path: Path) -> None:
    cfg = load_config(None, ["--inference.workers", "2"])
    cmds = PartCommands(cfg, "r", tmp_path, "nats://127.0.0.1:1")
    py = [sys.executable, "-m"]
    parts = [
        PartCommand("env-0", [*py, "jetrl.producers", "--run", "r"], kind="producer"),
        PartCommand(
            "inference-0", [*py, "jetrl.consumers.inference", "--worker-id", "inf-0"], 2, "inference"
        ),
        PartCommand(
            "inference-1", [*py, "jetrl.consumers.inference", "--worker-id", "inf-1"], 2, "inference"
        ),
        PartCommand("trainer", ["torchrun", "--nproc-per-node", "2"], kind="trainer"),
        PartCommand("recorder", [*py, "jetrl.consumers.recorder"], kind="recorder"),
        PartCommand("monitor", [*py, "jetrl.consumers.monitor"], kind="monitor"),
    ]
    out = {c.name: c for c in cmds.hosted(parts, ["producer", "inference", "trainer", "recorder", "monitor"])}
    assert set(out) == {"host-producer-inference", "host-recorder-monitor", "trainer"}
    work, follow = out["host-producer-inference"], out["host-recorder-monitor"]
    assert (work.follows, follow.follows, out["trainer"].follows) == (False, True, False)
    assert work.threads == 2 and work.argv[2] == "jetrl.deploy.host"
    spec = json.loads(Path(work.argv[-1][1:]).read_text())
    assert [e["module"] for e in spec] == ["jetrl.producers", *["jetrl.consumers.inference"] * 2]
    assert spec[2]["args"] == ["--worker-id", "inf-1"]
    assert not any(e["ends_process"] for e in spec) and not work.ends_run and out["trainer"].ends_run
    # A trainer of one process hosted beside others: its return ends the host, which ends the run.
    one = PartCommand("trainer", [*py, "jetrl.consumers.trainer", "--run", "r"], kind="trainer")
    hosted = {c.name: c for c in cmds.hosted([*parts[:2], one], ["producer", "inference", "trainer"])}
    host = hosted["host-producer-inference-trainer"]
    assert set(hosted) == {host.name} and host.ends_run
    spec = json.loads(Path(host.argv[-1][1:]).read_text())
    assert [e["ends_process"] for e in spec] == [False, False, True]
    # One part of a kind is left as it is; kinds not named are never hosted.
    alone = cmds.hosted(parts, ["recorder"])
    assert [c.name for c in alone] == [p.name for p in parts]


def test_the_recorders_gather_is_a_store_setting(tmp_path: Path) -> None:
    # `[store] recorder_gather_s` reaches the recorder's settings; unset, the recorder's default.
    def handed(over: list[str]) -> RecorderPart:
        cfg = load_config(None, over)
        cmd = PartCommands(cfg, "r", tmp_path, "nats://127.0.0.1:1").recorder("sqlite:///x.db", None)
        path = cmd.argv[cmd.argv.index("--settings") + 1].removeprefix("@")
        return RecorderPart.model_validate_json(Path(path).read_text())

    assert handed(["--store.recorder_gather_s", "1.5"]).gather_s == 1.5
    assert handed([]).gather_s == RecorderPart(db="x").gather_s
    with pytest.raises(ConfigError):
        load_config(None, ["--store.recorder_gather_s", "-1"])
