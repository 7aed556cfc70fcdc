"""A run under test that cannot outlive its test: whatever the test meets (a failed assert, a
timeout of its own), the run is cancelled on the way out, which stops its parts (a vLLM
server with its worker), and any part still alive is then stopped by the supervisor."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from jetrl.deploy.supervisor import Supervisor


@contextlib.asynccontextmanager
async def supervised(sup: Supervisor) -> AsyncIterator[asyncio.Task[int]]:
    run = asyncio.create_task(sup.run())
    try:
        yield run
    finally:
        if not run.done():
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(run, 120)  # its own clean-up: parts stopped, log closed
        sup.stop_parts()  # a part the cancelled run did not reach
