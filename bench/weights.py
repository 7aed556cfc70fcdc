"""Weight sync: from the trainer's publish to every worker holding the new weights.

The bench process plays the trainer: it exports weights (random float32 tensors of the size
asked) as the trainer does, in one pass that serialises them into the buffer the store sends
from and takes their checksum and transfer digest on the way (policy/weights.py,
``export_weights``, the checksum in a thread beside the copy from 8 MB; timed apart, as
``export``: it is the making of a version, done whatever the transport), then, timed, puts that
buffer into a payload store and hands the reference to N worker processes (a pipe line each,
standing in for the WeightsReady event). Each worker reads the bytes as a run's workers do
(:meth:`~jetrl.bus.payloads.Payloads.get_weights`: straight into its buffer, checked once as
they land, against the transfer digest, or by the store's own reader where it hashes anyway)
and holds the tensors, views of that buffer with the announced checksum; then it says so. A
round's latency is from just before the put to the last worker's answer. Stores:
  * ``objstore``: the run's JetStream Object Store bucket, on a private nats-server;
  * ``file``: a directory the processes share (an atomic write, then a read each; no fsync:
    the trainer flushes only version 0 to disk, every later version being rebuilt from the log
    should the machine crash; each round's file discarded after it, as the trainer discards a
    version past its retention, so the next round writes over its pages);
  * ``mooncake``: held by the trainer, pulled by each worker over Mooncake's transfer engine
    (TCP on loopback here; bus/mooncake.py).
Measured in the same run, the floors the stores are compared with:
  * ``memcpy``: one plain memory copy of the same bytes (into a buffer already touched);
  * ``loopback``: the same bytes sent by the trainer over a TCP loopback socket to every
    worker at once, received into memory (no check, no store); ``+blake3`` beside it, for
    scale only, is the same with each worker hashing what lands with BLAKE3 as it lands: the
    least a checked transfer costs here (the target stays against the bare floor);
and, for scale, one pass of each hash over the bytes: ``sha256`` (the weights checksum's, the
object store's) and ``blake3`` (the transfer digest a worker checks).
Each (size, store) is one warm-up round then ``--repeats`` rounds, each store round just after
a loopback round of its own; medians are reported, a store's ratio being the median of its
rounds' ratios to the loopback round beside each (this machine is shared: its load changes
within the minute a size takes, and a floor measured once, a minute before a store, compared
it with another machine); the loopback floor's line is its first measurement, and a last line
the median of the loopback rounds run beside the stores'. A round past ``--timeout`` is "too
slow to measure", never a crash.

    python bench/weights.py [--sizes 50,500] [--workers 2] [--repeats 3] [--timeout 180]

Sizes are in MB (10^6 bytes). ``--load N`` runs it all beside N busy CPU processes;
``BENCH_VERBOSE=1`` prints every round.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import msgspec
import numpy as np
import torch
from blake3 import blake3
from load import cpu_load

from jetrl.bus import events as ev
from jetrl.bus.client import Bus
from jetrl.bus.log import configure
from jetrl.bus.mooncake import MooncakePayloads
from jetrl.bus.payloads import (
    Buffer,
    FilePayloads,
    ObjectStorePayloads,
    Payloads,
    PayloadStore,
    ReceiveBuffer,
)
from jetrl.bus.server import EmbeddedServer
from jetrl.bus.settings import MooncakeSettings
from jetrl.bus.streams import GiB, StreamLimits, payload_bucket
from jetrl.policy.weights import ExportedWeights, export_weights, verified_tensors

MB = 1_000_000
RUN_ID = "benchweights"
STORES = ("objstore", "file", "mooncake")
TARGET = 2.0  # the best store within this many times the loopback floor
LIMITS = StreamLimits(max_bytes=GiB // 4, payload_max_bytes=4 * GiB)


# --------------------------------------------------------------------------- figures


def median(xs: Sequence[float]) -> float | None:
    """The median of the rounds measured; None when none was."""
    return statistics.median(xs) if xs else None


def ratio(t: float | None, floor: float | None) -> float | None:
    """``t`` over the floor; None when either is missing or the floor is not positive."""
    if t is None or floor is None or floor <= 0:
        return None
    return t / floor


def best_store(medians: dict[str, float | None]) -> tuple[str, float] | None:
    """The fastest store measured (its median), or None when none was."""
    measured = [(t, name) for name, t in medians.items() if t is not None]
    if not measured:
        return None
    t, name = min(measured)
    return name, t


def size_label(nbytes: int) -> str:
    return f"{nbytes / MB:g} MB"


def figure_line(
    label: str, name: str, t: float | None, nbytes: int, floor: float | None, paired: float | None = None
) -> str:
    """One figure; ``paired``: its ratio to the loopback rounds run beside its own (a store's),
    instead of to the floor measured before."""
    if t is None:
        return f"  {label:>8}  {name:<9} not measured"
    rate = f"{nbytes / t / 1e9:7.2f} GB/s" if t > 0 else "      - GB/s"
    r = paired if paired is not None else ratio(t, floor)
    rel = f"{r:6.2f}x loopback" if r is not None else "  (no loopback floor)"
    return f"  {label:>8}  {name:<9} {t * 1e3:9.1f} ms  {rate}  {rel}"


def summary_line(
    label: str,
    medians: dict[str, float | None],
    floor: float | None,
    paired: dict[str, float | None] | None = None,
) -> str:
    """The headline figure of one size: the best store against the loopback floor (``paired``:
    each store's median ratio to the loopback round run just before each of its rounds; the
    best store is then the one of lowest ratio)."""
    best = best_store(medians)
    if best is None:
        return f"weights best store {label}: too slow to measure (no store finished a round)"
    name, t = best
    r = ratio(t, floor)
    if paired is not None:
        by_ratio = best_store(paired)
        if by_ratio is not None:
            name, r = by_ratio
    if r is None:
        return f"weights best store {label}: {name} {t * 1e3:.1f} ms (loopback floor too slow to measure)"
    verdict = "met" if r <= TARGET else "missed"
    return f"weights best store {label}: {name} {r:.1f}x loopback (target <= {TARGET:g}x, {verdict})"


# --------------------------------------------------------------------------- workers


async def worker_main(nats_url: str, root: str) -> None:
    """One worker: a line in (a reference to read, or a socket to receive from), a line out."""
    configure(level="warning")
    bus = await Bus.connect(nats_url, name="bench-worker")
    objstore = await ObjectStorePayloads.for_run(bus.js, RUN_ID)
    pay = Payloads(
        objstore, FilePayloads(root, objstore.bucket), MooncakePayloads(MooncakeSettings(timeout_s=600))
    )
    received = ReceiveBuffer()  # the same memory round after round, as a worker's
    print(json.dumps({"ready": True}), flush=True)
    while line := await asyncio.to_thread(sys.stdin.readline):
        msg = json.loads(line)
        out: dict[str, float | str]
        try:
            if msg["op"] == "ref":
                ready = msgspec.json.decode(msg["ready"], type=ev.WeightsReady)
                data = await pay.get_weights(ready, into=received)  # as the embedded engine does
                tensors = verified_tensors(data, ready.weights_checksum)  # views: held, ready to load
                out = {"t": time.monotonic(), "n": data.nbytes}
                del data, tensors
            else:
                t = await asyncio.to_thread(_receive, msg["port"], msg["size"], msg.get("check", False))
                out = {"t": t, "n": msg["size"]}
        except Exception as exc:  # reported to the bench, which says so
            out = {"err": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)
    await bus.close()


def _receive(port: int, size: int, check: bool = False) -> float:
    """The loopback floor's receiver (``check``: hashing what lands with BLAKE3 as it lands,
    as a worker checks weights; nothing is compared)."""
    buf = bytearray(size)
    view = memoryview(buf)
    h = blake3() if check else None
    with socket.create_connection(("127.0.0.1", port)) as s:
        got = 0
        while got < size:
            n = s.recv_into(view[got:], min(size - got, 4 << 20))
            if n == 0:
                raise ConnectionError(f"the sender closed after {got} of {size} bytes")
            if h is not None:
                h.update(view[got : got + n])
            got += n
    if h is not None:
        h.digest()
    return time.monotonic()


class TooSlow(Exception):
    pass


class Workers:
    """N worker processes, started once (as a run's are) and restarted after a round that
    timed out (their answers to it would come late)."""

    def __init__(self, n: int, nats_url: str, root: str) -> None:
        self.n, self.nats_url, self.root = n, nats_url, root
        self.procs: list[asyncio.subprocess.Process] = []

    async def start(self, timeout: float) -> None:
        self.procs = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                __file__,
                "--worker",
                self.nats_url,
                self.root,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            for _ in range(self.n)
        ]
        await self.answers(timeout)

    async def stop(self) -> None:
        for p in self.procs:
            if p.returncode is None:
                p.kill()
            await p.wait()
        self.procs = []

    async def tell(self, msg: dict[str, object]) -> None:
        line = (json.dumps(msg) + "\n").encode()
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(line)
            await p.stdin.drain()

    async def answers(self, timeout: float) -> list[dict[str, float]]:
        async def one(p: asyncio.subprocess.Process) -> dict[str, float]:
            assert p.stdout is not None
            line = await p.stdout.readline()
            if not line:
                raise RuntimeError(f"a worker exited ({await p.wait()})")
            out: dict[str, float] = json.loads(line)
            if "err" in out:
                raise RuntimeError(f"a worker failed: {out['err']}")
            return out

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(p) for p in self.procs)), timeout)
        except TimeoutError:
            raise TooSlow from None


# --------------------------------------------------------------------------- rounds


async def store_round(
    workers: Workers, store: PayloadStore, name: str, weights: ExportedWeights, timeout: float
) -> float:
    t0 = time.monotonic()
    # As the trainer puts every version after 0: the transfer digest is the readers' check, no
    # SHA-256 pass here, and no flush to disk (consumers/trainer/trainer.py, announce_version).
    ref = await asyncio.wait_for(store.put(name, weights.data, sha256=False, durable=False), timeout)
    ready = ev.WeightsReady(version=1, location=ref, weights_checksum=weights.checksum, blake3=weights.blake3)
    await workers.tell({"op": "ref", "ready": msgspec.json.encode(ready).decode()})
    done = await workers.answers(timeout)
    assert all(int(d["n"]) == weights.data.nbytes for d in done)
    return max(d["t"] for d in done) - t0


async def loopback_round(workers: Workers, data: Buffer, timeout: float, check: bool = False) -> float:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        srv.settimeout(timeout)
        size = data.nbytes if isinstance(data, memoryview) else len(data)
        await workers.tell({"op": "sock", "port": srv.getsockname()[1], "size": size, "check": check})
        conns = [(await asyncio.to_thread(srv.accept))[0] for _ in range(workers.n)]
        t0 = time.monotonic()
        senders = [threading.Thread(target=c.sendall, args=(data,), daemon=True) for c in conns]
        for s in senders:
            s.start()
        try:
            done = await workers.answers(timeout)
        finally:
            for c in conns:
                c.close()
    return max(d["t"] for d in done) - t0


def memcpy_s(data: Buffer, repeats: int) -> float | None:
    src = np.frombuffer(data, dtype=np.uint8)
    dst = np.ones_like(src)  # touched: the floor is the copy, not page faults
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return median(times)


def hash_s(data: Buffer, repeats: int, kind: str) -> float | None:
    """One pass of ``kind`` (sha256, blake3) over the bytes."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        hashlib.sha256(data).digest() if kind == "sha256" else blake3(data).digest()
        times.append(time.perf_counter() - t0)
    return median(times)


def make_weights(nbytes: int) -> dict[str, torch.Tensor]:
    """Random float32 tensors of ``nbytes`` in all (16 MB each, the last what is left)."""
    g = torch.Generator().manual_seed(nbytes)
    per, left = 4_000_000, nbytes // 4
    out: dict[str, torch.Tensor] = {}
    while left > 0:
        out[f"layers.{len(out)}.weight"] = torch.randn(min(per, left), generator=g)
        left -= per
    return out


def export_s(tensors: dict[str, torch.Tensor], repeats: int) -> tuple[float | None, ExportedWeights]:
    """The trainer's export (serialise, checksum, transfer digest: one pass); the last one's."""
    times = []
    out = export_weights(tensors, {"version": "1"})  # a warm-up: it faults the buffer's pages in
    for _ in range(repeats):
        del out
        t0 = time.perf_counter()
        out = export_weights(tensors, {"version": "1"})
        times.append(time.perf_counter() - t0)
    return median(times), out


async def measure(
    label: str, workers: Workers, rounds: int, timeout: float, one: Callable[[int], Awaitable[float]]
) -> float | None:
    """The median of ``rounds`` rounds after a warm-up; None (and a note) when too slow."""
    times: list[float] = []
    try:
        for k in range(rounds + 1):
            t = await one(k)
            if os.environ.get("BENCH_VERBOSE"):
                print(f"    {label} round {k}: {t * 1e3:.1f} ms", flush=True)
            if k:
                times.append(t)
    except (TooSlow, TimeoutError, OSError, RuntimeError) as exc:
        why = "too slow to measure" if isinstance(exc, TooSlow | TimeoutError) else f"failed ({exc})"
        print(f"  {label}: {why}; workers restarted", flush=True)
        await workers.stop()
        await workers.start(timeout)
        return None
    return median(times)


async def measure_paired(
    label: str,
    workers: Workers,
    rounds: int,
    timeout: float,
    one: Callable[[int], Awaitable[float]],
    floor_one: Callable[[int], Awaitable[float]],
    floors: list[float],
) -> tuple[float | None, float | None]:
    """``one``'s median over ``rounds`` rounds after a warm-up, and the median of its ratio to a
    loopback round (``floor_one``) run just before each: both under the same load (this machine's
    others come and go within the minute a size takes). The loopback rounds join ``floors``.
    (None, None), and a note, when too slow."""
    times: list[float] = []
    ratios: list[float] = []
    try:
        for k in range(rounds + 1):
            f = await floor_one(k)
            t = await one(k)
            if os.environ.get("BENCH_VERBOSE"):
                print(f"    {label} round {k}: {t * 1e3:.1f} ms (loopback {f * 1e3:.1f} ms)", flush=True)
            if k:
                times.append(t)
                floors.append(f)
                if (r := ratio(t, f)) is not None:
                    ratios.append(r)
    except (TooSlow, TimeoutError, OSError, RuntimeError) as exc:
        why = "too slow to measure" if isinstance(exc, TooSlow | TimeoutError) else f"failed ({exc})"
        print(f"  {label}: {why}; workers restarted", flush=True)
        await workers.stop()
        await workers.start(timeout)
        return None, None
    return median(times), median(ratios)


async def bench_size(
    nbytes: int,
    stores: list[str],
    by_kind: dict[str, PayloadStore],
    workers: Workers,
    repeats: int,
    timeout: float,
) -> str:
    """Floors and stores at one size; its summary line."""
    label = size_label(nbytes)
    print(f"\n{label}:", flush=True)
    made, weights = export_s(make_weights(nbytes), repeats)
    data = weights.data
    copy = memcpy_s(data, repeats)
    floor = await measure(
        f"{label} loopback", workers, repeats, timeout, lambda k: loopback_round(workers, data, timeout)
    )
    print(figure_line(label, "memcpy", copy, nbytes, floor), flush=True)
    print(figure_line(label, "sha256", hash_s(data, repeats, "sha256"), nbytes, floor), flush=True)
    print(figure_line(label, "blake3", hash_s(data, repeats, "blake3"), nbytes, floor), flush=True)
    print(figure_line(label, "export", made, nbytes, floor) + "  (apart: before the put)", flush=True)
    print(figure_line(label, "loopback", floor, nbytes, floor), flush=True)
    checked = await measure(
        f"{label} loopback+check",
        workers,
        repeats,
        timeout,
        lambda k: loopback_round(workers, data, timeout, check=True),
    )
    print(
        figure_line(label, "+blake3", checked, nbytes, floor) + "  (loopback, each worker hashing)",
        flush=True,
    )
    medians: dict[str, float | None] = {}
    paired: dict[str, float | None] = {}
    floors: list[float] = []
    for kind in stores:
        store = by_kind[kind]

        async def one(k: int, store: PayloadStore = store) -> float:
            name = f"weights-{nbytes}-{k}"
            t = await store_round(workers, store, name, weights, timeout)
            if isinstance(store, ObjectStorePayloads):  # the bucket holds a round's weights
                await store.obj.delete(name)
            else:  # as the trainer discards a version past its retention
                await store.discard(name)
            return t

        medians[kind], paired[kind] = await measure_paired(
            f"{label} {kind}",
            workers,
            repeats,
            timeout,
            one,
            lambda k: loopback_round(workers, data, timeout),
            floors,
        )
        print(figure_line(label, kind, medians[kind], nbytes, floor, paired[kind]), flush=True)
    beside = median(floors)
    print(
        figure_line(label, "loopback", beside, nbytes, beside) + "  (beside the stores' rounds)", flush=True
    )
    return summary_line(label, medians, floor, paired)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="50,500", help="weights sizes in MB, comma-separated")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds a round may take")
    ap.add_argument("--stores", default=",".join(STORES))
    ap.add_argument("--load", type=int, default=0, help="busy CPU processes running beside the bench")
    ap.add_argument("--worker", nargs=2, metavar=("NATS_URL", "ROOT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        await worker_main(*args.worker)
        return
    sizes = [int(float(s) * MB) for s in args.sizes.split(",") if s.strip()]
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    if args.workers < 1 or args.repeats < 1 or not sizes or any(s <= 0 for s in sizes):
        ap.error("--workers and --repeats must be at least 1, --sizes positive")
    if unknown := set(stores) - set(STORES):
        ap.error(f"unknown stores {sorted(unknown)} (known: {', '.join(STORES)})")
    configure(level="warning")
    loaded = f", load {args.load}" if args.load else ""
    print(f"weights sync to {args.workers} workers, median of {args.repeats} rounds{loaded}", flush=True)
    summaries = []
    with tempfile.TemporaryDirectory() as tmp, EmbeddedServer(tmp) as srv, cpu_load(args.load):
        bus = await Bus.connect(srv.url, name="bench")
        await bus.ensure_run(RUN_ID, LIMITS)
        objstore = await ObjectStorePayloads.for_run(bus.js, RUN_ID)
        root = str(Path(tmp) / "payloads")
        by_kind: dict[str, PayloadStore] = {
            "objstore": objstore,
            "file": FilePayloads(root, payload_bucket(RUN_ID)),
            "mooncake": MooncakePayloads(MooncakeSettings(keep_objects=2, keep_mib=1, timeout_s=600)),
        }
        workers = Workers(args.workers, srv.url, root)
        await workers.start(args.timeout)
        try:
            for nbytes in sizes:
                summaries.append(
                    await bench_size(nbytes, stores, by_kind, workers, args.repeats, args.timeout)
                )
        finally:
            await workers.stop()
            await bus.close()
    print()
    for line in summaries:
        print(line)


if __name__ == "__main__":
    asyncio.run(main())
