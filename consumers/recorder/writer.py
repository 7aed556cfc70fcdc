"""Where the recorder's transactions run.

A batch is applied by :func:`jetrl.store.projection.apply_batch` in one transaction (read the
tracking row, fold, upsert, move the tracking row, commit) wherever it runs; a writer only
chooses where, and the recorder acks a batch once its writer says it is committed.

* ``inline``: on the event loop's thread;
* ``thread``: on one thread of this process (the event loop reads the next batch while a
  statement waits on the server or in SQLite's C code);
* ``process``: in a child process of its own (:class:`ProcessWriter`): the event loop only
  fetches, admits and acks, while the child decodes the same message bytes again, folds and
  writes under its own interpreter lock, so the two halves run on two cores. A batch of large
  events (inline arrays) is folded before it is sent instead, as rows without those bytes. The
  recorder's own process uses it.

On PostgreSQL a writer commits asynchronously (``synchronous_commit = off`` for its own
transactions): the commit returns before the WAL is flushed, which otherwise was ~20 ms of every
batch. A server crash can then lose the last commits, rows and tracking row together; the
writer passes the last sequence it committed to ``apply_batch``, which refuses a tracking row
below it (:class:`~jetrl.store.projection.TrackingRowBehind`), so the recorder stops and its
restart reads those events again from the log (the store, not the server's ack floor, is the
position). SQLite's ``synchronous=NORMAL`` makes the same trade for an OS crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.connection
import signal
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import sqlalchemy as sa

from jetrl.bus import events as ev
from jetrl.bus.consumer import Delivery
from jetrl.bus.log import get_logger
from jetrl.store.db import Store, open_store_for_writing
from jetrl.store.projection import (
    ApplyResult,
    Logged,
    LogItem,
    PreparedBatch,
    apply_batch,
    prepare_batch,
    read_offset,
    write_batch,
)

__all__ = ["BatchWriter", "LocalWriter", "ProcessWriter", "Target", "WriterKind", "make_writer"]

log = get_logger(__name__)

WriterKind = Literal["inline", "thread", "process"]


@dataclass(frozen=True)
class Target:
    """What a writer records into: the run, its stream and the tracking row's consumer."""

    run_id: str
    stream: str
    consumer: str


class BatchWriter(Protocol):
    async def start(self) -> None:
        """Be ready to write (a writer process started, its store open)."""

    async def read_offset(self) -> int:
        """The tracking row's last sequence."""

    async def apply(self, items: Sequence[Logged], through_seq: int, committed_seq: int) -> ApplyResult:
        """Apply ``items``, move the tracking row to at least ``through_seq``, and commit;
        ``committed_seq`` is the last sequence this recorder committed before. Every sequence
        after the tracking row up to ``through_seq`` is taken as recorded: the caller hands over
        a batch without a gap (the recorder checks it before each commit)."""

    def close(self) -> None: ...


@contextlib.contextmanager
def _transaction(store: Store) -> Iterator[sa.Connection]:
    with store.write() as conn:
        if store.backend == "postgresql":
            conn.exec_driver_sql("SET LOCAL synchronous_commit = off")  # see the module's docstring
        yield conn


def _apply(
    store: Store, t: Target, items: Sequence[Logged], through_seq: int, committed_seq: int
) -> ApplyResult:
    with _transaction(store) as conn:
        return apply_batch(
            conn,
            run_id=t.run_id,
            stream=t.stream,
            consumer=t.consumer,
            items=items,
            through_seq=through_seq,
            committed_seq=committed_seq,
        )


def _read_offset(store: Store, t: Target) -> int:
    with store.read() as conn:
        return read_offset(conn, t.stream, t.consumer)


class LocalWriter:
    """Writes with the recorder's own store, inline or on one thread of this process."""

    def __init__(self, store: Store, target: Target, *, thread: bool) -> None:
        self.store = store
        self.target = target
        self._thread = thread
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"recorder-{target.run_id}")
        # The store's one writer: SQLite's WAL checkpoints go to a thread, off its commits.
        store.checkpoint_in_background()

    async def start(self) -> None:
        return None

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if not self._thread:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def read_offset(self) -> int:
        offset: int = await self._run(_read_offset, self.store, self.target)
        return offset

    async def apply(self, items: Sequence[Logged], through_seq: int, committed_seq: int) -> ApplyResult:
        res: ApplyResult = await self._run(_apply, self.store, self.target, items, through_seq, committed_seq)
        return res

    def close(self) -> None:
        self._pool.shutdown(wait=True)


# ----------------------------------------------------------------------------- the child

Wire = tuple[int, str, bytes]  # stream sequence, subject, the message's bytes


def _child_apply(
    store: Store, t: Target, wire: list[Wire], through_seq: int, committed_seq: int
) -> ApplyResult:
    # The parent admitted these messages (decoded them, checked run and tenant) before sending
    # them; decoding the same bytes here gives the same events.
    items = [LogItem(seq, subject, ev.decode_event(data)) for seq, subject, data in wire]
    return _apply(store, t, items, through_seq, committed_seq)


