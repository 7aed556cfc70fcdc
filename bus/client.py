"""The JetStream client every jetrl process uses.

* :class:`Bus` connects (reconnecting forever, with clear errors), creates a run's stream, and
  publishes events with ``Nats-Msg-Id = event_id`` so a retried publish is stored once.
* :meth:`Bus.publisher` pipelines publishes (bus/publisher.py) and :meth:`Bus.consumer` makes
  a durable pull consumer (bus/consumer.py).
* :meth:`Bus.tail` reads a run's log in order from any point (an ordered consumer).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import hmac
import time
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from jetrl.bus import events as ev
from jetrl.bus import subjects
from jetrl.bus.consumer import ConsumerSpec, PullConsumer, origin_seq
from jetrl.bus.identity import VIOLATION, Credentials, PermissionDenied, connect_unless
from jetrl.bus.log import get_logger
from jetrl.bus.publisher import BusError, Publisher
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


REFUSALS = 4  # refusals of the credentials (one per reconnect attempt, 0.25 s apart) before giving up


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
        self.lost_requests = 0  # requests failed at once when their connection dropped
        self._channels: weakref.WeakSet[PullChannel] = weakref.WeakSet()  # its consumers' inboxes
        self._tails: weakref.WeakSet[JetStreamContext.PushSubscription] = weakref.WeakSet()  # its tails
        self.tails_restarted = 0  # tails whose consumer was made anew as the connection came back

    def fail_lost_requests(self) -> int:
        """Fail, as timed out, every request and JetStream publish still waiting for its reply
        when the connection dropped, and end the waits of its consumers' fetches. A reply goes
        back on the connection that asked, so none of these can come any more, and each would
        otherwise wait out its whole timeout (10 s for a direct get or a publisher's ack, 5 s
        of a fetch's silence) while a restarted server or another node of the cluster takes the
        client back within a second. Every caller retries a timeout: a publish is deduplicated
        by its event id, a read or a fetch is asked again. Returns how many requests failed."""
        lost = 0
        # nats-py keeps them in these maps until their reply or timeout; it has no public way
        # to fail them (checked against nats-py 2.16 by tests/bus/test_bus_restart.py).
        maps = (getattr(self.nc, "_resp_map", None), getattr(self.js, "_publish_async_futures", None))
        for waiting in maps:
            for fut in list((waiting or {}).values()):
                if not fut.done():
                    fut.set_exception(nats.errors.TimeoutError())
                    lost += 1
        self.lost_requests += lost
        for channel in list(self._channels):
            channel.connection_dropped()
        return lost

    async def restart_tails(self) -> int:
        """The connection is back: make each tail's ordered consumer anew from its next
        sequence now. A restarted server has lost them (they are ephemeral), and nats-py would
        notice only when its check of the idle heartbeats comes round (every two heartbeats:
        2-4 s, a stall of every part that follows the log, the producer's window included).
        What nats-py itself does then; done again by it, harmless. Returns how many."""
        restarted = 0
        for sub in list(self._tails):
            # nats-py's ordered-consumer state (2.16): on the subscription its tail wraps.
            jsi = getattr(getattr(sub, "_sub", None), "_jsi", None)
            if jsi is None or not getattr(jsi, "_ordered", False):
                continue
            with contextlib.suppress(Exception):  # at worst nats-py's own check does it later
                await jsi.reset_ordered_consumer(jsi._sseq + 1)
                restarted += 1
        self.tails_restarted += restarted
        return restarted

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

        made: list[Bus] = []  # the Bus, once connected: what on_disconnect fails its requests on

        async def on_disconnect() -> None:
            if not nc.is_closed:  # closing is deliberate, not news (nats-py marks it first)
                lost = made[0].fail_lost_requests() if made else 0
                blog.warning("nats_disconnected", requests_failed=lost)

        async def on_reconnect() -> None:
            tails = await made[0].restart_tails() if made else 0
            server = str(nc.connected_url.netloc if nc.connected_url else "")
            blog.info("nats_reconnected", server=server, tails_restarted=tails)

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
        made.append(bus)
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
        self._channels.add(channel)
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
        types: frozenset[str] | None = None,
    ) -> AsyncIterator[TailItem]:
        """Read the run's log in order from ``from_seq`` (default: the start), forever, until
        ``idle_timeout`` seconds pass with nothing new, or (``to_head``) until it has caught up
        with the log: at the first message after which the server has none pending for this
        reader, at once when nothing matches. Undecodable messages are yielded with ``error``
        set rather than skipped, so a reader sees the whole log. ``stream``: read a tenant's
        view instead (items then carry their sequence in the run's log; ``from_seq`` is the
        view's). ``types``: only events of these types, the others passed over by their type
        header without being decoded (a subject that carries large events beside the few a
        reader wants)."""
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
                # long a tail stays silent when its consumer is lost without a reconnect (after
                # one, restart_tails makes it anew at once; 5 s meant ~20 s stalls).
                idle_heartbeat=1.0,
            ),
        )
        self._tails.add(sub)
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
                kind = msg.headers.get(ev.HEADER_TYPE) if msg.headers else None
                if types is None or kind is None or kind in types:
                    try:
                        item = TailItem(seq, msg.subject, ev.decode_event(msg.data, msg.headers), None)
                    except ev.EventDecodeError as exc:
                        item = TailItem(seq, msg.subject, None, exc)
                    yield item
                if to_head and meta.num_pending == 0:
                    return
        finally:
            self._tails.discard(sub)  # never made anew once ended
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
