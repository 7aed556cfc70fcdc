"""`jetrl nats-config --hosts H1,H2,H3 --out DIR`: the configuration of a NATS JetStream cluster.

Writes one nats-server configuration per node (``<name>-<i>.conf``, deploy/nats_cluster.py) and
``client-urls.txt``, and prints the client URL list that every part is given (`jetrl run
--nats-url`, ...). Start each node with ``nats-server -c <name>-<i>.conf`` on its host.
"""

from __future__ import annotations

import argparse
from typing import Any

from jetrl.deploy.nats_cluster import (
    DEFAULT_CLIENT_PORT,
    DEFAULT_CLUSTER_PORT,
    DEFAULT_HTTP_PORT,
    DEFAULT_MAX_FILE_STORE,
    DEFAULT_NAME,
    DEFAULT_STORE_DIR,
    ClusterConfigError,
    plan_cluster,
    write_cluster,
)


def add_command(sub: Any) -> None:
    p = sub.add_parser("nats-config", help="nats-server configurations for a JetStream cluster")
    p.add_argument(
        "--hosts", required=True, help="the nodes' hosts, comma-separated (3 for a 3-node cluster)"
    )
    p.add_argument("--out", required=True, help="the directory to write the configurations into")
    p.add_argument("--name", default=DEFAULT_NAME, help=f"the cluster's name (default {DEFAULT_NAME})")
    p.add_argument("--client-port", type=int, default=DEFAULT_CLIENT_PORT)
    p.add_argument("--cluster-port", type=int, default=DEFAULT_CLUSTER_PORT, help="the routes between nodes")
    p.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT, help="monitoring (/healthz, /jsz)")
    p.add_argument(
        "--store-dir",
        default=DEFAULT_STORE_DIR,
        help="each node's JetStream store; {server} stands for the node's name (default %(default)s)",
    )
    p.add_argument(
        "--max-file-store-gib",
        type=float,
        default=DEFAULT_MAX_FILE_STORE / 1024**3,
        help="each node's JetStream file store limit (default %(default)g)",
    )
    p.add_argument("--listen-host", default=None, help="the interface to listen on (default: all)")
    p.add_argument(
        "--auth-include",
        default=None,
        help="the tenants' authorization file, as the configurations name it (relative to them)",
    )
    p.add_argument("--pid-dir", default=None, help="where each node writes its pid file")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        spec = plan_cluster(
            args.hosts.split(","),
            name=args.name,
            client_port=args.client_port,
            cluster_port=args.cluster_port,
            http_port=args.http_port,
            store_dir=args.store_dir,
            listen_host=args.listen_host,
            max_file_store=int(args.max_file_store_gib * 1024**3),
            auth_include=args.auth_include,
            pid_dir=args.pid_dir,
        )
    except ClusterConfigError as exc:
        print(f"nats-config: {exc}")
        return 2
    for path in write_cluster(spec, args.out):
        print(f"wrote {path}")
    print("give every client the cluster's URLs:")
    print(spec.client_url_list())
    return 0
