"""nats-server configurations for a JetStream cluster of N nodes (3 by default).

:func:`plan_cluster` lays the nodes out (names, ports, store directories), :func:`render_cluster`
turns them into one configuration text per node, :func:`write_cluster` writes them. Each node gets
its ``server_name``, a client listener, a monitoring port, ``jetstream { store_dir,
max_file_store }`` and a ``cluster { name, listen, routes }`` block naming every node's route
(its own included: nats-server skips it). Clients are given every node's client URL
(:meth:`ClusterSpec.client_urls`), so that they connect to any live one and fail over by
themselves. A run's stream and payload bucket on such a cluster get 3 replicas (``[bus] replicas
= "auto"``, bus/settings.py).

The configuration follows the single server's (bus/server.py): the same message size limit, the
same file store, and the same include of the tenants' ``authorization`` block (deploy/tenants.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from jetrl.bus.server import EmbeddedServer

DEFAULT_NAME = "jetrl"
DEFAULT_CLIENT_PORT = 4222
DEFAULT_CLUSTER_PORT = 6222
DEFAULT_HTTP_PORT = 8222
DEFAULT_STORE_DIR = "/var/lib/nats/{server}"
DEFAULT_MAX_FILE_STORE = 1024**4
# As the embedded server's: the largest payload a part puts on the bus in one message.
_EMBEDDED_DEFAULTS = EmbeddedServer.__init__.__kwdefaults__ or {}
DEFAULT_MAX_PAYLOAD = int(_EMBEDDED_DEFAULTS.get("max_payload", 8 * 1024 * 1024))
URLS_FILE = "client-urls.txt"


class ClusterConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ClusterNode:
    """One node: where clients, the other nodes and monitoring reach it, and its store."""

    server_name: str
    host: str
    client_port: int = DEFAULT_CLIENT_PORT
    cluster_port: int = DEFAULT_CLUSTER_PORT
    http_port: int = DEFAULT_HTTP_PORT
    store_dir: str = ""
    listen_host: str = "0.0.0.0"  # every interface: the node serves other machines

    @property
    def client_url(self) -> str:
        return f"nats://{self.host}:{self.client_port}"

    @property
    def route_url(self) -> str:
        return f"nats-route://{self.host}:{self.cluster_port}"


@dataclass(frozen=True)
class ClusterSpec:
    nodes: tuple[ClusterNode, ...]
    name: str = DEFAULT_NAME
    max_payload: int = DEFAULT_MAX_PAYLOAD
    max_file_store: int = DEFAULT_MAX_FILE_STORE
    # A file with the tenants' authorization block, as each node's configuration names it
    # (nats-server reads an include relative to the including file).
    auth_include: str | None = None
    # Where each node registers its pid file (``<client port>.pid``), for `jetrl tenants` to
    # reload the nodes of a machine after it changes the authorization.
    pid_dir: str | None = None

    def client_urls(self) -> list[str]:
        return [n.client_url for n in self.nodes]

    def client_url_list(self) -> str:
        """Every node's client URL, comma-separated: what `jetrl run --nats-url` and the other
        commands take."""
        return ",".join(self.client_urls())


def plan_cluster(
    hosts: Sequence[str],
    *,
    name: str = DEFAULT_NAME,
    client_port: int = DEFAULT_CLIENT_PORT,
    cluster_port: int = DEFAULT_CLUSTER_PORT,
    http_port: int = DEFAULT_HTTP_PORT,
    store_dir: str = DEFAULT_STORE_DIR,
    listen_host: str | None = None,
    max_file_store: int = DEFAULT_MAX_FILE_STORE,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    auth_include: str | None = None,
    pid_dir: str | None = None,
) -> ClusterSpec:
    """A cluster of one node per entry of ``hosts``, named ``<name>-0``, ``<name>-1``, ...

    The ports are every node's when the hosts are distinct machines. When a host appears more
    than once (several nodes on one machine, loopback say) node ``i`` takes each port plus
    ``i``, and ``store_dir`` must contain ``{server}`` (the node's name) so that no two nodes
    share a store. ``listen_host`` defaults to every interface, or to the host itself when it is
    a loopback address."""
    hosts = [h.strip() for h in hosts if h.strip()]
    if not hosts:
        raise ClusterConfigError("a cluster needs at least one host")
    if not _is_token(name):
        raise ClusterConfigError(f"cluster name {name!r}: letters, digits, '-' and '_' only")
    shared = len(set(hosts)) < len(hosts)
    if shared and "{server}" not in store_dir:
        raise ClusterConfigError(
            "several nodes on one host need their own store: put {server} in --store-dir"
        )
    nodes = []
    for i, host in enumerate(hosts):
        step = i if shared else 0
        server = f"{name}-{i}"
        nodes.append(
            ClusterNode(
                server_name=server,
                host=host,
                client_port=client_port + step,
                cluster_port=cluster_port + step,
                http_port=http_port + step,
                store_dir=store_dir.replace("{server}", server),
                listen_host=listen_host or (host if _is_loopback(host) else "0.0.0.0"),
            )
        )
    spec = ClusterSpec(
        nodes=tuple(nodes),
        name=name,
        max_payload=max_payload,
        max_file_store=max_file_store,
        auth_include=auth_include,
        pid_dir=pid_dir,
    )
    check_cluster(spec)
    return spec


def check_cluster(spec: ClusterSpec) -> None:
    """No two nodes share a name, a listening address or a store directory."""
    names = [n.server_name for n in spec.nodes]
    if len(set(names)) != len(names):
        raise ClusterConfigError(f"server names repeat: {names}")
    seen: dict[tuple[str, int], str] = {}
    for n in spec.nodes:
        for port in (n.client_port, n.cluster_port, n.http_port):
            if not 0 < port < 65536:
                raise ClusterConfigError(f"{n.server_name}: port {port} out of range")
            key = (n.host, port)
            if key in seen:
                raise ClusterConfigError(f"{n.server_name} and {seen[key]} both use {n.host}:{port}")
            seen[key] = n.server_name
    stores = [(n.host, n.store_dir) for n in spec.nodes]
    if len(set(stores)) != len(stores):
        raise ClusterConfigError("two nodes on one host share a store directory")


def render_node(spec: ClusterSpec, node: ClusterNode) -> str:
    """One node's nats-server configuration."""
    # Every node's route, its own too (nats-server recognises and skips it): the same list on
    # every node.
    routes = [f'    "{n.route_url}"' for n in spec.nodes]
    lines = [
        f"# nats-server configuration of {node.server_name}, one of the {len(spec.nodes)} nodes of the",
        f"# JetStream cluster {spec.name!r} (generated by `jetrl nats-config`).",
        f"# Clients: {spec.client_url_list()}",
        f"server_name: {node.server_name}",
        f'listen: "{node.listen_host}:{node.client_port}"',
        f'client_advertise: "{node.host}:{node.client_port}"',
        f'http: "{node.listen_host}:{node.http_port}"',
        f"max_payload: {spec.max_payload}",
        "",
        f"# {spec.max_file_store / 1024**3:g} GiB for the streams of every run this cluster holds",
        "jetstream {",
        f'  store_dir: "{node.store_dir}"',
        f"  max_file_store: {spec.max_file_store}",
        "}",
        "",
        "cluster {",
        f"  name: {spec.name}",
        f'  listen: "{node.listen_host}:{node.cluster_port}"',
        f'  advertise: "{node.host}:{node.cluster_port}"',
        "  routes: [",
        *routes,
        "  ]",
        "}",
    ]
    if spec.pid_dir is not None:
        lines.append(f'pid_file: "{Path(spec.pid_dir) / f"{node.client_port}.pid"}"')
    if spec.auth_include is not None:
        lines.append(f'include "{spec.auth_include}"')
    return "\n".join(lines) + "\n"


def render_cluster(spec: ClusterSpec) -> dict[str, str]:
    """Every file of the cluster's configuration by name: ``<server name>.conf`` per node, and
    the client URL list."""
    check_cluster(spec)
    files = {f"{n.server_name}.conf": render_node(spec, n) for n in spec.nodes}
    files[URLS_FILE] = spec.client_url_list() + "\n"
    return files


def include_path(auth_conf: str | Path, conf_dir: str | Path) -> str:
    """How a configuration in ``conf_dir`` names ``auth_conf``: relative to it, as nats-server
    resolves an include (the embedded server does the same)."""
    return os.path.relpath(Path(auth_conf).resolve(), Path(conf_dir).resolve())


def write_cluster(spec: ClusterSpec, out_dir: str | Path) -> list[Path]:
    """Write the cluster's files into ``out_dir``; the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for fname, text in render_cluster(spec).items():
        path = out / fname
        path.write_text(text)
        written.append(path)
    return written


def _is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


def _is_token(name: str) -> bool:
    return bool(name) and all(c.isalnum() or c in "-_" for c in name)
