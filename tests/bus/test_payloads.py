"""The claim-check: arrays inline or in the object store, always hash-checked."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import numpy as np
import pytest
from blake3 import blake3

from jetrl.bus import events as ev
from jetrl.bus.client import Bus
from jetrl.bus.payloads import (
    FilePayloads,
    ObjectStorePayloads,
    PayloadError,
    PayloadIntegrityError,
    PayloadMissing,
    Payloads,
    inline_array,
    log_array,
    token_list_ref,
)


async def test_20mb_routing_trace_round_trips_through_object_store(bus: Bus, run_id: str) -> None:
    # A long agentic rollout: 131k tokens x 48 MoE layers x top-4, uint8 (> 20 MB).
    rng = np.random.default_rng(1)
    trace = rng.integers(0, 128, size=(110_000, 48, 4), dtype=np.uint8)
    assert trace.nbytes > 20 * 1024 * 1024
    pay = Payloads(await ObjectStorePayloads.for_run(bus.js, run_id))
    ref = await pay.put_array("trace-g7-3", trace)
    assert isinstance(ref, ev.PayloadRef)
    assert ref.size == trace.nbytes and ref.shape == trace.shape and ref.dtype == "uint8"
    # The reference rides in an event and comes back intact.
    e = ev.new_event(ev.WeightsReady(version=1, location=ref, weights_checksum="x"), run_id=run_id)
    ready = ev.decode_event(ev.encode_event(e)).body
    assert isinstance(ready, ev.WeightsReady)
    back = await pay.get_array(ready.location)
    assert back.dtype == np.uint8 and np.array_equal(back, trace)


async def test_corrupted_payload_fails_loudly(bus: Bus, run_id: str) -> None:
    store = await ObjectStorePayloads.for_run(bus.js, run_id)
    pay = Payloads(store, inline_threshold=0)
    ref = await pay.put_array("logprobs-1", np.linspace(-3, 0, 50_000, dtype=np.float32))
    assert isinstance(ref, ev.PayloadRef)
    # Someone overwrites the object with other bytes of the same size.
    await store.obj.put("logprobs-1", b"\x00" * ref.size)
    with pytest.raises(PayloadIntegrityError, match=r"SHA-256 .* does not match"):
        await pay.get_array(ref)
    # A truncated object.
    await store.obj.put("logprobs-1", b"\x00" * 10)
    with pytest.raises(PayloadIntegrityError, match="holds 10 bytes, the reference 200000"):
        await pay.get_array(ref)
    with pytest.raises(PayloadMissing):
        await pay.get_bytes(
            ev.PayloadRef(store="objstore", bucket=ref.bucket, name="nope", size=1, sha256="0")
        )


async def test_a_read_whose_chunks_stop_coming_gives_up(bus: Bus, run_id: str) -> None:
    # nats-py's get waits for an object's chunks for ever; here they are gone from the bucket's
    # stream (its description still there), so none ever comes.
    store = await ObjectStorePayloads.for_run(bus.js, run_id)
    store.stall_s, store.retry_s = 0.3, 0.5
    pay = Payloads(store, inline_threshold=0)
    data = np.arange(100_000, dtype=np.float32)  # 400 KB: several chunks
    ref = await pay.put_array("logprobs-stalled", data)
    assert isinstance(ref, ev.PayloadRef)
    info = await store.obj.get_info(ref.name)
    await bus.js.purge_stream(f"OBJ_{store.bucket}", subject=f"$O.{store.bucket}.C.{info.nuid}")
    with pytest.raises(PayloadMissing, match=r"no chunk came for 0\.3 s"):
        await asyncio.wait_for(pay.get_array(ref), 20.0)
    out = memoryview(bytearray(ref.size))
    with pytest.raises(PayloadMissing, match="no chunk came"):
        await asyncio.wait_for(store.read_into(ref, out, lambda n: None), 20.0)


async def test_small_arrays_ride_inline(bus: Bus, run_id: str) -> None:
    pay = Payloads(await ObjectStorePayloads.for_run(bus.js, run_id), inline_threshold=1024)
    tokens = np.arange(200, dtype=np.int32)
    ref = await pay.put_array("tokens", tokens)
    assert isinstance(ref, ev.InlineArray) and ref.shape == (200,)
    assert np.array_equal(await pay.get_array(ref), tokens)


async def test_file_store_and_uint16_traces(tmp_path) -> None:
    fs = FilePayloads(tmp_path, "run1")
    pay = Payloads(fs, inline_threshold=0)
    trace = np.random.default_rng(2).integers(0, 384, size=(1000, 8, 8)).astype(np.uint16)
    ref = await pay.put_array("trace", trace)
    assert isinstance(ref, ev.PayloadRef) and ref.store == "file"
    assert np.array_equal(await pay.get_array(ref), trace)
    (tmp_path / "run1" / "trace").write_bytes(b"\x01" * ref.size)
    with pytest.raises(PayloadIntegrityError):
        await pay.get_array(ref)
    with pytest.raises(PayloadError, match="plain file name"):
        await fs.put("../escape", b"x")
    with pytest.raises(PayloadError, match="no payload store of kind 'mooncake'"):
        await pay.get_bytes(ev.PayloadRef(store="mooncake", bucket="b", name="n", size=1, sha256="0"))


async def test_log_arrays_are_read_where_they_lie_in_the_log(bus: Bus, run_id: str) -> None:
    """A rollout refers to its generation's inline arrays by stream sequence and dotted path
    (``samples.<i>.<field>``); they read back as the arrays, and a reference that does not
    match what lies there is refused."""
    pay = await Payloads.for_run(bus.js, run_id)
    tokens, lps = np.arange(7, dtype=np.int32), np.linspace(-1, 0, 7, dtype=np.float32)
    gen = ev.CompletionsGenerated(
        task_id="e.default.0",
        env="e",
        prompt_tokens=await pay.put_array("p", np.arange(3, dtype=np.int32)),
        samples=[
            ev.Completion(
                generation_id="e.default.0-0",
                sample_index=0,
                completion_tokens=await pay.put_array("c", tokens),
                logprobs=await pay.put_array("l", lps),
            )
        ],
        policy_version_start=0,
        policy_version_end=0,
        worker_id="w",
    )
    gen_event = ev.new_event(gen, run_id=run_id)
    seq = (await bus.publish(gen_event)).seq
    smp = gen.samples[0]
    refs = [
        log_array(seq, "samples.0.completion_tokens", smp.completion_tokens),
        log_array(seq, "samples.0.logprobs", smp.logprobs),
    ]
    assert all(isinstance(r, ev.LogArray) for r in refs)
    await pay.prefetch([*refs, None])
    assert np.array_equal(await pay.get_array(refs[0]), tokens)
    assert np.array_equal(await pay.get_array(refs[1]), lps)
    with pytest.raises(PayloadIntegrityError, match="no int32"):
        await pay.get_array(ev.LogArray(seq=seq, field="samples.0.logprobs", dtype="int32", shape=(7,)))
    with pytest.raises(PayloadMissing):
        await pay.get_array(
            ev.LogArray(seq=seq + 100, field="samples.0.logprobs", dtype="float32", shape=(7,))
        )
    for nowhere in (0, -1, 2**64 - 1):  # no sequence at all: missing, not a server error
        with pytest.raises(PayloadMissing):
            await pay.get_array(
                ev.LogArray(seq=nowhere, field="samples.0.logprobs", dtype="float32", shape=(7,))
            )
    # A rollout's arrays must lie in its own generation, not in another event it points at.
    assert np.array_equal(await pay.get_array(refs[0], of_event=gen_event.event_id), tokens)
    with pytest.raises(PayloadIntegrityError, match="not the expected"):
        await pay.get_array(refs[0], of_event="another-generation")
    with pytest.raises(PayloadError, match="cannot follow"):
        await Payloads(pay.default).get_array(refs[0])
    # A reference to a payload is kept as it is: it points at its own bytes already.
    stored = await Payloads(pay.default, inline_threshold=0).put_array("big", tokens)
    assert log_array(seq, "samples.0.completion_tokens", stored) is stored


async def test_log_array_paths_name_only_an_array_or_a_token_list(bus: Bus, run_id: str) -> None:
    """A LogArray's dotted path leads into a sample of a generation, or to a task's list of
    token ids; a path that leads nowhere, to something else, or to a list that does not fit
    the declared dtype and shape is a PayloadIntegrityError, never another error."""
    pay = await Payloads.for_run(bus.js, run_id)
    prompt = [5, 0, 2**31 - 1, 17]
    task = ev.new_event(
        ev.TaskSubmitted(task_id="e.default.0", env="e", group_size=2, prompt_tokens=prompt), run_id=run_id
    )
    task_seq = (await bus.publish(task)).seq
    wide = ev.new_event(
        ev.TaskSubmitted(task_id="e.default.1", env="e", group_size=2, prompt_tokens=[1, 2**40]),
        run_id=run_id,
    )
    wide_seq = (await bus.publish(wide)).seq
    lps = [np.linspace(-1, 0, 4 + i, dtype=np.float32) for i in range(3)]
    gen = ev.CompletionsGenerated(
        task_id="e.default.0",
        env="e",
        prompt_tokens=token_list_ref(task_seq, "prompt_tokens", prompt),
        samples=[
            ev.Completion(
                generation_id=f"e.default.0-{i}",
                sample_index=i,
                completion_tokens=inline_array(np.arange(4 + i, dtype=np.int32)),
                logprobs=inline_array(lps[i]),
            )
            for i in range(3)
        ],
        policy_version_start=0,
        policy_version_end=0,
        worker_id="w",
    )
    gen_event = ev.new_event(gen, run_id=run_id)
    seq = (await bus.publish(gen_event)).seq

    # The task's prompt, a list of token ids, reads as int32 (int64 too), in its own task only.
    ref = token_list_ref(task_seq, "prompt_tokens", prompt)
    assert (ref.dtype, ref.shape) == ("int32", (4,))
    got = await pay.get_array(ref, of_event=task.event_id)
    assert got.dtype == np.int32 and got.tolist() == prompt
    as64 = ev.LogArray(seq=task_seq, field="prompt_tokens", dtype="int64", shape=(4,))
    assert (await pay.get_array(as64)).tolist() == prompt
    with pytest.raises(PayloadIntegrityError, match="not the expected"):
        await pay.get_array(ref, of_event=gen_event.event_id)
    # Each sample's arrays at its own position in the list.
    for i in range(3):
        back = await pay.get_array(log_array(seq, f"samples.{i}.logprobs", gen.samples[i].logprobs))
        assert np.array_equal(back, lps[i])

    def at(s: int, field: str, dtype: str = "float32", shape: tuple[int, ...] = (4,)) -> ev.LogArray:
        return ev.LogArray(seq=s, field=field, dtype=dtype, shape=shape)

    refused = {
        "index out of range": at(seq, "samples.3.logprobs"),
        "far out of range": at(seq, "samples.99.logprobs"),
        "negative index": at(seq, "samples.-1.logprobs"),
        "no index": at(seq, "samples.x.logprobs"),
        "index into a struct": at(seq, "prompt_tokens.0"),
        "missing field": at(seq, "samples.0.nothing"),
        "empty path": at(seq, ""),
        "empty part": at(seq, "samples..logprobs"),
        "a dunder": at(seq, "__class__"),
        "a private name": at(seq, "samples.0.__struct_fields__"),
        "a sample, not an array": at(seq, "samples.0"),
        "the list of samples": at(seq, "samples"),
        "a string": at(seq, "task_id", "int32", (12,)),
        "a number": at(seq, "policy_version_start", "int32", (1,)),
        "into an inline array": at(seq, "samples.0.logprobs.data"),
        "another sample's shape": at(seq, "samples.1.logprobs"),
        "dtype mismatch": at(seq, "samples.0.logprobs", "float16"),
        "shape mismatch": at(seq, "samples.0.logprobs", "float32", (2, 2)),
        "a token list as floats": at(task_seq, "prompt_tokens", "float32"),
        "a token list as uint8": at(task_seq, "prompt_tokens", "uint8"),
        "a token list of another length": at(task_seq, "prompt_tokens", "int32", (5,)),
        "a token list of another shape": at(task_seq, "prompt_tokens", "int32", (2, 2)),
        "a token list that does not fit int32": at(wide_seq, "prompt_tokens", "int32", (2,)),
        "a token list, not a prompt": at(task_seq, "group_size", "int32", (1,)),
        "a path into the task that is not there": at(task_seq, "samples.0.logprobs"),
        "an info value": at(task_seq, "info", "int32", (0,)),
    }
    for what, bad in refused.items():
        with pytest.raises(PayloadIntegrityError):
            await pay.get_array(bad)
            pytest.fail(f"{what}: {bad.field!r} read")
    # The 2**40 token reads as int64: the dtype it was declared with is the one that fits.
    assert (await pay.get_array(at(wide_seq, "prompt_tokens", "int64", (2,)))).tolist() == [1, 2**40]


async def test_a_buffer_is_stored_as_it_is(bus: Bus, run_id: str, tmp_path) -> None:
    """A trainer's weights serialised in place (a bytearray) go in without a copy of the whole,
    in several object-store chunks, and come back as the same bytes."""
    data = bytearray(np.random.default_rng(3).integers(0, 256, size=300_000, dtype=np.uint8).tobytes())
    digest = hashlib.sha256(data).hexdigest()
    for store in (await ObjectStorePayloads.for_run(bus.js, run_id), FilePayloads(tmp_path, "run2")):
        ref = await store.put("weights-v1", data)
        assert (ref.size, ref.sha256) == (len(data), digest)
        assert await store.get_bytes(ref) == bytes(data)
        view_ref = await store.put("weights-v2", memoryview(data))
        assert (view_ref.size, view_ref.sha256) == (len(data), digest)


async def test_a_discarded_payload_is_gone_and_discarding_twice_is_no_error(
    bus: Bus, run_id: str, tmp_path: Path
) -> None:
    for store in (await ObjectStorePayloads.for_run(bus.js, run_id), FilePayloads(tmp_path, "run3")):
        old, kept = await store.put("weights-v1", b"old"), await store.put("weights-v2", b"kept")
        await store.discard("weights-v1")
        with pytest.raises(PayloadMissing):
            await store.get_bytes(old)
        assert await store.get_bytes(kept) == b"kept"
        await store.discard("weights-v1")
        await store.discard("never-written")
        with pytest.raises(PayloadError, match="plain file name"):
            await FilePayloads(tmp_path, "run3").discard("../escape")


async def test_the_file_store_writes_a_put_over_the_last_discarded_file(tmp_path: Path) -> None:
    """A discarded version's file is kept as the spare, and the next put is written over its
    pages (the same file, renamed): whole, at its own size, larger or smaller than the spare's."""
    files = FilePayloads(tmp_path, "w")
    root = tmp_path / "w"
    a, b, c = (np.random.default_rng(k).bytes(n) for k, n in ((1, 3_000_000), (2, 1_000_000), (3, 2_000_000)))
    ref_a = await files.put("weights-v1", a, sha256=False)
    inode = (root / "weights-v1").stat().st_ino
    await files.discard("weights-v1")
    assert not (root / "weights-v1").exists() and (root / ".spare").stat().st_ino == inode
    with pytest.raises(PayloadMissing):
        await files.get_bytes(ref_a)
    ref_b = await files.put("weights-v2", b)  # smaller than the spare: its tail is cut
    assert (root / "weights-v2").stat().st_ino == inode and not (root / ".spare").exists()
    assert await files.get_bytes(ref_b) == b and ref_b.sha256 == hashlib.sha256(b).hexdigest()
    await files.discard("weights-v2")
    ref_c = await files.put("weights-v3", c)  # larger than the spare: it grows
    assert (root / "weights-v3").stat().st_ino == inode and await files.get_bytes(ref_c) == c
    fresh = await files.put("weights-v4", b)  # no spare left: a new file
    assert (root / "weights-v4").stat().st_ino != inode and await files.get_bytes(fresh) == b
    # Discarding with a spare there replaces it; only the newest discarded file is kept.
    await files.discard("weights-v3")
    await files.discard("weights-v4")
    assert sorted(p.name for p in root.iterdir()) == [".spare"]
    assert (root / ".spare").read_bytes() == b


