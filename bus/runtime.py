"""Process plumbing shared by every jetrl process: logging, signals, a stop event, the part
entry point, and loading the engine a setting names."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from jetrl.bus.client import Bus
from jetrl.bus.identity import unless_set
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


async def connect_until(stop: asyncio.Event, url: str | list[str], **options: Any) -> Bus | None:
    """Connect, waiting for the server however long it takes (a part may start first), unless
    ``stop`` is set meanwhile: then None."""
    return await unless_set(stop, Bus.connect(url, **options))


def part_main(
    argv: list[str] | None,
    *,
    prog: str,
    settings_model: type[T],
    client_name: Callable[[argparse.Namespace, T], str],
    body: Callable[[Bus, argparse.Namespace, T, asyncio.Event], Awaitable[int | None]],
    options: Callable[[argparse.ArgumentParser], object] | None = None,
) -> int:
    """The entry point of a part (``python -m jetrl.<part> --nats-url URL --run RUN
    [--settings JSON]`` plus its ``options``): parse, connect, run ``body`` until stopped."""
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--nats-url", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--settings", default="{}", help="settings as JSON, or @path to a JSON file")
    ap.add_argument("--creds", default=None, help="the identity's credentials file (servers with auth)")
    if options is not None:
        options(ap)
    args = ap.parse_args(argv)
    settings = load_settings(settings_model, args.settings)

    async def go(stop: asyncio.Event) -> int | None:
        bus = await connect_until(stop, args.nats_url, name=client_name(args, settings), creds=args.creds)
        if bus is None:
            return 0  # stopped before the server answered
        try:
            return await body(bus, args, settings, stop)
        finally:
            await bus.close()

    return run_process(go)
