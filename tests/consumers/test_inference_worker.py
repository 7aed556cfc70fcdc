"""The inference worker's events for a task generated twice (its first worker died)."""

from __future__ import annotations

import msgspec
import numpy as np

from jetrl.bus import events as ev
from jetrl.bus.client import Bus
from jetrl.bus.payloads import Payloads
from jetrl.consumers.inference.engine import Sample
from jetrl.consumers.inference.settings import InferencePart, InferenceSettings
from jetrl.consumers.inference.worker import InferenceWorker

ORACLE = InferencePart(inference=InferenceSettings(engine="tests.support.engines:OracleEngine"))


async def test_a_second_generation_never_overwrites_the_arrays_of_the_first(bus: Bus, run_id: str) -> None:
    worker = InferenceWorker(bus, run_id, "inf-0", ORACLE)
    worker.payloads = await Payloads.for_run(bus.js, run_id)
    task = ev.TaskSubmitted(task_id="e.default.0", env="e", group_size=1, prompt_tokens=[1, 2, 3])
    task_event = ev.new_event(task, run_id=run_id)
    prompt = await worker.payloads.put_array("prompt", np.asarray(task.prompt_tokens, np.int32))
    rng = np.random.default_rng(0)

    def sample() -> Sample:  # long enough (32 KiB of tokens) to go to the object store
        n = 8192
        tokens = rng.integers(3, 60, n).astype(np.int32)
        return Sample(tokens, np.zeros(n, np.float32), "length")

    first, second = sample(), sample()
    kept = await worker._completion_event(task_event, task, 0, first, prompt, 0, 0.0, 0.0, 0.0, attempt=1)
    again = await worker._completion_event(task_event, task, 0, second, prompt, 0, 0.0, 0.0, 0.0, attempt=2)
    assert kept.event_id == again.event_id  # the stream keeps one: the first
    assert isinstance(kept.body, ev.GenerationCompleted) and isinstance(again.body, ev.GenerationCompleted)
    assert isinstance(kept.body.completion_tokens, ev.PayloadRef)
    # The kept event's reference still reads its own tokens, hash-checked.
    assert np.array_equal(
        await worker.payloads.get_array(kept.body.completion_tokens), first.completion_tokens
    )
    assert np.array_equal(
        await worker.payloads.get_array(again.body.completion_tokens), second.completion_tokens
    )


async def test_a_tenant_reading_only_its_view_gets_long_completions_inline(bus: Bus, run_id: str) -> None:
    """A registered tenant's producer cannot read the run's payload store: its generations
    carry their arrays in the event, while another tenant's long arrays go to the store."""
    part = ORACLE.model_copy(update={"inline_tenants": ["acme"]})
    worker = InferenceWorker(bus, run_id, "inf-0", part)
    worker.payloads = await Payloads.for_run(bus.js, run_id)
    n = 8192  # 32 KiB of tokens: past the store's inline threshold
    sample = Sample(np.arange(n, dtype=np.int32) % 50, np.zeros(n, np.float32), "length")
    kinds = {}
    for tenant in ("acme", "globex"):
        task = ev.TaskSubmitted(task_id=f"e.{tenant}.0", env="e", group_size=1, prompt_tokens=[1, 2, 3])
        task_event = ev.new_event(task, run_id=run_id, tenant=tenant)
        prompt = await worker.payloads.put_array("p", np.asarray(task.prompt_tokens, np.int32))
        e = await worker._completion_event(task_event, task, 0, sample, prompt, 0, 0.0, 0.0, 0.0, attempt=1)
        assert isinstance(e.body, ev.GenerationCompleted)
        kinds[tenant] = (type(e.body.completion_tokens), type(e.body.logprobs))
        assert np.array_equal(
            await worker.payloads.get_array(e.body.completion_tokens), sample.completion_tokens
        )
    assert kinds["acme"] == (ev.InlineArray, ev.InlineArray)
    assert kinds["globex"] == (ev.PayloadRef, ev.PayloadRef)


async def test_weights_that_cannot_be_read_leave_the_worker_waiting_for_an_announcement_that_can(
    bus: Bus, run_id: str
) -> None:
    """Weights announced by a trainer that died with them: the worker keeps what it has, counts
    them, does not retry them at once, and loads the same version announced anew."""
    worker = InferenceWorker(bus, run_id, "inf-0", ORACLE)
    worker.payloads = await Payloads.for_run(bus.js, run_id)
    data = b"weights of version 3" * 1000
    good = await worker.payloads.default.put("weights-v3", data)
    gone = msgspec.structs.replace(good, name="weights-v3-held-by-the-dead")

    def ready(ref: ev.PayloadRef) -> ev.WeightsReady:
        return ev.WeightsReady(version=3, location=ref, weights_checksum="x", format="safetensors")

    worker.latest = ready(gone)
    await worker.load_latest()
    assert worker.engine.loaded_version is None and worker.stats["weights_unreadable"] == 1
    await worker.load_latest()  # not tried again straight away
    assert worker.stats["weights_unreadable"] == 1
    worker.latest = ready(good)  # the restarted trainer's announcement
    await worker.load_latest()
    assert worker.loaded_version == 3 and worker.stats["weight_loads"] == 1
