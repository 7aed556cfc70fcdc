"""Durable pull consumers (:class:`PullConsumer`), typed by the event body they take, with explicit
acks. Messages that cannot be decoded, that carry another body type, that a handler rejects
(:class:`Reject`), that carry a spoofed tenant, or that failed ``max_deliver`` times are
published to the run's dead-letter subject with the reason and the original sequence and bytes,
and only then acked: never dropped in silence. :meth:`PullConsumer.run_batches` is the one
consumer loop (fetch, hand a batch over, settle its failures); :meth:`PullConsumer.run` handles
one event at a time on top of it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar, cast

from nats.aio.msg import Msg
from nats.js import api

from jetrl.bus import events as ev
from jetrl.bus import ids
from jetrl.bus.facts import rejecting_tenant, spoofed
from jetrl.bus.log import get_logger
from jetrl.bus.pull import PullChannel
from jetrl.bus.retry import RETRYABLE
from jetrl.bus.streams import stream_name

if TYPE_CHECKING:
    from jetrl.bus.client import Bus

log = get_logger(__name__)

B = TypeVar("B", bound=ev.EventBody)  # the event body a consumer takes
# A delivery only hands its body out, so a Delivery[RolloutsScored] is a Delivery[EventBody].
B_co = TypeVar("B_co", bound=ev.EventBody, covariant=True)


class Reject(Exception):
    """Raised by a handler for a message that can never be processed: dead-lettered at once."""

    def __init__(self, detail: str, reason: str = "rejected") -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass
class ConsumerSpec:
    run_id: str
    durable: str
    filter_subjects: Sequence[str]
    # Another stream than the run's log: a tenant's view of it (bus/streams.py), whose messages
    # are copies; deliveries then carry their sequence in the run's log.
    stream: str | None = None
    ack_wait: float = 30.0
    max_deliver: int = 5
    # Delay before redelivery after the n-th failure (last value repeats).
    backoff: Sequence[float] = (0.5, 2.0, 5.0, 15.0)
    max_ack_pending: int = 1024
    deliver_policy: api.DeliverPolicy = api.DeliverPolicy.ALL
    start_seq: int | None = None
    # ALL: one ack settles every message before it too (a consumer that acks whole batches).
    ack_policy: api.AckPolicy = api.AckPolicy.EXPLICIT
    # Event types on the filtered subjects that this consumer acks and passes over (its own
    # output, say), rather than dead-letter as not its body type.
    skip_types: tuple[str, ...] = ()
    # One fetch brings at most this many bytes (and at least one message, whatever its size).
    max_request_bytes: int = 32 * 1024 * 1024


@dataclass
class Delivery(Generic[B_co]):
    """One delivered event, whose body is a ``B_co``, and the handle to settle it."""

    event: ev.Event
    seq: int
    subject: str
    num_delivered: int
    msg: Msg
    settled: bool = field(default=False, repr=False)

    @property
    def body(self) -> B_co:
        return cast(B_co, self.event.body)  # checked against the consumer's body type on admission

    async def ack(self) -> None:
        if not self.settled:
            await self.msg.ack()
            self.settled = True

    async def nak(self, delay: float | None = None) -> None:
        if not self.settled:
            await self.msg.nak(delay=delay)
            self.settled = True

    async def in_progress(self) -> None:
        """Tell the server the work goes on, resetting the ack-wait clock."""
        if not self.settled:
            await self.msg.in_progress()

    def keep_alive(self, every: float) -> contextlib.AbstractAsyncContextManager[None]:
        """Send in-progress acks every ``every`` seconds while a long piece of work runs."""
        return keep_alive([self], every)


@dataclass
class Batch(Generic[B]):
    """What one fetch brought: the deliveries to handle, and the stream sequences of the
    messages it dead-lettered on admission (a consumer that tracks its position moves past them)."""

    deliveries: list[Delivery[B]]
    dead_lettered: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.deliveries or self.dead_lettered)


@contextlib.asynccontextmanager
async def keep_alive(deliveries: Sequence[Delivery[ev.EventBody]], every: float) -> AsyncIterator[None]:
    """In-progress acks for several deliveries (e.g. a batch being generated) while work runs."""

    async def beat() -> None:
        while True:
            await asyncio.sleep(every)
            for d in deliveries:
                with contextlib.suppress(Exception):
                    await d.in_progress()

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


Handler = Callable[[Delivery[B]], Awaitable[None]]
BatchHandler = Callable[[Batch[B]], Awaitable[None]]


SOURCE_HEADER = "Nats-Stream-Source"


def origin_seq(msg: Msg) -> int:
    """A view's copy of a message: its sequence in the stream it was sourced from (the server
    writes ``<stream> <seq> <filter> ...`` into the header). Read only on a view's messages:
    on the run's log the header is whatever the publisher put there."""
    value = (msg.headers or {}).get(SOURCE_HEADER, "")
    parts = value.split()
    if len(parts) >= 2 and parts[1].isdigit():
        return int(parts[1])
    return int(msg.metadata.sequence.stream)


