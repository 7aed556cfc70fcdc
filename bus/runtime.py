"""Process plumbing shared by every jetrl process: logging, signals, a stop event, the part
entry point."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import json
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from jetrl.bus.client import Bus
from jetrl.bus.identity import unless_set
from jetrl.bus.log import configure, get_logger

T = TypeVar("T", bound=BaseModel)


def load_settings(model: type[T], raw: str) -> T:
    """A process's settings: JSON on the command line, or ``@path`` to a JSON file."""
    text = Path(raw[1:]).read_text() if raw.startswith("@") else raw
    return model.model_validate(json.loads(text))


# glibc's mallopt parameters
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory() -> bool:
    """Have glibc's allocator keep what a step frees for the next step, not give it back to
    the kernel: a part allocates and frees the same buffers every step, and each page given
    back is faulted in (and zeroed) again (~900 faults a step in the demo's trainer and
    worker alike, ~100 and ~2 with this). Blocks of 32 MB and more are still mapped apart and
    unmapped when freed. False where the C library has no ``mallopt`` (not glibc)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # fixed: glibc's own raises it as blocks are freed
    mallopt(_M_TRIM_THRESHOLD, 256 << 20)  # the free top of a heap kept up to this much
    mallopt(_M_TOP_PAD, 16 << 20)  # and grown by this much more at a time
    return True


# A part a supervisor started carries its pid: should the supervisor die without stopping it
# (killed outright), nothing else would (its server gone, a log follower reconnects forever).
SUPERVISOR_PID_ENV = "JETRL_SUPERVISOR_PID"
WATCH_EVERY_S = 1.0
ORPHAN_GRACE_S = 15.0  # as long as a supervisor waits for a part it stops before killing it


async def _stop_when_orphaned(pid: int, stop: asyncio.Event) -> None:
    """Once process ``pid`` (the supervisor) is gone: stop as on SIGTERM, then, should the part
    not have ended ``ORPHAN_GRACE_S`` later, end the process at once."""
    while True:
        await asyncio.sleep(WATCH_EVERY_S)
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):  # gone, or its pid another user's now
            break
    log = get_logger(__name__, supervisor_pid=pid)
    log.error("supervisor_gone", grace_s=ORPHAN_GRACE_S)
    stop.set()
    await asyncio.sleep(ORPHAN_GRACE_S)
    log.error("orphan_killed")
    os._exit(3)


def run_process(
    main: Callable[[asyncio.Event], Awaitable[int | None]], *, log_level: str | None = None
) -> int:
    """Run ``main(stop)`` until it returns; SIGTERM and SIGINT set ``stop`` so the process
    finishes its current unit of work and exits cleanly (a second signal exits at once)."""
    configure(log_level)
    # What the imports made lives as long as the process: out of the collector's reach, a full
    # collection walks only what the part makes (a forked part also keeps those pages shared).
    gc.freeze()
    keep_freed_memory()

    async def runner() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        hits = 0

        def on_signal() -> None:
            nonlocal hits
            hits += 1
            if hits > 1:
                raise SystemExit(130)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, on_signal)
        supervisor = os.environ.get(SUPERVISOR_PID_ENV, "")
        watch = None
        if supervisor.isdigit():
            watch = asyncio.create_task(_stop_when_orphaned(int(supervisor), stop))
        try:
            return int(await main(stop) or 0)
        finally:
            if watch is not None:
                watch.cancel()

    return asyncio.run(runner())


async def connect_until(stop: asyncio.Event, url: str | list[str], **options: Any) -> Bus | None:
    """Connect, waiting for the server however long it takes (a part may start first), unless
    ``stop`` is set meanwhile: then None."""
    return await unless_set(stop, Bus.connect(url, **options))


PartTask = Callable[[asyncio.Event], Awaitable[int | None]]


@dataclass(frozen=True)
class PartEntry(Generic[T]):
    """What a part is on its command line (``python -m jetrl.<part> --nats-url URL --run RUN
    [--settings JSON]`` plus its ``options``): :meth:`main` runs it as a process, :meth:`task`
    as one task of a process that hosts several parts (deploy/host.py), each with its own bus
    connection, so that they still meet only through the log."""

    prog: str
    settings_model: type[T]
    client_name: Callable[[argparse.Namespace, T], str]
    body: Callable[[Bus, argparse.Namespace, T, asyncio.Event], Awaitable[int | None]]
    options: Callable[[argparse.ArgumentParser], object] | None = None

    def task(self, argv: list[str] | None) -> PartTask:
        """Parse ``argv``; the part, to run until ``stop`` is set: connect, run its body."""
        ap = argparse.ArgumentParser(prog=self.prog)
        ap.add_argument("--nats-url", required=True)
        ap.add_argument("--run", required=True)
        ap.add_argument("--settings", default="{}", help="settings as JSON, or @path to a JSON file")
        ap.add_argument("--creds", default=None, help="the identity's credentials file (servers with auth)")
        if self.options is not None:
            self.options(ap)
        args = ap.parse_args(argv)
        settings = load_settings(self.settings_model, args.settings)

        async def go(stop: asyncio.Event) -> int | None:
            name = self.client_name(args, settings)
            bus = await connect_until(stop, args.nats_url, name=name, creds=args.creds)
            if bus is None:
                return 0  # stopped before the server answered
            try:
                return await self.body(bus, args, settings, stop)
            finally:
                await bus.close()

        return go

    def main(self, argv: list[str] | None = None) -> int:
        """The part as its own process, until SIGTERM or SIGINT."""
        return run_process(self.task(argv))
