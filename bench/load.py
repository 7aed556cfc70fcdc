"""Busy CPU processes beside a benchmark (``--load N``): figures measured on a loaded machine.

Each process spins in pure Python until the benchmark ends (or ``limit_s`` passes, so that a
crashed benchmark leaves nothing running)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from collections.abc import Iterator


def _spin(stop: mp.synchronize.Event, limit_s: float) -> None:
    end = time.monotonic() + limit_s
    x = 0
    while not stop.is_set() and time.monotonic() < end:
        for _ in range(100_000):
            x += 1


@contextlib.contextmanager
def cpu_load(n: int, limit_s: float = 3600.0) -> Iterator[None]:
    if n <= 0:
        yield
        return
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=_spin, args=(stop, limit_s), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