def _weights_blob(size: int, seed: int) -> tuple[bytes, str]:
    """Bytes framed as a weights file (an 8-byte header length, a header, then data) and their
    transfer digest, as policy/weights.py's ``transfer_digest`` defines it."""
    head = b'{"__metadata__":{}}'.ljust(24)
    data = len(head).to_bytes(8, "little") + head + np.random.default_rng(seed).bytes(size)
    h = blake3(data[8 + len(head) :])
    h.update(data[: 8 + len(head)])
    return data, h.hexdigest()


def _ready(ref: ev.PayloadRef, b3: str | None) -> ev.WeightsReady:
    return ev.WeightsReady(version=1, location=ref, weights_checksum="c" * 64, blake3=b3)


async def test_weights_land_in_the_buffer_given_checked_once(bus: Bus, run_id: str, tmp_path: Path) -> None:
    """Weights are read straight into the caller's buffer and checked against the transfer
    digest as they land; a store that hashed them anyway (the object store) checks them itself."""
    data, b3 = _weights_blob(20_000_000, 1)  # several of the file store's reads
    objstore = await ObjectStorePayloads.for_run(bus.js, run_id)
    files = FilePayloads(tmp_path, "w")
    pay = Payloads(objstore, files)
    for store in (objstore, files):
        ref = await store.put("weights-v1", memoryview(data).toreadonly(), sha256=False)
        assert ref.sha256 == ("" if store is files else hashlib.sha256(data).hexdigest())
        given = memoryview(bytearray(len(data)))

        def into(n: int, given: memoryview = given) -> memoryview:
            return given[:n]

        got = await pay.get_weights(_ready(ref, b3), into=into)
        assert got.obj is given.obj and bytes(got) == data
        assert bytes(await pay.get_weights(_ready(ref, b3))) == data
    # Whose check it is: the object store's reader hashes every chunk (one hash, no progress
    # told); the file store tells each piece as it lands, for the caller to hash.
    for store, itself in ((objstore, True), (files, False)):
        ref = await store.put("weights-v1", data, sha256=False)
        told: list[int] = []
        assert await store.read_into(ref, memoryview(bytearray(len(data))), told.append) is itself
        assert (told == []) is itself and (itself or told[-1] == len(data))
    # An announcement of before the transfer digest: the reference's SHA-256 is the check.
    old = await objstore.put("weights-v0", data)
    assert bytes(await pay.get_weights(_ready(old, None))) == data


