"""Pipelined publishing (:class:`Publisher`): a bounded number of publishes in flight, every
failure surfaced. An event whose ack never came is re-sent (deduplicated by the server by its
event id), and one that still fails is raised from :meth:`Publisher.flush`."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import nats
import nats.errors
import nats.js.errors
from nats.js import api

from jetrl.bus import events as ev
from jetrl.bus import subjects
from jetrl.bus.identity import PermissionDenied
from jetrl.bus.log import get_logger

if TYPE_CHECKING:
    from jetrl.bus.client import Bus

log = get_logger(__name__)


class BusError(RuntimeError):
    pass


class PublishError(BusError):
    """Publishes that failed after every retry; ``failed`` maps event_id to the last error."""

    def __init__(self, failed: dict[str, BaseException]) -> None:
        self.failed = failed
        first = next(iter(failed.items()))
        super().__init__(f"{len(failed)} publish(es) failed; first {first[0]}: {first[1]!r}")


@dataclass
class _Pending:
    event_id: str
    subject: str
    data: bytes
    headers: dict[str, str]
    attempts: int = 0
    future: asyncio.Future[api.PubAck] | None = None
    sent_at: float = 0.0
    first_sent: float = 0.0


class Publisher:
    """Pipelined publishing: up to ``max_inflight`` un-acked publishes, no ack lost track of.

    ``publish`` returns once the message is handed to the connection, waiting for the oldest
    ack when the window is full; ``flush`` waits for every ack. A publish whose ack fails or
    does not come within ``ack_timeout`` (lost in a reconnect, say) is re-sent under the same
    event id, which the server deduplicates; after ``retries`` re-sends and ``retry_s``
    seconds, or at once for an error that cannot heal (stream full, permission denied), it is
    reported by :class:`PublishError` from the next ``publish`` or ``flush``.

    Acks are collected from the head of a FIFO instead of per-future callbacks: JetStream
    acks in order, and a callback per publish costs an event-loop turn each.
    """

    def __init__(
        self, bus: Bus, *, max_inflight: int, ack_timeout: float, retries: int, retry_s: float
    ) -> None:
        self.bus = bus
        self.max_inflight = max_inflight
        self.ack_timeout = ack_timeout
        self.retries = retries
        self.retry_s = retry_s
        self._queue: deque[_Pending] = deque()
        self._failed: dict[str, BaseException] = {}
        self._duplicates: deque[tuple[_Pending, api.PubAck]] = deque()
        self.published = 0
        self.duplicates = 0
        self.resent = 0

    @property
    def inflight(self) -> int:
        return len(self._queue)

    async def publish(self, event: ev.Event) -> None:
        await self.publish_encoded(
            subjects.subject_for(event), ev.encode_event(event), ev.event_headers(event)
        )

    async def publish_encoded(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        self._reap()
        while len(self._queue) >= self.max_inflight:
            await self._wait_oldest()
        if self._duplicates:
            await self._claim_duplicates()
        p = _Pending(headers[ev.HEADER_MSG_ID], subject, data, self.bus.msg_headers(headers))
        self._queue.append(p)
        await self._send(p)

    async def _send(self, p: _Pending) -> None:
        p.attempts += 1
        p.sent_at = time.monotonic()
        p.first_sent = p.first_sent or p.sent_at
        try:
            p.future = await self.bus.js.publish_async(p.subject, p.data, headers=p.headers)
        except Exception as exc:  # refused outright (e.g. connection closed): retried by _wait_oldest
            p.future = None
            log.warning("publish_send_failed", event_id=p.event_id, error=repr(exc))

    def _reap(self) -> None:
        q = self._queue
        while q:
            fut = q[0].future
            if fut is None or not fut.done() or fut.cancelled() or fut.exception() is not None:
                return
            ack = fut.result()
            p = q.popleft()
            self.published += 1
            if ack.duplicate:
                self.duplicates += 1
                self._duplicates.append((p, ack))

    async def _claim_duplicates(self) -> None:
        """Duplicate acks checked off the hot path (Bus.claim_duplicate says why)."""
        while self._duplicates:
            p, ack = self._duplicates.popleft()
            try:
                await self.bus.claim_duplicate(p.subject, p.data, p.headers, ack, timeout=self.ack_timeout)
            except Exception as exc:
                self._failed[p.event_id] = exc

    async def _wait_oldest(self) -> None:
        p = self._queue[0]
        if p.future is not None and not p.future.done():
            remaining = self.ack_timeout - (time.monotonic() - p.sent_at)
            if remaining > 0:
                await asyncio.wait((p.future,), timeout=remaining)
        fut = p.future
        if fut is not None and fut.done() and not fut.cancelled() and fut.exception() is None:
            self._reap()
            return
        # No ack: failed, refused, or timed out.
        error: BaseException
        if fut is None:
            error = BusError("refused by the connection")
        elif not fut.done():
            fut.cancel()
            error = BusError(f"no ack within {self.ack_timeout}s")
        else:
            error = fut.exception() or BusError("cancelled")
        denied = self.bus.denied(p.subject)
        if denied:
            error = PermissionDenied(denied)
        permanent = denied is not None or (
            isinstance(error, nats.js.errors.APIError)
            and not isinstance(error, nats.js.errors.ServiceUnavailableError)
        )
        if permanent or (p.attempts > self.retries and time.monotonic() - p.first_sent >= self.retry_s):
            self._queue.popleft()
            self._failed[p.event_id] = error
            log.error(
                "publish_failed",
                event_id=p.event_id,
                subject=p.subject,
                attempts=p.attempts,
                error=repr(error),
            )
            return
        self.resent += 1
        log.warning("publish_resend", event_id=p.event_id, attempt=p.attempts + 1, error=repr(error))
        await asyncio.sleep(min(0.05 * 2**p.attempts, 2.0))
        await self._send(p)

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every publish is acked or has definitively failed; raise if any failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._reap()
        while self._queue:
            if deadline is not None and time.monotonic() > deadline:
                raise BusError(f"flush timed out with {len(self._queue)} publishes unacked")
            await self._wait_oldest()
            self._reap()
        await self._claim_duplicates()
        if self._failed:
            failed, self._failed = self._failed, {}
            raise PublishError(failed)

    async def __aenter__(self) -> Publisher:
        return self

    async def __aexit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            await self.flush()
