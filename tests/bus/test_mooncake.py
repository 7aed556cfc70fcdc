"""The mooncake payload store: a real transfer engine over TCP on loopback, the writer in a
process of its own, the reader here."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from jetrl.bus import events as ev
from jetrl.bus.mooncake import MooncakePayloads
from jetrl.bus.payloads import PayloadIntegrityError, PayloadMissing, Payloads
from jetrl.bus.server import EmbeddedServer
from jetrl.bus.settings import MooncakeSettings
from jetrl.deploy.config import load_config
from jetrl.deploy.supervisor import Supervisor
from tests.support.runlog import bodies, read_log, samples

pytest.importorskip("mooncake.engine")

# The writer: one command a line on stdin, one answer a line on stdout.
#   blob NAME SIZE SEED   -> the reference of SIZE seeded random bytes
#   buffer NAME SIZE SEED -> the same, from a bytearray (the store keeps a copy)
#   again NAME            -> the last bytes put again, under another name
#   array NAME            -> the reference of a uint16 array (a routing trace)
#   weights NAME MB SEED  -> a trainer's export of MB of weights: [reference, BLAKE3 digest]
#   flip OFFSET           -> one bit of the last weights flipped where the writer holds them
#   held                  -> [objects, bytes]
WRITER = r"""
import asyncio, json, sys
import msgspec, numpy as np, torch
from jetrl.bus.mooncake import MooncakePayloads
from jetrl.bus.payloads import Payloads
from jetrl.bus.settings import MooncakeSettings
from jetrl.policy.weights import export_weights

async def main():
    store = MooncakePayloads(MooncakeSettings.model_validate_json(sys.argv[1]))
    pay = Payloads(store, inline_threshold=1024)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd in ("blob", "buffer"):
            data = np.random.default_rng(int(args[2])).bytes(int(args[1]))
            if cmd == "buffer":
                data = bytearray(data)
            last = data
            out = msgspec.json.encode(await store.put(args[0], data)).decode()
        elif cmd == "again":
            out = msgspec.json.encode(await store.put(args[0], last)).decode()
        elif cmd == "weights":
            g = torch.Generator().manual_seed(int(args[2]))
            tensors = {f"w{i}": torch.randn(250_000, generator=g) for i in range(int(args[1]))}
            exported = export_weights(tensors, {"version": args[0]})
            ref = await store.put(args[0], exported.data, sha256=False)
            out = json.dumps([msgspec.to_builtins(ref), exported.blake3])
        elif cmd == "flip":
            np.asarray(exported.data.obj)[int(args[0])] ^= 1
            out = "{}"
        elif cmd == "array":
            trace = np.arange(300_000, dtype=np.uint16).reshape(1000, 30, 10)
            out = msgspec.json.encode(await pay.put_array(args[0], trace)).decode()
        else:
            out = json.dumps(store.held())
        print(out, flush=True)

