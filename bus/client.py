"""The JetStream client every jetrl process uses.

* :class:`Bus` connects (reconnecting forever, with clear errors), creates a run's stream, and
  publishes events with ``Nats-Msg-Id = event_id`` so a retried publish is stored once.
* :class:`Publisher` pipelines publishes with a bounded number in flight and surfaces every
  failure: an event whose ack never came is re-sent (deduplicated by the server), and one that
  still fails is raised from :meth:`Publisher.flush`.
* :class:`PullConsumer` is a durable pull consumer with explicit acks, typed by the event body
  it takes. Messages that cannot be decoded, that carry another body type, that a handler
  rejects, that carry a spoofed tenant, or that failed ``max_deliver`` times are published to
  the run's dead-letter subject with the reason and the original sequence and bytes, and only
  then acked: never dropped in silence. :meth:`PullConsumer.run_batches` is the one consumer
  loop (fetch, hand a batch over, settle its failures); :meth:`PullConsumer.run` handles one
  event at a time on top of it.
* :meth:`Bus.tail` reads a run's log in order from any point (an ordered consumer).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import hmac
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast, overload

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from jetrl.bus import events as ev
from jetrl.bus import ids, subjects
from jetrl.bus.facts import rejecting_tenant, spoofed
from jetrl.bus.identity import VIOLATION, Credentials, PermissionDenied, connect_unless
from jetrl.bus.log import get_logger
from jetrl.bus.pull import PullChannel
from jetrl.bus.retry import RETRY_S, RETRYABLE, retrying
from jetrl.bus.streams import (
    StreamLimits,
    ensure_payload_bucket,
    ensure_run_stream,
    stored_message,
    stream_name,
)

log = get_logger(__name__)

B = TypeVar("B", bound=ev.EventBody)  # the event body a consumer takes
# A delivery only hands its body out, so a Delivery[RolloutScored] is a Delivery[EventBody].
B_co = TypeVar("B_co", bound=ev.EventBody, covariant=True)


class BusError(RuntimeError):
    pass


class PublishError(BusError):
    """Publishes that failed after every retry; ``failed`` maps event_id to the last error."""

    def __init__(self, failed: dict[str, BaseException]) -> None:
        self.failed = failed
        first = next(iter(failed.items()))
        super().__init__(f"{len(failed)} publish(es) failed; first {first[0]}: {first[1]!r}")


REFUSALS = 4  # refusals of the credentials (one per reconnect attempt, 0.25 s apart) before giving up


class Reject(Exception):
    """Raised by a handler for a message that can never be processed: dead-lettered at once."""

    def __init__(self, detail: str, reason: str = "rejected") -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class Bus:
    """A connection to NATS plus the JetStream context, bound to no run in particular."""

    def __init__(self, nc: NATS, js: JetStreamContext, name: str) -> None:
        self.nc = nc
        self.js = js
        self.name = name
        # Permission violations the server reported, by subject (lower-cased, as it reports them).
        self._denied: dict[str, str] = {}
        self.identity: Credentials | None = None
        self._msg_id_key: bytes | None = None
        self._watch: asyncio.Task[None] | None = None

    def msg_headers(self, headers: dict[str, str]) -> dict[str, str]:
        """The headers to publish with: a tenant's message id keyed (Credentials.msg_id_key)."""
        key = self._msg_id_key
        if key is None:
            return headers
        mid = hmac.new(key, headers[ev.HEADER_MSG_ID].encode(), hashlib.sha256).hexdigest()[:32]
        return {**headers, ev.HEADER_MSG_ID: mid}

    @classmethod
    async def connect(
        cls,
        url: str | Sequence[str],
        *,
        name: str = "jetrl",
        connect_timeout: float = 5.0,
        reconnect_wait: float = 0.25,
        max_inflight: int = 512,
        request_timeout: float = 10.0,
        creds: str | None = None,
    ) -> Bus:
        """Connect to ``url`` (one server or a cluster's), as the identity of the credentials
        file ``creds`` (deploy/tenants.py writes them) when the server requires one."""
        # A cluster's URLs, as a list or comma-separated (how a command line gives them).
        given = [url] if isinstance(url, str) else list(url)
        servers = [u.strip() for one in given for u in one.split(",") if u.strip()]
        blog = log.bind(client=name)
        denied: dict[str, str] = {}
        ident = Credentials.load(creds) if creds else None

        quiet_until: dict[str, float] = {}
        refused = asyncio.Event()  # the server refused these credentials (or their absence)
        refusals: list[float] = []

        async def on_error(exc: Exception) -> None:
            text = str(exc)
            if "authorization violation" in text.lower() or "authentication" in text.lower():
                # nats-py would retry forever; a refused identity stays refused until an
                # operator acts, so the client ends here, saying why. Not at the first refusal:
                # a server in the middle of a configuration reload can refuse a valid identity.
                refusals.append(time.monotonic())
                if len(refusals) >= REFUSALS and not refused.is_set():
                    blog.error("nats_credentials_refused", identity=ident.name if ident else None)
                    refused.set()
                return
            m = VIOLATION.search(text)
            if m:
                if len(denied) < 1024:
                    denied[m.group(1)] = text
                blog.warning("nats_permission_denied", subject=m.group(1))
                return
            # A server that is down is retried every reconnect_wait: say so every 10 s, not each time.
            kind, now = type(exc).__name__, time.monotonic()
            if now >= quiet_until.get(kind, 0.0):
                quiet_until[kind] = now + 10.0
                blog.warning("nats_error", error=repr(exc), servers=servers, repeats_muted_s=10)

        async def on_disconnect() -> None:
            if not nc.is_closed:  # closing is deliberate, not news (nats-py marks it first)
                blog.warning("nats_disconnected")

        async def on_reconnect() -> None:
            blog.info("nats_reconnected", server=str(nc.connected_url.netloc if nc.connected_url else ""))

        try:
            nc = await connect_unless(
                refused,
                servers=servers,
                name=name,
                connect_timeout=connect_timeout,
                reconnect_time_wait=reconnect_wait,
                max_reconnect_attempts=-1,
                allow_reconnect=True,
                # Publishes made while reconnecting are buffered, then flushed.
                pending_size=64 * 1024 * 1024,
                error_cb=on_error,
                disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect,
                **(ident.connect_options() if ident else {}),
            )
        except nats.errors.Error as exc:
            if "authorization" in str(exc).lower() or refused.is_set():
                who = f"identity {ident.name!r}" if ident else "no credentials"
                raise BusError(
                    f"NATS at {', '.join(servers)} refused {who}: {exc}. Was the identity removed "
                    "or rotated (`jetrl tenants list`)? Pass --creds with a current credentials file."
                ) from exc
            raise
        except (TimeoutError, OSError, nats.errors.NoServersError) as exc:
            raise BusError(
                f"cannot connect to NATS at {', '.join(servers)}: {exc!r}. Is nats-server running "
                "with JetStream (-js)? `jetrl run` without --nats-url starts a private one."
            ) from exc
        js = nc.jetstream(timeout=request_timeout, publish_async_max_pending=max_inflight)
        bus = cls(nc, js, name)
        bus._denied = denied

        async def close_when_refused() -> None:
            await refused.wait()  # revoked or rotated while connected: reconnects cannot succeed
            with contextlib.suppress(Exception):
                await nc.close()

        bus._watch = asyncio.create_task(close_when_refused())
        bus.identity = ident
        bus._msg_id_key = ident.msg_id_key() if ident else None
        return bus

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        # Flush what was published, then close; a drain would wait on idle pull subscriptions.
        if not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.nc.flush(timeout=2)
            with contextlib.suppress(Exception):
                await self.nc.close()

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ streams

    async def ensure_run(self, run_id: str, limits: StreamLimits | None = None) -> api.StreamInfo:
        """Create (or check) the run's log stream and payload bucket, with as many replicas as
        ``limits`` asks (or, for "auto", as the server's cluster allows). Idempotent."""
        limits = (limits or StreamLimits()).resolve_replicas(self.cluster_size())
        # A cluster just formed (or electing its meta leader) answers nothing for a while.
        info = await retrying(f"stream of {run_id}", lambda: ensure_run_stream(self.js, run_id, limits))
        await retrying(f"payloads of {run_id}", lambda: ensure_payload_bucket(self.js, run_id, limits))
        return info

    def cluster_size(self) -> int:
        """How many servers the connected one's cluster has: 1 for a server on its own. From
        the server's INFO (``cluster`` and the members' client URLs it gossips), which nats-py
        keeps but does not expose."""
        info = self.nc._server_info
        if not info.get("cluster"):
            return 1
        return max(1, len(set(info.get("connect_urls") or [])))

    # ------------------------------------------------------------------ publish

    async def publish(
        self,
        event: ev.Event,
        *,
        timeout: float = 5.0,
        retries: int = 5,
        backoff: float = 0.2,
        retry_s: float = RETRY_S,
    ) -> api.PubAck:
        """Publish one event and wait for the stream's ack, retrying an error that may heal
        at least ``retries`` times and for ``retry_s`` seconds. Retries are safe: the event id
        is the message id, so the server stores a retried event once (``ack.duplicate``)."""
        subject = subjects.subject_for(event)
        data = ev.encode_event(event)
        headers = ev.event_headers(event)
        return await self._publish_raw(
            subject, data, headers, timeout=timeout, retries=retries, backoff=backoff, retry_s=retry_s
        )

    async def _publish_raw(
        self,
        subject: str,
        data: bytes,
        headers: dict[str, str],
        *,
        timeout: float = 5.0,
        retries: int = 5,
        backoff: float = 0.2,
        retry_s: float = RETRY_S,
    ) -> api.PubAck:
        delay = backoff
        headers = self.msg_headers(headers)
        give_up = time.monotonic() + retry_s
        attempt = 0
        while True:
            try:
                ack = await self.js.publish(subject, data, timeout=timeout, headers=dict(headers))
                if ack.duplicate:
                    ack = await self.claim_duplicate(subject, data, headers, ack, timeout=timeout)
                return ack
            except RETRYABLE as exc:
                denied = self.denied(subject)
                if denied:
                    raise PermissionDenied(denied) from exc
                attempt += 1
                if attempt > retries and time.monotonic() >= give_up:
                    raise BusError(f"publish to {subject} failed after {attempt} attempts: {exc!r}") from exc
                log.warning("publish_retry", subject=subject, attempt=attempt, error=repr(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def claim_duplicate(
        self, subject: str, data: bytes, headers: dict[str, str], ack: api.PubAck, *, timeout: float = 5.0
    ) -> api.PubAck:
        """A publish the stream called a duplicate: genuine when the message stored under its id
        is on the same subject (a retry, a restarted publisher). Otherwise another client took
        the id first (ids are derived, so predictable: a tenant could publish on its own
        subject under the id of another's next event, or of the trainer's next step, and make
        that vanish): the event is stored under the next free id ``<id>.1``, ``<id>.2``... of
        the same derivation, so that its own retries are still deduplicated. Readers key on
        the envelope's event id, which is unchanged. A tenant's ids are keyed instead."""
        if self._msg_id_key is not None:
            return ack  # only this identity can make its ids: a duplicate is its own retry
        base = headers[ev.HEADER_MSG_ID]
        for k in range(1, 9):
            stored = await stored_message(self.js, ack.stream, ack.seq)
            if stored.subject == subject:
                return ack
            log.warning("message_id_taken", subject=subject, event_id=base, by_subject=stored.subject)
            headers = {**headers, ev.HEADER_MSG_ID: f"{base}.{k}"}
            ack = await self.js.publish(subject, data, timeout=timeout, headers=headers)
            if not ack.duplicate:
                return ack
        raise BusError(f"event {base}: its message ids are all taken on other subjects")

    def denied(self, subject: str) -> str | None:
        """The server's permission error for publishing on ``subject``, if it sent one: the
        publish is then refused for good, not lost in transit (it reports it asynchronously)."""
        return self._denied.get(subject.lower())

    def publisher(
        self,
        *,
        max_inflight: int = 256,
        ack_timeout: float = 10.0,
        retries: int = 5,
        retry_s: float = RETRY_S,
    ) -> Publisher:
        return Publisher(
            self, max_inflight=max_inflight, ack_timeout=ack_timeout, retries=retries, retry_s=retry_s
        )

    # ------------------------------------------------------------------ consume

    @overload
    async def consumer(self, spec: ConsumerSpec) -> PullConsumer[ev.EventBody]: ...
    @overload
    async def consumer(self, spec: ConsumerSpec, body: type[B]) -> PullConsumer[B]: ...
    async def consumer(
        self, spec: ConsumerSpec, body: type[ev.EventBody] = ev.EventBody
    ) -> PullConsumer[Any]:
        """Create or bind a durable pull consumer on the run's stream that delivers events whose
        body is a ``body`` (any event by default); others are dead-lettered as invalid, but for
        the types ``spec.skip_types`` names, which are acked and passed over."""
        stream = spec.stream or stream_name(spec.run_id)
        cfg = api.ConsumerConfig(
            durable_name=spec.durable,
            name=spec.durable,
            ack_policy=spec.ack_policy,
            ack_wait=spec.ack_wait,
            # Delivery attempts are bounded by the client (it dead-letters), never by the server,
            # which would otherwise leave an exhausted message unacked and invisible.
            max_deliver=-1,
            max_ack_pending=spec.max_ack_pending,
            deliver_policy=spec.deliver_policy,
            opt_start_seq=spec.start_seq,
            filter_subjects=list(spec.filter_subjects),
        )
        made = f"consumer {spec.durable}"  # made on the stream's leader: retried through an election
        try:
            await retrying(made, lambda: self.js.add_consumer(stream, config=cfg))
        except nats.js.errors.BadRequestError as exc:
            # Exists with another config (e.g. new filters): update what may be updated.
            if exc.err_code not in (10148, 10013):  # consumer already exists / name in use
                raise
            cfg.deliver_policy = None
            cfg.opt_start_seq = None
            await retrying(made, lambda: self.js.add_consumer(stream, config=cfg))
        channel = await PullChannel(self.nc, stream, spec.durable, max_bytes=spec.max_request_bytes).open()
        return PullConsumer(self, spec, channel, body)

    async def tail(
        self,
        run_id: str,
        *,
        from_seq: int | None = None,
        from_time: float | None = None,
        filter_subject: str | None = None,
        idle_timeout: float | None = None,
        to_head: bool = False,
        stream: str | None = None,
    ) -> AsyncIterator[TailItem]:
        """Read the run's log in order from ``from_seq`` (default: the start), forever, until
        ``idle_timeout`` seconds pass with nothing new, or (``to_head``) until it has caught up
        with the log: at the first message after which the server has none pending for this
        reader, at once when nothing matches. Undecodable messages are yielded with ``error``
        set rather than skipped, so a reader sees the whole log. ``stream``: read a tenant's
        view instead (items then carry their sequence in the run's log; ``from_seq`` is the
        view's)."""
        subject = filter_subject or subjects.all_subjects(run_id)
        queue: asyncio.Queue[Msg] = asyncio.Queue(maxsize=10_000)

        async def on_msg(msg: Msg) -> None:
            await queue.put(msg)

        if from_time is not None:  # ``from_time``: the first message stored at or after it (epoch s)
            start = datetime.datetime.fromtimestamp(from_time, datetime.UTC)
            cfg = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_TIME, opt_start_time=start)
        else:
            cfg = api.ConsumerConfig(
                deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE if from_seq else api.DeliverPolicy.ALL,
                opt_start_seq=from_seq,
            )
        view = stream is not None and stream != stream_name(run_id)
        sub = await retrying(  # through a leader election (the consumer is made on the leader)
            f"tail {subject}",
            lambda: self.js.subscribe(
                subject,
                stream=stream or stream_name(run_id),
                cb=on_msg,
                ordered_consumer=True,
                config=cfg,
                # nats-py resets an ordered consumer after two missed heartbeats: 1 s bounds how
                # long a tail stays silent after the server restarts (5 s meant ~20 s stalls).
                idle_heartbeat=1.0,
            ),
        )
        try:
            if to_head:
                info = await sub.consumer_info()
                assert info.delivered is not None  # the server always reports it
                if not info.num_pending and not info.delivered.consumer_seq:
                    return  # nothing matches
            while True:
                try:
                    msg = await asyncio.wait_for(queue.get(), timeout=idle_timeout)
                except TimeoutError:
                    return
                meta = msg.metadata
                seq = origin_seq(msg) if view else meta.sequence.stream
                try:
                    item = TailItem(seq, msg.subject, ev.decode_event(msg.data, msg.headers), None)
                except ev.EventDecodeError as exc:
                    item = TailItem(seq, msg.subject, None, exc)
                yield item
                if to_head and meta.num_pending == 0:
                    return
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def read_log(self, run_id: str, *, filter_subject: str | None = None) -> list[TailItem]:
        """What the run's log holds now, in order."""
        return [item async for item in self.tail(run_id, filter_subject=filter_subject, to_head=True)]

    async def last_seq(self, run_id: str) -> int:
        info = await self.js.stream_info(stream_name(run_id))
        return int(info.state.last_seq)


@dataclass(frozen=True)
class TailItem:
    seq: int
    subject: str
    event: ev.Event | None
    error: ev.EventDecodeError | None


# ---------------------------------------------------------------------- publisher


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


# ---------------------------------------------------------------------- consumer


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

    async def fetch_batch(self, batch: int = 64, timeout: float = 1.0) -> Batch[B]:
        """Fetch up to ``batch`` events. Poison messages (undecodable, spoofed, of another body
        type, delivered too often) are dead-lettered and acked here and never delivered. Empty
        on timeout and while the connection is down (the caller just loops)."""
        out: Batch[B] = Batch([])
        try:
            msgs = await self._pull(batch, timeout)
        except RETRYABLE as exc:
            self.log.warning("fetch_retry", error=repr(exc))
            await asyncio.sleep(0.2)
            return out
        for msg in msgs:
            d = await self._admit(msg, out.dead_lettered)
            if d is not None:
                out.deliveries.append(d)
        return out

    async def _pull(self, batch: int, timeout: float) -> list[Msg]:
        """Wait up to ``timeout`` for the first message, then take what the server already has
        (bus/pull.py says how, and why not nats-py's fetch)."""
        return await self.channel.fetch(batch, timeout)

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
    ) -> None:
        """The consumer loop: fetch up to ``batch`` events, hand them to ``handler``, then call
        ``after`` (with or without events: periodic work; it returns True to end the loop),
        until ``stop`` is set.

        A handler settles what it is done with and may keep deliveries for later batches (the
        trainer holds partial groups). When it raises, the batch's unsettled deliveries are
        retried with backoff or dead-lettered (:meth:`settle_failure`); with ``settle_failures``
        off the error propagates instead, for consumers whose position must never pass an
        event they failed on. ``prefetch`` fetches the next batch while the handler runs."""
        stop = stop or asyncio.Event()
        pending: asyncio.Task[Batch[B]] | None = None
        try:
            while not stop.is_set():
                got = await (pending or self.fetch_batch(batch, fetch_timeout))
                pending = None
                if got and prefetch and not stop.is_set():
                    pending = asyncio.create_task(self.fetch_batch(batch, fetch_timeout))
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
        finally:
            if pending is not None:
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending

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
