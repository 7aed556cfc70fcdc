"""The claim-check: arrays and blobs that are too big to ride in an event.

An array is raw little-endian bytes plus dtype and shape. Below ``inline_threshold`` bytes it
travels inside the event (:class:`~jetrl.bus.events.InlineArray`); above, it goes to a payload
store and the event carries a :class:`~jetrl.bus.events.PayloadRef` (store, bucket, name,
size, SHA-256). Reading a reference always verifies the hash and raises
:class:`PayloadIntegrityError` on mismatch. Weights are read by :meth:`Payloads.get_weights`:
straight into the buffer the caller loads from, checked once, as they land, against their
WeightsReady's transfer digest (BLAKE3).

Stores implement :class:`PayloadStore`; the event format does not change with the store. A
store is a plugin of the registry (jetrl/plugins.py, ``PAYLOAD_STORES``), named by the kind its
references carry: a class whose ``open(site)`` opens it where a process needs it
(:class:`StoreKind`), and whose checks, if it registers any, ``check`` the ``[bus]`` section.
Built in: the run's JetStream Object Store bucket (where arrays go), a shared filesystem
directory, and ``mooncake`` (bus/mooncake.py): bytes held by their writer, pulled by readers over
Mooncake's transfer engine, for weights and routing traces when ``[bus]`` says so. A third kind of reference,
:class:`~jetrl.bus.events.LogArray`, names an inline array already in the run's log (a scored
rollout's arrays are its generation's); :class:`LogArrays` reads them by stream sequence.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import io
import math
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import msgspec
import nats.js.errors
import numpy as np
from blake3 import blake3
from nats.js.object_store import ObjectStore

from jetrl.bus import events as ev
from jetrl.bus.log import get_logger
from jetrl.bus.retry import RETRY_S, retrying
from jetrl.bus.settings import BusSettings
from jetrl.bus.streams import payload_bucket, stored_message, stream_name
from jetrl.plugins import PAYLOAD_STORES

log = get_logger(__name__)

DEFAULT_INLINE_THRESHOLD = 16 * 1024
_ALLOWED_DTYPES = {"uint8", "uint16", "int32", "int64", "float16", "float32", "float64", "bfloat16"}


T = TypeVar("T")


class PayloadError(RuntimeError):
    pass


class PayloadIntegrityError(PayloadError):
    """The bytes read do not match the reference's size or SHA-256."""


class PayloadMissing(PayloadError):
    pass


class ChunksStalled(TimeoutError):
    """An object's chunks stopped coming: retried as a timeout is, then the payload is missing."""


# --------------------------------------------------------------------------- arrays


# numpy's dtype.name is slow (~2 us, a few hundred arrays a step): the allowed dtypes' names
# and little-endian dtypes, looked up.
_NAMES = {np.dtype(n): n for n in _ALLOWED_DTYPES - {"bfloat16"}}
_LITTLE_ENDIAN = {n: np.dtype(n).newbyteorder("<") for n in _ALLOWED_DTYPES - {"bfloat16"}}


def array_bytes(arr: np.ndarray) -> tuple[str, tuple[int, ...], bytes]:
    dtype = _NAMES.get(arr.dtype) or arr.dtype.name
    if dtype not in _ALLOWED_DTYPES:
        raise PayloadError(f"dtype {dtype} cannot be carried (allowed: {sorted(_ALLOWED_DTYPES)})")
    order = arr.dtype.byteorder
    if order == ">" or (order == "=" and sys.byteorder == "big"):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return dtype, arr.shape, arr.tobytes()  # tobytes: C order, contiguous or not


def inline_array(arr: np.ndarray) -> ev.InlineArray:
    """``arr`` carried in the event itself."""
    dtype, shape, data = array_bytes(arr)
    return ev.InlineArray(dtype=dtype, shape=shape, data=data)


def array_from_bytes(dtype: str, shape: tuple[int, ...], data: bytes | memoryview) -> np.ndarray:
    dt = _LITTLE_ENDIAN.get(dtype)
    if dt is None:
        if dtype == "bfloat16":
            raise PayloadError("bfloat16 arrays are read with torch (policy/), not numpy")
        raise PayloadError(f"unknown array dtype {dtype!r}")
    expected = math.prod(shape) * dt.itemsize  # Python ints: never overflows, and cheap
    if len(data) != expected:
        raise PayloadIntegrityError(f"array of {dtype}{list(shape)} needs {expected} bytes, got {len(data)}")
    flat = np.frombuffer(data, dtype=dt)
    # A step reads ~1,000 arrays, most of them 1-D: frombuffer's shape already.
    return flat if len(shape) == 1 else flat.reshape(shape)


