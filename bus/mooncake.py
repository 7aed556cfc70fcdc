"""Payloads held by their writer and pulled by readers over Mooncake's transfer engine.

Each process that uses the store runs one transfer engine (``mooncake-transfer-engine``; TCP on
any machine, RDMA where there are NICs for it), started on first use with peer-to-peer
handshakes: no metadata server and no master. A write registers the bytes with the writer's
engine (``bytes`` or a read-only buffer where they lie; a buffer its owner may change, as a
copy) and writes a 32-byte header naming the object into a registered header table. The
reference says where: ``bucket`` is the writer's engine ("host:port"), ``name`` the object's
name, the addresses of its bytes and header, and its id. A reader pulls the bytes straight into
its own memory (or the buffer it is handed) with one-sided reads of ``_PULL`` bytes, a few in
flight at once, each reported as it lands (so the caller checks the bytes while the rest
arrive), then reads the header: evicting an object zeroes its header first, so a read that
overlapped an eviction (or the reuse of the memory for another object) fails as
:class:`PayloadMissing` instead of returning another object's bytes. Evicted memory is
released ``RELEASE_S`` after it is unregistered, so a send in flight never reads freed memory.

Waiting: the engine's own synchronous read spins on the transfer's status until it is done,
a core per reader; on a machine with fewer cores than readers and writer that starves the
transfer itself (500 MB to two readers took seconds on two cores). Reads are submitted
asynchronously and their status polled with short sleeps instead (0.25 ms, doubling to 4 ms
while a read is under way: few wake-ups, and the next piece is already in flight). The
engine's TCP transport moves 64 KiB per socket call unless ``MC_TCP_SLICE_SIZE`` says
otherwise; jetrl sets 4 MiB (where the environment has not set it) before its engine starts.

The writer bounds what it holds (:class:`~jetrl.bus.settings.MooncakeSettings`:
``keep_objects``, ``keep_mib``; the oldest evicted first, the newest two always kept). A dead
writer, an evicted object, or a read past ``timeout_s`` raise :class:`PayloadMissing`; the
bytes' size and SHA-256 are checked by :class:`~jetrl.bus.payloads.Payloads` as for every
store.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import hashlib
import importlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from jetrl.bus import events as ev
from jetrl.bus.log import get_logger
from jetrl.bus.payloads import Buffer, PayloadError, PayloadMissing, StoreSite
from jetrl.bus.settings import MooncakeSettings

log = get_logger(__name__)

MAGIC = b"JETRLMC1"
HEADER = 32  # MAGIC, the object's 16-byte id, its size (little-endian u64)
_CHUNK = 8 << 20  # copied and hashed in chunks that stay in cache between the two
_PULL = 16 << 20  # a read is this many bytes at a time,
_DEPTH = 4  # this many in flight
_POLL_S = (0.00025, 0.004)  # between looks at a read's status: doubling from the first to the last
_SLICE = str(4 << 20)  # MC_TCP_SLICE_SIZE, unless set
# An evicted object's memory is kept this long after it is unregistered: a send the engine
# started before still reads it. (The memory held is the objects kept plus what was evicted
# in the last RELEASE_S seconds: at most one weights version a step.)
RELEASE_S = 10.0


def advertised_host(settings: MooncakeSettings) -> str:
    """The host this process's engine is reached at: the setting, else $JETRL_HOST, else
    127.0.0.1."""
    return settings.host or os.environ.get("JETRL_HOST") or "127.0.0.1"


def _header(oid: bytes, size: int) -> bytes:
    return MAGIC + oid + size.to_bytes(8, "little")


def _address(buf: np.ndarray) -> int:
    return int(buf.ctypes.data)


@dataclass
class _Held:
    data: bytes | memoryview | np.ndarray  # registered with the engine: the writer's, or a copy
    slot: int  # its header's place in the header table
    size: int


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MADV_HUGEPAGE = 14
_HUGE = 2 << 20


def _huge_pages(addr: int, size: int) -> None:
    """Ask for transparent huge pages over the not yet touched ``[addr, addr + size)``: a
    buffer of hundreds of MB is faulted in a few hundred times instead of ~10^5 (a no-op where
    the kernel has them off)."""
    start, end = -(-addr // _HUGE) * _HUGE, (addr + size) // _HUGE * _HUGE
    if end - start >= _HUGE:
        _libc.madvise(start, end - start, _MADV_HUGEPAGE)


def _new_buffer(size: int) -> np.ndarray:
    buf = np.empty(size, dtype=np.uint8)
    _huge_pages(_address(buf), size)
    return buf


class MooncakePayloads:
    """A payload store whose objects stay in the writer's memory until evicted."""

    kind = "mooncake"
    held_by_writer = True  # evicted by its own limits, gone with the trainer

    def __init__(self, settings: MooncakeSettings | None = None, *, bucket: str = "") -> None:
        self.s = settings or MooncakeSettings()
        self.bucket = bucket  # the run's bucket name: only in messages
        self.host = advertised_host(self.s)
        self._engine: Any = None
        self._session = ""
        self._start_lock = threading.Lock()
        self._lock = threading.Lock()  # the held objects (puts run in threads)
        self._held: collections.OrderedDict[bytes, _Held] = collections.OrderedDict()
        # One header per held object, in one registered table; a slot is zeroed when its
        # object is evicted.
        self._headers = np.zeros(self.s.keep_objects * HEADER, dtype=np.uint8)
        self._free_slots = list(range(self.s.keep_objects))
        self._spare: np.ndarray | None = None  # an evicted copy, reused for the next one
        self._registered: collections.Counter[int] = collections.Counter()  # bytes put twice
        self._released: list[tuple[float, bytes | memoryview | np.ndarray]] = []  # freed RELEASE_S later

    @classmethod
    async def open(cls, site: StoreSite) -> MooncakePayloads | None:
        """This process's engine ([bus.mooncake]), where the run's weights or traces use it."""
        return cls(site.bus.mooncake, bucket=site.bucket) if cls.kind in site.uses else None

    # ------------------------------------------------------------------ the engine

    def _start(self) -> Any:
        with self._start_lock:
            if self._engine is None:
                os.environ.setdefault("MC_TCP_SLICE_SIZE", _SLICE)  # read once, by the engine
                try:
                    engine_mod = importlib.import_module("mooncake.engine")
                except ImportError as exc:
                    raise PayloadError(
                        f"the mooncake store needs mooncake-transfer-engine (and libibverbs1): {exc}"
                    ) from None
                engine = engine_mod.TransferEngine()
                rc = engine.initialize(self.host, "P2PHANDSHAKE", self.s.protocol, self.s.device)
                if rc != 0:
                    raise PayloadError(
                        f"mooncake transfer engine did not start on {self.host} ({self.s.protocol}): rc {rc}"
                    )
                if engine.register_memory(_address(self._headers), self._headers.size) != 0:
                    raise PayloadError("mooncake could not register the header table")
                self._session = f"{self.host}:{engine.get_rpc_port()}"
                self._engine = engine
                log.info("mooncake_started", session=self._session, protocol=self.s.protocol)
            return self._engine

    @property
    def session(self) -> str:
        """This process's engine, "host:port" (started if it was not)."""
        self._start()
        return self._session

    # ------------------------------------------------------------------ writing

    async def put(
        self, name: str, data: Buffer, *, sha256: bool = True, durable: bool = True
    ) -> ev.PayloadRef:
        if "#" in name:
            raise PayloadError(f"payload name {name!r} may not contain '#'")
        return await asyncio.to_thread(self._put, name, data, sha256)

    def _put(self, name: str, data: Buffer, sha256: bool = True) -> ev.PayloadRef:
        engine = self._start()
        src = np.frombuffer(data, dtype=np.uint8)
        size = int(src.size)
        held: bytes | memoryview | np.ndarray
        digest = ""
        if isinstance(data, bytes) or (isinstance(data, memoryview) and data.readonly):
            # Immutable (or handed over read-only, as a trainer's exported weights): served
            # where it lies, no copy.
            held = data
            if sha256:
                digest = hashlib.sha256(data).hexdigest()
            with self._lock:
                first = size and not self._registered[_address(src)]
                if first and engine.register_memory(_address(src), size) != 0:
                    raise PayloadError(f"mooncake could not register {size} bytes for {name}")
                self._registered[_address(src)] += 1
        else:  # a buffer its owner may change: a copy, hashed as it is made
            with self._lock:
                spare, self._spare = self._spare, None
            if spare is not None and spare.size != size:
                with self._lock:
                    self._release(engine, spare)
                spare = None
            held = spare if spare is not None else _new_buffer(size)
            h = hashlib.sha256() if sha256 else None
            for off in range(0, size, _CHUNK):
                part = src[off : off + _CHUNK]
                held[off : off + part.size] = part
                if h is not None:
                    h.update(part.data)
            digest = h.hexdigest() if h is not None else ""
            if spare is None and size and engine.register_memory(_address(held), size) != 0:
                raise PayloadError(f"mooncake could not register {size} bytes for {name}")
        data_addr = _address(np.frombuffer(held, dtype=np.uint8)) if size else 0
        oid = os.urandom(16)
        with self._lock:
            self._evict(engine, incoming=size)
            slot = self._free_slots.pop()
            self._headers[slot * HEADER : (slot + 1) * HEADER] = np.frombuffer(_header(oid, size), np.uint8)
            self._held[oid] = _Held(held, slot, size)
        head = _address(self._headers) + slot * HEADER
        return ev.PayloadRef(
            store=self.kind,
            bucket=self._session,
            name=f"{name}#{data_addr:x}#{head:x}#{oid.hex()}",
            size=size,
            sha256=digest,
        )

    def _evict(self, engine: Any, incoming: int) -> None:
        """Make room for one more object of ``incoming`` bytes: evict the oldest past the
        limits, but never the newest one (with the new one, the newest two stay). An evicted
        object's header is zeroed, so a read of it fails however far it got; a copy is kept
        as the spare for the next, anything else unregistered and released."""
        limit = int(self.s.keep_mib * (1 << 20))
        total = incoming + sum(h.size for h in self._held.values())
        while len(self._held) > 1 and (len(self._held) + 1 > self.s.keep_objects or total > limit):
            _, old = self._held.popitem(last=False)
            self._headers[old.slot * HEADER : (old.slot + 1) * HEADER] = 0
            self._free_slots.append(old.slot)
            total -= old.size
            if isinstance(old.data, np.ndarray) and self._spare is None:
                self._spare = old.data  # stays registered: its next object gets another header
            else:
                self._release(engine, old.data)

    def _release(self, engine: Any, data: bytes | memoryview | np.ndarray) -> None:
        """Unregister ``data``; drop it ``RELEASE_S`` later (a send already under way may still
        read it), and what was released before that now."""
        view = np.frombuffer(data, dtype=np.uint8)
        addr = _address(view)
        if not isinstance(data, np.ndarray):  # the same bytes may be held under several names
            self._registered[addr] -= 1
            if self._registered[addr] > 0:
                return
            del self._registered[addr]
        if view.size:
            engine.unregister_memory(addr)
        now = time.monotonic()
        self._released = [(t, b) for t, b in self._released if t > now]
        self._released.append((now + RELEASE_S, data))

    def held(self) -> tuple[int, int]:
        """(objects, bytes) this writer holds readable."""
        with self._lock:
            return len(self._held), sum(h.size for h in self._held.values())

    async def discard(self, name: str) -> None:
        return None  # held objects are evicted past `keep_objects` and `keep_mib`, oldest first

    # ------------------------------------------------------------------ reading

    async def get_bytes(self, ref: ev.PayloadRef) -> bytes:
        # The bytes land in a new bytes object that no one else holds yet (zero pages until
        # written), so none is copied after the read; bytes of 0 or 1 are shared singletons.
        out: bytes | bytearray = bytes(ref.size) if ref.size > 1 else bytearray(ref.size)
        await self.read_into(ref, memoryview(out), lambda _: None)
        return bytes(out)

    async def read_into(self, ref: ev.PayloadRef, out: memoryview, progress: Callable[[int], None]) -> bool:
        try:
            name, data_hex, head_hex, oid_hex = ref.name.rsplit("#", 3)
            data_addr, head_addr, oid = int(data_hex, 16), int(head_hex, 16), bytes.fromhex(oid_hex)
        except ValueError:
            raise PayloadError(f"{ref.name!r} is not a mooncake object reference") from None
        if out.nbytes != ref.size:
            raise PayloadError(f"payload {name}: a buffer of {out.nbytes} bytes for {ref.size}")
        await asyncio.to_thread(self._read, ref.bucket, name, data_addr, head_addr, oid, out, progress)
        return False  # the caller checks the bytes

    def _read(
        self,
        session: str,
        name: str,
        data_addr: int,
        head_addr: int,
        oid: bytes,
        out: memoryview,
        progress: Callable[[int], None],
    ) -> None:
        engine = self._start()
        size = out.nbytes
        local = _address(np.frombuffer(out, dtype=np.uint8)) if size else 0
        head = np.zeros(HEADER, dtype=np.uint8)
        regs = [(_address(head), HEADER)] + ([(local, size)] if size else [])
        for a, n in regs:
            if engine.register_memory(a, n) != 0:
                raise PayloadError(f"mooncake could not register {n} bytes to read {name} into")
        deadline = time.monotonic() + self.s.timeout_s
        pieces = [(off, min(_PULL, size - off)) for off in range(0, size, _PULL)]
        # The header last, in flight with the last pieces (not a round trip after them): still
        # this object's then, the bytes read were this object's; an eviction after it was read
        # changes bytes still to come, which their check (SHA-256, or weights' BLAKE3) refuses.
        reads = [(local + off, data_addr + off, n) for off, n in pieces]
        reads.append((_address(head), head_addr, HEADER))
        pending: collections.deque[int] = collections.deque()
        try:
            if not self._pull(engine, session, reads, pending, deadline, name, progress):
                raise PayloadMissing(f"payload {name}: {session} did not serve it (writer gone, or evicted)")
            if head.tobytes() != _header(oid, size):
                raise PayloadMissing(f"payload {name}: evicted by {session}")
        finally:
            if pending:  # reads still under way may yet write there: never let go of that memory
                _ABANDONED.append((out, head))
            else:
                for a, _ in regs:
                    engine.unregister_memory(a)

    def _pull(
        self,
        engine: Any,
        session: str,
        reads: list[tuple[int, int, int]],
        pending: collections.deque[int],
        deadline: float,
        name: str,
        progress: Callable[[int], None] | None = None,
    ) -> bool:
        """``reads`` (local address, remote address, length), ``_DEPTH`` in flight at a time;
        ``progress(local bytes so far)`` as each but the last (the header) completes, in order.
        False when one fails (the writer is gone, or the range is not registered there),
        PayloadMissing past ``deadline``; either way ``pending`` keeps the reads still in flight."""
        start = reads[0][0]
        submitted = done = 0
        wait = _POLL_S[0]
        while submitted < len(reads) or pending:
            while submitted < len(reads) and len(pending) < _DEPTH:
                local, remote, n = reads[submitted]
                batch = engine.batch_transfer_async_read(session, [local], [remote], [n])
                if not batch:
                    return False
                pending.append(batch)
                submitted += 1
            status = engine.transfer_check_status(pending[0])
            if status in (0, -2):  # under way (or late: the deadline decides)
                if time.monotonic() > deadline:
                    raise PayloadMissing(
                        f"payload {name} from {session}: no answer within {self.s.timeout_s:g} s"
                    )
                time.sleep(wait)
                wait = min(2 * wait, _POLL_S[1])
                continue
            wait = _POLL_S[0]
            pending.popleft()
            if status != 1:
                return False
            local, _, n = reads[done]
            done += 1
            if progress is not None and done < len(reads):
                progress(local + n - start)
        return True


# Buffers a read was abandoned in (timed out, or failed with others in flight): the engine may
# still write into them, so they stay allocated and registered for the life of the process.
_ABANDONED: list[tuple[memoryview, np.ndarray]] = []
