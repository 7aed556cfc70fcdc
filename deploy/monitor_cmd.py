"""``jetrl monitor RUN``: the run's live dashboard, in the terminal or (``--web``) a browser.

A live run is followed on its server (``--nats-url``, else the URL the supervisor wrote in
``<runs dir>/<run>/nats_url``); a run whose server is gone is read from its store (``--db``,
else ``<runs dir>/<run>/store.db``, opened read-only: nothing is created or migrated) and shows
the same series. ``--from-step`` and ``--from-time`` start the series at a point of the run's
history.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import re
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

if TYPE_CHECKING:
    from jetrl.bus.client import Bus
    from jetrl.consumers.monitor.service import Monitor

DEFAULT_WEB_PORT = 8265


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("monitor", help="a run's live dashboard: terminal, or --web for a browser")
    p.add_argument("run")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--nats-url", default=None, help="the run's server (default: the one its run dir names)")
    p.add_argument("--creds", default=None, help="credentials file (servers with authentication)")
    p.add_argument("--tenants-dir", default=None, help="the deployment's registry (its monitor identity)")
    p.add_argument(
        "--db",
        default=None,
        help="store URL for a finished run, read-only (default: <run dir>/store.db)",
    )
    p.add_argument("--store", action="store_true", help="read the store even if the server is up")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--from-step", type=int, default=None, help="start the series at this step")
    start.add_argument(
        "--from-time", default=None, help="start at a time: 'now', '-30m' (ago), epoch seconds or ISO 8601"
    )
    p.add_argument("--web", action="store_true", help="serve the dashboard to a browser")
    p.add_argument("--host", default="127.0.0.1", help="--web: address to bind (0.0.0.0: other machines)")
    p.add_argument("--port", type=int, default=DEFAULT_WEB_PORT, help="--web: port (0: any free one)")
    p.add_argument("--once", action="store_true", help="terminal: print one frame once caught up, then exit")
    p.add_argument("--prometheus", action="store_true", help="--web: also serve /metrics")
    p.set_defaults(func=main)


def parse_time(text: str, now: float) -> float:
    """'now', '-30m', '-2h', '-90s' (ago), epoch seconds, or an ISO 8601 time (local when naive)."""
    if text.strip() == "now":
        return now
    m = re.fullmatch(r"-(\d+(?:\.\d+)?)([smhd])", text.strip())
    if m:
        return now - float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    with contextlib.suppress(ValueError):
        return float(text)
    try:
        return datetime.datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise SystemExit(
            f"jetrl monitor: --from-time {text!r}: give ISO 8601, epoch seconds or -30m"
        ) from None


def server_up(url: str, timeout: float = 1.0) -> bool:
    """Whether something listens at the NATS URL (nats-py would wait for it forever)."""
    first = url.split(",")[0]
    u = urlparse(first if "://" in first else f"nats://{first}")
    try:
        with socket.create_connection((u.hostname or "127.0.0.1", u.port or 4222), timeout=timeout):
            return True
    except OSError:
        return False


@contextlib.asynccontextmanager
async def private_log(run_dir: Path) -> AsyncIterator[Bus | None]:
    """A finished run's own log files (``<run dir>/nats``) served by a private nats-server for
    as long as the dashboard runs, so that its inspector can read tokens; None when the run
    has no such files (its log was on another server)."""
    from jetrl.bus.client import Bus
    from jetrl.bus.server import EmbeddedServer

    if not (run_dir / "nats").is_dir():
        yield None
        return
    with EmbeddedServer(run_dir / "nats") as srv:
        bus = await Bus.connect(srv.url, name="monitor-inspector")
        try:
            yield bus
        finally:
            await bus.close()


async def show_terminal(monitor: Monitor, stop: asyncio.Event, once: bool) -> None:
    from rich.console import Console
    from rich.live import Live

    from jetrl.consumers.monitor.terminal import render

    # Piped output gets 80 columns by default, too few for the tables.
    console = Console() if sys.stdout.isatty() else Console(width=150)
    head = await monitor.bus.last_seq(monitor.run_id) if monitor.bus is not None else 0
    task = asyncio.create_task(monitor.run(stop))
    waiter = asyncio.create_task(monitor.caught_up.wait())
    # A long log takes a while to fold: say how far it got.
    with console.status("reading the run's log...") as status:
        while not (task.done() or waiter.done()):
            await asyncio.wait({task, waiter}, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
            st = monitor.state
            status.update(f"reading the run's log: {st.events:,} events, at {st.last_seq:,} of {head:,}")
    if task.done():
        waiter.cancel()
        task.result()  # its error, if any
    if once:
        console.print(render(monitor))
        stop.set()
    else:
        with Live(render(monitor), console=console, refresh_per_second=1, screen=console.is_terminal) as live:
            while not stop.is_set() and not task.done():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
                live.update(render(monitor))
    stop.set()
    await task


async def show_web(monitor: Monitor, stop: asyncio.Event, host: str, port: int, prometheus: bool) -> None:
    from jetrl.consumers.monitor.web import serve

    metrics = None
    if prometheus:
        from jetrl.consumers.monitor.prometheus import Exporter

        exporter = Exporter(monitor)
        metrics = exporter.render
    task = asyncio.create_task(monitor.run(stop))
    try:
        await serve(
            monitor,
            host=host,
            port=port,
            stop=stop,
            metrics=metrics,
            on_ready=lambda url: print(f"jetrl monitor: run {monitor.run_id} at {url}", flush=True),
        )
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def main(args: argparse.Namespace) -> int:
    import time

    from jetrl.bus.runtime import run_process
    from jetrl.consumers.monitor.reader import Start
    from jetrl.consumers.monitor.service import Monitor
    from jetrl.consumers.monitor.settings import MonitorSettings

    run_dir = Path(args.runs_dir) / args.run
    start = Start(
        step=args.from_step,
        time=parse_time(args.from_time, time.time()) if args.from_time is not None else None,
    )
    url = args.nats_url
    if url is None and (run_dir / "nats_url").exists():
        url = (run_dir / "nats_url").read_text().strip()
    up = url is not None and server_up(url)
    live = up and not args.store
    if args.nats_url and not live and not args.store:
        print(
            f"jetrl monitor: no server at {args.nats_url}; reading the run's store instead", file=sys.stderr
        )
    store = None
    if not live:
        from jetrl.store.db import StoreError, open_store_read_only, sqlite_url

        db = args.db
        if db is None:
            path = run_dir / "store.db"
            if not path.exists():
                print(f"jetrl monitor: no live server for {args.run} and no store at {path}", file=sys.stderr)
                return 2
            db = sqlite_url(path)
        try:  # a finished run is only read: nothing is created or migrated
            store = open_store_read_only(db)
        except StoreError as exc:
            print(f"jetrl monitor: {exc}", file=sys.stderr)
            return 2
    creds = args.creds
    if live and creds is None:
        from jetrl.deploy.tenants import TenantRegistry
        from jetrl.deploy.tenants_cmd import tenants_dir

        reg = TenantRegistry(tenants_dir(args.tenants_dir))
        if reg.has_tenants():  # the server authenticates: watch as jetrl's monitor identity
            creds = str(reg.creds_path("monitor"))

    async def go(stop: asyncio.Event) -> int:
        from jetrl.bus.client import Bus

        bus = log_bus = None
        if live:
            assert url is not None
            bus = await Bus.connect(url, name=f"monitor-cli-{args.run}", creds=creds)
        async with contextlib.AsyncExitStack() as stack:
            if args.web and not up:  # never a second server on files a live one is using
                log_bus = await stack.enter_async_context(private_log(run_dir))
            monitor = Monitor(
                args.run, bus=bus, store=store, settings=MonitorSettings(), start=start, log_bus=log_bus
            )
            try:
                if args.web:
                    await show_web(monitor, stop, args.host, args.port, args.prometheus)
                else:
                    await show_terminal(monitor, stop, args.once)
            finally:
                if bus is not None:
                    await bus.close()
                if store is not None:
                    store.close()
        return 0

    # Logs would tear the terminal frame: only errors go to stderr there.
    return run_process(go, log_level=None if args.web else "error")
