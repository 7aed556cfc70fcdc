"""`jetrl run [CONFIG] [--section.key value ...]`: an RL run, every part its own process."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from jetrl.bus.log import configure
from jetrl.deploy.config import ConfigError, load_config
from jetrl.deploy.launcher import ShadowedPackage
from jetrl.deploy.parts import KINDS
from jetrl.deploy.supervisor import Supervisor
from jetrl.deploy.tenants_cmd import tenants_dir


def main(args: argparse.Namespace) -> int:
    configure(level="warning")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"jetrl run: {exc}")
        return 2
    try:
        local = local_parts(args.parts)
    except ValueError as exc:
        print(f"jetrl run: {exc}")
        return 2
    run_id = args.run_id or f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(args.runs_dir or cfg.run.runs_dir) / run_id
    try:
        sup = Supervisor(
            cfg,
            run_id,
            run_dir,
            nats_url=args.nats_url,
            db_url=args.db,
            tenants_dir=Path(tenants_dir(args.tenants_dir)),
            local=local,
        )
    except ShadowedPackage as exc:
        print(f"jetrl run: {exc}")
        return 2
    return asyncio.run(sup.run())


def local_parts(spec: str) -> frozenset[str]:
    """``--parts``: "all", "none", or kinds of part separated by commas."""
    if spec in ("all", "none"):
        return frozenset(KINDS) if spec == "all" else frozenset()
    kinds = {k.strip() for k in spec.split(",") if k.strip()}
    unknown = kinds - set(KINDS)
    if unknown:
        raise ValueError(f"--parts: unknown kind(s) {sorted(unknown)}; give all, none or some of {KINDS}")
    return frozenset(kinds)


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "run",
        help="run RL: embedded nats-server and SQLite unless told otherwise",
        description="Override any config key with --section.key value (e.g. --trainer.lr 1e-3, "
        "--envs.0.group_size 8).",
    )
    p.add_argument("config", nargs="?", default=None, help="TOML run config (see configs/)")
    p.add_argument("--nats-url", default=None, help="use this NATS server instead of a private one")
    p.add_argument("--db", default=None, help="store URL (default: SQLite file in the run directory)")
    p.add_argument("--run-id", default=None)
    p.add_argument("--runs-dir", default=None)
    p.add_argument(
        "--tenants-dir",
        default=None,
        help="the deployment's tenants (default $JETRL_TENANTS_DIR or runs/tenants): with any, every "
        "client authenticates",
    )
    p.add_argument(
        "--parts",
        default="all",
        help="the parts started here: all (default), none, or a comma list of "
        f"{', '.join(KINDS)}; the others are started anywhere with `jetrl part KIND` (docs/cluster.md)",
    )
    p.set_defaults(func=main, overrides=[])


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate --section.key overrides (free-form) from the command's own flags."""
    own, overrides = [], []
    it = iter(argv)
    for a in it:
        if a.startswith("--") and "." in a.split("=", 1)[0]:
            overrides.append(a)
            if "=" not in a:
                nxt = next(it, None)
                if nxt is not None:
                    overrides.append(nxt)
        else:
            own.append(a)
    return own, overrides
