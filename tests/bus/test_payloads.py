"""The claim-check: arrays inline or in the object store, always hash-checked."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from jetrl.bus import events as ev
from jetrl.bus.client import Bus
from jetrl.bus.payloads import (
    FilePayloads,
    ObjectStorePayloads,
    PayloadError,
    PayloadIntegrityError,
    PayloadMissing,
    Payloads,
    log_array,
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
    """A rollout refers to its generation's inline arrays by stream sequence and field; they
    read back as the arrays, and a reference that does not match what lies there is refused."""
    pay = await Payloads.for_run(bus.js, run_id)
    tokens, lps = np.arange(7, dtype=np.int32), np.linspace(-1, 0, 7, dtype=np.float32)
    gen = ev.GenerationCompleted(
        generation_id="e.default.0-0",
        task_id="e.default.0",
        env="e",
        group_id="e.default.0",
        sample_index=0,
        group_size=2,
        prompt_tokens=await pay.put_array("p", np.arange(3, dtype=np.int32)),
        completion_tokens=await pay.put_array("c", tokens),
        logprobs=await pay.put_array("l", lps),
        policy_version_start=0,
        policy_version_end=0,
        worker_id="w",
    )
    gen_event = ev.new_event(gen, run_id=run_id)
    seq = (await bus.publish(gen_event)).seq
    refs = [
        log_array(seq, "completion_tokens", gen.completion_tokens),
        log_array(seq, "logprobs", gen.logprobs),
    ]
    assert all(isinstance(r, ev.LogArray) for r in refs)
    await pay.prefetch([*refs, None])
    assert np.array_equal(await pay.get_array(refs[0]), tokens)
    assert np.array_equal(await pay.get_array(refs[1]), lps)
    with pytest.raises(PayloadIntegrityError, match="no int32"):
        await pay.get_array(ev.LogArray(seq=seq, field="logprobs", dtype="int32", shape=(7,)))
    with pytest.raises(PayloadMissing):
        await pay.get_array(ev.LogArray(seq=seq + 100, field="logprobs", dtype="float32", shape=(7,)))
    for nowhere in (0, -1, 2**64 - 1):  # no sequence at all: missing, not a server error
        with pytest.raises(PayloadMissing):
            await pay.get_array(ev.LogArray(seq=nowhere, field="logprobs", dtype="float32", shape=(7,)))
    # A rollout's arrays must lie in its own generation, not in another event it points at.
    assert np.array_equal(await pay.get_array(refs[0], of_event=gen_event.event_id), tokens)
    with pytest.raises(PayloadIntegrityError, match="not the expected"):
        await pay.get_array(refs[0], of_event="another-generation")
    with pytest.raises(PayloadError, match="cannot follow"):
        await Payloads(pay.default).get_array(refs[0])
    # A reference to a payload is kept as it is: it points at its own bytes already.
    stored = await Payloads(pay.default, inline_threshold=0).put_array("big", tokens)
    assert log_array(seq, "completion_tokens", stored) is stored


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
