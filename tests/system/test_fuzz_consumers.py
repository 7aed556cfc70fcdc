"""Property-based fuzzing of every consumer's edge through a real nats-server (issue 14).

Hypothesis generates, per example, a handful of events for one consumer: raw garbage, truncated
and byte-flipped msgpack of valid events, envelopes of unknown types, newer or impossible schema
versions, disagreeing type headers, bodies that do not fit their type, spoofed runs and tenants,
events on another subject than their own, foreign entity ids, impossible values (group sizes,
non-finite rewards and temperatures, token ids outside the vocabulary, prompts past the context,
future versions, arrays of the wrong dtype, shape or length, references to missing payloads) and
oversized lists, always mixed with good events. Each is published raw (nats-py) to the run's
stream; the consumer, one instance per test running across all examples, works until its
durable consumers have nothing pending or unacked (bounded by a deadline, never unbounded).
Then, per event:

* a bad one has exactly one DeadLettered from the consumer (its id is the consumer's derived
  dead-letter id for the original's stream sequence, so a dead letter a tenant forged does not
  count), with a non-empty reason among those expected, and had no effect;
* a good one was processed (inference: one GenerationCompleted per sample; trainer: each
  rollout in exactly one StepCompleted; scorer: a RolloutScored; recorder: its row in the store)
  and was not dead-lettered;
* a byte-flipped event that still decodes may go either way, but exactly one way;
* and the consumer's task is still running.

Examples are derandomized and the example database is off, so CI tries the same cases every
time; shrinking is off (each example costs a round trip through the server), so a failure
reports the first failing example as generated. The counts of cases tried, per consumer and
kind, are printed at the end of each test (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from jetrl.bus import events as ev
from jetrl.bus import ids, subjects
from jetrl.bus.client import Bus
from jetrl.bus.payloads import ObjectStorePayloads, Payloads, inline_array
from jetrl.bus.server import EmbeddedServer
from jetrl.bus.settings import EnvRoute, TenantSettings
from jetrl.bus.streams import payload_bucket
from jetrl.consumers.inference.engine import GroupRequest, Sample
from jetrl.consumers.inference.settings import InferencePart, InferenceSettings
from jetrl.consumers.inference.worker import InferenceWorker
from jetrl.consumers.recorder import Recorder
from jetrl.policy.settings import ModelSettings
from jetrl.policy.tokenizer import CharTokenizer
from jetrl.producers.producer import EnvProducer
from jetrl.producers.settings import EnvSettings, ProducerPart
from jetrl.store.db import Store, open_store
from tests.conftest import TEST_LIMITS
from tests.support.engines import OracleEngine

pytestmark = pytest.mark.slow

T = TypeVar("T")
TOK = CharTokenizer()
VOCAB = 64  # tiny-dense and tiny-moe
CONTEXT = 256
SETTLE_S = 90.0  # per example: a guard against a hang, not a timing assertion


def fuzz_settings(n: int) -> settings:
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


# ----------------------------------------------------------------------------- cases


@dataclass
class Item:
    """One message of an example, and what must become of it."""

    kind: str
    subject: str
    data: bytes
    headers: dict[str, str] | None
    # "dead": dead-lettered (reason in ``reasons``; any non-empty one when None); "good":
    # processed; "either": exactly one of the two (a flipped byte that still decodes);
    # "withheld": a good rollout whose group a bad member condemned (trainer).
    expect: str
    reasons: frozenset[str] | None = None
    event: ev.Event | None = None
    seq: int = 0


def encode(e: ev.Event) -> bytes:
    return ev.encode_event(e)


def wire(e: ev.Event) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.msgpack.decode(encode(e))
    return out


def packed(d: Any) -> bytes:
    return msgspec.msgpack.encode(d)


def headers_of(e: ev.Event) -> dict[str, str]:
    return ev.event_headers(e)


def fresh(e: ev.Event, **changes: Any) -> ev.Event:
    """``e`` under a new event id (a copy with the original's id would be deduplicated)."""
    return msgspec.structs.replace(e, event_id=uuid.uuid4().hex, **changes)


def good_item(kind: str, e: ev.Event) -> Item:
    return Item(kind, subjects.subject_for(e), encode(e), headers_of(e), "good", event=e)


def dead_item(kind: str, e: ev.Event, *reasons: str, subject: str | None = None) -> Item:
    return Item(
        kind,
        subject or subjects.subject_for(e),
        encode(e),
        headers_of(e),
        "dead",
        frozenset(reasons),
        event=e,
    )


# Transformations every consumer's edge (bus/client.py, PullConsumer._admit) must refuse,
# applied to a valid event of the consumer's input. Their parameters come from hypothesis.
EDGE_KINDS = (
    "garbage",
    "truncated",
    "flipped",
    "not_envelope",
    "unknown_type",
    "schema_version",
    "header_mismatch",
    "bad_body",
    "spoof_run",
    "spoof_tenant",
    "wrong_subject",
    "foreign_type",
    "foreign_id",
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


@st.composite
def edge_params(draw: st.DrawFn) -> tuple[str, Any]:
    kind = draw(st.sampled_from(EDGE_KINDS))
    if kind == "garbage":
        return kind, draw(st.binary(min_size=0, max_size=300))
    if kind == "truncated":
        return kind, draw(st.floats(0.0, 0.999))
    if kind == "flipped":
        flips = st.tuples(st.floats(0.0, 0.999), st.integers(1, 255))
        return kind, draw(st.lists(flips, min_size=1, max_size=4))
    if kind == "not_envelope":
        value = draw(json_values)
        # A map holding every envelope key with the right types would be an envelope.
        return kind, value
    if kind == "unknown_type":
        return kind, draw(
            st.text(min_size=0, max_size=20).filter(lambda s: s not in ev.CATALOG)
            | st.sampled_from(["taskSubmitted", "TaskSubmitted ", "", "RolloutScoredV3"])
        )
    if kind == "schema_version":
        return kind, draw(st.sampled_from([0, -1, 3, 99, 2**31]) | st.integers(3, 2**40))
    if kind == "header_mismatch":
        return kind, draw(st.sampled_from(sorted(ev.CATALOG)) | st.text(min_size=1, max_size=10))
    if kind == "bad_body":
        return kind, (draw(st.integers(0, 50)), draw(st.sampled_from(["drop", "str", "none", "list", "map"])))
    if kind in ("spoof_run", "spoof_tenant"):
        return kind, draw(st.sampled_from(["acme2", "globex", "evil", "default", "jetrl", "x" * 64]))
    if kind == "foreign_type":
        return kind, draw(st.integers(0, 10))
    return kind, draw(st.integers(0, 3))


def other_envelope_types(e: ev.Event) -> list[ev.Event]:
    """Events of other types than ``e``'s, for publishing on ``e``'s subject."""
    run, tenant = e.run_id, e.tenant
    z = inline_array(np.zeros(2, np.int32))
    bodies: list[ev.EventBody] = [
        ev.StepCompleted(step=0, policy_version=1, rollout_ids=["math.acme.0-0"]),
        ev.WeightsReady(
            version=1,
            location=ev.PayloadRef(
                store="objstore", bucket=payload_bucket(run), name="weights-v1", size=1, sha256="0" * 64
            ),
            weights_checksum="0" * 64,
        ),
        ev.RunFinished(status="completed", steps=0),
        ev.WorkerHeartbeat(worker_id="inf-9", kind="inference"),
        ev.PolicyVersionPublished(version=1, step=1, weights_checksum="0" * 64),
        ev.TaskSubmitted(task_id="modsum.acme.900", env="modsum", group_size=2, prompt_tokens=[1, 5]),
        ev.GenerationCompleted(
            generation_id="modsum.acme.900-0",
            task_id="modsum.acme.900",
            env="modsum",
            group_id="modsum.acme.900",
            sample_index=0,
            group_size=2,
            prompt_tokens=z,
            completion_tokens=z,
            logprobs=inline_array(np.zeros(2, np.float32)),
            policy_version_start=0,
            policy_version_end=0,
            worker_id="inf-0",
        ),
        ev.RolloutWithheld(
            rollout_id="math.acme.900-0",
            group_id="math.acme.900",
            env="math",
            reason="stale",
            trainer_step=0,
            policy_version=0,
        ),
        ev.EvaluationReported(
            env="modsum",
            policy_version=0,
            n_tasks=1,
            samples=1,
            pass_at_1=0.0,
            pass_at_k=0.0,
            reward_mean=0.0,
            version_min=0,
            version_max=0,
        ),
        ev.WeightsLoaded(version=0, worker_id="inf-0"),
        ev.RunStarted(config={}, code_version="0"),
    ]
    return [ev.new_event(b, run_id=run, tenant=tenant) for b in bodies if e.type != type(b).TYPE]


def edge_item(kind: str, param: Any, base: ev.Event, other_subject: str) -> Item:
    """The hostile message of edge kind ``kind`` made from the valid event ``base``.
    ``other_subject``: a subject the consumer reads that is not ``base``'s own."""
    subject = subjects.subject_for(base)
    raw = encode(base)
    hdr = headers_of(base)
    malformed = frozenset({"malformed"})
    if kind == "garbage":
        return Item(kind, subject, param, None, "dead", malformed)
    if kind == "truncated":
        return Item(kind, subject, raw[: int(param * len(raw))], hdr, "dead", malformed)
    if kind == "flipped":
        buf = bytearray(raw)
        for frac, xor in param:
            buf[int(frac * len(buf))] ^= xor
        data = bytes(buf)
        try:
            ev.decode_event(bytes(data), hdr)
        except ev.EventDecodeError as exc:  # cannot be read: must be dead-lettered, for that reason
            return Item(kind, subject, bytes(data), hdr, "dead", frozenset({exc.reason}))
        return Item(kind, subject, bytes(data), hdr, "either", event=ev.decode_event(bytes(data), hdr))
    if kind == "not_envelope":
        return Item(kind, subject, packed(param), None, "dead", malformed)
    w = wire(base)
    if kind == "unknown_type":
        w["type"] = param
        return Item(kind, subject, packed(w), None, "dead", frozenset({"unknown_type"}))
    if kind == "schema_version":
        w["schema_version"] = param
        return Item(kind, subject, packed(w), hdr, "dead", frozenset({"unsupported_schema"}))
    if kind == "header_mismatch":
        if param == base.type:
            param = param + "X"
        return Item(kind, subject, raw, {**hdr, ev.HEADER_TYPE: param}, "dead", malformed)
    if kind == "bad_body":
        index, how = param
        body = w["body"]
        key = sorted(body)[index % len(body)]
        if how == "drop":
            del body[key]
            required = key in _required_fields(base.type)
            if not required:  # a default is filled in: still a good event
                data = packed(w)
                return Item(kind, subject, data, hdr, "either", event=ev.decode_event(data, hdr))
        else:
            body[key] = {"str": "\u2603", "none": None, "list": [[]], "map": {"k": []}}[how]
        data = packed(w)
        try:  # a string where a string goes (or None where None may go) still decodes
            decoded = ev.decode_event(data, hdr)
        except ev.EventDecodeError:
            return Item(kind, subject, data, hdr, "dead", malformed)
        return Item(kind, subject, data, hdr, "either", event=decoded)
    if kind == "spoof_run":
        e = fresh(base, run_id=base.run_id + param)
        return Item(kind, subject, encode(e), headers_of(e), "dead", frozenset({"spoofed"}), e)
    if kind == "spoof_tenant":
        tenant = param if param != base.tenant else "someone"
        e = fresh(base, tenant=tenant)
        return Item(kind, subject, encode(e), headers_of(e), "dead", frozenset({"spoofed"}), e)
    if kind == "wrong_subject":
        return Item(kind, other_subject, raw, hdr, "dead", frozenset({"spoofed"}), base)
    if kind == "foreign_type":
        others = other_envelope_types(base)
        e = others[param % len(others)]
        return Item(kind, subject, encode(e), headers_of(e), "dead", frozenset({"spoofed"}))
    assert kind == "foreign_id"
    b = base.body
    names = [n for n in ("task_id", "group_id", "generation_id", "rollout_id") if hasattr(b, n)]
    name = names[param % len(names)]
    value: str = getattr(b, name)
    env, _, rest = value.partition(".")
    _, _, rest = rest.partition(".")
    e = fresh(base, body=msgspec.structs.replace(b, **{name: f"{env}.globex.{rest}"}))
    return Item(kind, subject, encode(e), headers_of(e), "dead", frozenset({"spoofed"}), e)


def _required_fields(type_name: str) -> set[str]:
    cls = ev.CATALOG[type_name]
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    return {f.encode_name for f in info.fields if f.required}


# ----------------------------------------------------------------------------- the harness


class LoopThread:
    """An event loop on a thread of its own, so the consumer under test keeps running between
    hypothesis examples (which are synchronous)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class Fuzz:
    """One consumer on one run, and the log it writes, across all examples."""

    name = ""  # the consumer, in the report
    durables: tuple[str, ...] = ()

    def __init__(self, bus: Bus, run_id: str) -> None:
        self.bus = bus
        self.run_id = run_id
        self.stop = asyncio.Event()
        self.task: asyncio.Task[Any] | None = None
        self.collector: asyncio.Task[None] | None = None
        self.dead: dict[int, list[tuple[int, ev.DeadLettered]]] = {}  # original seq -> (seq, body)
        self.forged_dead = 0
        self.outputs: list[tuple[int, ev.Event]] = []
        self.counts: Counter[str] = Counter()
        self.reasons: Counter[str] = Counter()
        self.examples = 0
        self.slowest: tuple[float, str] = (0.0, "")

    # what a consumer defines
    async def start_consumer(self) -> Awaitable[Any]:
        raise NotImplementedError

    async def build(self, recipe: tuple[str, Any]) -> list[Item]:
        raise NotImplementedError

    def processed(self, item: Item) -> bool:
        raise NotImplementedError

    def held(self) -> int:
        """Messages the consumer legitimately keeps unacked (the trainer's partial groups)."""
        return 0

    # the common part
    async def start(self) -> None:
        self.collector = asyncio.create_task(self.collect())
        self.task = asyncio.create_task(self._run(await self.start_consumer()))

    @staticmethod
    async def _run(aw: Awaitable[Any]) -> Any:
        return await aw

    async def collect(self) -> None:
        async for item in self.bus.tail(self.run_id):
            e = item.event
            if e is None:
                continue
            b = e.body
            if isinstance(b, ev.DeadLettered) and b.consumer in self.durables:
                if e.event_id == ids.dead_letter_id(self.run_id, b.consumer, b.original_stream_seq):
                    self.dead.setdefault(b.original_stream_seq, []).append((item.seq, b))
                else:
                    self.forged_dead += 1
            else:
                self.outputs.append((item.seq, e))

    async def settled(self) -> bool:
        pending = acked = 0
        for durable in self.durables:
            try:
                info = await self.bus.js.consumer_info(f"JETRL_{self.run_id}", durable)
            except Exception:
                return False  # not created yet
            pending += info.num_pending or 0
            acked += info.num_ack_pending or 0
        return pending == 0 and acked <= self.held()

    def outcome(self, it: Item) -> tuple[bool, bool]:
        return bool(self.dead.get(it.seq)), self.processed(it)

    async def run_case(self, items: list[Item]) -> None:
        assert self.task is not None
        self.examples += 1
        for it in items:
            ack = await self.bus.js.publish(it.subject, it.data, headers=it.headers or None)
            assert not ack.duplicate, it
            it.seq = ack.seq
            self.counts[it.kind] += 1

        def resolved(it: Item) -> bool:
            dead, done = self.outcome(it)
            if it.expect == "dead":
                return dead
            if it.expect == "good":
                return done
            if it.expect == "withheld":
                return self.withheld(it)
            return dead or done or self.is_held(it)

        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline and not self.task.done():
            if all(resolved(it) for it in items) and await self.settled():
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)  # a second dead letter or output would show by now
        assert not self.task.done(), f"the {self.name} stopped: {self.task}"
        for it in items:
            dls = self.dead.get(it.seq, [])
            dead, done = self.outcome(it)
            where = f"{it.kind} (seq {it.seq}, {it.subject}): {it.data[:200]!r}"
            if it.expect == "dead":
                assert len(dls) == 1, f"{len(dls)} dead letters for {where}"
                reason = dls[0][1].reason
                assert reason, where
                assert it.reasons is None or reason in it.reasons, f"reason {reason!r} for {where}"
                assert not done, f"processed although dead-lettered: {where}"
                self.reasons[reason] += 1
            elif it.expect == "good":
                assert done, f"good event not processed: {where}; dead letters {[b for _, b in dls]}"
                assert not dls, f"good event dead-lettered: {where}: {dls[0][1].detail}"
            elif it.expect == "withheld":
                assert self.withheld(it) and not dls and not done, where
            else:
                assert (dead, done, self.is_held(it)).count(True) == 1 and len(dls) <= 1, where
                if dls:
                    self.reasons[dls[0][1].reason] += 1
        assert await self.settled(), f"the {self.name}'s consumers did not settle"

    def withheld(self, it: Item) -> bool:
        return False

    def is_held(self, it: Item) -> bool:
        return False

    async def close(self) -> None:
        self.stop.set()
        if self.task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.task, 60)
        if self.collector is not None:
            self.collector.cancel()
            with contextlib.suppress(BaseException):
                await self.collector

    def report(self) -> str:
        good = sum(n for k, n in self.counts.items() if k.startswith("good"))
        lines = [
            f"fuzz {self.name}: {self.examples} examples, {sum(self.counts.values())} events "
            f"({good} good), dead-lettered by reason {dict(sorted(self.reasons.items()))}",
            *(f"  {k}: {n}" for k, n in sorted(self.counts.items())),
            f"  slowest example {self.slowest[0]:.1f} s: {self.slowest[1]}",
        ]
        return "\n".join(lines)


def drive(
    nats_server: EmbeddedServer,
    make: Callable[[Bus, str], Fuzz],
    recipes: st.SearchStrategy[list[tuple[str, Any]]],
    examples: int,
) -> Fuzz:
    """Start the consumer, run ``examples`` hypothesis examples through it, print the counts."""
    lt = LoopThread()
    run_id = f"f{uuid.uuid4().hex[:12]}"

    async def setup() -> Fuzz:
        bus = await Bus.connect(nats_server.url, name="fuzz")
        await bus.ensure_run(run_id, TEST_LIMITS)
        fz = make(bus, run_id)
        await fz.start()
        return fz

    fz = lt.run(setup(), 120)
    try:

        @fuzz_settings(examples)
        @given(recipes)
        def check(case: list[tuple[str, Any]]) -> None:
            async def one() -> None:
                items = [it for r in case for it in await fz.build(r)]
                await fz.run_case(items)

            t0 = time.monotonic()
            lt.run(one(), SETTLE_S + 60)
            fz.slowest = max(fz.slowest, (time.monotonic() - t0, str(case)[:300]))

        check()
    finally:
        print()
        print(fz.report())
        lt.run(fz.close(), 90)
        lt.run(fz.bus.close(), 10)
        lt.close()
    return fz


def mixed(
    good: st.SearchStrategy[tuple[str, Any]], bad: st.SearchStrategy[tuple[str, Any]]
) -> st.SearchStrategy[list[tuple[str, Any]]]:
    """An example: one to three good events and one to four bad ones, in any order."""
    return st.tuples(st.lists(good, min_size=1, max_size=3), st.lists(bad, min_size=1, max_size=4)).flatmap(
        lambda gb: st.permutations([*gb[0], *gb[1]])
    )


# ----------------------------------------------------------------------------- inference


class TolerantEngine(OracleEngine):
    """The oracle, but for any prompt: modsum prompts are answered, anything else gets an
    end-of-turn token (a real model generates from any in-vocabulary prompt)."""

    async def generate(self, groups: Any) -> list[list[Sample]]:
        out = []
        for g in groups:
            try:
                ids_ = self.answer(g.prompt_tokens)
            except Exception:
                ids_ = np.asarray([TOK.eos_id], np.int32)
            ids_ = ids_[: max(1, g.max_tokens)]
            out.append([Sample(ids_, np.zeros(len(ids_), np.float32), "stop") for _ in range(g.n)])
        return out


_ = GroupRequest  # the requests TolerantEngine answers


INFERENCE_BAD = (
    "unknown_env",
    "unknown_tenant",
    "invalid_group",
    "bad_tokens",
    "too_long",
    "oversized",
    "bad_params",
    "future_version",
)


@st.composite
def inference_good(draw: st.DrawFn) -> tuple[str, Any]:
    kind = draw(st.sampled_from(["good_task", "good_task", "good_gateway", "good_bare", "good_odd"]))
    a, b = draw(st.integers(0, 9)), draw(st.integers(0, 9))
    return kind, {
        "a": a,
        "b": b,
        "group_size": draw(st.integers(2, 6)),
        "max_tokens": draw(st.integers(0, 8)),
        "temperature": draw(st.sampled_from([0.0, 0.7, 1.0, 1e30])),
        "min_policy_version": draw(st.sampled_from([0, 0, -3])),
    }


@st.composite
def inference_bad(draw: st.DrawFn) -> tuple[str, Any]:
    if draw(st.booleans()):
        return draw(edge_params())
    kind = draw(st.sampled_from(INFERENCE_BAD))
    if kind == "invalid_group":
        return kind, draw(st.sampled_from([0, 1, -1, -(2**40), 4097, 10**6, 2**62]))
    if kind == "bad_tokens":
        bad = st.integers(VOCAB, 2**62) | st.integers(-(2**62), -1)
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), max_size=6))
        return kind, (draw(st.booleans()) or not prompt, prompt, draw(bad), draw(st.integers(0, 6)))
    if kind == "too_long":
        return kind, (draw(st.integers(1, CONTEXT)), draw(st.integers(0, 2**31)))
    if kind == "oversized":
        return kind, draw(st.integers(CONTEXT, 100_000))
    if kind == "bad_params":
        return kind, draw(
            st.sampled_from(
                [("temperature", math.nan), ("temperature", math.inf), ("temperature", -math.inf)]
            )
            | st.tuples(st.just("temperature"), st.floats(max_value=-1e-300, allow_nan=False))
            | st.tuples(st.just("max_tokens"), st.integers(-(2**62), -1))
        )
    if kind == "future_version":
        return kind, draw(st.integers(3, 2**62))
    return kind, draw(st.sampled_from(["nope", "gateway2", "math"]))