def _child_write(store: Store, t: Target, batch: PreparedBatch, committed_seq: int) -> ApplyResult:
    with _transaction(store) as conn:
        return write_batch(
            conn, batch, run_id=t.run_id, stream=t.stream, consumer=t.consumer, committed_seq=committed_seq
        )


_CHILD_OPS: dict[str, Callable[..., Any]] = {
    "apply": _child_apply,
    "write": _child_write,
    "read_offset": _read_offset,
}


def _child_main(conn: multiprocessing.connection.Connection, url: str) -> None:
    """The writer process: open the store, then serve one request at a time until the parent
    says stop or goes away."""
    # Ctrl-C reaches the whole process group: the parent decides when to stop, after a commit.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from jetrl.consumers.recorder.recorder import configure_gc  # that module imports this one

    try:
        store = open_store_for_writing(url)
        store.checkpoint_in_background()  # the store's one writer, as with LocalWriter
    except Exception as exc:
        conn.send(("error", exc))
        return
    configure_gc()
    conn.send(("ok", None))
    try:
        while True:
            try:
                request = conn.recv()
            except EOFError:  # the parent is gone; a transaction in hand was finished first
                return
            if request is None:
                return
            op, args = request
            try:
                reply: tuple[str, Any] = ("ok", _CHILD_OPS[op](store, *args))
            except Exception as exc:
                reply = ("error", exc)
            try:
                conn.send(reply)
            except OSError:
                return
    finally:
        store.close()


def _wire(item: Logged) -> Wire:
    if isinstance(item, Delivery):
        return item.seq, item.subject, bytes(item.msg.data)
    return item.seq, item.subject, ev.encode_event(item.event)


class WriterProcessError(RuntimeError):
    pass


class ProcessWriter:
    """Writes from a child process that opens the store at the same URL. The child is spawned
    (never forked: this process has threads and an event loop) and serves one request at a
    time over a pipe. If it dies, the next call raises and the recorder stops, to resume from
    the store's tracking row like after any crash; a child whose parent was killed finishes the
    transaction in hand and exits (a commit without an ack only means those events are skipped
    by sequence when they are read again)."""

    def __init__(self, store: Store, target: Target, *, fold_above_bytes: int = 16 * 1024) -> None:
        url = store.engine.url
        if url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:"):
            raise ValueError("a writer process needs a store it can open by URL, not an in-memory SQLite")
        self.target = target
        # Batches averaging more bytes per event than this are folded here and sent as rows.
        self.fold_above_bytes = fold_above_bytes
        self._url = url.render_as_string(hide_password=False)
        self._conn: multiprocessing.connection.Connection | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None
        # Sends and receives block: one thread does them, in order, off the event loop.
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"recorder-pipe-{target.run_id}")

    @property
    def pid(self) -> int | None:
        """The writer process's id, once started."""
        return self._proc.pid if self._proc is not None else None

    def _spawn(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_child_main,
            args=(child, self._url),
            name=f"recorder-writer-{self.target.run_id}",
            daemon=True,
        )
        proc.start()
        child.close()
        self._conn, self._proc = parent, proc
        self._receive()  # the store is open

    def _receive(self) -> Any:
        assert self._conn is not None and self._proc is not None
        try:
            kind, value = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(timeout=5)
            raise WriterProcessError(f"the writer process exited (code {self._proc.exitcode})") from None
        if kind == "error":
            raise value
        return value

    def _call(self, op: str, *args: Any) -> Any:
        if self._conn is None:
            self._spawn()
        assert self._conn is not None
        try:
            self._conn.send((op, args))
        except OSError:
            raise WriterProcessError("the writer process is gone") from None
        return self._receive()

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def start(self) -> None:
        if self._conn is None:
            await self._run(self._spawn)

    async def read_offset(self) -> int:
        offset: int = await self._run(self._call, "read_offset", self.target)
        return offset

    async def apply(self, items: Sequence[Logged], through_seq: int, committed_seq: int) -> ApplyResult:
        wire = [_wire(i) for i in items]
        res: ApplyResult
        if sum(len(w[2]) for w in wire) <= self.fold_above_bytes * max(1, len(wire)):
            res = await self._run(self._call, "apply", self.target, wire, through_seq, committed_seq)
            return res
        # Large events (inline arrays): their bytes cost more to copy through the pipe than
        # folding them here, and the rows hold none of those bytes.
        batch = prepare_batch(items, after_seq=committed_seq, through_seq=through_seq)
        res = await self._run(self._call, "write", self.target, batch, committed_seq)
        return res

    def close(self) -> None:
        self._io.shutdown(wait=True)
        conn, proc, self._conn, self._proc = self._conn, self._proc, None, None
        if conn is None or proc is None:
            return
        with contextlib.suppress(OSError):
            conn.send(None)
        conn.close()
        proc.join(timeout=30)
        if proc.is_alive():
            log.warning("writer_process_kill", pid=proc.pid)
            proc.kill()
            proc.join()


def make_writer(kind: WriterKind, store: Store, target: Target) -> BatchWriter:
    if kind == "process":
        return ProcessWriter(store, target)
    return LocalWriter(store, target, thread=kind == "thread")
