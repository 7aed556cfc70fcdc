"""``python -m jetrl.consumers.recorder --nats-url URL --run RUN --settings JSON``: the recorder
as its own process (settings: consumers/recorder/settings.py; ``db`` is required).

SIGTERM or SIGINT stops it after the batch in progress is committed and acked; SIGKILL at any
moment is safe too (the next start resumes from the store's tracking row).
"""

from __future__ import annotations

import asyncio
import sys

from jetrl.bus.client import Bus
from jetrl.bus.log import get_logger
from jetrl.bus.runtime import PartEntry
from jetrl.consumers.recorder.recorder import Recorder, configure_gc
from jetrl.consumers.recorder.settings import RecorderPart
from jetrl.store.db import open_store_for_writing


async def record(bus: Bus, run_id: str, s: RecorderPart, stop: asyncio.Event) -> int:
    store = open_store_for_writing(s.db)
    rec = Recorder(bus, store, run_id, durable=s.durable, batch=s.batch, writer=s.writer, gather_s=s.gather_s)
    configure_gc()
    stopper = asyncio.create_task(stop.wait())
    stopper.add_done_callback(lambda _: rec.stop())
    try:
        await rec.run()
    finally:
        stopper.cancel()
        rec.close()
        store.close()
    get_logger(__name__, run_id=run_id).info("recorder_exit", recorded_seq=rec.recorded_seq)
    return 0


PART = PartEntry(
    prog="jetrl-recorder",
    settings_model=RecorderPart,
    client_name=lambda args, s: f"recorder-{args.run}",
    body=lambda bus, args, s, stop: record(bus, args.run, s, stop),
)


def main(argv: list[str] | None = None) -> int:
    return PART.main(argv)


if __name__ == "__main__":
    sys.exit(main())