def sha256(data: Buffer) -> str:
    return hashlib.sha256(data).hexdigest()


_sha256 = sha256  # for the stores, whose put has an argument of that name


# --------------------------------------------------------------------------- stores


# What a store takes: bytes, or a writable buffer (a trainer's weights, serialised in place)
# that must not be copied again on its way out.
Buffer = bytes | bytearray | memoryview


class _BufferReader(io.BufferedIOBase):
    """A buffer read in chunks without a copy of the whole (the object store copies bytes-like
    data it cannot read in place)."""

    def __init__(self, data: bytearray | memoryview) -> None:
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = min(len(b), len(self._view) - self._pos)
        b[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n


class _BufferWriter(io.BufferedIOBase):
    """Chunks written in place into a buffer of the size expected (more is an error), or into
    ``into``; ``progress(bytes written so far)`` after each."""

    def __init__(
        self, size: int, into: memoryview | None = None, progress: Callable[[int], None] | None = None
    ) -> None:
        self._buf: bytearray | memoryview = bytearray(size) if into is None else into
        self._pos = 0
        self._progress = progress

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = len(b)
        if self._pos + n > len(self._buf):
            raise PayloadIntegrityError(f"more than the {len(self._buf)} bytes expected")
        self._buf[self._pos : self._pos + n] = b
        self._pos += n
        if self._progress is not None:
            self._progress(self._pos)
        return n

    @property
    def written(self) -> int:
        return self._pos

    def value(self) -> bytes:
        """What was written (shorter than expected if the object is; the reader checks)."""
        view = memoryview(self._buf)[: self._pos]
        return bytes(view)


class PayloadStore(Protocol):
    kind: str  # the name a reference carries (PayloadRef.store): which store reads it back
    # Whether the bytes live in their writer's memory (bus/mooncake.py), gone when it dies: a
    # restarted writer must put them again, and what outlives it goes to another store.
    held_by_writer: bool

    async def put(
        self, name: str, data: Buffer, *, sha256: bool = True, durable: bool = True
    ) -> ev.PayloadRef:
        """Store ``data`` under ``name``. ``sha256=False``: the caller has the bytes checked
        another way (a WeightsReady's ``blake3``), so the reference's ``sha256`` is left empty
        where it would cost a pass over the bytes of its own. ``durable=False``: the bytes need
        not outlive a crash of the machine (a reader finds them missing or failing their check,
        and the writer puts them again), so a store may skip flushing them to disk. A read-only
        buffer is never changed by its owner: a store may keep it as it is."""
        ...

    async def get_bytes(self, ref: ev.PayloadRef) -> bytes: ...

    async def read_into(self, ref: ev.PayloadRef, out: memoryview, progress: Callable[[int], None]) -> bool:
        """Read the ``ref.size`` bytes of ``ref`` into ``out`` (of that size), calling
        ``progress(n)`` each time the first ``n`` bytes are in place (from a worker thread).
        Returns whether the store itself checked the bytes against ``ref.sha256`` (the
        object store does, as it reads, and tells no progress); if not, the caller checks them.
        A missing object raises :class:`PayloadMissing`, one of another size
        :class:`PayloadIntegrityError`."""
        ...

    async def discard(self, name: str) -> None:
        """The writer no longer needs ``name`` (a policy version past its retention): the store
        may drop it. A name that is not there is no error."""
        ...


@dataclass(frozen=True)
class StoreSite:
    """Where a process opens the run's payload stores: the run, the kinds its ``[bus]`` writes
    to, the run's shared directory (None: this process has none) and ``[bus]`` itself, each
    store reading its own section."""

    js: nats.js.JetStreamContext
    run_id: str
    bus: BusSettings
    directory: Path | None = None

    @property
    def bucket(self) -> str:
        return payload_bucket(self.run_id)

    @property
    def uses(self) -> frozenset[str]:
        return frozenset({self.bus.weights_store, self.bus.traces_store})


class StoreKind(Protocol):
    """What the registry names for a payload store (a class, or any object with ``open``)."""

    async def open(self, site: StoreSite) -> PayloadStore | None:
        """The store, as this process uses it at ``site``; None where it has nothing to follow
        here (a reader opens every store it may meet a reference of)."""
        ...


class ObjectStorePayloads:
    """The run's JetStream Object Store bucket (chunked, replicated with the run)."""

    kind = "objstore"
    held_by_writer = False
    # nats-py's get waits for an object's chunks for ever: a read that gets no chunk for
    # ``stall_s`` is started again (a consumer lost in a leader election), for ``retry_s``.
    stall_s = 15.0
    retry_s = RETRY_S

    def __init__(self, obj: ObjectStore, bucket: str) -> None:
        self.obj = obj
        self.bucket = bucket

    @classmethod
    async def open(cls, site: StoreSite) -> ObjectStorePayloads:
        return await cls.for_run(site.js, site.run_id)

    @classmethod
    async def for_run(cls, js: nats.js.JetStreamContext, run_id: str) -> ObjectStorePayloads:
        bucket = payload_bucket(run_id)
        try:
            obj = await js.object_store(bucket)
        except nats.js.errors.BucketNotFoundError:
            raise PayloadError(f"payload bucket {bucket} does not exist; call Bus.ensure_run first") from None
        return cls(obj, bucket)

    async def put(
        self, name: str, data: Buffer, *, sha256: bool = True, durable: bool = True
    ) -> ev.PayloadRef:
        # Retried through a leader election of the bucket's stream (a fresh reader each time).
        info = await retrying(
            f"put {self.bucket}/{name}",
            lambda: self.obj.put(name, data if isinstance(data, bytes) else _BufferReader(data)),
        )
        # The object store hashed the bytes already ("SHA-256=<base64url>"): no second pass.
        assert info.digest is not None  # set on every object the store put
        digest = base64.urlsafe_b64decode(info.digest.split("=", 1)[1]).hex()
        return _ref(self, name, data, digest)

    async def get_bytes(self, ref: ev.PayloadRef) -> bytes:
        async def read() -> _BufferWriter:
            info = await self.obj.get_info(ref.name)
            if info.size != ref.size:
                raise PayloadIntegrityError(
                    f"payload {ref.bucket}/{ref.name} holds {info.size} bytes, the reference {ref.size}"
                )
            # Into a buffer of the object's size: without one nats-py appends each chunk to a
            # bytes object, a copy of all read so far per chunk (19 s for 64 MiB, measured).
            into = _BufferWriter(int(info.size or 0))
            await self._chunks(ref.name, into)
            return into

        return (await self._reading(ref, read)).value()

    async def _reading(self, ref: ev.PayloadRef, read: Callable[[], Awaitable[T]]) -> T:
        """``read()`` retried through a leader election of the bucket's stream, as a put is (a
        reader that gave up would crash its part, which restarts into the same election), its
        failures told as the payload's."""
        try:
            return await retrying(f"get {ref.bucket}/{ref.name}", read, retry_s=self.retry_s)
        except nats.js.errors.ObjectNotFoundError:
            raise PayloadMissing(f"payload {ref.bucket}/{ref.name} not found") from None
        except ChunksStalled as exc:
            raise PayloadMissing(f"payload {ref.bucket}/{ref.name}: {exc}") from None
        except nats.js.errors.DigestMismatchError as exc:
            raise PayloadIntegrityError(
                f"payload {ref.bucket}/{ref.name} corrupted in the store: {exc}"
            ) from None

    async def _chunks(self, name: str, into: _BufferWriter) -> None:
        """The object's chunks into ``into``; :class:`ChunksStalled` when none came for ``stall_s``."""
        get = asyncio.ensure_future(self.obj.get(name, writeinto=into))
        try:
            seen = into.written
            while not (await asyncio.wait({get}, timeout=self.stall_s))[0]:
                if into.written == seen:
                    raise ChunksStalled(f"no chunk came for {self.stall_s:g} s ({into.written} bytes read)")
                seen = into.written
            get.result()
        finally:
            if not get.done():
                get.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await get

    async def read_into(self, ref: ev.PayloadRef, out: memoryview, progress: Callable[[int], None]) -> bool:
        async def read() -> None:
            info = await self.obj.get_info(ref.name)
            if info.size != ref.size:
                raise PayloadIntegrityError(
                    f"payload {ref.bucket}/{ref.name} holds {info.size} bytes, the reference {ref.size}"
                )
            assert info.digest is not None
            digest = base64.urlsafe_b64decode(info.digest.split("=", 1)[1]).hex()
            if digest != ref.sha256:
                raise PayloadIntegrityError(
                    f"payload {ref.bucket}/{ref.name} is not the object the reference names "
                    f"(SHA-256 {digest}, the reference {ref.sha256 or 'none'})"
                )
            # nats-py hashes the chunks as they come and compares with the object's digest: that
            # is the check, so progress is not told (the caller would hash them a second time).
            into = _BufferWriter(ref.size, out)
            await self._chunks(ref.name, into)
            if into.written != ref.size:
                raise PayloadIntegrityError(
                    f"payload {ref.bucket}/{ref.name}: read {into.written} of {ref.size} bytes"
                )

        await self._reading(ref, read)
        return True

    async def discard(self, name: str) -> None:
        gone = (
            nats.js.errors.NotFoundError,
            nats.js.errors.ObjectNotFoundError,
            nats.js.errors.ObjectDeletedError,
        )
        with contextlib.suppress(*gone):  # retried through a reconnect or an election, as a put is
            await retrying(f"discard {name}", lambda: self.obj.delete(name), retry_s=self.retry_s)


class FilePayloads:
    """A directory on a shared filesystem; writes are atomic (temp file + rename).

    A discarded object (a policy version past its retention) is kept as the directory's spare
    file, and the next put writes over the spare's pages instead of a new file's: the pages
    stay in the page cache, so a put is one copy, not the allocation of as many new pages. On
    a VM that hands freed memory back to its host (virtio-balloon free page reporting, as on
    the 2-core VMs docs/events.md measures on), new pages are faulted in by the host again: a
    500 MB put took 0.9-1.4 s instead of 0.12 s, one put in three. A reader still reading the
    discarded object then meets changed bytes, which its check refuses, as it would a missing
    object.
    """

    kind = "file"
    held_by_writer = False

    def __init__(self, root: str | Path, bucket: str) -> None:
        self.root = Path(root)
        self.bucket = bucket

    @classmethod
    async def open(cls, site: StoreSite) -> FilePayloads | None:
        """Where the run has a shared directory (a reader may meet weights written there)."""
        if site.directory is None:
            if cls.kind in site.uses:
                raise PayloadError(f"the {cls.kind!r} payload store needs the run's shared directory")
            return None
        return cls(site.directory, site.bucket)

    @classmethod
    def check(cls, bus: BusSettings) -> None:
        if bus.traces_store == cls.kind:
            raise ValueError(
                f"[bus] traces_store = {cls.kind!r}: routing traces do not go to the shared directory "
                "(nothing there discards them)"
            )

    def _path(self, name: str) -> Path:
        if "/" in name or name.startswith(".") or "\\" in name:
            raise PayloadError(f"payload name {name!r} must be a plain file name")
        return self.root / self.bucket / name

    async def put(
        self, name: str, data: Buffer, *, sha256: bool = True, durable: bool = True
    ) -> ev.PayloadRef:
        path = self._path(name)
        await asyncio.to_thread(_atomic_write, path, data, durable, path.with_name(_SPARE))
        return _ref(self, name, data, _sha256(data) if sha256 else "")

    async def get_bytes(self, ref: ev.PayloadRef) -> bytes:
        path = self._path(ref.name)
        try:
            return await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            raise PayloadMissing(f"payload {path} not found") from None

    async def read_into(self, ref: ev.PayloadRef, out: memoryview, progress: Callable[[int], None]) -> bool:
        path = self._path(ref.name)
        try:
            await asyncio.to_thread(_read_file_into, path, out, progress)
        except FileNotFoundError:
            raise PayloadMissing(f"payload {path} not found") from None
        return False

    async def discard(self, name: str) -> None:
        path = self._path(name)
        with contextlib.suppress(FileNotFoundError):  # the spare it replaces is unlinked
            await asyncio.to_thread(path.replace, path.with_name(_SPARE))


_SPARE = ".spare"  # a discarded object's file, for the next put to write over (no name starts with ".")
_READ_PIECE = 8 << 20  # a file is read, and its progress told, this much at a time


def _read_file_into(path: Path, out: memoryview, progress: Callable[[int], None]) -> None:
    with path.open("rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size != out.nbytes:
            raise PayloadIntegrityError(f"payload {path} holds {size} bytes, the reference {out.nbytes}")
        got = 0
        while got < size:
            n = f.readinto(out[got : got + _READ_PIECE])
            if not n:
                raise PayloadIntegrityError(f"payload {path} ended after {got} of {size} bytes")
            got += n
            progress(got)


class NoPayloadStore:
    """Where a reader has no payload store it may use (a tenant's producer: the run's store is
    jetrl's): every array travels inline, and a reference it meets is refused clearly."""

    kind = "none"
    held_by_writer = False

    async def put(
        self, name: str, data: Buffer, *, sha256: bool = True, durable: bool = True
    ) -> ev.PayloadRef:
        raise PayloadError(
            f"{name}: {len(data)} bytes is past what an event carries here, and there is no payload store"
        )

    async def get_bytes(self, ref: ev.PayloadRef) -> bytes:
        raise PayloadError(
            f"payload {ref.bucket}/{ref.name} is in the run's payload store, which this identity cannot read"
        )

    async def read_into(self, ref: ev.PayloadRef, out: memoryview, progress: Callable[[int], None]) -> bool:
        return bool(await self.get_bytes(ref))  # refused

    async def discard(self, name: str) -> None:
        return None  # it holds nothing


def _ref(store: ObjectStorePayloads | FilePayloads, name: str, data: Buffer, digest: str) -> ev.PayloadRef:
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    return ev.PayloadRef(store=store.kind, bucket=store.bucket, name=name, size=size, sha256=digest)


def _atomic_write(path: Path, data: Buffer, durable: bool = True, spare: Path | None = None) -> None:
    """``data`` into ``path`` whole or not at all; written over ``spare``'s pages where there is
    one (claimed by renaming it: of two writers, one gets it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    reuse = False
    if spare is not None:
        with contextlib.suppress(FileNotFoundError):
            spare.replace(tmp)
            reuse = True
    with tmp.open("r+b" if reuse else "wb") as f:
        f.write(data)
        if reuse:
            f.truncate()  # at the end of what was written: a larger spare's tail goes
        f.flush()
        if durable:  # an fsync a step stalls the run where a store's commits share the disk
            os.fsync(f.fileno())
    tmp.replace(path)


class ReceiveBuffer:
    """Where a reader receives weights, version after version: the same memory while the size
    stays (weights keep theirs), so only the first version faults its pages in. Reuse is safe
    once the tensors of the previous version are no longer used (a worker has loaded them into
    its model); memory a read was abandoned in is never handed out again."""

    def __init__(self) -> None:
        self._buf: np.ndarray | None = None

    def __call__(self, size: int) -> memoryview:
        buf = self._buf
        if buf is None or buf.size != size:
            buf = self._buf = np.empty(size, dtype=np.uint8)
        return buf.data

    def drop(self) -> None:
        """Let the memory go (after a failed read, which may have abandoned it)."""
        self._buf = None


class WeightsDigest:
    """A weights buffer's transfer digest (WeightsReady ``blake3``, policy/weights.py's
    ``transfer_digest``), taken while the bytes land in ``buf`` in order: BLAKE3 of the bytes
    after the safetensors header, then of the header (its 8-byte length and the header itself),
    the order in which the trainer writes them. ``progress(n)``: the first ``n`` bytes are in."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.size = buf.nbytes
        self._h = blake3()
        self._start: int | None = None  # where the header ends
        self._done = 0  # hashed up to here

    def progress(self, upto: int) -> None:
        if self._start is None:
            if upto < min(8, self.size):
                return
            n = int.from_bytes(self.buf[:8], "little") if self.size >= 8 else self.size
            self._start = self._done = min(8 + n, self.size)
        if upto > self._done:
            self._h.update(self.buf[self._done : upto])
            self._done = upto

    def verify(self, expected: str, where: str) -> None:
        self.progress(self.size)
        assert self._start is not None
        self._h.update(self.buf[: self._start])
        got = self._h.hexdigest()
        if got != expected:
            raise PayloadIntegrityError(
                f"payload {where}: BLAKE3 {got} does not match the announced {expected}"
            )


class LogArrays:
    """Arrays referred to by their place in the run's log (gets by stream sequence, direct
    first; each event read once while it is among the most recent ``cache_events``)."""

    def __init__(self, js: nats.js.JetStreamContext, run_id: str, *, cache_events: int = 8192) -> None:
        self.js = js
        self.stream = stream_name(run_id)
        self.cache_events = cache_events
        self._events: dict[int, ev.Event] = {}

    async def event(self, seq: int) -> ev.Event:
        """The event at ``seq`` of the run's log (read once while among the recent ones)."""
        event = self._events.get(seq)
        if event is None:
            if not 1 <= seq < 2**63:  # the server refuses such a request (it is no sequence)
                raise PayloadMissing(f"{seq} is not a sequence of {self.stream}")
            read = functools.partial(stored_message, self.js, self.stream, seq)
            try:  # retried through a reconnect or an election: a reader that gave up would crash
                msg = await retrying(f"{self.stream} #{seq}", read)
            except nats.js.errors.NotFoundError:
                raise PayloadMissing(f"{self.stream} has no message at sequence {seq}") from None
            except nats.js.errors.BadRequestError as exc:
                raise PayloadMissing(f"{self.stream} refused sequence {seq}: {exc}") from None
            event = ev.decode_event(msg.data or b"", msg.headers)
            if len(self._events) >= self.cache_events:
                del self._events[next(iter(self._events))]  # the oldest read
            self._events[seq] = event
        return event

    async def prefetch(self, refs: list[ev.LogArray]) -> None:
        """Read the events behind ``refs`` concurrently (one request each), ahead of get_array."""
        seqs = {r.seq for r in refs if r.seq not in self._events}  # not `- keys()`: a walk of the cache
        await asyncio.gather(*(self.event(s) for s in sorted(seqs)))

    async def get_array(self, ref: ev.LogArray, *, of_event: str | None = None) -> np.ndarray:
        """The array ``ref`` names; ``of_event``: the event id it must lie in (a rollout's
        arrays are its own generation's, never another tenant's)."""
        return self.array_in(await self.event(ref.seq), ref, of_event=of_event)

    def cached_array(self, ref: ev.LogArray, *, of_event: str | None = None) -> np.ndarray | None:
        """:meth:`get_array` without a wait: None while the event is not read (or no longer kept)."""
        event = self._events.get(ref.seq)
        return None if event is None else self.array_in(event, ref, of_event=of_event)

    def array_in(self, event: ev.Event, ref: ev.LogArray, *, of_event: str | None = None) -> np.ndarray:
        """The array ``ref`` names in ``event``, the event at ``ref.seq``."""
        if of_event is not None and event.event_id != of_event:
            raise PayloadIntegrityError(
                f"{self.stream} sequence {ref.seq} is event {event.event_id}, not the expected {of_event}"
            )
        found = _at_path(event.body, ref.field)
        if isinstance(found, ev.InlineArray) and found.dtype == ref.dtype and found.shape == ref.shape:
            return array_from_bytes(found.dtype, found.shape, found.data)
        what = f"{self.stream} sequence {ref.seq} ({event.type})"
        if (
            isinstance(found, list)
            and _is_token_list(found)
            and ref.dtype in _TOKEN_LIST_DTYPES
            and ref.shape == (len(found),)
        ):
            try:
                return np.asarray(found, dtype=ref.dtype)
            except OverflowError:
                raise PayloadIntegrityError(f"{what}: {ref.field!r} does not fit {ref.dtype}") from None
        raise PayloadIntegrityError(f"{what} has no {ref.dtype}{list(ref.shape)} array at {ref.field!r}")


# A list of token ids in a body (a task's prompt) is read as an array of one of these.
_TOKEN_LIST_DTYPES = frozenset({"int32", "int64"})


def _is_token_list(value: list[object]) -> bool:
    return all(type(x) is int for x in value)


def _at_path(body: object, path: str) -> object:
    """What a LogArray's dotted ``path`` names in a body: attribute names, and list indexes
    where the value is a list (``samples.3.logprobs``); None where nothing is."""
    value: object = body
    for name, index in _path_parts(path):
        if isinstance(value, list):
            if index is None or index >= len(value):
                return None
            value = value[index]
        elif name is not None and isinstance(value, msgspec.Struct):
            value = getattr(value, name, None)
        else:
            return None
    return value


@functools.lru_cache(maxsize=4096)
def _path_parts(path: str) -> tuple[tuple[str | None, int | None], ...]:
    """A dotted path's parts, each as an attribute name (None for a private one, which is
    never read) and as a list index (None: not a number); parsed once per path (a step reads
    ~1,000 arrays through a few dozen paths)."""
    return tuple(
        (None if part.startswith("_") else part, int(part) if part.isdigit() else None)
        for part in path.split(".")
    )


def log_array(seq: int, field: str, arr: ev.ArrayRef) -> ev.ArrayRef:
    """A reference to ``arr``, at ``field`` (a dotted path) of the event at ``seq``, if it lies
    there inline; other references are returned as they are (they point at their own bytes
    already)."""
    if isinstance(arr, ev.InlineArray):
        return ev.LogArray(seq=seq, field=field, dtype=arr.dtype, shape=arr.shape)
    return arr


async def open_store(kind: str, site: StoreSite) -> PayloadStore | None:
    """The payload store ``kind`` names in the registry, opened at ``site`` (None: not used here)."""
    opener: StoreKind = PAYLOAD_STORES.load(kind)
    store = await opener.open(site)
    if store is not None and store.kind != kind:
        raise PayloadError(f"payload store {kind!r} opened a store of kind {store.kind!r}")
    return store


def token_list_ref(seq: int, field: str, tokens: list[int]) -> ev.LogArray:
    """A reference to the list of token ids at ``field`` of the event at ``seq`` (a task's
    prompt), read as int32."""
    return ev.LogArray(seq=seq, field=field, dtype="int32", shape=(len(tokens),))


# --------------------------------------------------------------------------- codec


class WeightsAnnounced(Protocol):
    """What reading a policy version's weights needs of its announcement (a WeightsReady, or
    the read model's fact of one)."""

    @property
    def location(self) -> ev.PayloadRef: ...

    @property
    def blake3(self) -> str | None: ...


class Payloads:
    """Encode arrays into event fields and back, choosing inline vs. store by size.

    Several stores may be registered (by kind) so that a reader can follow references written
    by any of them; ``default`` receives new writes."""

    def __init__(
        self,
        default: PayloadStore,
        *others: PayloadStore,
        inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
        log: LogArrays | None = None,
    ) -> None:
        self.default = default
        self.stores: dict[str, PayloadStore] = {s.kind: s for s in (default, *others)}
        self.inline_threshold = inline_threshold
        self.log = log  # to follow LogArray references

    @classmethod
    async def for_run(
        cls,
        js: nats.js.JetStreamContext,
        run_id: str,
        *,
        weights_dir: str | Path | None = None,
        bus: BusSettings | None = None,
    ) -> Payloads:
        """A run's arrays: its object store (where new ones go), the log, and every other store
        a reader may meet a reference of, each opened as it says it is used here
        (:class:`StoreKind`): the registry's built-ins and whatever ``bus`` (the run's ``[bus]``)
        writes to. ``weights_dir``: the run's shared directory, where this process has one."""
        site = StoreSite(js, run_id, bus or BusSettings(), None if weights_dir is None else Path(weights_dir))
        objstore = await ObjectStorePayloads.open(site)
        others: list[PayloadStore] = []
        for kind in [*PAYLOAD_STORES.builtins, *sorted(site.uses - PAYLOAD_STORES.builtins.keys())]:
            if kind == objstore.kind:
                continue
            store = await open_store(kind, site)
            if store is not None:
                others.append(store)
        return cls(objstore, *others, log=LogArrays(js, run_id))

    def fits_inline(self, inline: ev.InlineArray, *, inline_threshold: int | None = None) -> bool:
        """Whether an array serialised by :func:`inline_array` is small enough to ride in its
        event (``inline_threshold``, default the store's)."""
        return len(inline.data) <= (self.inline_threshold if inline_threshold is None else inline_threshold)

    async def put_inline(self, name: str, inline: ev.InlineArray, *, store: str | None = None) -> ev.ArrayRef:
        """An array already serialised by :func:`inline_array`, in the store (``store``: the
        kind, default the default) with a reference: its bytes are not made again."""
        ref = await self.store(store).put(name, inline.data)
        return msgspec.structs.replace(ref, dtype=inline.dtype, shape=inline.shape)

    async def put_array(
        self, name: str, arr: np.ndarray, *, inline_threshold: int | None = None, store: str | None = None
    ) -> ev.ArrayRef:
        """``arr`` inline when it is small (:meth:`fits_inline`), else in the store with a
        reference (:meth:`put_inline`)."""
        inline = inline_array(arr)
        if self.fits_inline(inline, inline_threshold=inline_threshold):
            return inline
        return await self.put_inline(name, inline, store=store)

    def store(self, kind: str | None = None) -> PayloadStore:
        """The store of ``kind`` (None: the default, where new writes go)."""
        if kind is None:
            return self.default
        store = self.stores.get(kind)
        if store is None:
            raise PayloadError(f"no payload store of kind {kind!r} is configured here")
        return store

    async def get_bytes(self, ref: ev.PayloadRef) -> bytes:
        data = await self.store(ref.store).get_bytes(ref)
        if len(data) != ref.size:
            raise PayloadIntegrityError(
                f"payload {ref.bucket}/{ref.name}: expected {ref.size} bytes, read {len(data)}"
            )
        digest = sha256(data)
        if digest != ref.sha256:
            raise PayloadIntegrityError(
                f"payload {ref.bucket}/{ref.name}: SHA-256 {digest} does not match the reference {ref.sha256}"
            )
        return data

    async def get_weights(
        self, ready: WeightsAnnounced, *, into: Callable[[int], memoryview] | None = None
    ) -> memoryview:
        """The bytes of ``ready``'s weights, checked once: read straight into ``into(size)`` (the
        buffer the caller loads from; by default a new one) and checked against ``ready.blake3``
        as they land, unless the store checked them itself as it read (the object store, whose
        reader hashes every chunk: against ``location.sha256``). An announcement without
        ``blake3`` (schema 1) is checked by ``location.sha256``. Bytes that fail their check
        raise :class:`PayloadIntegrityError`, a truncated object too."""
        ref = ready.location
        if ready.blake3 is None:
            data = await self.get_bytes(ref)
            if into is None:
                return memoryview(data)
            out = into(ref.size)
            out[:] = data
            return out
        store = self.store(ref.store)
        out = np.empty(ref.size, dtype=np.uint8).data if into is None else into(ref.size)
        if out.nbytes != ref.size:
            raise PayloadError(
                f"payload {ref.bucket}/{ref.name}: a buffer of {out.nbytes} bytes for {ref.size}"
            )
        check = WeightsDigest(out)
        if not await store.read_into(ref, out, check.progress):
            check.verify(ready.blake3, f"{ref.bucket}/{ref.name}")
        return out

    async def prefetch(self, refs: list[ev.ArrayRef | None]) -> None:
        """Read ahead, concurrently, what ``refs`` need from the log (a step's rollouts, say)."""
        in_log = [r for r in refs if isinstance(r, ev.LogArray)]
        if in_log:
            await self._log().prefetch(in_log)

    async def event(self, seq: int) -> ev.Event:
        """The event at ``seq`` of the run's log."""
        return await self._log().event(seq)

    def _log(self) -> LogArrays:
        if self.log is None:
            raise PayloadError("this reader cannot follow references into the log (no LogArrays)")
        return self.log

    async def get_arrays(self, refs: Sequence[tuple[ev.ArrayRef, str | None]]) -> list[np.ndarray]:
        """The arrays ``refs`` name, each with the event id it must lie in (or None), as
        :meth:`get_array` reads them: the log's events behind them read together first."""
        await self.prefetch([ref for ref, _ in refs])
        log, out = self.log, []
        for ref, of_event in refs:
            # Read in place where nothing is left to wait for (a step reads ~1,000 arrays).
            got = (
                log.cached_array(ref, of_event=of_event)
                if isinstance(ref, ev.LogArray) and log is not None
                else None
            )
            out.append(got if got is not None else await self.get_array(ref, of_event=of_event))
        return out

    async def get_array(self, ref: ev.ArrayRef, *, of_event: str | None = None) -> np.ndarray:
        """The array ``ref`` names, checked (``of_event``: see :meth:`LogArrays.get_array`)."""
        if isinstance(ref, ev.InlineArray):
            return array_from_bytes(ref.dtype, ref.shape, ref.data)
        if isinstance(ref, ev.LogArray):
            return await self._log().get_array(ref, of_event=of_event)
        if ref.dtype is None or ref.shape is None:
            raise PayloadError(f"payload {ref.bucket}/{ref.name} is a blob, not an array")
        return array_from_bytes(ref.dtype, ref.shape, await self.get_bytes(ref))
