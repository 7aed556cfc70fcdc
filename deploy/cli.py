"""The `jetrl` command line."""

from __future__ import annotations

import argparse
import importlib
import sys

from jetrl import __version__

# Each entry adds its subcommands with `add_command(subparsers)`; imported lazily so that a
# command's heavy imports (torch, SQLAlchemy) cost nothing to the others.
_COMMAND_MODULES = [
    "jetrl.deploy.run_cmd",
    "jetrl.deploy.replay_cmd",
    "jetrl.deploy.resume_cmd",
    "jetrl.deploy.store_cmd",
    "jetrl.deploy.bus_demo_cmd",
    "jetrl.deploy.gateway_cmd",
    "jetrl.deploy.export_cmd",
    "jetrl.deploy.plot_cmd",
    "jetrl.deploy.tiny_hf_cmd",
    "jetrl.deploy.import_model_cmd",
    "jetrl.deploy.tenants_cmd",
    "jetrl.deploy.producer_cmd",
    "jetrl.deploy.monitor_cmd",
    "jetrl.deploy.nats_cmd",
    "jetrl.deploy.part_cmd",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jetrl", description="asynchronous RL for LLMs over NATS JetStream")
    parser.add_argument("--version", action="version", version=f"jetrl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _COMMAND_MODULES:
        importlib.import_module(name).add_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from jetrl.deploy.run_cmd import split_overrides

    argv = list(sys.argv[1:] if argv is None else argv)
    own, overrides = split_overrides(argv)
    args = build_parser().parse_args(own)
    if overrides:
        if args.command not in ("run", "resume", "producer"):
            build_parser().error(f"unrecognized arguments: {' '.join(overrides)}")
        args.overrides = overrides
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
