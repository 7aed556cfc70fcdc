"""`jetrl nats-config` and deploy/nats_cluster.py: the configurations parse, real nats-servers
started from them form a JetStream cluster on which a run's stream and payload bucket are
replicated, and the example in deploy/nats is what the generator writes."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
from pathlib import Path

import pytest

from jetrl.bus.client import Bus
from jetrl.bus.server import find_binary
from jetrl.bus.streams import StreamLimits, payload_bucket, stream_name
from jetrl.deploy.cli import main
from jetrl.deploy.nats_cluster import (
    URLS_FILE,
    ClusterConfigError,
    ClusterSpec,
    include_path,
    plan_cluster,
    render_cluster,
    write_cluster,
)
from jetrl.deploy.tenants import ADMIN, TenantRegistry
from tests.support.cluster import LoopbackCluster, loopback_spec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_DIR = ROOT / "deploy" / "nats"
# How deploy/nats was generated (its README says the same).
EXAMPLE_HOSTS = "nats-1.example.internal,nats-2.example.internal,nats-3.example.internal"
AUTO = StreamLimits(max_bytes=64 * 1024**2, payload_max_bytes=128 * 1024**2, replicas=0)


def nats_test(conf: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([find_binary(), "-c", str(conf), "-t"], capture_output=True, text=True, timeout=30)


def test_the_example_is_the_generators_output(tmp_path: Path) -> None:
    assert main(["nats-config", "--hosts", EXAMPLE_HOSTS, "--out", str(tmp_path)]) == 0
    generated = {p.name: p.read_text() for p in tmp_path.iterdir()}
    committed = {p.name: p.read_text() for p in EXAMPLE_DIR.iterdir() if p.name != "README.md"}
    assert committed == generated, (
        f"deploy/nats is stale: jetrl nats-config --hosts {EXAMPLE_HOSTS} --out deploy/nats"
    )
    assert set(generated) == {"jetrl-0.conf", "jetrl-1.conf", "jetrl-2.conf", URLS_FILE}
    for name in ("jetrl-0.conf", "jetrl-1.conf", "jetrl-2.conf"):
        done = nats_test(tmp_path / name)
        assert done.returncode == 0, done.stderr + done.stdout


def test_cli_prints_the_client_urls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["nats-config", "--hosts", "127.0.0.1,127.0.0.1,127.0.0.1", "--out", str(tmp_path)]
    args += ["--store-dir", str(tmp_path / "{server}"), "--client-port", "14222", "--name", "c1"]
    assert main(args) == 0
    urls = "nats://127.0.0.1:14222,nats://127.0.0.1:14223,nats://127.0.0.1:14224"
    assert capsys.readouterr().out.strip().splitlines()[-1] == urls
    assert (tmp_path / URLS_FILE).read_text().strip() == urls
    conf = (tmp_path / "c1-2.conf").read_text()
    assert 'listen: "127.0.0.1:14224"' in conf and 'http: "127.0.0.1:8224"' in conf
    assert f'store_dir: "{tmp_path / "c1-2"}"' in conf and "name: c1" in conf
    assert conf.count("nats-route://127.0.0.1:") == 3  # every node's route, its own skipped by the server
    # Several nodes on one host without {server} in the store directory would share it.
    bad = ["nats-config", "--hosts", "h,h", "--out", str(tmp_path / "x"), "--store-dir", "/data/nats"]
    assert main(bad) == 2


def test_plan_checks() -> None:
    spec = plan_cluster(["a", "b", "c"])
    assert [n.client_port for n in spec.nodes] == [4222] * 3  # distinct hosts: the same ports
    assert [n.store_dir for n in spec.nodes] == [f"/var/lib/nats/jetrl-{i}" for i in range(3)]
    assert spec.client_url_list() == "nats://a:4222,nats://b:4222,nats://c:4222"
    with pytest.raises(ClusterConfigError):
        plan_cluster([])
    with pytest.raises(ClusterConfigError):
        plan_cluster(["a"], name="bad name")
    with pytest.raises(ClusterConfigError):
        plan_cluster(["a", "b"], client_port=8222)  # clients and monitoring on one port


async def test_auth_include_and_pid_file(tmp_path: Path) -> None:
    """With the tenants' authorization included, the cluster serves the admin identity and
    refuses a client without credentials."""
    reg = TenantRegistry(tmp_path / "tenants")
    assert main(["tenants", "--dir", str(reg.dir), "add", "acme", "--run", "r1"]) == 0
    base = loopback_spec(tmp_path / "c", 3)
    # Each node's configuration is in its store directory, all at one depth: one relative include.
    conf_dir = Path(base.nodes[0].store_dir)
    spec = ClusterSpec(
        nodes=base.nodes,
        name=base.name,
        max_file_store=base.max_file_store,
        auth_include=include_path(reg.auth_conf, conf_dir),
        pid_dir=str(tmp_path / "pids"),
    )
    files = write_cluster(spec, conf_dir)
    assert nats_test(files[0]).returncode == 0
    assert 'include "' in render_cluster(spec)["n0.conf"]

    with LoopbackCluster(tmp_path / "c", spec=spec) as cluster:
        assert sorted(p.name for p in (tmp_path / "pids").iterdir()) == sorted(
            f"{n.client_port}.pid" for n in spec.nodes
        )
        bus = await Bus.connect(cluster.urls, name="admin", creds=str(reg.creds_path(ADMIN)))
        try:
            info = await bus.ensure_run("r1", AUTO)
            assert info.config.num_replicas == 3
        finally:
            await bus.close()
        with pytest.raises(Exception, match=r"(?i)authoriz|refused"):
            await Bus.connect(cluster.url, name="nobody", connect_timeout=2)


@pytest.mark.parametrize(("nodes", "replicas"), [(3, 3), (2, 2)])
async def test_a_run_on_a_cluster_is_replicated(nodes: int, replicas: int, tmp_path: Path) -> None:
    """The generated configurations, started for real: the servers form a cluster, and a run's
    stream and payload bucket (Bus.ensure_run, replicas "auto") get min(3, nodes) replicas."""
    with LoopbackCluster(tmp_path, nodes) as cluster:
        bus = await Bus.connect(cluster.url, name="test")
        try:
            assert bus.cluster_size() == nodes
            info = await bus.ensure_run("r1", AUTO)
            assert info.config.num_replicas == replicas
            bucket = await bus.js.stream_info(f"OBJ_{payload_bucket('r1')}")
            assert bucket.config.num_replicas == replicas
        finally:
            await bus.close()
        for stream in (stream_name("r1"), f"OBJ_{payload_bucket('r1')}"):
            c = await cluster.stream_cluster(stream)
            assert c.leader in cluster.names()
            assert sorted([str(c.leader), *(str(p.name) for p in c.replicas or [])]) == cluster.names()


async def test_a_run_set_up_while_the_cluster_has_no_quorum_waits_for_it(tmp_path: Path) -> None:
    """Bus.ensure_run on a cluster whose JetStream meta group has lost its quorum (one of two
    nodes down: nothing answers) waits until the node is back instead of failing the run's
    set-up, as a run started on a cluster still forming or electing would."""
    with LoopbackCluster(tmp_path, 2) as cluster:
        # A 2 s request timeout: an answer not in time is given up, and the set-up must retry.
        bus = await Bus.connect(cluster.servers[0].url, name="test", request_timeout=2.0)
        try:
            cluster.kill(1)
            setup = asyncio.create_task(bus.ensure_run("r1", dataclasses.replace(AUTO, replicas=2)))
            await asyncio.sleep(5.0)
            assert not setup.done()  # no quorum: no answer yet, and no error either
            await asyncio.to_thread(cluster.restart, 1)
            info = await asyncio.wait_for(setup, 60)
            assert info.config.num_replicas == 2
        finally:
            await bus.close()