async def test_corrupt_or_truncated_weights_are_refused(bus: Bus, run_id: str, tmp_path: Path) -> None:
    data, b3 = _weights_blob(20_000_000, 2)
    files = FilePayloads(tmp_path, "w")
    objstore = await ObjectStorePayloads.for_run(bus.js, run_id)
    pay = Payloads(objstore, files)
    ref = await files.put("weights-v2", data, sha256=False)
    path = tmp_path / "w" / "weights-v2"
    for at in (len(data) - 5, 12, 10_000_000):  # in the last read, in the header, in between
        bad = bytearray(data)
        bad[at] ^= 0x40
        path.write_bytes(bad)
        with pytest.raises(PayloadIntegrityError, match=r"BLAKE3 .* does not match the announced"):
            await pay.get_weights(_ready(ref, b3))
    path.write_bytes(data[:-1])
    with pytest.raises(PayloadIntegrityError, match="holds 20000031 bytes, the reference 20000032"):
        await pay.get_weights(_ready(ref, b3))
    path.unlink()
    with pytest.raises(PayloadMissing):
        await pay.get_weights(_ready(ref, b3))
    # The object store: another object under the name (the reference's SHA-256 no longer
    # names it), and bytes that do not match their own digest.
    stored = await objstore.put("weights-v2", data)
    await objstore.obj.put("weights-v2", data[:-1] + b"\0")
    with pytest.raises(PayloadIntegrityError, match="not the object the reference names"):
        await pay.get_weights(_ready(stored, b3))
    path.write_bytes(data)
    with pytest.raises(PayloadIntegrityError, match="does not match the announced"):
        await pay.get_weights(_ready(ref, "0" * 64))