asyncio.run(main())
"""


class Writer:
    def __init__(self, settings: MooncakeSettings) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, settings.model_dump_json()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "JETRL_HOST": "127.0.0.1"},
        )

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        assert answer, f"the writer died ({self.proc.poll()})"
        return answer

    def blob(self, name: str, size: int, seed: int = 0, *, cmd: str = "blob") -> ev.PayloadRef:
        return msgspec.json.decode(self.ask(f"{cmd} {name} {size} {seed}"), type=ev.PayloadRef)

    def held(self) -> tuple[int, int]:
        objects, nbytes = json.loads(self.ask("held"))
        return objects, nbytes

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def writer() -> Iterator[Writer]:
    w = Writer(MooncakeSettings(keep_objects=3, keep_mib=64, timeout_s=20))
    yield w
    w.kill()


def reader(timeout_s: float = 20) -> Payloads:
    return Payloads(MooncakePayloads(MooncakeSettings(host="127.0.0.1", timeout_s=timeout_s)))


async def test_blob_and_array_round_trip_between_processes(writer: Writer) -> None:
    pay = reader()
    ref = writer.blob("weights-v0", 3_000_000, seed=7)
    assert ref.store == "mooncake" and ref.bucket.startswith("127.0.0.1:") and ref.size == 3_000_000
    assert await pay.get_bytes(ref) == np.random.default_rng(7).bytes(3_000_000)
    # Readers pull concurrently.
    both = await asyncio.gather(pay.get_bytes(ref), pay.get_bytes(ref))
    assert both[0] == both[1]
    arr_ref = msgspec.json.decode(writer.ask("array trace-g1-0"), type=ev.ArrayRef)
    assert isinstance(arr_ref, ev.PayloadRef) and arr_ref.dtype == "uint16"
    back = await pay.get_array(arr_ref)
    assert np.array_equal(back, np.arange(300_000, dtype=np.uint16).reshape(1000, 30, 10))


async def test_a_wrong_hash_or_size_fails_loudly(writer: Writer) -> None:
    pay = reader()
    ref = writer.blob("logprobs-1", 100_000)
    with pytest.raises(PayloadIntegrityError, match="does not match"):
        await pay.get_bytes(msgspec.structs.replace(ref, sha256="0" * 64))
    with pytest.raises(PayloadMissing):  # past the end of the writer's buffer: refused
        await pay.get_bytes(msgspec.structs.replace(ref, size=ref.size + 1))


@pytest.mark.parametrize("cmd", ["blob", "buffer"])
async def test_evicted_objects_are_missing_and_the_writer_stays_bounded(writer: Writer, cmd: str) -> None:
    pay = reader()
    refs = [writer.blob(f"weights-v{v}", 1_000_000, seed=v, cmd=cmd) for v in range(5)]
    assert writer.held() == (3, 3_000_000)  # keep_objects = 3
    for ref in refs[:2]:
        with pytest.raises(PayloadMissing):
            await pay.get_bytes(ref)
    assert await pay.get_bytes(refs[-1]) == np.random.default_rng(4).bytes(1_000_000)
    # keep_mib = 64: two of 40 MB are kept though over it (the newest two always are), a
    # third evicts the oldest.
    big = [writer.blob(f"weights-v{v}", 40_000_000, seed=v, cmd=cmd) for v in (5, 6, 7)]
    objects, nbytes = writer.held()
    assert objects == 2 and nbytes == 80_000_000
    with pytest.raises(PayloadMissing):
        await pay.get_bytes(big[0])
    # The same bytes put twice: held under both names, readable while either is.
    again = msgspec.json.decode(writer.ask("again weights-v7b"), type=ev.PayloadRef)
    assert again.sha256 == big[2].sha256
    assert await pay.get_bytes(again) == await pay.get_bytes(big[2])
    big[1:] = [big[2], again]
    # The newest two read back (with a copy, in a buffer an evicted object held before).
    for v, ref in ((7, big[1]), (7, big[2])):
        assert await pay.get_bytes(ref) == np.random.default_rng(v).bytes(40_000_000)
    # A reference to an address no buffer of the writer's covers.
    bogus = msgspec.structs.replace(refs[-1], name="weights-v4#10#20#" + "00" * 16)
    with pytest.raises(PayloadMissing):
        await pay.get_bytes(bogus)


async def test_weights_are_checked_as_they_land_and_a_corrupt_piece_is_refused(writer: Writer) -> None:
    """A trainer's exported weights, served where they lie (no copy, no SHA-256 pass), pulled
    into the reader's buffer a piece at a time and checked against their transfer digest: one
    bit flipped where the writer holds them, in the first piece or a later one, is refused."""
    pay = reader()
    ref_b, b3 = json.loads(writer.ask("weights weights-v1 40 3"))  # 40 MB: several pieces
    ref = msgspec.convert(ref_b, ev.PayloadRef)
    assert ref.sha256 == "" and ref.size > 40_000_000
    ready = ev.WeightsReady(version=1, location=ref, weights_checksum="c" * 64, blake3=b3)
    into = np.zeros(ref.size, dtype=np.uint8).data
    got = await pay.get_weights(ready, into=lambda n: into)
    from jetrl.policy.weights import tensors_of, transfer_digest

    assert transfer_digest(got) == b3 and len(tensors_of(got)[0]) == 40
    for offset in (ref.size - 3, 100, 33_000_000):  # the last piece, the header, a middle piece
        writer.ask(f"flip {offset}")
        with pytest.raises(PayloadIntegrityError, match="BLAKE3"):
            await pay.get_weights(ready)
        writer.ask(f"flip {offset}")  # back as it was
    assert bytes(await pay.get_weights(ready)) == bytes(got)
    with pytest.raises(PayloadIntegrityError, match="does not match the announced"):
        await pay.get_weights(msgspec.structs.replace(ready, blake3="0" * 64))


async def test_a_dead_writer_is_a_clear_error_in_bounded_time() -> None:
    w = Writer(MooncakeSettings())
    ref = w.blob("weights-v3", 200_000)
    pay = reader(timeout_s=10)
    assert len(await pay.get_bytes(ref)) == 200_000
    w.kill()
    t0 = time.monotonic()
    with pytest.raises(PayloadMissing):
        await pay.get_bytes(ref)
    # A reader that never met the writer before.
    with pytest.raises(PayloadMissing):
        await reader(timeout_s=10).get_bytes(ref)
    assert time.monotonic() - t0 < 15


@pytest.mark.slow
async def test_a_run_with_weights_and_traces_in_mooncake(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    steps = 4
    args = (
        "--trainer.max_steps 4 --trainer.batch_groups 2 --envs.0.group_size 4 --inference.workers 1"
        " --bus.weights_store mooncake --bus.traces_store mooncake"
    )
    cfg = load_config(None, args.split())
    sup = Supervisor(cfg, "mc1", tmp_path / "mc1", nats_url=nats_server.url, quiet=True)
    assert await sup.run() == 0
    log = await read_log(nats_server.url, "mc1")
    assert len(bodies(log, ev.StepCompleted)) == steps
    ready = {r.version: r.location.store for r in bodies(log, ev.WeightsReady)}
    # The initial weights, where recovery without a checkpoint starts, outlive the trainer.
    assert ready[0] == "objstore" and set(range(1, steps + 1)) <= ready.keys()
    assert all(ready[v] == "mooncake" for v in range(1, steps + 1))
    traces = [s.routing_trace for _, s in samples(log)]
    assert traces and all(t is not None for t in traces)
    # The tiny model's traces are below the inline threshold (they ride in the event); a
    # larger one is a mooncake reference held by its worker.
    assert all(t.store == "mooncake" for t in traces if isinstance(t, ev.PayloadRef))


async def test_weights_held_by_a_killed_trainer_are_announced_again(
    nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    """The trainer holds the weights it announced: killed, it takes them with it, and a worker
    restarted after it finds the newest version gone. The restarted trainer announces them again
    (a WeightsReady of its own), so the run goes on.

    The kill must land after the trainer announced its version (killed between a step and its
    announcement, it announces the version for the first time, which proves nothing): the
    worker is paused, so the trainer runs out of rollouts and waits with its version announced."""
    steps, run_id = 6, "mc-kill"
    args = (
        f"--trainer.max_steps {steps} --trainer.batch_groups 2 --trainer.checkpoint_every 2"
        " --envs.0.group_size 4 --inference.workers 1 --bus.weights_store mooncake"
        " --trainer.ack_wait_s 2 --inference.ack_wait_s 2 --envs.0.ack_wait_s 2"
    )
    cfg = load_config(None, args.split())
    run_dir = tmp_path / run_id
    sup = Supervisor(cfg, run_id, run_dir, nats_url=nats_server.url, quiet=True)
    run = asyncio.create_task(sup.run())
    while len(sup.progress.steps) < 2 and not run.done():
        await asyncio.sleep(0.05)
    trainer, worker = (next(p for p in sup.parts if p.name == n) for n in ("trainer", "inference-0"))
    assert worker.proc is not None and worker.proc.poll() is None
    worker.proc.send_signal(signal.SIGSTOP)
    # Wait until the trainer has no more to train and its newest version is announced.
    done = 0
    while not run.done():
        log = await read_log(nats_server.url, run_id)
        done = len(bodies(log, ev.StepCompleted))
        announced = {r.version for r in bodies(log, ev.WeightsReady)}
        await asyncio.sleep(3)
        if done in announced and len(sup.progress.steps) == done:
            break
    held = done  # the version the killed trainer held, announced once by it
    assert done < steps, "the run ended before the kill; the test needs more steps"
    for victim in (trainer, worker):
        assert victim.proc is not None and victim.proc.poll() is None
        victim.proc.kill()  # the worker too (paused): it restarts after the trainer
        while victim.restarts == 0 and not run.done():
            await asyncio.sleep(0.05)
    assert await asyncio.wait_for(run, 240) == 0
    # The worker waited for the announcement it could read; it did not crash on the dead one.
    assert (trainer.restarts, worker.restarts) == (1, 1)
    log = await read_log(nats_server.url, run_id)
    assert [s.step for s in bodies(log, ev.StepCompleted)] == list(range(steps))
    announced_as: dict[int, set[str]] = {}
    for r in bodies(log, ev.WeightsReady):
        announced_as.setdefault(r.version, set()).add(r.location.name)
    recovered = [
        json.loads(line)["version"]
        for line in (run_dir / "logs" / "trainer.log").read_text().splitlines()
        if '"trainer_recovered"' in line
    ]
    assert recovered == [held]
    assert len(announced_as[held]) == 2, f"version {held} not announced anew: {announced_as}"
    assert all(len(names) == 1 for v, names in announced_as.items() if v != held)
    assert all(r.location.store == "mooncake" for r in bodies(log, ev.WeightsReady) if r.version > 0)
