"""``python -m jetrl.consumers.recorder``: the recorder as a separate process.

SIGTERM or SIGINT stops it after the batch in progress is committed and acked; SIGKILL at any
moment is safe too (the next start resumes from the store's tracking row).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from jetrl.bus.client import Bus
from jetrl.bus.log import configure, get_logger
from jetrl.consumers.recorder.recorder import DEFAULT_DURABLE, Recorder
from jetrl.store.db import open_store


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jetrl.consumers.recorder", description=__doc__)
    p.add_argument("--nats-url", required=True, help="NATS server URL (comma-separated for a cluster)")
    p.add_argument("--run", required=True, help="run id whose log is recorded")
    p.add_argument("--db", required=True, help="store URL (sqlite:///path or postgresql+psycopg://...)")
    p.add_argument("--durable", default=DEFAULT_DURABLE, help="durable consumer name (default %(default)s)")
    p.add_argument("--batch", type=int, default=1000, help="events fetched and committed together")
    p.add_argument("--log-level", default=None)
    return p.parse_args(argv)


async def amain(args: argparse.Namespace) -> int:
    log = get_logger("jetrl.recorder", run_id=args.run, consumer=args.durable)
    store = open_store(args.db)
    bus = await Bus.connect(args.nats_url.split(","), name=f"recorder-{args.run}")
    rec = Recorder(bus, store, args.run, durable=args.durable, batch=args.batch)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, rec.stop)
    try:
        await rec.run()
    finally:
        rec.close()
        await bus.close()
        store.close()
    log.info("recorder_exit", recorded_seq=rec.recorded_seq)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure(args.log_level)
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