class InferenceFuzz(Fuzz):
    name = "inference"
    durables = ("inference",)

    def __init__(self, bus: Bus, run_id: str) -> None:
        super().__init__(bus, run_id)
        self.n = 0
        self.generations: dict[str, int] = {}  # task event id -> GenerationCompleted seen

    async def start_consumer(self) -> Awaitable[Any]:
        payloads = await Payloads.for_run(self.bus.js, self.run_id)
        ref = await payloads.default.put("weights-v0", b"weights")
        ready = ev.WeightsReady(version=0, location=ref, weights_checksum="0" * 64)
        await self.bus.publish(ev.new_event(ready, run_id=self.run_id))
        part = InferencePart(
            inference=InferenceSettings(engine="tests.support.engines:OracleEngine", max_batch_tasks=8),
            model=ModelSettings(name="tiny-dense"),  # vocabulary 64, context 256
            tenants=[TenantSettings(name="acme")],  # one tenant: one consumer over every task subject
            envs=[EnvRoute(tenant="acme", env="modsum", group_size=2)],
        )
        worker = InferenceWorker(self.bus, self.run_id, "w0", part)
        worker.engine = TolerantEngine(part, "w0")
        worker.future_delays = (0.05,)
        return worker.run(self.stop)

    def make_task(self, tenant: str = "acme", env: str = "modsum", **over: Any) -> ev.Event:
        self.n += 1
        fields: dict[str, Any] = {
            "task_id": f"{env}.{tenant}.{self.n}",
            "env": env,
            "group_size": 2,
            "prompt_tokens": TOK.encode("3+4="),
            "max_tokens": 2,
        }
        fields.update(over)
        return ev.new_event(ev.TaskSubmitted(**fields), run_id=self.run_id, tenant=tenant)

    async def build(self, recipe: tuple[str, Any]) -> list[Item]:
        kind, p = recipe
        if kind.startswith("good"):
            over = {
                "prompt_tokens": TOK.encode(f"{p['a']}+{p['b']}="),
                "group_size": p["group_size"],
                "max_tokens": p["max_tokens"],
                "temperature": p["temperature"],
                "min_policy_version": p["min_policy_version"],
            }
            if kind == "good_gateway":  # the gateway's tasks: any tenant of the run, group of one
                tenant = "default" if p["a"] % 2 else "acme"
                e = self.make_task(tenant, "gateway", **{**over, "group_size": 1})
            elif kind == "good_odd":  # a later turn and an evaluation: groups of one
                if p["b"] % 2:
                    e = self.make_task(**{**over, "group_size": 1, "turn": 1, "episode_id": "modsum.acme.0"})
                else:
                    self.n += 1
                    e = self.make_task(
                        **{**over, "group_size": 1, "task_id": f"modsum.acme.eval.v0.n{self.n}"}
                    )
            else:
                e = self.make_task(**over)
            item = good_item(kind, e)
            if kind == "good_bare":
                item.headers = None  # no Nats-Msg-Id, no Jetrl-Type: optional
            return [item]
        if kind in EDGE_KINDS:
            base = self.make_task()
            return [edge_item(kind, p, base, subjects.task_subject(self.run_id, "acme", "gateway"))]
        if kind == "unknown_env":
            return [dead_item(kind, self.make_task(env=p), "unknown_env")]
        if kind == "unknown_tenant":
            return [dead_item(kind, self.make_task(tenant="evil"), "unknown_env")]
        if kind == "invalid_group":
            return [dead_item(kind, self.make_task(group_size=p), "invalid_group")]
        if kind == "bad_tokens":
            empty, prompt, bad, at = p
            tokens = [] if empty else [*prompt[:at], bad, *prompt[at:]]
            return [dead_item(kind, self.make_task(prompt_tokens=tokens), "bad_tokens")]
        if kind == "too_long":
            plen, max_tokens = p
            max_tokens = max(max_tokens, CONTEXT - plen + 1)
            return [
                dead_item(kind, self.make_task(prompt_tokens=[5] * plen, max_tokens=max_tokens), "too_long")
            ]
        if kind == "oversized":
            return [dead_item(kind, self.make_task(prompt_tokens=[5] * p), "too_long")]
        if kind == "bad_params":
            name, value = p
            return [dead_item(kind, self.make_task(**{name: value}), "bad_params")]
        assert kind == "future_version"
        return [dead_item(kind, self.make_task(min_policy_version=p), "future_version")]

    def processed(self, item: Item) -> bool:
        e = item.event
        if e is None:
            return False
        while self.outputs:  # fold new outputs in
            _, out = self.outputs.pop()
            if isinstance(out.body, ev.GenerationCompleted) and out.causation_id:
                self.generations[out.causation_id] = self.generations.get(out.causation_id, 0) + 1
        want = max(1, e.body.group_size) if isinstance(e.body, ev.TaskSubmitted) else 1
        return self.generations.get(e.event_id, 0) >= want


