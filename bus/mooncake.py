"""Payloads held by their writer and pulled by readers over Mooncake's transfer engine.

Each process that uses the store runs one transfer engine (``mooncake-transfer-engine``; TCP on
any machine, RDMA where there are NICs for it), started on first use with peer-to-peer
handshakes: no metadata server and no master. A write copies the bytes into a buffer of the
writer's own, registered with its engine, behind a 32-byte header naming the object; the
reference says where: ``bucket`` is the writer's engine ("host:port") and ``name`` the object's
name, buffer address and id. A reader pulls the bytes straight into its own memory with one
one-sided read, then reads the header again: a buffer evicted (or reused for another object)
meanwhile no longer carries the id, and the read fails as :class:`PayloadMissing` rather than
returning bytes of another object. Buffers are written once and never changed while
registered, and an evicted one is released only ``timeout_s`` later, so a read in flight never
touches freed memory.

The writer bounds what it holds (:class:`MooncakeSettings`: ``keep_objects``, ``keep_mib``; the
oldest evicted first, the newest two always kept). A dead writer, an evicted object, or a read
past ``timeout_s`` raise :class:`PayloadMissing`; the bytes' size and SHA-256 are checked by
:class:`~jetrl.bus.payloads.Payloads` as for every store.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import importlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from jetrl.bus import events as ev
from jetrl.bus.log import get_logger
from jetrl.bus.payloads import Buffer, PayloadError, PayloadMissing
from jetrl.bus.settings import MooncakeSettings

log = get_logger(__name__)

MAGIC = b"JETRLMC1"
HEADER = 32  # MAGIC, the object's 16-byte id, its size (little-endian u64)
_CHUNK = 8 << 20  # copied and hashed in chunks that stay in cache between the two


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
    buf: np.ndarray  # header + data, registered with the engine
    size: int


class MooncakePayloads:
    """A payload store whose objects stay in the writer's memory until evicted."""

    kind = "mooncake"

    def __init__(self, settings: MooncakeSettings | None = None, *, bucket: str = "") -> None:
        self.s = settings or MooncakeSettings()
        self.bucket = bucket  # the run's bucket name: only in messages
        self.host = advertised_host(self.s)
        self._engine: Any = None
        self._session = ""
        self._start_lock = threading.Lock()
        self._lock = threading.Lock()  # the held objects (puts run in threads)
        self._held: collections.OrderedDict[bytes, _Held] = collections.OrderedDict()
        self._released: list[tuple[float, np.ndarray]] = []  # evicted, freed after timeout_s

    # ------------------------------------------------------------------ the engine

    def _start(self) -> Any:
        with self._start_lock:
            if self._engine is None:
                os.environ.setdefault("GLOG_minloglevel", "2")  # the engine's info lines
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

    async def put(self, name: str, data: Buffer) -> ev.PayloadRef:
        if "#" in name:
            raise PayloadError(f"payload name {name!r} may not contain '#'")
        return await asyncio.to_thread(self._put, name, data)

    def _put(self, name: str, data: Buffer) -> ev.PayloadRef:
        engine = self._start()
        src = np.frombuffer(data, dtype=np.uint8)
        size = int(src.size)
        oid = os.urandom(16)
        buf = np.empty(HEADER + size, dtype=np.uint8)
        digest = hashlib.sha256()
        for off in range(0, size, _CHUNK):
            part = src[off : off + _CHUNK]
            buf[HEADER + off : HEADER + off + part.size] = part
            digest.update(part)
        buf[:HEADER] = np.frombuffer(_header(oid, size), dtype=np.uint8)
        addr = _address(buf)
        if engine.register_memory(addr, buf.size) != 0:
            raise PayloadError(f"mooncake could not register {buf.size} bytes for {name}")
        with self._lock:
            self._held[oid] = _Held(buf, size)
            self._evict(engine)
        return ev.PayloadRef(
            store=self.kind,
            bucket=self._session,
            name=f"{name}#{addr:x}#{oid.hex()}",
            size=size,
            sha256=digest.hexdigest(),
        )

    def _evict(self, engine: Any) -> None:
        """Past the limits, unregister the oldest objects (never the newest two); free the
        buffers evicted more than ``timeout_s`` ago."""
        now = time.monotonic()
        self._released = [(t, b) for t, b in self._released if t > now]
        limit = int(self.s.keep_mib * (1 << 20))
        total = sum(h.size for h in self._held.values())
        while len(self._held) > 2 and (len(self._held) > self.s.keep_objects or total > limit):
            _, old = self._held.popitem(last=False)
            engine.unregister_memory(_address(old.buf))
            self._released.append((now + self.s.timeout_s, old.buf))
            total -= old.size

    def held(self) -> tuple[int, int]:
        """(objects, bytes) this writer holds readable."""
        with self._lock:
            return len(self._held), sum(h.size for h in self._held.values())

    # ------------------------------------------------------------------ reading

    async def get_bytes(self, ref: ev.PayloadRef) -> bytes:
        try:
            name, addr_hex, oid_hex = ref.name.rsplit("#", 2)
            addr, oid = int(addr_hex, 16), bytes.fromhex(oid_hex)
        except ValueError:
            raise PayloadError(f"{ref.name!r} is not a mooncake object reference") from None
        try:
            return await asyncio.wait_for(
                asyncio.to_thread(self._read, ref.bucket, name, addr, oid, ref.size), self.s.timeout_s
            )
        except TimeoutError:
            raise PayloadMissing(
                f"payload {name} from {ref.bucket}: no answer within {self.s.timeout_s:g} s"
            ) from None

    def _read(self, session: str, name: str, addr: int, oid: bytes, size: int) -> bytes:
        engine = self._start()
        # The bytes land in a new bytes object that no one else holds yet (zero pages until
        # written), so none is copied after the read; bytes of 0 or 1 are shared singletons.
        out: bytes | bytearray = bytes(size) if size > 1 else bytearray(size)
        head = np.zeros(HEADER, dtype=np.uint8)
        local = _address(np.frombuffer(out, dtype=np.uint8)) if size else 0
        regs = [(_address(head), HEADER)] + ([(local, size)] if size else [])
        for a, n in regs:
            if engine.register_memory(a, n) != 0:
                raise PayloadError(f"mooncake could not register {n} bytes to read {name} into")
        try:
            if size and engine.transfer_sync_read(session, local, addr + HEADER, size) != 0:
                raise PayloadMissing(f"payload {name}: {session} did not serve it (writer gone, or evicted)")
            # Still this object after the read: it was this object's bytes throughout.
            if engine.transfer_sync_read(session, _address(head), addr, HEADER) != 0:
                raise PayloadMissing(f"payload {name}: evicted by {session} (or the writer is gone)")
            if head.tobytes() != _header(oid, size):
                raise PayloadMissing(f"payload {name}: evicted by {session}, its buffer reused")
        finally:
            for a, _ in regs:
                engine.unregister_memory(a)
        return bytes(out)
