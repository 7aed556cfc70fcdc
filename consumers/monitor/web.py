"""The monitor's web page (``jetrl monitor RUN --web``): one aiohttp server over a :class:`Monitor`.

Routes:

- ``/``: the page (``static/index.html``), ``/static/<file>`` its script and style, and
  ``/static/plotly.min.js`` the plotly.js bundled in the installed ``plotly`` package (served
  from here: the page loads nothing from elsewhere, so it works on a machine without internet);
- ``/api/snapshot``: ``Monitor.snapshot()``; ``/api/points?after=N``: the step points after step N;
- ``/api/steps/{step}/rollouts``: the rollout inspector (``Monitor.inspect``), 404 when the step
  is not known;
- ``/events``: server-sent events: on connect every point (``points``) and the ``snapshot``,
  then about every second the new points and the snapshot. A reconnecting EventSource sends
  the last step it got (``Last-Event-ID``) and gets only the points after it;
- ``/metrics``: the Prometheus text, when the caller gives a ``metrics`` callable.

The server only reads the monitor; the caller runs it (``await monitor.run(stop)``).
JSON has no NaN or infinities: such values are sent as null.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gzip
import importlib.resources
import json
import math
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from jetrl.bus.log import get_logger
from jetrl.consumers.monitor.service import Monitor

log = get_logger(__name__)

STATIC = Path(__file__).parent / "static"
PUSH_EVERY_S = 1.0
Metrics = Callable[[], tuple[bytes, str]]

_MONITOR = web.AppKey("monitor", Monitor)
_CLOSING = web.AppKey("closing", asyncio.Event)
_PUSH_EVERY_S = web.AppKey("push_every_s", float)


def _finite(x: Any) -> Any:
    """``x`` with every non-finite float replaced by None (JSON has no NaN)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def _dumps(x: Any) -> str:
    return json.dumps(_finite(x), separators=(",", ":"), default=str, allow_nan=False)


def _json(x: Any, status: int = 200) -> web.Response:
    return web.json_response(x, status=status, dumps=_dumps)


@functools.cache
def _plotly(gzipped: bool) -> bytes:
    """plotly.min.js of the installed plotly package (package_data), read once, gzipped once."""
    raw = importlib.resources.files("plotly").joinpath("package_data", "plotly.min.js").read_bytes()
    return gzip.compress(raw, 6) if gzipped else raw


def _monitor(request: web.Request) -> Monitor:
    return request.app[_MONITOR]


async def _index(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


async def _static(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    path = STATIC / name
    # Only the files of static/ itself: no subfolders, no way out of it.
    if "/" in name or "\\" in name or name.startswith(".") or not path.is_file():
        raise web.HTTPNotFound()
    return web.FileResponse(path, headers={"Cache-Control": "no-cache"})


async def _plotly_js(request: web.Request) -> web.Response:
    gz = "gzip" in request.headers.get("Accept-Encoding", "")
    body = await asyncio.to_thread(_plotly, gz)
    headers = {"Cache-Control": "public, max-age=86400", "Vary": "Accept-Encoding"}
    if gz:
        headers["Content-Encoding"] = "gzip"
    return web.Response(body=body, content_type="application/javascript", headers=headers)


async def _snapshot(request: web.Request) -> web.Response:
    return _json(_monitor(request).snapshot())


def _int_query(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise web.HTTPBadRequest(
            text=_dumps({"error": f"{name} must be an integer, not {raw!r}"}),
            content_type="application/json",
        ) from None


async def _points(request: web.Request) -> web.Response:
    after = _int_query(request, "after", -1)
    return _json(_monitor(request).points(after))


async def _rollouts(request: web.Request) -> web.Response:
    raw = request.match_info["step"]
    try:
        step = int(raw)
    except ValueError:
        return _json({"error": f"a step is an integer, not {raw!r}"}, 400)
    try:
        out = await _monitor(request).inspect(step)
    except Exception as exc:  # the log unreachable, an array gone: the page says so
        log.warning("monitor_inspect_failed", step=step, error=repr(exc))
        return _json({"error": f"reading step {step}: {exc}", "step": step}, 500)
    if out is None:
        return _json({"error": f"step {step} is not in the run", "step": step}, 404)
    return _json(out)


def _sse(event: str, data: Any, event_id: int | None = None) -> bytes:
    head = f"event: {event}\n" + (f"id: {event_id}\n" if event_id is not None else "")
    return (head + f"data: {_dumps(data)}\n\n").encode()


async def _events(request: web.Request) -> web.StreamResponse:
    monitor = _monitor(request)
    closing = request.app[_CLOSING]
    after = -1
    with contextlib.suppress(ValueError):
        after = int(request.headers.get("Last-Event-ID", "") or request.query.get("after", "-1"))
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # a proxy in front must not hold the stream back
        }
    )
    try:
        await resp.prepare(request)
        await resp.write(b"retry: 2000\n\n")
        while not closing.is_set():
            pts = monitor.points(after)
            if pts:
                after = int(pts[-1]["step"])
                await resp.write(_sse("points", pts, after))
            await resp.write(_sse("snapshot", monitor.snapshot()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(closing.wait(), request.app[_PUSH_EVERY_S])
            transport = request.transport
            if transport is None or transport.is_closing():
                break  # the page went away
    except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError):
        pass  # the page went away between two writes: nothing to tell anyone
    return resp


def _metrics_handler(metrics: Metrics) -> Callable[[web.Request], Any]:
    async def handler(request: web.Request) -> web.Response:
        body, ctype = metrics()
        return web.Response(body=body, headers={"Content-Type": ctype})

    return handler


async def _closing(app: web.Application) -> None:
    app[_CLOSING].set()  # server-sent event streams end, so the server stops at once


def make_app(
    monitor: Monitor, metrics: Metrics | None = None, *, push_every_s: float = PUSH_EVERY_S
) -> web.Application:
    app = web.Application()
    app[_MONITOR] = monitor
    app[_PUSH_EVERY_S] = push_every_s
    app[_CLOSING] = asyncio.Event()
    app.on_shutdown.append(_closing)
    app.router.add_get("/", _index)
    app.router.add_get("/static/plotly.min.js", _plotly_js)
    app.router.add_get("/static/{name}", _static)
    app.router.add_get("/api/snapshot", _snapshot)
    app.router.add_get("/api/points", _points)
    app.router.add_get("/api/steps/{step}/rollouts", _rollouts)
    app.router.add_get("/events", _events)
    if metrics is not None:
        app.router.add_get("/metrics", _metrics_handler(metrics))
    return app


def _url(host: str, port: int) -> str:
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()  # every interface: the name other machines reach it by
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/"


async def serve(
    monitor: Monitor,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    stop: asyncio.Event,
    metrics: Metrics | None = None,
    on_ready: Callable[[str], None] | None = None,
    push_every_s: float = PUSH_EVERY_S,
) -> None:
    """Serve the page on ``host:port`` (port 0: a free one) until ``stop``; ``on_ready`` gets its URL.
    The event stream pushes new points every ``push_every_s``."""
    app = make_app(monitor, metrics, push_every_s=push_every_s)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=5.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = port
        for addr in runner.addresses:
            if isinstance(addr, tuple) and len(addr) >= 2:
                bound = int(addr[1])
                break
        url = _url(host, bound)
        log.info("monitor_web_serving", run_id=monitor.run_id, url=url)
        if on_ready is not None:
            on_ready(url)
        await stop.wait()
    finally:
        app[_CLOSING].set()
        await runner.cleanup()
