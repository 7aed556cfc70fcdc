"""The claim-check: arrays and blobs that are too big to ride in an event.

An array is raw little-endian bytes plus dtype and shape. Below ``inline_threshold`` bytes it
travels inside the event (:class:`~jetrl.bus.events.InlineArray`); above, it goes to a payload
store and the event carries a :class:`~jetrl.bus.events.PayloadRef` (store, bucket, name,
size, SHA-256). Reading a reference always verifies the hash and raises
:class:`PayloadIntegrityError` on mismatch.

Stores implement :class:`PayloadStore`; the event format does not change with the store. Built
in: the run's JetStream Object Store bucket (default) and a shared filesystem directory; and
``mooncake`` (bus/mooncake.py): bytes held by their writer, pulled by readers over Mooncake's
transfer engine, for weights and routing traces when ``[bus]`` says so. A third kind of reference,
:class:`~jetrl.bus.events.LogArray`, names an inline array already in the run's log (a scored
rollout's arrays are its generation's); :class:`LogArrays` reads them by stream sequence.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import os
from pathlib import Path
from typing import Any, Protocol

import msgspec
import nats.js.errors
import numpy as np
from nats.js.object_store import ObjectStore

from jetrl.bus import events as ev
from jetrl.bus.log import get_logger
from jetrl.bus.retry import retrying
from jetrl.bus.settings import MooncakeSettings
from jetrl.bus.streams import payload_bucket, stored_message, stream_name

log = get_logger(__name__)

DEFAULT_INLINE_THRESHOLD = 16 * 1024
_ALLOWED_DTYPES = {"uint8", "uint16", "int32", "int64", "float16", "float32", "float64", "bfloat16"}


class PayloadError(RuntimeError):
    pass


class PayloadIntegrityError(PayloadError):
    """The bytes read do not match the reference's size or SHA-256."""


class PayloadMissing(PayloadError):
    pass


# --------------------------------------------------------------------------- arrays


def array_bytes(arr: np.ndarray) -> tuple[str, tuple[int, ...], bytes]:
    dtype = arr.dtype.name
    if dtype not in _ALLOWED_DTYPES:
        raise PayloadError(f"dtype {dtype} cannot be carried (allowed: {sorted(_ALLOWED_DTYPES)})")
    le = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
    return dtype, tuple(int(s) for s in arr.shape), np.ascontiguousarray(le).tobytes()


def inline_array(arr: np.ndarray) -> ev.InlineArray:
    """``arr`` carried in the event itself."""
    dtype, shape, data = array_bytes(arr)
    return ev.InlineArray(dtype=dtype, shape=shape, data=data)


def array_from_bytes(dtype: str, shape: tuple[int, ...], data: bytes | memoryview) -> np.ndarray:
    if dtype not in _ALLOWED_DTYPES:
        raise PayloadError(f"unknown array dtype {dtype!r}")
    if dtype == "bfloat16":
        raise PayloadError("bfloat16 arrays are read with torch (policy/), not numpy")
    dt = np.dtype(dtype).newbyteorder("<")
    expected = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if len(data) != expected:
        raise PayloadIntegrityError(f"array of {dtype}{list(shape)} needs {expected} bytes, got {len(data)}")
    return np.frombuffer(data, dtype=dt).reshape(shape)


def sha256(data: Buffer) -> str:
    return hashlib.sha256(data).hexdigest()


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
    """Chunks written in place into a buffer of the size expected (more is an error)."""

    def __init__(self, size: int) -> None:
        self._buf = bytearray(size)
        self._pos = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = len(b)
        if self._pos + n > len(self._buf):
            raise PayloadIntegrityError(f"more than the {len(self._buf)} bytes expected")
        self._buf[self._pos : self._pos + n] = b
        self._pos += n
        return n

    def value(self) -> bytes:
        """What was written (shorter than expected if the object is; the reader checks)."""
        view = memoryview(self._buf)[: self._pos]
        return bytes(view)


