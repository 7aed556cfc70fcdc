"""python -m jetrl.consumers.trainer --nats-url URL --run RUN --run-dir DIR [--settings JSON]"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from jetrl.bus.client import Bus
from jetrl.bus.runtime import load_settings, run_process
from jetrl.consumers.trainer.trainer import Trainer, TrainerSettings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jetrl-trainer")
    ap.add_argument("--nats-url", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--settings", default="{}", help="TrainerSettings as JSON, or @path to a JSON file")
    args = ap.parse_args(argv)
    settings = load_settings(TrainerSettings, args.settings)

    async def go(stop: asyncio.Event) -> int:
        bus = await Bus.connect(args.nats_url, name="trainer")
        try:
            return await Trainer(bus, args.run, settings, args.run_dir).run(stop)
        finally:
            await bus.close()

    return run_process(go)


if __name__ == "__main__":
    sys.exit(main())
