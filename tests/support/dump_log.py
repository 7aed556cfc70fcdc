"""``python -m tests.support.dump_log URLS RUN FILE``: a run's whole log, written to FILE (for
tests whose servers the test process cannot reach itself, as in a network namespace)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import msgspec

from jetrl.bus import events as ev
from tests.support.runlog import read_log


def load(path: Path) -> list[ev.Event]:
    """The events :func:`main` wrote."""
    pairs = msgspec.msgpack.decode(path.read_bytes(), type=list[tuple[bytes, dict[str, str]]])
    return [ev.decode_event(data, headers) for data, headers in pairs]


def main(url: str, run_id: str, out: str) -> None:
    log = asyncio.run(read_log(url, run_id))
    Path(out).write_bytes(msgspec.msgpack.encode([(ev.encode_event(e), ev.event_headers(e)) for e in log]))


if __name__ == "__main__":
    main(*sys.argv[1:4])
