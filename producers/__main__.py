"""python -m jetrl.producers --nats-url URL --run RUN [--settings JSON]"""

from __future__ import annotations

import argparse
import asyncio
import sys

from jetrl.bus.client import Bus
from jetrl.bus.runtime import load_settings, run_process
from jetrl.producers.producer import EnvProducer, ProducerSettings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jetrl-producer")
    ap.add_argument("--nats-url", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--settings", default="{}", help="ProducerSettings as JSON, or @path to a JSON file")
    args = ap.parse_args(argv)
    settings = load_settings(ProducerSettings, args.settings)

    async def go(stop: asyncio.Event) -> int:
        bus = await Bus.connect(args.nats_url, name=f"env-{settings.env}")
        try:
            await EnvProducer(bus, args.run, settings).run(stop)
        finally:
            await bus.close()
        return 0

    return run_process(go)


if __name__ == "__main__":
    sys.exit(main())
