"""A run over three "hosts" (network namespaces this test makes): a 3-node NATS JetStream
cluster spread over them, the trainer on one, inference on another, the producer, the recorder
and the coordinator on the third, each started with `jetrl part` / `jetrl run --parts none` as
on separate machines. The hosts reach each other only over their private subnet; the run must
keep the invariants of a run on one machine. Completed, the run is resumed with more steps and
its parts started again elsewhere: they take up the resume's config (RunResumed)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from jetrl.bus import events as ev
from jetrl.bus.server import find_binary
from jetrl.deploy.nats_cluster import plan_cluster, render_node
from jetrl.store import queries
from jetrl.store.db import open_store
from tests.support import netns
from tests.support.dump_log import load
from tests.support.invariants import assert_run_invariants
from tests.support.runlog import bodies, scored_rollouts

pytestmark = [pytest.mark.slow]

STEPS = 4
MORE = 6  # the steps of the run resumed after it completed
MAX_OFF = 1
RUN = "multihost"
JETRL = [sys.executable, "-m", "jetrl.deploy.cli"]


@pytest.fixture
def hosts():
    why = netns.why_not()
    if why is not None:
        pytest.skip(f"no network namespaces here: {why}")
    h = netns.Hosts(3).up()
    yield h
    h.down()
    assert h.exists() == [], "a namespace of the test was left behind"


def wait_for_text(path: Path, text: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {path}: {path.read_text(errors='replace')[-2000:]}")


def wait_ready(hosts: netns.Hosts, url: str, timeout: float = 60.0) -> None:
    """Until the cluster takes a JetStream request, asked from inside the third host."""
    probe = (
        "import asyncio, sys\n"
        "from jetrl.bus.client import Bus\n"
        "async def go():\n"
        "    b = await Bus.connect(sys.argv[1], connect_timeout=2)\n"
        "    await b.js.account_info()\n"
        "    print(b.cluster_size())\n"
        "    await b.close()\n"
        "asyncio.run(go())\n"
    )
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        r = hosts.run(2, [sys.executable, "-c", probe, url], timeout=30)
        if r.returncode == 0 and r.stdout.strip() == "3":
            return
        last = r.stderr[-500:] or r.stdout
        time.sleep(1.0)
    raise AssertionError(f"the cluster did not form: {last}")


@pytest.mark.parametrize(
    "trainer_nodes",
    [1, 2],  # 2: one rank on each of the first two hosts, torchrun's ranks meeting over the subnet
)
def test_a_run_over_three_hosts_keeps_the_invariants(
    trainer_nodes: int, hosts: netns.Hosts, tmp_path: Path
) -> None:
    inference_host, control_host = 1, 2
    mooncake = trainer_nodes > 1
    spec = plan_cluster(hosts.addresses, store_dir=str(tmp_path / "nats" / "{server}"))
    url = spec.client_url_list()
    logs = tmp_path / "logs"
    logs.mkdir()
    run_dir = tmp_path / RUN  # the hosts' shared filesystem
    db = f"sqlite:///{tmp_path / 'store.db'}"
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(name: str, host: int, argv: list[str], env: dict[str, str] | None = None) -> None:
        out = (logs / f"{name}.log").open("wb")
        # JETRL_HOST: the address a part's Mooncake engine advertises, its host's.
        base = {"JETRL_LOG_JSON": "1", "JETRL_HOST": hosts.addresses[host]}
        procs[name] = hosts.popen(host, argv, out=out, env={**base, **(env or {})})

    def output(name: str) -> str:
        return (logs / f"{name}.log").read_text(errors="replace")[-3000:]

    try:
        for i, node in enumerate(spec.nodes):
            conf = tmp_path / f"{node.server_name}.conf"
            conf.write_text(render_node(spec, node))
            start(node.server_name, i, [find_binary(), "-c", str(conf)])
        wait_ready(hosts, url)
        part = [*JETRL, "part"]
        common = ["--nats-url", url, "--run", RUN, "--run-dir", str(run_dir)]
        trainer = [*part, "trainer", *common]
        if trainer_nodes > 1:
            trainer += ["--nnodes", str(trainer_nodes), "--rdzv-endpoint", f"{hosts.addresses[0]}:29517"]
        for k in range(trainer_nodes):
            # gloo finds its interface from the host name, which resolves outside the namespace.
            start(f"trainer-{k}", k, [*trainer, "--node-rank", str(k)], env={"GLOO_SOCKET_IFNAME": "eth0"})
        start("inference", inference_host, [*part, "inference", *common, "--worker-id", "inf-h1"])
        start("producer", control_host, [*part, "producer", *common])
        start("recorder", control_host, [*part, "recorder", *common, "--db", db])
        parts = [*(f"trainer-{k}" for k in range(trainer_nodes)), "inference", "producer", "recorder"]
        for name in parts:  # started before the run, each says what it waits for
            wait_for_text(logs / f"{name}.log", f"waiting for run {RUN} to start")
        overrides = [
            *("--trainer.max_steps", str(STEPS), "--trainer.batch_groups", "2"),
            *("--trainer.max_off_policy_steps", str(MAX_OFF), "--trainer.checkpoint_every", "2"),
            *("--envs.0.name", "reverse", "--envs.0.group_size", "4"),
            *("--bus.max_gib", "0.25", "--bus.payload_max_gib", "0.5"),
            *("--trainer.parallelism.dp_shard", str(trainer_nodes)),
            # Over two trainer hosts the weights go over Mooncake, pulled from rank 0's memory.
            *(("--bus.weights_store", "mooncake", "--bus.traces_store", "mooncake") if mooncake else ()),
        ]
        coordinator = [*JETRL, "run", "--nats-url", url, "--run-id", RUN, "--parts", "none", "--db", db]
        start("coordinator", control_host, [*coordinator, "--runs-dir", str(tmp_path), *overrides])
        assert procs["coordinator"].wait(420) == 0, output("coordinator")
        for name in parts:  # each ends with the run, on its own and cleanly
            assert procs[name].wait(120) == 0, f"{name}: {output(name)}"
        # One started after the run completed has nothing to do, and says so.
        late = hosts.run(inference_host, [*part, "inference", *common, "--worker-id", "inf-late"])
        assert late.returncode == 0 and f"run {RUN} has completed; nothing to do" in late.stdout, late
        if trainer_nodes == 1:  # the completed run resumed with more steps, its parts elsewhere
            resume = [
                *JETRL,
                "resume",
                RUN,
                "--runs-dir",
                str(tmp_path),
                "--nats-url",
                url,
                "--parts",
                "none",
            ]
            start("resume", control_host, [*resume, "--db", db, "--trainer.max_steps", str(MORE)])
            wait_for_text(logs / "resume.log", f"jetrl run {RUN}:")  # its RunResumed is in the log
            start("trainer-again", 0, [*trainer, "--node-rank", "0"], env={"GLOO_SOCKET_IFNAME": "eth0"})
            start("inference-again", inference_host, [*part, "inference", *common, "--worker-id", "inf-h1"])
            start("producer-again", control_host, [*part, "producer", *common])
            start("recorder-again", control_host, [*part, "recorder", *common, "--db", db])
            assert procs["resume"].wait(420) == 0, output("resume")
            for name in ("trainer-again", "inference-again", "producer-again", "recorder-again"):
                assert procs[name].wait(120) == 0, f"{name}: {output(name)}"
        dump = tmp_path / "log.msgpack"
        r = hosts.run(control_host, [sys.executable, "-m", "tests.support.dump_log", url, RUN, str(dump)])
        assert r.returncode == 0, r.stderr[-2000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()

    log = load(dump)
    first_end = next(i for i, e in enumerate(log) if isinstance(e.body, ev.RunFinished))
    assert_run_invariants(log[: first_end + 1], steps=STEPS, rollouts_per_step=2 * 4, max_off=MAX_OFF)
    steps = STEPS if trainer_nodes > 1 else MORE
    if trainer_nodes == 1:
        (resumed,) = bodies(log, ev.RunResumed)
        assert resumed.config["trainer"]["max_steps"] == MORE
        assert resumed.overrides == ["--trainer.max_steps", str(MORE)]
        assert [f.status for f in bodies(log, ev.RunFinished)] == ["completed", "completed"]
        done = bodies(log, ev.StepCompleted)
        assert [s.step for s in done] == list(range(MORE)) and [s.final for s in done].count(True) == 2
        trained = [rid for s in done for rid in s.rollout_ids]
        assert len(trained) == len(set(trained)), "a rollout was trained twice"
        scored = {r.rollout_id for _, r in scored_rollouts(log)}
        assert scored == set(trained) | {w.rollout_id for w in bodies(log, ev.RolloutWithheld)}
    if mooncake:  # every version after the first pulled from the trainer's host, over TCP
        held = [r.location for r in bodies(log, ev.WeightsReady) if r.version > 0]
        assert held and all(
            ref.store == "mooncake" and ref.bucket.startswith(f"{hosts.addresses[0]}:") for ref in held
        )
    # The worker on the second host loaded the trainer's weights: they came over the cluster.
    assert "inf-h1" in {e.body.worker_id for e in log if isinstance(e.body, ev.WeightsLoaded)}
    ckpts = sorted((run_dir / "trainer").glob("ckpt-v*"))
    assert ckpts, "the trainer's checkpoints are in the shared run directory"
    # Over two nodes each rank wrote its own shard of the checkpoint (DCP, one file a rank).
    assert len(list(ckpts[-1].glob("*.distcp"))) == (trainer_nodes if trainer_nodes > 1 else 0)
    store = open_store(db)
    try:
        assert [h.step for h in queries.step_history(store, RUN)] == list(range(steps))
        assert queries.recorded_seq(store, RUN) == len(log)
    finally:
        store.close()
