"""A JetStream cluster of real nats-servers on loopback, for tests: each node its own process,
free ports and store directory, configured by deploy/nats_cluster.py. Nodes can be SIGKILLed
and restarted (same ports, same store); :meth:`LoopbackCluster.leader` names the node leading a
stream. Every process it started is gone after :meth:`LoopbackCluster.stop` (and at exit)."""

from __future__ import annotations

import asyncio
import atexit
import json
import shutil
import time
import urllib.request
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
from nats.js.api import ClusterInfo

from jetrl.bus.server import EmbeddedServer, ServerError, free_port
from jetrl.deploy.nats_cluster import ClusterNode, ClusterSpec, render_node

_LIVE: weakref.WeakSet[LoopbackCluster] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:  # a test that never reached its teardown leaves nothing running
    for cluster in list(_LIVE):
        cluster.stop()


class ClusterNodeServer(EmbeddedServer):
    """One node: the embedded server's process handling, with the cluster's configuration."""

    def __init__(self, spec: ClusterSpec, node: ClusterNode) -> None:
        super().__init__(node.store_dir, port=node.client_port, host=node.host)
        self.node = node
        self.text = render_node(spec, node)
        self.pid_dir = Path(spec.pid_dir) if spec.pid_dir else None

    def _config(self) -> Path:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        if self.pid_dir is not None:
            self.pid_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats-server.conf"
        conf.write_text(self.text)
        return conf

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def monitor(self, path: str, timeout: float = 1.0) -> Any:
        """The node's monitoring endpoint ``path`` (``jsz``, ``healthz``...), parsed."""
        url = f"http://{self.node.host}:{self.node.http_port}/{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # healthz answers 503 with a body while catching up
            return json.loads(exc.read() or b"{}")


def loopback_spec(root: Path, n: int = 3, name: str = "jetrl-test") -> ClusterSpec:
    nodes = tuple(
        ClusterNode(
            server_name=f"n{i}",
            host="127.0.0.1",
            client_port=free_port(),
            cluster_port=free_port(),
            http_port=free_port(),
            store_dir=str(root / f"n{i}"),
            listen_host="127.0.0.1",
        )
        for i in range(n)
    )
    # Streams reserve their max_bytes on every replica's node: room for a few small runs.
    return ClusterSpec(nodes=nodes, name=name, max_file_store=64 * 1024**3)


class LoopbackCluster:
    def __init__(self, root: Path, n: int = 3, spec: ClusterSpec | None = None) -> None:
        self.root, self.n, self.planned = root, n, spec is None
        self.spec = spec or loopback_spec(root, n)
        self.servers = [ClusterNodeServer(self.spec, node) for node in self.spec.nodes]
        _LIVE.add(self)

    @property
    def urls(self) -> list[str]:
        return self.spec.client_urls()

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated (as `jetrl run --nats-url` takes them)."""
        return self.spec.client_url_list()

    def names(self) -> list[str]:
        return [s.node.server_name for s in self.servers]

    def index(self, server_name: str) -> int:
        return self.names().index(server_name)

    def start(self, timeout: float = 60.0, tries: int = 3) -> LoopbackCluster:
        for attempt in range(tries):
            try:
                for s in self.servers:
                    s.start(timeout)
                self.wait_formed(timeout)
                return self
            except ServerError as exc:
                self.stop()
                # Another test's listener took one of the ports between their choice and the
                # bind: a cluster this class planned chooses again.
                if not (self.planned and "address already in use" in str(exc) and attempt + 1 < tries):
                    raise
                for node in self.spec.nodes:  # a cluster that never formed: start clean
                    shutil.rmtree(node.store_dir, ignore_errors=True)
                self.spec = loopback_spec(self.root, self.n)
                self.servers = [ClusterNodeServer(self.spec, node) for node in self.spec.nodes]
                _LIVE.add(self)
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def wait_formed(self, timeout: float = 60.0) -> None:
        """Until every live node routes to every other live one and JetStream's meta group has
        a leader and all of them as members."""
        live = [s for s in self.servers if s.alive]
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                if all(self._formed(s, len(live)) for s in live):
                    return
            except (OSError, ValueError) as exc:
                last = exc
            time.sleep(0.1)
        raise ServerError(f"cluster not formed after {timeout}s ({last!r}):\n{live[0].tail_log()}")

    @staticmethod
    def _formed(s: ClusterNodeServer, n: int) -> bool:
        routes = s.monitor("routez").get("routes") or []
        peers = {r.get("remote_name") for r in routes}
        meta = s.monitor("jsz").get("meta_cluster") or {}
        return len(peers) >= n - 1 and bool(meta.get("leader")) and int(meta.get("cluster_size", 0)) >= n

    def kill(self, i: int) -> None:
        """SIGKILL node ``i``."""
        self.servers[i].kill()

    def restart(self, i: int, timeout: float = 60.0) -> None:
        """Start node ``i`` again on its ports and store."""
        self.servers[i].start(timeout)

    def wait_healthy(self, i: int, timeout: float = 60.0) -> float:
        """Until node ``i`` says its streams and consumers are current (``/healthz``); the
        seconds it took."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            try:
                if self.servers[i].monitor("healthz").get("status") == "ok":
                    return time.monotonic() - t0
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        raise ServerError(f"node {i} not healthy after {timeout}s:\n{self.servers[i].tail_log()}")

    def live_urls(self) -> list[str]:
        return [s.url for s in self.servers if s.alive]

    async def stream_cluster(self, stream: str, timeout: float = 30.0) -> ClusterInfo:
        """The stream's cluster info (leader, replicas), asked of any live node; waits out an
        election in progress."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            nc = None
            try:
                nc = await nats.connect(servers=self.live_urls(), connect_timeout=2, allow_reconnect=False)
                info = await nc.jetstream(timeout=2).stream_info(stream)
                if info.cluster is not None and info.cluster.leader:
                    return info.cluster
            except Exception as exc:  # no leader yet, or the node asked just died
                last = exc
            finally:
                if nc is not None:
                    await nc.close()
            await asyncio.sleep(0.1)
        raise ServerError(f"stream {stream} has no leader after {timeout}s ({last!r})")

    async def leader(self, stream: str) -> int:
        """The index of the node leading ``stream``."""
        info = await self.stream_cluster(stream)
        assert info.leader is not None
        return self.index(info.leader)

    def stop(self) -> None:
        for s in self.servers:
            try:
                s.stop(timeout=5)
            finally:
                s.kill()
        _LIVE.discard(self)

    def __enter__(self) -> LoopbackCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def cluster_fixture(root: Path, n: int = 3) -> Iterator[LoopbackCluster]:
    """For a pytest fixture: a started cluster, stopped afterwards whatever happened."""
    cluster = LoopbackCluster(root, n)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