def _ack_position(msg: Msg) -> tuple[int, int]:
    """(stream sequence, delivery count) from the ack subject, without building nats-py's
    metadata object (a measurable share of the consume path for small events)."""
    reply = msg.reply or ""
    toks = reply.split(".")
    if len(toks) == 9 and toks[0] == "$JS":  # $JS.ACK.<stream>.<consumer>.<n>.<sseq>.<cseq>.<ts>.<pending>
        return int(toks[5]), int(toks[4])
    meta = msg.metadata
    return meta.sequence.stream, meta.num_delivered


@dataclass
class ConsumerStats:
    delivered: int = 0
    acked: int = 0
    retried: int = 0
    dead_lettered: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)


class PullConsumer(Generic[B]):
    def __init__(self, bus: Bus, spec: ConsumerSpec, channel: PullChannel, body: type[B]) -> None:
        self.bus = bus
        self.spec = spec
        self.channel = channel
        self.body = body
        self.stats = ConsumerStats()
        self.view = spec.stream is not None and spec.stream != stream_name(spec.run_id)
        self.log = log.bind(run_id=spec.run_id, consumer=spec.durable)

    async def fetch(self, batch: int = 64, timeout: float = 1.0) -> list[Delivery[B]]:
        """Fetch up to ``batch`` events; see :meth:`fetch_batch`."""
        return (await self.fetch_batch(batch, timeout)).deliveries

    async def fetch_batch(
        self, batch: int = 64, timeout: float = 1.0, *, wait: bool = True, stop: asyncio.Event | None = None
    ) -> Batch[B]:
        """Fetch up to ``batch`` events. Poison messages (undecodable, spoofed, of another body
        type, delivered too often) are dead-lettered and acked here and never delivered. Empty
        on timeout, once ``stop`` is set while it waits for the first event, and while the
        connection is down (the caller just loops). ``wait`` False: only what the server
        already has, never waiting for the first event."""
        out: Batch[B] = Batch([])
        try:
            ch = self.channel
            msgs = await (ch.fetch(batch, timeout, stop) if wait else ch.fetch_ready(batch))
        except RETRYABLE as exc:
            self.log.warning("fetch_retry", error=repr(exc))
            await asyncio.sleep(0.2)
            return out
        for msg in msgs:
            d = await self._admit(msg, out.dead_lettered)
            if d is not None:
                out.deliveries.append(d)
        return out

    async def _admit(self, msg: Msg, dead_lettered: list[int]) -> Delivery[B] | None:
        seq, n = _ack_position(msg)
        if self.view:
            seq = origin_seq(msg)
        self.stats.delivered += 1
        try:
            event = ev.decode_event(msg.data, msg.headers)
        except ev.EventDecodeError as exc:
            dead_lettered.append(await self._dead_letter_msg(msg, exc.reason, str(exc)))
            return None
        if spoof := spoofed(self.spec.run_id, msg.subject, event):
            dead_lettered.append(await self._dead_letter_msg(msg, "spoofed", spoof, event))
            return None
        if not isinstance(event.body, self.body):
            if event.type in self.spec.skip_types:
                await msg.ack()
                return None
            detail = f"{self.spec.durable} takes {self.body.__name__} events, got {event.type}"
            dead_lettered.append(await self._dead_letter_msg(msg, "invalid", detail, event))
            return None
        if n > self.spec.max_deliver:
            # Delivered more often than allowed without being settled (e.g. it crashes its
            # handler's process every time): park it instead of looping forever.
            detail = f"delivered {n} times without success"
            dead_lettered.append(await self._dead_letter_msg(msg, "max_deliver", detail, event))
            return None
        return Delivery(event=event, seq=seq, subject=msg.subject, num_delivered=n, msg=msg)

    async def dead_letter(self, d: Delivery[B], reason: str, detail: str) -> None:
        await self._dead_letter_msg(d.msg, reason, detail, d.event)
        d.settled = True

    async def _dead_letter_msg(
        self, msg: Msg, reason: str, detail: str, event: ev.Event | None = None
    ) -> int:
        """Publish the message's dead letter, then ack it; returns its stream sequence."""
        meta = msg.metadata
        seq = origin_seq(msg) if self.view else meta.sequence.stream
        headers = dict(msg.headers or {})
        body = ev.DeadLettered(
            reason=reason,
            detail=detail[:4000],
            consumer=self.spec.durable,
            original_subject=msg.subject,
            original_stream_seq=seq,
            delivery_count=meta.num_delivered,
            original_event_id=event.event_id if event else headers.get(ev.HEADER_MSG_ID),
            original_type=event.type if event else headers.get(ev.HEADER_TYPE),
            original_headers=headers,
            original_data=bytes(msg.data),
        )
        # Deterministic id: a dead letter re-sent after a crash is stored once.
        dl_id = ids.dead_letter_id(self.spec.run_id, self.spec.durable, seq)
        dl = ev.new_event(
            body,
            run_id=self.spec.run_id,
            # Under the tenant whose subject it came on (its credential's): that tenant reads it.
            tenant=rejecting_tenant(msg.subject),
            causation_id=body.original_event_id,
            event_id=dl_id,
        )
        await self.bus.publish(dl)
        await msg.ack()
        self.stats.dead_lettered += 1
        self.stats.by_reason[reason] = self.stats.by_reason.get(reason, 0) + 1
        self.log.warning("dead_lettered", seq=seq, reason=reason, detail=detail[:300], subject=msg.subject)
        return int(seq)

    async def settle_failure(self, d: Delivery[B], exc: BaseException) -> None:
        """After a handler error: retry later with backoff, or dead-letter once exhausted."""
        if isinstance(exc, Reject):
            await self.dead_letter(d, exc.reason, exc.detail)
            return
        if d.num_delivered >= self.spec.max_deliver:
            await self.dead_letter(d, "max_deliver", f"failed {d.num_delivered} times; last error: {exc!r}")
            return
        backoff = self.spec.backoff or (1.0,)
        delay = backoff[min(d.num_delivered - 1, len(backoff) - 1)]
        self.stats.retried += 1
        self.log.warning(
            "handler_failed", seq=d.seq, attempt=d.num_delivered, retry_in_s=delay, error=repr(exc)
        )
        await d.nak(delay=delay)

    async def run_batches(
        self,
        handler: BatchHandler[B],
        *,
        batch: int = 64,
        fetch_timeout: float = 1.0,
        stop: asyncio.Event | None = None,
        after: Callable[[], Awaitable[bool]] | None = None,
        prefetch: bool = False,
        settle_failures: bool = True,
        gather_s: float = 0.0,
    ) -> None:
        """The consumer loop: fetch up to ``batch`` events, hand them to ``handler``, then call
        ``after`` (with or without events: periodic work; it returns True to end the loop),
        until ``stop`` is set. ``gather_s``: after a batch short of ``batch`` events, the next
        fetch waits until that long after this one began, so that a consumer keeping up with
        the log handles what came meanwhile at once rather than a few events at a time (the
        recorder: a transaction each).

        A handler settles what it is done with and may keep deliveries for later batches (the
        trainer holds partial groups). When it raises, the batch's unsettled deliveries are
        retried with backoff or dead-lettered (:meth:`settle_failure`); with ``settle_failures``
        off the error propagates instead, for consumers whose position must never pass an
        event they failed on. ``prefetch`` fetches the next batch while the handler runs."""
        stop = stop or asyncio.Event()
        pending: asyncio.Task[Batch[B]] | None = None
        try:
            while not stop.is_set():
                began = time.monotonic()
                got = await (pending or self.fetch_batch(batch, fetch_timeout, stop=stop))
                pending = None
                short = len(got.deliveries) + len(got.dead_lettered) < batch
                if got and prefetch and not (gather_s and short) and not stop.is_set():
                    pending = asyncio.create_task(self.fetch_batch(batch, fetch_timeout, stop=stop))
                if got:
                    try:
                        await handler(got)
                    except Exception as exc:
                        if not settle_failures:
                            raise
                        self.log.exception("batch_failed", events=len(got.deliveries))
                        for d in got.deliveries:
                            if not d.settled:
                                await self.settle_failure(d, exc)
                if after is not None and await after():
                    return
                if gather_s and short and got and (rest := began + gather_s - time.monotonic()) > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), rest)
        finally:
            if pending is not None:
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending
            # A fetch the loop gave up (a stop, a prefetch cancelled) may still be answered.
            await self.channel.hand_back()

    async def run(
        self,
        handler: Handler[B],
        *,
        batch: int = 32,
        fetch_timeout: float = 1.0,
        stop: asyncio.Event | None = None,
        concurrency: int = 1,
        drain_s: float = 10.0,
    ) -> None:
        """Handle events one by one until ``stop`` is set, up to ``concurrency`` at once (one at
        a time, in order, by default). A handler acks implicitly by returning (or explicitly via
        the delivery), raises :class:`Reject` to dead-letter, or raises anything else to be
        retried with backoff. On stop, handlers still running get ``drain_s`` seconds to finish."""
        slots = asyncio.Semaphore(concurrency)
        inflight: set[asyncio.Task[None]] = set()

        async def one(d: Delivery[B]) -> None:
            try:
                await handler(d)
            except Exception as exc:
                await self.settle_failure(d, exc)
            else:
                await d.ack()
                self.stats.acked += 1
            finally:
                slots.release()

        async def each(got: Batch[B]) -> None:
            for d in got.deliveries:
                await slots.acquire()
                if concurrency == 1:
                    await one(d)  # no task per message on the sequential path
                    continue
                t = asyncio.create_task(one(d))
                inflight.add(t)
                t.add_done_callback(inflight.discard)

        await self.run_batches(each, batch=batch, fetch_timeout=fetch_timeout, stop=stop)
        if inflight:
            await asyncio.wait(inflight, timeout=drain_s)

    async def info(self) -> api.ConsumerInfo:
        info: api.ConsumerInfo = await self.bus.js.consumer_info(
            self.spec.stream or stream_name(self.spec.run_id), self.spec.durable
        )
        return info

    async def unsubscribe(self) -> None:
        with contextlib.suppress(Exception):
            await self.channel.close()
