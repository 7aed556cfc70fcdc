"""The inference worker's events for a task generated twice (its first worker died)."""

from __future__ import annotations

import dataclasses
from typing import cast

import msgspec
import numpy as np
from nats.aio.msg import Msg

from jetrl.bus import events as ev
from jetrl.bus import ids, subjects
from jetrl.bus.client import Bus
from jetrl.bus.consumer import Delivery
from jetrl.bus.payloads import Payloads, token_list_ref
from jetrl.consumers.inference.engine import Sample
from jetrl.consumers.inference.settings import InferencePart, InferenceSettings
from jetrl.consumers.inference.worker import InferenceWorker

ORACLE = InferencePart(inference=InferenceSettings(engine="tests.support.engines:OracleEngine"))


async def delivered(
    bus: Bus, task: ev.TaskSubmitted, run_id: str, tenant: str = "default", attempt: int = 1
) -> Delivery[ev.TaskSubmitted]:
    """The task in the log, as a worker's delivery of it (attempt ``attempt``)."""
    event = ev.new_event(task, run_id=run_id, tenant=tenant)
    seq = (await bus.publish(event)).seq
    return Delivery[ev.TaskSubmitted](
        event=event, seq=seq, subject=subjects.subject_for(event), num_delivered=attempt, msg=cast(Msg, None)
    )


async def test_a_second_generation_never_overwrites_the_arrays_of_the_first(bus: Bus, run_id: str) -> None:
    worker = InferenceWorker(bus, run_id, "inf-0", ORACLE)
    worker.payloads = await Payloads.for_run(bus.js, run_id)
    task = ev.TaskSubmitted(task_id="e.default.0", env="e", group_size=2, prompt_tokens=[1, 2, 3])
    first_try = await delivered(bus, task, run_id)
    second_try = dataclasses.replace(first_try, num_delivered=2)  # the same message, redelivered
    rng = np.random.default_rng(0)

    def sample() -> Sample:  # long enough (32 KiB of tokens) to go to the object store
        n = 8192
        tokens = rng.integers(3, 60, n).astype(np.int32)
        return Sample(tokens, np.zeros(n, np.float32), "length")

    first, second = [sample(), sample()], [sample(), sample()]
    kept = await worker._completions_event(first_try, task, first, 0, 0.0, 0.0)
    again = await worker._completions_event(second_try, task, second, 0, 0.0, 0.0)
    assert kept.event_id == again.event_id  # the stream keeps one: the first
    assert kept.event_id == ids.generation_event_id(run_id, first_try.event.event_id)
    assert isinstance(kept.body, ev.CompletionsGenerated) and isinstance(again.body, ev.CompletionsGenerated)
    assert [s.sample_index for s in kept.body.samples] == [0, 1]
    assert [s.generation_id for s in kept.body.samples] == ["e.default.0-0", "e.default.0-1"]
    refs = [s.completion_tokens for b in (kept.body, again.body) for s in b.samples]
    refs += [s.logprobs for b in (kept.body, again.body) for s in b.samples]
    assert all(isinstance(r, ev.PayloadRef) for r in refs)
    assert len({r.name for r in refs if isinstance(r, ev.PayloadRef)}) == 8  # no two samples share an object
    # The kept event's references still read its own tokens, hash-checked, sample by sample.
    for body, samples in ((kept.body, first), (again.body, second)):
        for smp, want in zip(body.samples, samples, strict=True):
            assert np.array_equal(
                await worker.payloads.get_array(smp.completion_tokens), want.completion_tokens
            )
            assert smp.finish_reason == "length"
    # The prompt is the task's own list of token ids, where it lies in the log.
    assert kept.body.prompt_tokens == token_list_ref(first_try.seq, "prompt_tokens", task.prompt_tokens)
    prompt = await worker.payloads.get_array(kept.body.prompt_tokens, of_event=first_try.event.event_id)
    assert prompt.tolist() == task.prompt_tokens


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
        task = ev.TaskSubmitted(task_id=f"e.{tenant}.0", env="e", group_size=2, prompt_tokens=[1, 2, 3])
        d = await delivered(bus, task, run_id, tenant)
        e = await worker._completions_event(d, task, [sample, sample], 0, 0.0, 0.0)
        assert isinstance(e.body, ev.CompletionsGenerated)
        kinds[tenant] = {(type(s.completion_tokens), type(s.logprobs)) for s in e.body.samples}
        for s in e.body.samples:
            assert np.array_equal(
                await worker.payloads.get_array(s.completion_tokens), sample.completion_tokens
            )
    assert kinds["acme"] == {(ev.InlineArray, ev.InlineArray)}
    assert kinds["globex"] == {(ev.PayloadRef, ev.PayloadRef)}


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
