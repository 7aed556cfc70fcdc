"""python -m jetrl.consumers.inference --nats-url URL --run RUN --worker-id ID [--settings JSON]"""

from __future__ import annotations

import argparse
import asyncio
import sys

from jetrl.bus.client import Bus
from jetrl.bus.runtime import load_settings, run_process
from jetrl.consumers.inference.worker import InferenceSettings, InferenceWorker


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jetrl-inference")
    ap.add_argument("--nats-url", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--worker-id", required=True)
    ap.add_argument("--settings", default="{}", help="InferenceSettings as JSON, or @path to a JSON file")
    args = ap.parse_args(argv)
    settings = load_settings(InferenceSettings, args.settings)

    async def go(stop: asyncio.Event) -> int:
        bus = await Bus.connect(args.nats_url, name=f"inference-{args.worker_id}")
        try:
            await InferenceWorker(bus, args.run, args.worker_id, settings).run(stop)
        finally:
            await bus.close()
        return 0

    return run_process(go)


if __name__ == "__main__":
    sys.exit(main())
