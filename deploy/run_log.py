"""Reaching a finished run's log from a command: the server named by ``--nats-url``, or the
run's own log files (``<runs dir>/<run>/nats``) served by a private nats-server for as long as
the command runs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from jetrl.bus.server import EmbeddedServer


def with_run_log(
    command: str, run_dir: Path, nats_url: str | None, go: Callable[[str], Coroutine[Any, Any, int]]
) -> int:
    """``go(url)`` against the run's log; exit status 2 when there is none to serve."""
    if nats_url:
        return asyncio.run(go(nats_url))
    if not (run_dir / "nats").is_dir():
        print(f"{command}: {run_dir / 'nats'} not found; give --nats-url for a run on another server")
        return 2
    with EmbeddedServer(run_dir / "nats") as srv:
        return asyncio.run(go(srv.url))
