"""Weighted fair pulling from several durable consumers: deficit round robin (DRR).

One :class:`FairQueue` per source (the inference workers: one durable consumer per tenant, all
workers sharing each). A filler task per queue keeps a small local buffer of admitted deliveries
(``depth``, at most one fetch in flight), so that a backlogged queue is never empty at the moment
a batch is built; :meth:`FairPuller.take` builds a batch from the buffers by DRR:

* each visit to a queue with work adds ``quantum * weight / min weight`` to its deficit, where the
  quantum grows to the largest cost seen, so every visit to a backlogged queue serves at least one
  delivery (the loop always ends) and no costs need to be known in advance;
* the queue serves deliveries from the head while their cost fits its deficit, then the turn
  passes on; a queue found empty forfeits its deficit (an idle queue banks no credit);
* a batch that fills up mid-turn keeps the rest of that deficit and resumes there next batch,
  so shares hold across batch boundaries. Under contention each queue gets ``weight / sum of
  the weights with work`` of the cost served.

When no buffer holds anything, :meth:`FairPuller.next_batch` waits on an event that any filler
sets: no polling. Each filler's fetch lingers at the server (bus/pull.py) and is cancelled only on
close; a cancelled fetch loses nothing, since messages its requests bring stay queued on the
channel's inbox (:meth:`close` hands them back with a NAK, like the buffered deliveries).
Buffered deliveries get in-progress acks every ``keep_alive_s`` (they may wait for a long batch).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic

from jetrl.bus.consumer import B, Delivery, PullConsumer
from jetrl.bus.log import get_logger

log = get_logger(__name__)


def num_pending(d: Delivery[B]) -> int:
    """Messages the delivering consumer still had pending behind this one when it was delivered
    (the last token of the v1 ack subject, else nats-py's parse of the metadata)."""
    toks = (d.msg.reply or "").split(".")
    if len(toks) == 9 and toks[0] == "$JS":  # $JS.ACK.<stream>.<consumer>.<n>.<sseq>.<cseq>.<ts>.<pending>
        return int(toks[8])
    return int(d.msg.metadata.num_pending)


@dataclass(eq=False)
class FairQueue(Generic[B]):
    name: str
    consumer: PullConsumer[B]
    weight: float = 1.0
    buffer: deque[Delivery[B]] = field(default_factory=deque)
    deficit: float = 0.0
    served: float = 0.0  # cost taken from this queue so far
    # Messages its consumer still had pending behind the last one fetched: > 0, the queue has
    # more work than its buffer shows, and a batch waits (briefly) for its refill.
    backlog: int = 0
    space: asyncio.Event = field(default_factory=asyncio.Event)


# Called once per delivery a filler fetched: True keeps it for a batch; False means the callback
# settled it (dead-lettered, handed back).
Admit = Callable[[FairQueue[B], Delivery[B]], Awaitable[bool]]


class FairPuller(Generic[B]):
    def __init__(
        self,
        queues: Sequence[FairQueue[B]],
        *,
        cost: Callable[[Delivery[B]], float],
        admit: Admit[B] | None = None,
        depth: int = 16,
        linger_s: float = 5.0,
        keep_alive_s: float = 10.0,
        refill_wait_s: float = 0.25,
    ) -> None:
        if not queues:
            raise ValueError("a fair puller needs at least one queue")
        self.queues = list(queues)
        self.cost = cost
        self.admit = admit
        self.depth = max(1, depth)
        self.linger_s = linger_s
        self.keep_alive_s = keep_alive_s
        self.refill_wait_s = refill_wait_s
        self.quantum = 1.0
        self.min_weight = min(q.weight for q in self.queues)
        self._turn = 0
        self._fresh = True  # the queue whose turn it is has not had its quantum yet
        self._ready = asyncio.Event()  # some buffer got a delivery
        self._filled = asyncio.Event()  # some fetch ended
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        # One short fetch of each queue first, so the first batch sees every queue with work
        # rather than whichever answered first.
        await asyncio.gather(*(self._fill(q, timeout=0.2) for q in self.queues))
        self._tasks = [asyncio.create_task(self._filler(q)) for q in self.queues]
        self._tasks.append(asyncio.create_task(self._keep_alive()))

    async def close(self) -> None:
        """Stop fetching; hand every buffered or arrived-but-unread delivery back (NAK) so that
        another worker takes it at once instead of after the ack wait."""
        self._closed = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        for q in self.queues:
            while q.buffer:
                with contextlib.suppress(Exception):
                    await q.buffer.popleft().nak()
            await q.consumer.channel.hand_back()

    # ---------------------------------------------------------------- filling

    def queued(self) -> int:
        return sum(len(q.buffer) for q in self.queues)

    async def _fill(self, q: FairQueue[B], timeout: float) -> None:
        room = self.depth - len(q.buffer)
        if room <= 0:
            return
        got = await q.consumer.fetch_batch(room, timeout)
        q.backlog = num_pending(got.deliveries[-1]) if got.deliveries else 0
        for d in got.deliveries:
            try:
                keep = await self.admit(q, d) if self.admit is not None else True
            except Exception as exc:  # never let one delivery stop the queue
                log.exception("admit_failed", queue=q.name, seq=d.seq)
                if not d.settled:
                    await q.consumer.settle_failure(d, exc)
                continue
            if keep and not d.settled:
                q.buffer.append(d)
                self._ready.set()
        self._filled.set()

    async def _filler(self, q: FairQueue[B]) -> None:
        while not self._closed:
            if len(q.buffer) >= self.depth:
                q.space.clear()
                await q.space.wait()
                continue
            try:
                await self._fill(q, self.linger_s)
            except Exception:
                log.exception("fill_failed", queue=q.name)
                await asyncio.sleep(0.5)

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self.keep_alive_s)
            for q in self.queues:
                for d in list(q.buffer):
                    with contextlib.suppress(Exception):
                        await d.in_progress()

    # ---------------------------------------------------------------- scheduling

    async def next_batch(self, max_items: int, timeout: float) -> list[tuple[FairQueue[B], Delivery[B]]]:
        """Up to ``max_items`` deliveries by DRR; waits up to ``timeout`` for the first."""
        if not self.queued():
            self._ready.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._ready.wait(), timeout)
        await self._refills(max_items)
        return self.take(max_items)

    async def _refills(self, need: int) -> None:
        """Let queues with work still at the server fill their buffers before a batch is built:
        one that a fast engine drained would otherwise be passed over as idle and lose its share.
        Bounded by ``refill_wait_s``, so a slow fetch never holds the others up for long."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.refill_wait_s
        need = min(need, self.depth)
        while any(q.backlog > 0 and len(q.buffer) < need for q in self.queues):
            left = end - loop.time()
            if left <= 0:
                return
            self._filled.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._filled.wait(), left)

    def take(self, max_items: int) -> list[tuple[FairQueue[B], Delivery[B]]]:
        out: list[tuple[FairQueue[B], Delivery[B]]] = []
        n = len(self.queues)
        while len(out) < max_items and self.queued():
            q = self.queues[self._turn]
            if q.buffer:
                if self._fresh:
                    self.quantum = max(self.quantum, max(self.cost(d) for d in q.buffer))
                    q.deficit += self.quantum * q.weight / self.min_weight
                    self._fresh = False
                while q.buffer and len(out) < max_items and (c := self.cost(q.buffer[0])) <= q.deficit:
                    q.deficit -= c
                    q.served += c
                    out.append((q, q.buffer.popleft()))
                if len(out) >= max_items and q.buffer:
                    break  # its turn goes on in the next batch, with what is left of its deficit
            if not q.buffer:
                q.deficit = 0.0
            self._turn = (self._turn + 1) % n
            self._fresh = True
        for q in {q for q, _ in out}:
            q.space.set()
        return out
