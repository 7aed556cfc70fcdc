"""Pull requests to a durable JetStream consumer, and the inbox their messages arrive on.

One fetch is at most two requests:

1. if nothing is waiting here, a lingering request for one message that expires with the
   caller's timeout (with idle heartbeats when that is long, so a dead connection shows);
2. then a ``no_wait`` request for the rest of the batch, bounded in count and in bytes and with
   no expiry: the server sends what it has at once and ends the request with a status (or with
   the last message of the batch), and the fetch waits for that end however long the transfer
   takes.

Why not nats-py's ``fetch``: its batch fetch keeps waiting for a full batch once one message has
come (a trickle of events would each wait the whole timeout), and a short fetch for "what is
already there" gives up on requests that the server goes on serving: each left up to a batch in
flight, and with 66 KiB events they added up past the server's 64 MiB buffer for one client. The
server then closed the connection as a slow consumer ("Slow Consumer Detected: MaxPending of
67108864 Exceeded"), and what it carried came back only after the ack wait (2,000 events took
exactly the ack wait: 30.2 s at 30 s, 5.2 s at 5 s; over half were delivered twice). Here at most
one request of each kind is open, bounded by ``max_bytes``, and every message delivered to the
inbox stays queued until a fetch takes it, whichever request it answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

STATUS = "Status"
HEARTBEAT = "100"  # idle heartbeat; every other status ends the request it answers
DROPPED = "503"  # put here when the connection dropped: ends a wait whose answer went with it
MiB = 1024 * 1024


def status_of(msg: Msg) -> str | None:
    return msg.headers.get(STATUS) if msg.headers and not msg.data else None


class PullChannel:
    """Fetches from the durable ``durable`` of ``stream`` through a private inbox."""

    def __init__(self, nc: NATS, stream: str, durable: str, *, max_bytes: int = 32 * MiB) -> None:
        self.nc = nc
        self.next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self.max_bytes = max_bytes  # per request: bounds what one fetch can bring in
        self.inbox = nc.new_inbox()
        self.queue: asyncio.Queue[Msg] = asyncio.Queue()
        self.sub: Subscription | None = None

    async def open(self) -> PullChannel:
        async def on_msg(msg: Msg) -> None:
            self.queue.put_nowait(msg)

        self.sub = await self.nc.subscribe(self.inbox, cb=on_msg)
        return self

    def connection_dropped(self) -> None:
        """The connection dropped: a request open on it will never be answered (the server
        answers on the connection that asked), so a fetch waiting for it stops now, as if the
        request had ended, and the next fetch asks again, instead of waiting out its patience
        (5 s of silence) or its expiry."""
        self.queue.put_nowait(Msg(_client=self.nc, subject=self.inbox, headers={STATUS: DROPPED}))

    async def close(self) -> None:
        if self.sub is not None:
            await self.sub.unsubscribe()
            self.sub = None
        await self.hand_back()

    async def hand_back(self) -> None:
        """NAK what came here and no fetch took (for a fetch given up: a stop, a cancelled
        prefetch), so that it is delivered again at once rather than after the ack wait."""
        while not self.queue.empty():
            msg = self.queue.get_nowait()
            if status_of(msg) is None:
                with contextlib.suppress(Exception):
                    await msg.nak()

    async def fetch(self, batch: int, timeout: float, stop: asyncio.Event | None = None) -> list[Msg]:
        """Up to ``batch`` messages: waits up to ``timeout`` for the first one (no longer once
        ``stop`` is set), never for more than the server already has."""
        out = self._queued(batch)
        if not out:
            first = await self._linger_for_one(timeout, stop)
            if first is None:
                return []
            out = [first]
        return out + await self.fetch_ready(batch - len(out), max(timeout, 5.0))

    async def fetch_ready(self, batch: int, patience: float = 5.0) -> list[Msg]:
        """Up to ``batch`` messages the server already has, without waiting for any: those
        queued here, then one ``no_wait`` request for the rest, answered at once (``patience``:
        the longest silence between its messages before the connection counts as gone)."""
        out = self._queued(batch)
        if len(out) < batch:
            out += await self._what_is_there(batch - len(out), patience)
        return out

    def _queued(self, batch: int) -> list[Msg]:
        out: list[Msg] = []
        while len(out) < batch and not self.queue.empty():
            msg = self.queue.get_nowait()
            if status_of(msg) is None:  # a late status answers an older request
                out.append(msg)
        return out

    async def _request(self, req: dict[str, int | bool]) -> None:
        await self.nc.publish(self.next_subject, json.dumps(req).encode(), reply=self.inbox)

    async def _linger_for_one(self, timeout: float, stop: asyncio.Event | None) -> Msg | None:
        req: dict[str, int | bool] = {"batch": 1, "expires": int(timeout * 1e9)}
        quiet = timeout + 1.0  # the server ends the request with a 408 at expiry
        if timeout >= 2.0:
            hb = timeout / 4
            req["idle_heartbeat"] = int(hb * 1e9)
            quiet = 3 * hb  # no heartbeat for that long: the request or the connection is gone
        await self._request(req)
        deadline = time.monotonic() + timeout + 1.0
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await self._next(min(left, quiet), stop)
            except TimeoutError:
                return None
            if msg is None:
                return None  # stopped: what the request still brings is handed back at the end
            status = status_of(msg)
            if status is None:
                return msg
            if status != HEARTBEAT:
                return None  # expired (408), no messages (404), or refused (409)
        return None

    async def _next(self, wait: float, stop: asyncio.Event | None) -> Msg | None:
        """The next message of the inbox within ``wait`` seconds (TimeoutError past it), or None
        once ``stop`` is set without one: a part told to stop does not wait out a fetch."""
        if stop is None:
            return await asyncio.wait_for(self.queue.get(), wait)
        got = asyncio.ensure_future(self.queue.get())
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait((got, stopped), timeout=wait, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not got.done():
                got.cancel()  # a queue's get cancelled before it took a message takes none
        if got.done() and not got.cancelled():
            return got.result()
        if stop.is_set():
            return None
        raise TimeoutError

    async def _what_is_there(self, n: int, patience: float) -> list[Msg]:
        await self._request({"batch": n, "no_wait": True, "max_bytes": self.max_bytes})
        out: list[Msg] = []
        while len(out) < n:
            try:
                # The server answers a no_wait request at once; waiting longer than `patience`
                # between two of its messages means the connection went away meanwhile.
                msg = await asyncio.wait_for(self.queue.get(), patience)
            except TimeoutError:
                break
            status = status_of(msg)
            if status is None:
                out.append(msg)
            elif status != HEARTBEAT:
                break  # the request's end: nothing more (404/408) or the byte bound (409)
        return out