class PayloadStore(Protocol):
    kind: str  # the name a reference carries (PayloadRef.store): which store reads it back
    # Whether the bytes live in their writer's memory (bus/mooncake.py), gone when it dies: a
    # restarted writer must put them again, and what outlives it goes to another store.
    held_by_writer: bool

    async def put(self, name: str, data: Buffer) -> ev.PayloadRef: ...

    async def get_bytes(self, ref: ev.PayloadRef) -> bytes: ...

    async def discard(self, name: str) -> None:
        """The writer no longer needs ``name`` (a policy version past its retention): the store
        may drop it. A name that is not there is no error."""
        ...


class ObjectStorePayloads:
    """The run's JetStream Object Store bucket (chunked, replicated with the run)."""

    kind = "objstore"
    held_by_writer = False

    def __init__(self, obj: ObjectStore, bucket: str) -> None:
        self.obj = obj
        self.bucket = bucket

    @classmethod
    async def for_run(cls, js: nats.js.JetStreamContext, run_id: str) -> ObjectStorePayloads:
        bucket = payload_bucket(run_id)
        try:
            obj = await js.object_store(bucket)
        except nats.js.errors.BucketNotFoundError:
            raise PayloadError(f"payload bucket {bucket} does not exist; call Bus.ensure_run first") from None
        return cls(obj, bucket)

    async def put(self, name: str, data: Buffer) -> ev.PayloadRef:
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
            await self.obj.get(ref.name, writeinto=into)
            return into

        try:
            # Retried through a leader election of the bucket's stream, as a put is (a reader
            # that gave up would crash its part, which restarts into the same election).
            into = await retrying(f"get {ref.bucket}/{ref.name}", read)
        except nats.js.errors.ObjectNotFoundError:
            raise PayloadMissing(f"payload {ref.bucket}/{ref.name} not found") from None
        except nats.js.errors.DigestMismatchError as exc:
            raise PayloadIntegrityError(
                f"payload {ref.bucket}/{ref.name} corrupted in the store: {exc}"
            ) from None
        return into.value()

    async def discard(self, name: str) -> None:
        gone = (
            nats.js.errors.NotFoundError,
            nats.js.errors.ObjectNotFoundError,
            nats.js.errors.ObjectDeletedError,
        )
        with contextlib.suppress(*gone):
            await self.obj.delete(name)


class FilePayloads:
    """A directory on a shared filesystem; writes are atomic (temp file + rename)."""

    kind = "file"
    held_by_writer = False

    def __init__(self, root: str | Path, bucket: str) -> None:
        self.root = Path(root)
        self.bucket = bucket

    def _path(self, name: str) -> Path:
        if "/" in name or name.startswith(".") or "\\" in name:
            raise PayloadError(f"payload name {name!r} must be a plain file name")
        return self.root / self.bucket / name

    async def put(self, name: str, data: Buffer) -> ev.PayloadRef:
        path = self._path(name)
        await asyncio.to_thread(_atomic_write, path, data)
        return _ref(self, name, data, sha256(data))

    async def get_bytes(self, ref: ev.PayloadRef) -> bytes:
        path = self._path(ref.name)
        try:
            return await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            raise PayloadMissing(f"payload {path} not found") from None

    async def discard(self, name: str) -> None:
        await asyncio.to_thread(self._path(name).unlink, missing_ok=True)


class NoPayloadStore:
    """Where a reader has no payload store it may use (a tenant's producer: the run's store is
    jetrl's): every array travels inline, and a reference it meets is refused clearly."""

    kind = "none"
    held_by_writer = False

    async def put(self, name: str, data: Buffer) -> ev.PayloadRef:
        raise PayloadError(
            f"{name}: {len(data)} bytes is past what an event carries here, and there is no payload store"
        )

    async def get_bytes(self, ref: ev.PayloadRef) -> bytes:
        raise PayloadError(
            f"payload {ref.bucket}/{ref.name} is in the run's payload store, which this identity cannot read"
        )

    async def discard(self, name: str) -> None:
        return None  # it holds nothing


