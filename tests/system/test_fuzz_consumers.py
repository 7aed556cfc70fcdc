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
from jetrl.bus.payloads import ObjectStorePayloads, Payloads, inline_array, log_array
from jetrl.bus.server import EmbeddedServer
from jetrl.bus.settings import EnvRoute, TenantSettings
from jetrl.bus.streams import payload_bucket
from jetrl.consumers.inference.engine import GroupRequest, Sample
from jetrl.consumers.inference.settings import InferencePart, InferenceSettings
from jetrl.consumers.inference.worker import InferenceWorker
from jetrl.consumers.recorder import Recorder
from jetrl.consumers.trainer.replay import read_rollouts
from jetrl.consumers.trainer.settings import TrainerPart, TrainerSettings
from jetrl.consumers.trainer.trainer import Trainer
from jetrl.policy.origin import model_config_of
from jetrl.policy.settings import ModelSettings
from jetrl.policy.tokenizer import CharTokenizer
from jetrl.producers.producer import EnvProducer
from jetrl.producers.settings import EnvSettings, ProducerPart
from jetrl.store.db import Store, open_store
from tests.conftest import TEST_LIMITS
from tests.support.catalog_samples import forged_generation
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
    # "withheld": a good rollout whose group a bad member condemned (trainer); "ignored":
    # settled without a dead letter or any effect (the trainer's copy of a rollout it has).
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


# Transformations every consumer's edge (bus/consumer.py, PullConsumer._admit) must refuse,
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
        forged_generation("modsum.acme.900", "modsum", np.zeros(2, np.int32), group_size=2),
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
        self.own: set[int] = set()  # log positions of what this harness published (not outputs)
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
            self.own.add(ack.seq)
            self.counts[it.kind] += 1

        def resolved(it: Item) -> bool:
            dead, done = self.outcome(it)
            if it.expect == "dead":
                return dead
            if it.expect == "good":
                return done
            if it.expect == "withheld":
                return self.withheld(it)
            if it.expect == "ignored":
                return True  # settled() decides
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
            elif it.expect == "ignored":
                assert not dls and not done and not self.is_held(it), where
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


# ----------------------------------------------------------------------------- the trainer

# tiny-moe, the trainer's default model: vocabulary 64, context 256, 2 MoE layers of 8
# experts, top 2, routing replayed (every rollout carries a trace).
MOE_LAYERS, TOP_K, EXPERTS = 2, 2, 8
TRAINER_ROUTES = [
    EnvRoute(tenant="acme", env="math", group_size=2),
    EnvRoute(tenant="globex", env="code", group_size=3),
]
NAN, INF = math.nan, math.inf
# The trainer's own reasons, beside the bus's: those found at admission, and those found only
# when a complete group's arrays are read for a step (bad_tokens, nan_logprobs, unreadable,
# bad_values); a refused member's group mates are withheld (incomplete_group) where the reason
# condemns the group.
TRAINER_BAD = (
    "unknown_env",
    "bad_ids",
    "invalid_group",
    "non_finite",
    "reward_range",
    "bad_version",
    "future_version",
    "bad_arrays",
    "too_long",
    "bad_tokens",
    "nan_logprobs",
    "unreadable",
    "bad_values",
    "replay_trained",
    "replay_withheld",
)
TRAINER_REASON = {
    "nan_logprobs": "non_finite",
    "unreadable": "bad_arrays",
    "bad_values": "bad_arrays",
}
READ_TIME = frozenset({"bad_tokens", "nan_logprobs", "unreadable", "bad_values"})


@dataclass
class Member:
    """One rollout's arrays, before they are put in an event."""

    prompt: np.ndarray
    completion: np.ndarray
    logprobs: np.ndarray
    trace: np.ndarray
    mask: np.ndarray | None = None


