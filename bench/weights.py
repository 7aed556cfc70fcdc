"""Weight sync: from the trainer's publish to every worker holding the new weights.

The bench process plays the trainer: it puts a weights blob into a payload store and hands
the reference to N worker processes (a pipe line each, standing in for the WeightsReady event);
each worker reads the bytes through :class:`~jetrl.bus.payloads.Payloads` (size and SHA-256
checked, as a run's workers do) and says when it holds them. A round's latency is from just
before the put to the last worker's answer. Stores:
  * ``objstore``: the run's JetStream Object Store bucket, on a private nats-server;
  * ``file``: a directory the processes share (atomic write with fsync, then a read each);
  * ``mooncake``: held by the trainer, pulled by each worker over Mooncake's transfer engine
    (TCP on loopback here; bus/mooncake.py).
Measured in the same run, the floors the stores are compared with:
  * ``memcpy``: one plain memory copy of the same bytes (into a buffer already touched);
  * ``loopback``: the same bytes sent by the trainer over a TCP loopback socket to every
    worker at once, received into memory (no hash, no store);
and, for scale, one SHA-256 pass over the bytes (``sha256``): a store's writer hashes what it
puts, and every reader what it reads, so a store's round holds two passes one after the other.
Each (size, store) is one warm-up round then ``--repeats`` rounds; medians are reported, with
ratios to the loopback floor. A round past ``--timeout`` is "too slow to measure", never a crash.

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
from load import cpu_load

from jetrl.bus import events as ev
from jetrl.bus.client import Bus
from jetrl.bus.log import configure
from jetrl.bus.mooncake import MooncakePayloads
from jetrl.bus.payloads import FilePayloads, ObjectStorePayloads, Payloads, PayloadStore
from jetrl.bus.server import EmbeddedServer
from jetrl.bus.settings import MooncakeSettings
from jetrl.bus.streams import GiB, StreamLimits, payload_bucket

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


def figure_line(label: str, name: str, t: float | None, nbytes: int, floor: float | None) -> str:
    if t is None:
        return f"  {label:>8}  {name:<9} not measured"
    rate = f"{nbytes / t / 1e9:7.2f} GB/s" if t > 0 else "      - GB/s"
    r = ratio(t, floor)
    rel = f"{r:6.2f}x loopback" if r is not None else "  (no loopback floor)"
    return f"  {label:>8}  {name:<9} {t * 1e3:9.1f} ms  {rate}  {rel}"


def summary_line(label: str, medians: dict[str, float | None], floor: float | None) -> str:
    """The headline figure of one size: the best store against the loopback floor."""
    best = best_store(medians)
    if best is None:
        return f"weights best store {label}: too slow to measure (no store finished a round)"
    name, t = best
    r = ratio(t, floor)
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
    print(json.dumps({"ready": True}), flush=True)
    while line := await asyncio.to_thread(sys.stdin.readline):
        msg = json.loads(line)
        out: dict[str, float | str]
        try:
            if msg["op"] == "ref":
                data = await pay.get_bytes(msgspec.json.decode(msg["ref"], type=ev.PayloadRef))
                out = {"t": time.monotonic(), "n": len(data)}
                del data
            else:
                out = {"t": await asyncio.to_thread(_receive, msg["port"], msg["size"]), "n": msg["size"]}
        except Exception as exc:  # reported to the bench, which says so
            out = {"err": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)
    await bus.close()


def _receive(port: int, size: int) -> float:
    buf = bytearray(size)
    view = memoryview(buf)
    with socket.create_connection(("127.0.0.1", port)) as s:
        got = 0
        while got < size:
            n = s.recv_into(view[got:], min(size - got, 4 << 20))
            if n == 0:
                raise ConnectionError(f"the sender closed after {got} of {size} bytes")
            got += n
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


async def store_round(workers: Workers, store: PayloadStore, name: str, data: bytes, timeout: float) -> float:
    t0 = time.monotonic()
    ref = await asyncio.wait_for(store.put(name, data), timeout)
    await workers.tell({"op": "ref", "ref": msgspec.json.encode(ref).decode()})
    done = await workers.answers(timeout)
    assert all(int(d["n"]) == len(data) for d in done)
    return max(d["t"] for d in done) - t0


async def loopback_round(workers: Workers, data: bytes, timeout: float) -> float:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        srv.settimeout(timeout)
        await workers.tell({"op": "sock", "port": srv.getsockname()[1], "size": len(data)})
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


def memcpy_s(data: bytes, repeats: int) -> float | None:
    src = np.frombuffer(data, dtype=np.uint8)
    dst = np.ones_like(src)  # touched: the floor is the copy, not page faults
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return median(times)


def sha256_s(data: bytes, repeats: int) -> float | None:
    """One SHA-256 pass over the bytes: every store's writer makes one, each reader another."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        hashlib.sha256(data).digest()
        times.append(time.perf_counter() - t0)
    return median(times)


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
    # Weights as the local trainer exports them (bytes); the parallel one hands a bytearray.
    data = np.random.default_rng(nbytes).bytes(nbytes)
    print(f"\n{label}:", flush=True)
    copy = memcpy_s(data, repeats)
    floor = await measure(
        f"{label} loopback", workers, repeats, timeout, lambda k: loopback_round(workers, data, timeout)
    )
    print(figure_line(label, "memcpy", copy, nbytes, floor), flush=True)
    print(figure_line(label, "sha256", sha256_s(data, repeats), nbytes, floor), flush=True)
    print(figure_line(label, "loopback", floor, nbytes, floor), flush=True)
    medians: dict[str, float | None] = {}
    for kind in stores:
        store = by_kind[kind]

        async def one(k: int, store: PayloadStore = store) -> float:
            name = f"weights-{nbytes}-{k}"
            t = await store_round(workers, store, name, data, timeout)
            if isinstance(store, ObjectStorePayloads):  # the bucket holds a round's weights
                await store.obj.delete(name)
            elif isinstance(store, FilePayloads):
                (store.root / store.bucket / name).unlink(missing_ok=True)
            return t

        medians[kind] = await measure(f"{label} {kind}", workers, repeats, timeout, one)
        print(figure_line(label, kind, medians[kind], nbytes, floor), flush=True)
    return summary_line(label, medians, floor)


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
