"""The `jetrl` command line."""

from __future__ import annotations

import argparse
import importlib
import sys

from jetrl import __version__

# Each entry adds its subcommands with `add_command(subparsers)`; imported lazily so that a
# command's heavy imports (torch, SQLAlchemy) cost nothing to the others.
_COMMAND_MODULES = [
    "jetrl.deploy.bus_demo",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jetrl", description="asynchronous RL for LLMs over NATS JetStream")
    parser.add_argument("--version", action="version", version=f"jetrl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _COMMAND_MODULES:
        importlib.import_module(name).add_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