def _ref(store: ObjectStorePayloads | FilePayloads, name: str, data: Buffer, digest: str) -> ev.PayloadRef:
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    return ev.PayloadRef(store=store.kind, bucket=store.bucket, name=name, size=size, sha256=digest)


def _atomic_write(path: Path, data: Buffer) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


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
            try:
                msg = await stored_message(self.js, self.stream, seq)
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
        seqs = {r.seq for r in refs} - self._events.keys()
        await asyncio.gather(*(self.event(s) for s in sorted(seqs)))

    async def get_array(self, ref: ev.LogArray, *, of_event: str | None = None) -> np.ndarray:
        """The array ``ref`` names; ``of_event``: the event id it must lie in (a rollout's
        arrays are its own generation's, never another tenant's)."""
        event = await self.event(ref.seq)
        if of_event is not None and event.event_id != of_event:
            raise PayloadIntegrityError(
                f"{self.stream} sequence {ref.seq} is event {event.event_id}, not the expected {of_event}"
            )
        found = getattr(event.body, ref.field, None)
        if not isinstance(found, ev.InlineArray) or (found.dtype, found.shape) != (ref.dtype, ref.shape):
            raise PayloadIntegrityError(
                f"{self.stream} sequence {ref.seq} ({event.type}) has no {ref.dtype}{list(ref.shape)} "
                f"array in {ref.field!r}"
            )
        return array_from_bytes(found.dtype, found.shape, found.data)


def log_array(seq: int, field: str, arr: ev.ArrayRef) -> ev.ArrayRef:
    """A reference to ``arr``, field ``field`` of the event at ``seq``, if it lies there inline;
    other references are returned as they are (they point at their own bytes already)."""
    if isinstance(arr, ev.InlineArray):
        return ev.LogArray(seq=seq, field=field, dtype=arr.dtype, shape=arr.shape)
    return arr


def weight_stores(directory: str | Path | None, bucket: str) -> list[PayloadStore]:
    """The extra store a process needs to read weights written to a shared directory."""
    return [FilePayloads(directory, bucket)] if directory else []


# --------------------------------------------------------------------------- codec


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
        mooncake: MooncakeSettings | None = None,
    ) -> Payloads:
        """A run's arrays: its object store (where new ones go), the log, the shared weights
        directory when weights travel as files, and this process's Mooncake engine when weights
        or traces travel that way."""
        from jetrl.bus.mooncake import MooncakePayloads

        objstore = await ObjectStorePayloads.for_run(js, run_id)
        others = weight_stores(weights_dir, objstore.bucket)
        if mooncake is not None:
            others.append(MooncakePayloads(mooncake, bucket=objstore.bucket))
        return cls(objstore, *others, log=LogArrays(js, run_id))

    async def put_array(
        self, name: str, arr: np.ndarray, *, inline_threshold: int | None = None, store: str | None = None
    ) -> ev.ArrayRef:
        """``arr`` inline when it is small (``inline_threshold``, default the store's), else in
        the store (``store``: the kind, default the default) with a reference."""
        inline = inline_array(arr)
        if len(inline.data) <= (self.inline_threshold if inline_threshold is None else inline_threshold):
            return inline
        ref = await self.store(store).put(name, inline.data)
        return msgspec.structs.replace(ref, dtype=inline.dtype, shape=inline.shape)

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

    async def get_array(self, ref: ev.ArrayRef, *, of_event: str | None = None) -> np.ndarray:
        """The array ``ref`` names, checked (``of_event``: see :meth:`LogArrays.get_array`)."""
        if isinstance(ref, ev.InlineArray):
            return array_from_bytes(ref.dtype, ref.shape, ref.data)
        if isinstance(ref, ev.LogArray):
            return await self._log().get_array(ref, of_event=of_event)
        if ref.dtype is None or ref.shape is None:
            raise PayloadError(f"payload {ref.bucket}/{ref.name} is a blob, not an array")
        return array_from_bytes(ref.dtype, ref.shape, await self.get_bytes(ref))
