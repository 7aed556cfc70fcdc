"""Process plumbing shared by every jetrl process: logging, signals, a stop event."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from jetrl.bus.log import configure

T = TypeVar("T", bound=BaseModel)


def load_settings(model: type[T], raw: str) -> T:
    """A process's settings: JSON on the command line, or ``@path`` to a JSON file."""
    text = Path(raw[1:]).read_text() if raw.startswith("@") else raw
    return model.model_validate(json.loads(text))


def run_process(
    main: Callable[[asyncio.Event], Awaitable[int | None]], *, log_level: str | None = None
) -> int:
    """Run ``main(stop)`` until it returns; SIGTERM and SIGINT set ``stop`` so the process
    finishes its current unit of work and exits cleanly (a second signal exits at once)."""
    configure(log_level)

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
        return int(await main(stop) or 0)

    return asyncio.run(runner())