def member(
    rng: np.random.Generator, plen: int, clen: int, tokens: str = "int32", lp: str = "float32"
) -> Member:
    rows = plen + clen - 1
    trace = np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(rows * MOE_LAYERS)])
    return Member(
        prompt=rng.integers(0, VOCAB, plen).astype(tokens),
        completion=rng.integers(0, VOCAB, clen).astype(tokens),
        # Near a fresh tiny model's own (-ln 64): the step's importance ratios keep the tokens,
        # so steps change the weights.
        logprobs=rng.uniform(-4.6, -3.7, clen).astype(lp),
        trace=trace.reshape(rows, MOE_LAYERS, TOP_K).astype(np.uint8),
    )


@st.composite
def trainer_good(draw: st.DrawFn) -> tuple[str, Any]:
    kind = draw(st.sampled_from(["good_group", "good_group", "good_code", "good_refs", "good_odd"]))
    return kind, {
        "seed": draw(st.integers(0, 2**32 - 1)),
        "plen": draw(st.integers(1, 12)),
        "clen": draw(st.integers(1, 6)),
        "tokens": draw(st.sampled_from(["int32", "int32", "int64", "uint16", "uint8"])),
        "lp": draw(st.sampled_from(["float32", "float32", "float16", "float64"])),
        "rewards": draw(st.lists(st.floats(-10, 10) | st.sampled_from([0.0, 1.0]), min_size=3, max_size=3)),
        "stale": draw(st.integers(0, 10**6)),
        "mask": draw(st.booleans()),
        "dup": draw(st.sampled_from([-1, -1, 0, 1])),  # a member published twice
        "odd": draw(st.integers(0, 5)),
    }


@st.composite
def trainer_bad(draw: st.DrawFn) -> tuple[str, Any]:
    if draw(st.integers(0, 3)) == 0:
        return draw(edge_params())
    # The kinds with most variants, more often.
    kind = draw(st.sampled_from([*TRAINER_BAD, *READ_TIME, "unreadable", "bad_arrays", "bad_arrays"]))
    oov = (
        st.tuples(st.just("int32"), st.integers(VOCAB, 2**31 - 1) | st.integers(-(2**31), -1))
        | st.tuples(st.just("int64"), st.integers(VOCAB, 2**63 - 1) | st.integers(-(2**63), -1))
        | st.tuples(st.just("uint16"), st.integers(VOCAB, 2**16 - 1))
        | st.tuples(st.just("uint8"), st.integers(VOCAB, 255))
    )
    return kind, {
        "seed": draw(st.integers(0, 2**32 - 1)),
        "variant": draw(st.integers(0, 2**16)),
        "code": draw(st.integers(0, 3)) == 0,  # globex's code (groups of 3), else acme's math
        "partner": draw(st.booleans()),
        "first": draw(st.booleans()),  # the bad member before its mates
        "big": draw(st.integers(1, 2**62) | st.sampled_from([1, 2, 10**9])),
        "seq": draw(st.integers(-(2**63), 2**64 - 1) | st.sampled_from([0, -1, 10**9, 2**63 - 1, 2**64 - 1])),
        "nonfinite": draw(st.sampled_from([NAN, INF, -INF])),
        "huge": draw(st.floats(1.000001e9, 1e308)),
        "oov": draw(oov),
        "text": draw(st.text(max_size=12)),
    }