def test_fuzz_inference_worker(nats_server: EmbeddedServer) -> None:
    drive(nats_server, InferenceFuzz, mixed(inference_good(), inference_bad()), examples=150)


# ----------------------------------------------------------------------------- the scorer


def arr(values: Any, dtype: str) -> ev.InlineArray:
    return inline_array(np.asarray(values, dtype=dtype))


@st.composite
def scorer_good(draw: st.DrawFn) -> tuple[str, Any]:
    kind = draw(st.sampled_from(["good_generation", "good_generation", "good_odd_values"]))
    return kind, (draw(st.integers(0, 4)), draw(st.integers(0, 4)), draw(st.integers(-5, 10**6)))


@st.composite
def scorer_bad(draw: st.DrawFn) -> tuple[str, Any]:
    if draw(st.booleans()):
        return draw(edge_params())
    kind = draw(st.sampled_from(["unknown_task", "missing_payload", "short_bytes", "bad_dtype", "log_ref"]))
    return kind, draw(st.integers(0, 2**31))


class ScorerFuzz(Fuzz):
    name = "scorer"
    durables = ("scorer-acme-modsum",)

    def __init__(self, bus: Bus, run_id: str) -> None:
        super().__init__(bus, run_id)
        part = ProducerPart(env=EnvSettings(name="modsum", tenant="acme", group_size=2))
        self.producer = EnvProducer(bus, run_id, part)
        self.n = 0
        self.scored: set[str] = set()  # generation event ids scored

    async def start_consumer(self) -> Awaitable[Any]:
        self.producer.payloads = Payloads(await ObjectStorePayloads.for_run(self.bus.js, self.run_id))
        return self.producer.score_loop(self.stop)

    def generation(self, *, known: bool = True, **over: Any) -> ev.Event:
        self.n += 1
        tid = f"modsum.acme.{self.n}"
        a, b = self.n % 5, (self.n // 5) % 5
        if known:  # the producer handed the task out
            self.producer.tasks[tid] = ev.TaskSubmitted(
                task_id=tid,
                env="modsum",
                group_size=2,
                prompt_tokens=TOK.encode(f"{a}+{b}="),
                info={"answer": str((a + b) % 5)},
            )
        completion = TOK.encode(str((a + b) % 5), bos=False, eos=True)
        fields: dict[str, Any] = {
            "generation_id": f"{tid}-0",
            "task_id": tid,
            "env": "modsum",
            "group_id": tid,
            "sample_index": 0,
            "group_size": 2,
            "prompt_tokens": arr(TOK.encode(f"{a}+{b}="), "int32"),
            "completion_tokens": arr(completion, "int32"),
            "logprobs": arr([-0.1] * len(completion), "float32"),
            "policy_version_start": 0,
            "policy_version_end": 0,
            "worker_id": "inf-0",
        }
        fields.update(over)
        return ev.new_event(ev.GenerationCompleted(**fields), run_id=self.run_id, tenant="acme")

    async def build(self, recipe: tuple[str, Any]) -> list[Item]:
        kind, p = recipe
        if kind == "good_generation":
            return [good_item(kind, self.generation())]
        if kind == "good_odd_values":
            # Values only the trainer judges (it refuses them): the scorer scores what it can read.
            i, size, token = p
            e = self.generation(
                sample_index=i - 2,
                group_size=size,
                completion_tokens=arr([token, TOK.eos_id], "int32"),
                logprobs=arr([math.nan, -1.0], "float32"),
            )
            return [good_item(kind, e)]
        if kind == "wrong_subject":  # its consumer reads one subject: a body of another env on it
            e = self.generation(env="code")
            return [
                dead_item(
                    kind, e, "spoofed", subject=subjects.generation_subject(self.run_id, "acme", "modsum")
                )
            ]
        if kind in EDGE_KINDS:
            return [edge_item(kind, p, self.generation(), "")]
        if kind == "unknown_task":
            return [dead_item(kind, self.generation(known=False), "invalid")]
        bucket = payload_bucket(self.run_id)
        bad: ev.ArrayRef
        if kind == "missing_payload":
            bad = ev.PayloadRef(
                store="objstore",
                bucket=bucket,
                name=f"tokens-missing-{p}",
                size=8,
                sha256="0" * 64,
                dtype="int32",
                shape=(2,),
            )
        elif kind == "short_bytes":
            bad = ev.InlineArray(dtype="int32", shape=(3,), data=b"\0" * (p % 12))
        elif kind == "bad_dtype":
            bad = ev.InlineArray(
                dtype=["object", "complex128", "U8", "bfloat16"][p % 4], shape=(1,), data=b""
            )
        else:
            bad = ev.LogArray(seq=p, field="completion_tokens", dtype="int32", shape=(2,))
        return [dead_item(kind, self.generation(completion_tokens=bad), "unreadable")]

    def processed(self, item: Item) -> bool:
        while self.outputs:
            _, out = self.outputs.pop()
            if isinstance(out.body, ev.RolloutScored) and out.causation_id:
                self.scored.add(out.causation_id)
        return item.event is not None and item.event.event_id in self.scored


def test_fuzz_environment_scorer(nats_server: EmbeddedServer) -> None:
    drive(
        nats_server,
        ScorerFuzz,
        mixed(scorer_good(), scorer_bad()),
        examples=int(os.environ.get("FUZZ_N", 120)),
    )


# ----------------------------------------------------------------------------- the recorder


@st.composite
def recorder_good(draw: st.DrawFn) -> tuple[str, Any]:
    kind = draw(st.sampled_from(["good_task", "good_generation", "good_rollout", "good_odd_rollout"]))
    return kind, (draw(st.integers(0, 100_000)), draw(st.sampled_from([math.nan, math.inf, -1e300, 0.5])))


class RecorderFuzz(Fuzz):
    name = "recorder"
    durables = ("recorder",)

    def __init__(self, bus: Bus, run_id: str, store: Store) -> None:
        super().__init__(bus, run_id)
        self.store = store
        self.recorder = Recorder(bus, store, run_id, batch=200, fetch_timeout=0.2)
        self.n = 0

    async def start_consumer(self) -> Awaitable[Any]:
        return self.recorder.run()

    async def close(self) -> None:
        self.recorder.stop()
        await super().close()
        self.recorder.close()

    def event(self, kind: str, p: Any = (3, 0.5)) -> ev.Event:
        self.n += 1
        n, reward = p
        z = arr([1, 2], "int32")
        tid = f"modsum.acme.{self.n}"
        body: ev.EventBody
        if kind == "task":
            body = ev.TaskSubmitted(task_id=tid, env="modsum", group_size=2, prompt_tokens=[5] * n)
        elif kind == "generation":
            body = ev.GenerationCompleted(
                generation_id=f"{tid}-0",
                task_id=tid,
                env="modsum",
                group_id=tid,
                sample_index=0,
                group_size=2,
                prompt_tokens=z,
                completion_tokens=z,
                logprobs=arr([0.0, 0.0], "float32"),
                policy_version_start=0,
                policy_version_end=0,
                worker_id="inf-0",
            )
        else:
            odd = kind == "odd_rollout"  # what the trainer refuses is still a fact to record
            body = ev.RolloutScored(
                rollout_id=f"{tid}-{-1 if odd else 0}",
                generation_event_id=uuid.uuid4().hex,
                task_id=tid,
                env="modsum",
                group_id=tid,
                sample_index=-1 if odd else 0,
                group_size=0 if odd else 2,
                reward=reward if odd else 0.5,
                reward_parts={"x": reward} if odd else {},
                prompt_tokens=ev.LogArray(seq=10**9, field="x", dtype="int32", shape=(n,)) if odd else z,
                completion_tokens=z,
                logprobs=arr([0.0], "int32") if odd else arr([0.0, 0.0], "float32"),
                policy_version_start=5 if odd else 0,
                policy_version_end=n if odd else 0,
            )
        return ev.new_event(body, run_id=self.run_id, tenant="acme")

    async def build(self, recipe: tuple[str, Any]) -> list[Item]:
        kind, p = recipe
        if kind.startswith("good_"):
            return [good_item(kind, self.event(kind.removeprefix("good_"), p))]
        base = self.event(["task", "generation", "rollout"][self.n % 3])
        other = subjects.step_subject(self.run_id)
        return [edge_item(kind, p, base, other)]

    def processed(self, item: Item) -> bool:
        import sqlalchemy as sa

        if item.seq > self.recorder.recorded_seq:
            return False
        e = item.event
        if e is None:
            return False
        b = e.body
        table, key, col = {
            ev.TaskSubmitted: ("tasks", "task_id", "seq"),
            ev.GenerationCompleted: ("generations", "event_id", "seq"),
            ev.RolloutScored: ("rollouts", "rollout_id", "scored_seq"),
        }.get(type(b), ("", "", ""))
        if not table:
            return False
        value = e.event_id if key == "event_id" else getattr(b, key)
        with self.store.read() as conn:
            row = conn.execute(
                sa.text(f"SELECT {col} FROM {table} WHERE run_id = :r AND {key} = :k"),
                {"r": self.run_id, "k": value},
            ).first()
        return row is not None and row[0] == item.seq


def test_fuzz_recorder(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        drive(
            nats_server,
            lambda bus, run: RecorderFuzz(bus, run, store),
            mixed(recorder_good(), edge_params()),
            examples=120,
        )
    finally:
        store.close()
