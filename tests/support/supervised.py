"""Runs under test that cannot outlive their test."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from jetrl.deploy.supervisor import Supervisor


@contextlib.asynccontextmanager
async def supervised(sup: Supervisor) -> AsyncIterator[asyncio.Task[int]]:
    """The run as a task: whatever the test meets (a failed assert, a bound of its own), the
    run is cancelled on the way out, which stops its parts (a vLLM server with its worker)
    and closes its log, rather than left pending in the session's event loop. A part its
    clean-up did not reach is stopped by :func:`runs_end_with_the_test`."""
    run = asyncio.create_task(sup.run())
    try:
        yield run
    finally:
        if not run.done():
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(run, 120)


@contextlib.contextmanager
def runs_end_with_the_test(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every Supervisor made inside has its parts and its own nats-server stopped on the way
    out, whatever ended the test: pytest-timeout's signal lands in the event loop's wait, not
    in the test, so no `finally` of the test runs, and a run's trainer or vLLM server left
    alive would slow (or confuse) every test after it on that worker."""
    made: list[Supervisor] = []
    init = Supervisor.__init__

    def tracked(self: Supervisor, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Supervisor, "__init__", tracked)
    try:
        yield
    finally:
        for sup in made:
            sup.stop_parts(timeout=5.0)  # parts already ended are skipped
            if sup.server is not None:
                sup.server.stop()
