"""`jetrl resume RUN`: carry on a run that stopped (Ctrl-C, a crash, a machine gone).

The run's directory holds its config and, for the embedded default, its log files. Every part
starts again and rebuilds its state from the log: the trainer replays the steps after its last
checkpoint, producers re-read what they submitted, the recorder resumes from its tracking row,
and unacked tasks and rollouts are delivered again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from jetrl.bus.log import configure
from jetrl.deploy.config import ConfigError, config_for_run
from jetrl.deploy.run_cmd import local_parts
from jetrl.deploy.supervisor import Supervisor
from jetrl.deploy.tenants_cmd import tenants_dir


def main(args: argparse.Namespace) -> int:
    configure(level="warning")
    run_dir = Path(args.runs_dir) / args.run
    cfg_path = run_dir / "config.json"
    if not cfg_path.exists():
        print(f"jetrl resume: {cfg_path} not found (is {args.run} a run under {args.runs_dir}?)")
        return 2
    data = json.loads(cfg_path.read_text())
    try:
        # Only limits may change on resume (e.g. more steps); the rest must stay as recorded.
        cfg = config_for_run(data, args.overrides)
    except ConfigError as exc:
        print(f"jetrl resume: {exc}")
        return 2
    try:
        local = local_parts(args.parts)
    except ValueError as exc:
        print(f"jetrl resume: {exc}")
        return 2
    sup = Supervisor(
        cfg,
        args.run,
        run_dir,
        nats_url=args.nats_url,
        db_url=args.db,
        tenants_dir=Path(tenants_dir(args.tenants_dir)),
        local=local,
        overrides=args.overrides,
    )
    return asyncio.run(sup.run())


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "resume",
        help="carry on a stopped run from its log",
        description="Overrides (e.g. --trainer.max_steps 2000) change the resumed run.",
    )
    p.add_argument("run")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--nats-url", default=None, help="the run's NATS server, when it was not the embedded one")
    p.add_argument("--db", default=None)
    p.add_argument("--tenants-dir", default=None, help="the deployment's tenants, as for `jetrl run`")
    p.add_argument("--parts", default="all", help="the parts started here, as for `jetrl run`")
    p.set_defaults(func=main, overrides=[])