class TrainerFuzz(Fuzz):
    name = "trainer"
    durables = ("trainer",)

    def __init__(self, bus: Bus, run_id: str, run_dir: Path) -> None:
        super().__init__(bus, run_id)
        settings_ = TrainerSettings(
            batch_groups=1,
            max_off_policy_steps=10**9,  # nothing good is withheld as stale
            max_steps=10**6,
            checkpoint_every=0,
        )
        self.part = TrainerPart(trainer=settings_, envs=TRAINER_ROUTES)  # model: tiny-moe
        self.trainer = Trainer(bus, run_id, self.part, run_dir)
        self.n = 0
        self.garbage_seq = 0  # an undecodable message in the log, for a LogArray to point at
        self.gen_seq = 0  # a GenerationCompleted in the log
        self.by_seq: dict[int, Item] = {}
        self.trained_seqs: Counter[int] = Counter()  # stream seq -> StepCompleted naming it
        self.trained_ids: Counter[str] = Counter()
        self.withheld_of: dict[str, str] = {}  # causation (the rollout's event id) -> reason
        self.trained_items: list[Item] = []
        self.withheld_items: list[Item] = []
        self.replay_checked: set[str] = set()
        self.replay_mismatch: list[tuple[str, str]] = []  # (rollout id, kind of the first copy)
        self.nonfinite_metrics: Counter[str] = Counter()
        self.steps = 0
        self.payloads: Payloads | None = None

    async def start_consumer(self) -> Awaitable[Any]:
        cfg = model_config_of(self.part.model)
        assert (cfg.vocab_size, cfg.max_seq_len) == (VOCAB, CONTEXT)
        assert (cfg.num_moe_layers, cfg.top_k, cfg.num_experts) == (MOE_LAYERS, TOP_K, EXPERTS)
        self.payloads = await Payloads.for_run(self.bus.js, self.run_id)
        junk = await self.bus.js.publish(
            subjects.generation_subject(self.run_id, "acme", "math"), b"\xc1junk"
        )
        self.garbage_seq = junk.seq
        return self.trainer.run(self.stop)

    # ------------------------------------------------------------ building rollouts

    def group_id(self, tenant: str, env: str, tag: str = "g") -> str:
        self.n += 1
        return f"{env}.{tenant}.{tag}{self.n}"

    async def put(self, name: str, a: np.ndarray, mode: str, gen_seq: int, field_: str) -> ev.ArrayRef:
        assert self.payloads is not None
        if mode == "store":
            return await self.payloads.put_array(f"{name}-{field_}", a, inline_threshold=0)
        if mode == "log":
            return log_array(gen_seq, field_, inline_array(a))
        return inline_array(a)

    async def rollout(
        self,
        gid: str,
        i: int,
        m: Member,
        *,
        tenant: str,
        env: str,
        size: int,
        reward: float = 0.0,
        mode: str = "inline",
        start: int | None = None,
        end: int | None = None,
        **changes: Any,
    ) -> ev.Event:
        """Sample ``i`` of group ``gid``, its arrays inline, in the object store or (``log``)
        its generation's, published first; then ``changes``."""
        version = self.trainer.version
        end = version if end is None else end
        start = end if start is None else start
        gen_seq = 0
        gen_id = uuid.uuid4().hex  # the generation's event id (its arrays lie there in "log" mode)
        if mode == "log":
            gen = ev.GenerationCompleted(
                generation_id=f"{gid}-{i}",
                task_id=gid,
                env=env,
                group_id=gid,
                sample_index=i,
                group_size=size,
                prompt_tokens=inline_array(m.prompt),
                completion_tokens=inline_array(m.completion),
                logprobs=inline_array(m.logprobs),
                routing_trace=inline_array(m.trace),
                policy_version_start=start,
                policy_version_end=end,
                worker_id="inf-0",
            )
            gen_event = ev.new_event(gen, run_id=self.run_id, tenant=tenant, event_id=gen_id)
            gen_seq = (await self.bus.publish(gen_event)).seq
            self.gen_seq = gen_seq
        name = f"{gid}-{i}-{uuid.uuid4().hex[:6]}"
        b = ev.RolloutScored(
            rollout_id=ids.rollout_id(gid, i),
            generation_event_id=gen_id,
            task_id=gid,
            env=env,
            group_id=gid,
            sample_index=i,
            group_size=size,
            reward=reward,
            reward_parts={"correct": reward},
            prompt_tokens=await self.put(name, m.prompt, mode, gen_seq, "prompt_tokens"),
            completion_tokens=await self.put(name, m.completion, mode, gen_seq, "completion_tokens"),
            logprobs=await self.put(name, m.logprobs, mode, gen_seq, "logprobs"),
            routing_trace=await self.put(name, m.trace, mode, gen_seq, "routing_trace"),
            completion_mask=None if m.mask is None else inline_array(m.mask),
            policy_version_start=start,
            policy_version_end=end,
        )
        if changes:
            b = msgspec.structs.replace(b, **changes)
        return ev.new_event(b, run_id=self.run_id, tenant=tenant)

    async def good_group(self, kind: str, p: dict[str, Any]) -> list[Item]:
        rng = np.random.default_rng(p["seed"])
        tenant, env, size = ("globex", "code", 3) if kind == "good_code" else ("acme", "math", 2)
        gid = self.group_id(tenant, env)
        plen, clen, rewards = p["plen"], p["clen"], list(p["rewards"])
        version = self.trainer.version
        start = max(0, version - p["stale"])
        odd = p["odd"] if kind == "good_odd" else -1
        if odd == 0:  # the whole context
            plen = CONTEXT - clen
        elif odd == 1:  # no advantage at all
            rewards = [rewards[0]] * 3
        elif odd == 2:  # the largest rewards allowed
            rewards = [1e9, -1e9, 1e9]
        elif odd == 5:  # the oldest version, still within max_off_policy_steps
            start = 0
        modes = ["inline", "log", "store"]
        out = []
        for i in range(size):
            m = member(rng, plen, clen, p["tokens"], p["lp"])
            if p["mask"] or odd == 3:
                m.mask = np.zeros(clen, np.uint8) if odd == 3 else rng.integers(0, 2, clen).astype(np.uint8)
            if odd == 4:  # the vocabulary's ends
                m.prompt[:] = 0
                m.completion[:] = VOCAB - 1
            mode = modes[(p["seed"] + i) % 3] if kind == "good_refs" else "inline"
            end = rng.integers(start, version + 1)
            e = await self.rollout(
                gid,
                i,
                m,
                tenant=tenant,
                env=env,
                size=size,
                reward=rewards[i],
                mode=mode,
                start=start,
                end=int(end),
            )
            out.append(good_item(kind, e))
        order = rng.permutation(size)
        items = [out[k] for k in order]
        if p["dup"] >= 0:  # the same rollout again (a producer's retry): kept once
            e = items[p["dup"] % size].event
            assert e is not None
            copy = fresh(e)
            items.insert(
                int(rng.integers(p["dup"] % size + 1, size + 1)),
                Item(
                    kind + "_dup",
                    subjects.subject_for(copy),
                    encode(copy),
                    headers_of(copy),
                    "ignored",
                    event=copy,
                ),
            )
        return items

    async def bad_group(self, kind: str, p: dict[str, Any]) -> list[Item]:
        rng = np.random.default_rng(p["seed"])
        tenant, env, size = ("globex", "code", 3) if p["code"] else ("acme", "math", 2)
        v = p["variant"]
        version = self.trainer.version
        plen, clen = int(rng.integers(1, 8)), int(rng.integers(1, 5))
        bad_i = int(rng.integers(0, size))
        members = [member(rng, plen, clen) for _ in range(size)]
        mates: list[int] = [i for i in range(size) if i != bad_i]
        reasons = (TRAINER_REASON.get(kind, kind),)
        mate_expect = "withheld"
        changes: dict[str, Any] = {}
        mode = "inline"
        m = members[bad_i]
        if kind == "unknown_env":  # the whole group is of an env the tenant does not have
            env = ["poker", "code" if tenant == "acme" else "math"][v % 2]
            mate_expect = "dead"
        gid = self.group_id(tenant, env)
        if kind == "bad_ids":
            # A rollout id that is not its group's sample: alone, or (first) claiming a mate's
            # id; the real members then come too, and train.
            target = mates[v % len(mates)] if p["partner"] else bad_i + 7
            changes["rollout_id"] = ids.rollout_id(gid, target)
            mate_expect = "good"
        elif kind == "invalid_group":
            if v % 2:
                changes["group_size"] = [1, 0, -1, size + 1, size - 1, 4097, 2**62, -(2**62)][v // 2 % 8]
                if changes["group_size"] == size:
                    changes["group_size"] = 1
            else:
                index = [size, size + 1, -1, 2**62, -(2**40)][v // 2 % 5]
                changes.update(sample_index=index, rollout_id=ids.rollout_id(gid, index))
        elif kind == "non_finite":
            if v % 2:
                changes["reward"] = p["nonfinite"]
            else:
                changes["reward_parts"] = {"correct": 1.0, p["text"] + "x": p["nonfinite"]}
        elif kind == "reward_range":
            changes["reward"] = p["huge"] if v % 2 else -p["huge"]
        elif kind == "bad_version":
            end = int(rng.integers(0, version + 1))
            if v % 2:
                changes.update(policy_version_start=-p["big"], policy_version_end=end)
            else:
                changes.update(policy_version_start=end + p["big"], policy_version_end=end)
        elif kind == "future_version":  # past any version this example can reach
            changes.update(policy_version_start=0, policy_version_end=version + 100 + p["big"])
        elif kind == "too_long":
            members[bad_i] = m = member(rng, CONTEXT - clen + 1 + p["big"] % 3000, clen)
        elif kind == "bad_arrays":
            changes.update(self.bad_arrays(v, m, p))
        elif kind == "bad_tokens":
            dtype, value = p["oov"]
            for x in members:
                x.prompt, x.completion = x.prompt.astype(dtype), x.completion.astype(dtype)
            where = m.prompt if v % 2 else m.completion
            where[int(rng.integers(0, len(where)))] = value
            mode = ["inline", "log", "store"][v // 2 % 3]
        elif kind == "nan_logprobs":
            m.logprobs = m.logprobs.astype(["float32", "float16", "float64"][v // 3 % 3])
            m.logprobs[int(rng.integers(0, clen))] = p["nonfinite"]
            mode = ["inline", "log", "store"][v % 3]
        elif kind == "bad_values":
            spot = int(rng.integers(0, m.trace.size))
            if v % 4 == 0:  # an expert that does not exist
                m.trace = m.trace.astype("uint16" if p["big"] % 2 else "uint8")
                m.trace.flat[spot] = EXPERTS + p["big"] % (255 - EXPERTS)
            elif v % 4 == 1:  # one expert twice in a token's top-k
                m.trace[spot // (MOE_LAYERS * TOP_K), spot // TOP_K % MOE_LAYERS] = v % EXPERTS
            elif v % 4 == 2:  # a negative expert
                m.trace = m.trace.astype("int64" if p["big"] % 2 else "int32")
                m.trace.flat[spot] = -1 - p["big"] % (2**31 - 1)
            else:  # a mask of other values than 0 and 1
                m.mask = rng.integers(0, 2, clen).astype(np.uint8)
                m.mask[int(rng.integers(0, clen))] = 2 + p["big"] % 254
                for i in mates:
                    members[i].mask = np.ones(clen, np.uint8)
            mode = ["inline", "log", "store"][v // 4 % 3]
        elif kind == "unreadable":
            changes.update(await self.unreadable(v, m, p))
        reward = changes.pop("reward", float(rng.normal()))
        bad = await self.rollout(
            gid, bad_i, m, tenant=tenant, env=env, size=size, reward=reward, mode=mode, **changes
        )
        items = [dead_item(kind, bad, *reasons)]
        # Read-time reasons show only once the group is complete: its mates always come.
        with_mates = p["partner"] or kind in READ_TIME
        if kind == "bad_ids" and p["partner"]:
            mates = list(range(size))  # the real members, the squatted one included
        for i in mates if with_mates else []:
            e = await self.rollout(
                gid, i, members[i], tenant=tenant, env=env, size=size, reward=float(i), mode=mode
            )
            it = good_item(kind + "_mate", e)
            it.expect = mate_expect
            if mate_expect == "dead":
                it.reasons = frozenset(reasons)
            items.append(it)
        if not p["first"] and kind != "bad_ids":  # a squatter comes first (later, it is a copy)
            items.reverse()
        return items

    def bad_arrays(self, v: int, m: Member, p: dict[str, Any]) -> dict[str, Any]:
        """Arrays admission refuses for their declared dtype, shape or place."""
        c = len(m.completion)
        bucket = payload_bucket(self.run_id)
        ref = ev.PayloadRef(store="objstore", bucket=bucket, name="n", size=4 * c, sha256="0" * 64)
        options: list[dict[str, Any]] = [
            {"prompt_tokens": inline_array(m.prompt.astype(np.float32))},
            {"completion_tokens": inline_array(m.completion.reshape(1, -1))},
            {
                "completion_tokens": ev.InlineArray(
                    dtype="int32", shape=(c,), data=b"\0" * (p["big"] % (4 * c))
                )
            },
            {
                "prompt_tokens": ev.InlineArray(
                    dtype=["object", "complex128", "U8", "bfloat16", p["text"]][v // 16 % 5],
                    shape=(1,),
                    data=b"\0" * 2,
                )
            },
            {
                "completion_tokens": inline_array(np.zeros(0, np.int32)),
                "logprobs": inline_array(np.zeros(0, np.float32)),
            },
            {"prompt_tokens": inline_array(np.zeros(0, np.int32))},
            {"logprobs": inline_array(np.zeros(c + 1 + p["big"] % 3, np.float32))},
            {"logprobs": inline_array(np.full(c, -1, np.int32))},
            {"completion_mask": inline_array(np.ones(c, np.int32))},
            {"completion_mask": inline_array(np.ones(c + 1, np.uint8))},
            {"routing_trace": None},
            {
                "routing_trace": inline_array(
                    m.trace[:-1] if len(m.trace) > 1 else np.zeros((2, 2, 2), np.uint8)
                )
            },
            {"routing_trace": inline_array(m.trace.astype(np.float32))},
            {"routing_trace": inline_array(m.trace[:, :1])},
            {"completion_tokens": msgspec.structs.replace(ref, dtype="int32", shape=(c,), bucket="another")},
            {"completion_tokens": ref},  # a blob: no dtype/shape
            {"completion_tokens": ev.InlineArray(dtype="int32", shape=(-c,), data=b"")},
            {
                "completion_tokens": ev.LogArray(
                    seq=self.gen_seq, field="completion_tokens", dtype="float32", shape=(c,)
                )
            },
            {"completion_tokens": msgspec.structs.replace(ref, dtype="int32", shape=(c,), size=4 * c + 1)},
            {"logprobs": ev.LogArray(seq=self.gen_seq, field="logprobs", dtype="float32", shape=(c, 1))},
        ]
        return options[v % len(options)]

    async def unreadable(self, v: int, m: Member, p: dict[str, Any]) -> dict[str, Any]:
        """References admission accepts that cannot be read, or read what they do not declare."""
        assert self.payloads is not None
        c = m.completion
        dtype, shape = c.dtype.name, tuple(c.shape)
        # A generation whose completion is one token longer than the declared shape.
        other = member(np.random.default_rng(v), 2, len(c) + 1)
        gen_body = ev.GenerationCompleted(
            generation_id="math.acme.other-0",
            task_id="math.acme.other",
            env="math",
            group_id="math.acme.other",
            sample_index=0,
            group_size=2,
            prompt_tokens=inline_array(other.prompt),
            completion_tokens=inline_array(other.completion),
            logprobs=inline_array(other.logprobs),
            policy_version_start=0,
            policy_version_end=0,
            worker_id="inf-0",
        )
        gen = (await self.bus.publish(ev.new_event(gen_body, run_id=self.run_id, tenant="acme"))).seq
        seq = p["seq"]
        if 0 < seq < 10**9:
            seq += 10**9  # past this run's log, not at one of its events
        ok = await self.payloads.put_array(f"ok-{uuid.uuid4().hex[:8]}", c, inline_threshold=0)
        assert isinstance(ok, ev.PayloadRef)
        field_ = ["env", "group_size", "timings", "worker_id", "nope", p["text"]][v // 12 % 6]
        options: list[ev.ArrayRef] = [
            ev.LogArray(seq=seq, field="completion_tokens", dtype=dtype, shape=shape),  # nothing there
            ev.LogArray(seq=10**12 + v, field="completion_tokens", dtype=dtype, shape=shape),
            ev.LogArray(seq=self.garbage_seq, field="completion_tokens", dtype=dtype, shape=shape),
            ev.LogArray(seq=gen, field=field_, dtype=dtype, shape=shape),  # not an array
            # that array, but not of that shape
            ev.LogArray(seq=gen, field="completion_tokens", dtype=dtype, shape=shape),
            ev.LogArray(seq=1, field="completion_tokens", dtype=dtype, shape=shape),  # the run's first event
            msgspec.structs.replace(ok, name=f"tokens-missing-{v}"),
            msgspec.structs.replace(ok, sha256="0" * 64),
            msgspec.structs.replace(ok, store=["file", "mooncake", "none", p["text"]][v // 12 % 4]),
            msgspec.structs.replace(
                ok,
                name=["", " ", "*", ">", "a.b", "../x", "x" * 300, "\0", "\u2603", p["text"]][v // 12 % 10],
            ),
            msgspec.structs.replace(ok, name="weights-v0"),  # another object, other bytes
        ]
        return {"completion_tokens": options[v % len(options)]}

    async def build(self, recipe: tuple[str, Any]) -> list[Item]:
        kind, p = recipe
        if kind.startswith("good"):
            items = await self.good_group(kind, p)
        elif kind in EDGE_KINDS:
            m = member(np.random.default_rng(self.n), 3, 2)
            base = await self.rollout(
                self.group_id("acme", "math", "x"), 0, m, tenant="acme", env="math", size=2
            )
            it = edge_item(kind, p, base, subjects.rollout_subject(self.run_id, "acme", "code"))
            if kind == "foreign_type" and ev.decode_event(it.data, it.headers).type == "RolloutWithheld":
                # On the rollout subject, where the trainer writes its own: skipped, not refused.
                it.expect, it.reasons = "ignored", None
            items = [it]
        elif kind in ("replay_trained", "replay_withheld"):
            # A rollout again under a new event id (a producer's retry, or a hostile copy with
            # other values): the trainer has it already and settles it silently.
            done = self.trained_items if kind == "replay_trained" else self.withheld_items
            if not done:
                return []
            old = done[p["variant"] % len(done)].event
            assert old is not None and isinstance(old.body, ev.RolloutScored)
            hostile = {"reward": p["nonfinite"]} if p["partner"] else {}
            e = fresh(old, body=msgspec.structs.replace(old.body, **hostile))
            items = [Item(kind, subjects.subject_for(e), encode(e), headers_of(e), "ignored", event=e)]
        else:
            items = await self.bad_group(kind, p)
        return items

    # ------------------------------------------------------------ outcomes

    def fold(self) -> None:
        while self.outputs:
            seq, out = self.outputs.pop()
            if seq in self.own:
                continue  # a case's own event (a forged StepCompleted, say), not the trainer's
            b = out.body
            if isinstance(b, ev.StepCompleted):
                self.steps += 1
                self.trained_seqs.update(b.rollout_seqs)
                self.trained_ids.update(b.rollout_ids)
                self.nonfinite_metrics.update(k for k, x in b.metrics.items() if not math.isfinite(x))
            elif isinstance(b, ev.RolloutWithheld) and out.causation_id:
                self.withheld_of[out.causation_id] = b.reason

    def processed(self, item: Item) -> bool:
        self.fold()
        return self.trained_seqs[item.seq] > 0

    def withheld(self, it: Item) -> bool:
        self.fold()
        return it.event is not None and self.withheld_of.get(it.event.event_id) == "incomplete_group"

    def held_seqs(self) -> set[int]:
        return {d.seq for d in self.trainer.buffer.held()}

    def held(self) -> int:
        return len(self.held_seqs())

    def is_held(self, it: Item) -> bool:
        return it.seq in self.held_seqs()

    async def run_case(self, items: list[Item]) -> None:
        await super().run_case(items)
        self.fold()
        for it in items:
            self.by_seq[it.seq] = it
            if self.trained_seqs[it.seq]:
                self.trained_items.append(it)
            elif it.expect == "withheld":
                self.withheld_items.append(it)
        twice = [r for r, k in self.trained_ids.items() if k > 1]
        assert not twice, f"trained twice: {twice}"
        assert all(k == 1 for k in self.trained_seqs.values())
        for seq in self.trained_seqs:
            got = self.by_seq.get(seq)
            assert got is not None and got.expect in ("good", "either"), f"trained, not good: {got}"
            assert got.event is not None and isinstance(got.event.body, ev.RolloutScored)
            assert self.trained_ids[got.event.body.rollout_id] == 1
        assert not self.forged_dead
        await self.check_replay()

    async def check_replay(self) -> None:
        """What recovery would re-take (replay.read_rollouts: the first RolloutScored of each
        trained id in the log) is what was trained (the event at the step's rollout_seqs)."""
        by_id = {}
        for seq in self.trained_seqs:
            e = self.by_seq[seq].event
            assert e is not None and isinstance(e.body, ev.RolloutScored)
            by_id[e.body.rollout_id] = (seq, e.body)
        new = set(by_id) - self.replay_checked
        if not new:
            return
        # As a restarted trainer reads them: at the sequences the steps recorded.
        scored, _ = await read_rollouts(self.bus, self.run_id, new, {rid: by_id[rid][0] for rid in new})
        for rid in sorted(new):
            self.replay_checked.add(rid)
            if scored[rid] != by_id[rid][1]:
                first = min(
                    (
                        it
                        for it in self.by_seq.values()
                        if it.event is not None and getattr(it.event.body, "rollout_id", None) == rid
                    ),
                    key=lambda it: it.seq,
                )
                self.replay_mismatch.append((rid, first.kind))

    def report(self) -> str:
        lines = [
            super().report(),
            f"  steps {self.steps}, trained rollouts {len(self.trained_ids)}, "
            f"withheld {len(self.withheld_of)}, held in partial groups {self.held()}",
        ]
        if self.nonfinite_metrics:
            lines.append(f"  non-finite step metrics: {dict(self.nonfinite_metrics)}")
        if self.replay_mismatch:
            lines.append(
                f"  REPLAY WOULD DIVERGE: {len(self.replay_mismatch)} trained rollouts whose first copy in "
                f"the log is another event, by its kind: {dict(Counter(k for _, k in self.replay_mismatch))}"
            )
        return "\n".join(lines)


def test_fuzz_trainer(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    fz = drive(
        nats_server,
        lambda bus, run: TrainerFuzz(bus, run, tmp_path),
        # One or two good groups (each a step) and two to five hostile cases, in any order.
        st.tuples(
            st.lists(trainer_good(), min_size=1, max_size=2), st.lists(trainer_bad(), min_size=2, max_size=5)
        ).flatmap(lambda gb: st.permutations([*gb[0], *gb[1]])),
        examples=int(os.environ.get("FUZZ_TRAINER_N", 200)),
    )
    assert isinstance(fz, TrainerFuzz)
    assert not fz.replay_mismatch, fz.report()  # replay reads exactly what was trained
