"""A run fed by two tenants: every client authenticates, jetrl's parts as their own identities;
tenant acme's env runs under the supervisor as acme, tenant globex's env runs "on its own
machine": `jetrl producer --creds` in a process of its own, through its view."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jetrl.bus.server import EmbeddedServer
from jetrl.deploy.config import load_config
from jetrl.deploy.supervisor import Supervisor
from jetrl.deploy.tenants import TenantRegistry
from jetrl.store import queries
from jetrl.store.db import StoreError, open_store_read_only

pytestmark = pytest.mark.slow

CONFIG = """
[run]
name = "tenants"

[model]
name = "tiny-moe"

[trainer]
batch_groups = 4
max_off_policy_steps = 1
max_steps = 400  # the test ends the run once both tenants were trained
checkpoint_every = 4

[inference]
workers = 1
max_batch_tasks = 4

[bus]
max_gib = 0.25
payload_max_gib = 0.5

[[tenants]]
name = "globex"
max_tasks_in_flight = 64

[[envs]]
name = "modsum"
tenant = "acme"
group_size = 4
params = { modulus = 5 }

[[envs]]
name = "reverse"
tenant = "globex"
group_size = 4
remote = true
"""


def write(path: Path, text: str) -> None:
    path.write_text(text)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_producer(config: Path, creds: Path, url: str, log: Path) -> subprocess.Popen[bytes]:
    """`jetrl producer` as a tenant runs it on its own machine."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [
                *(sys.executable, "-m", "jetrl.deploy.cli", "producer", str(config)),
                *("--creds", str(creds), "--run", "tn1", "--nats-url", url),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, JETRL_LOG_JSON="1"),
        )


def tenant_summaries(db: Path) -> dict[str, queries.TenantSummary]:
    """The run's tenants as the recorder has recorded them so far (none before it made the
    store), read as `jetrl runs` reads them: read-only, while the recorder may be writing."""
    try:
        store = open_store_read_only(f"sqlite:///{db}")
    except StoreError:  # no store yet, or not yet migrated by the recorder
        return {}
    try:
        return {t.tenant: t for t in queries.tenant_summaries(store, "tn1")}
    finally:
        store.close()


def both_trained(db: Path) -> bool:
    summary = tenant_summaries(db)
    return all(t in summary and summary[t].trained > 0 for t in ("acme", "globex"))


async def test_a_run_fed_by_a_local_and_a_remote_tenant(tmp_path: Path) -> None:
    reg = TenantRegistry(tmp_path / "tenants")
    reg.add("acme", [])
    reg.add("globex", ["tn1"])
    reg.save()
    config = tmp_path / "run.toml"
    write(config, CONFIG)
    cfg = load_config(config)
    run_dir = tmp_path / "tn1"
    # The operator's server, run with the registry's authorization; the tenant's producer is
    # started before the run exists and waits for its view.
    server = EmbeddedServer(tmp_path / "nats", auth_conf=reg.auth_conf, pid_dir=reg.servers_dir).start()
    remote_log = tmp_path / "remote.log"
    try:
        remote = start_producer(config, reg.creds_path("globex"), server.url, remote_log)
        try:
            for _ in range(600):
                if '"waiting_for_view"' in remote_log.read_text() or remote.poll() is not None:
                    break
                await asyncio.sleep(0.1)
            assert '"waiting_for_view"' in remote_log.read_text(), remote_log.read_text()[-2000:]
            sup = Supervisor(cfg, "tn1", run_dir, nats_url=server.url, quiet=True, tenants_dir=reg.dir)
            run = asyncio.create_task(sup.run())
            # However fast the run, the remote tenant joins it a moment late: the run is ended
            # once the store shows both tenants trained (or the test's time is up).
            deadline = asyncio.get_running_loop().time() + 240
            while not run.done() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.5)
                if both_trained(run_dir / "store.db"):
                    break
            sup.end("both tenants trained")
            assert await asyncio.wait_for(run, timeout=120) == 0
            assert remote.poll() is None, remote_log.read_text()[-2000:]  # it never crashed
        finally:
            stop_process(remote)
    finally:
        server.stop()
    assert '"producer_started"' in remote_log.read_text()
    summary = tenant_summaries(run_dir / "store.db")
    # Both tenants' rollouts were trained; nothing of either was refused.
    assert summary["acme"].trained > 0 and summary["globex"].trained > 0, summary
    assert summary["acme"].rejections == 0 and summary["globex"].rejections == 0, summary
    # acme joined the run when it started (its env is in the config).
    assert "tn1" in TenantRegistry(reg.dir).identities["acme"].runs
