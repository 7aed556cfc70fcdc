"""Property-based fuzzing of every consumer's edge through a real nats-server (issue 14).

Hypothesis generates, per example, a handful of events for one consumer: raw garbage, truncated
and byte-flipped msgpack of valid events, envelopes of unknown types, newer or impossible schema
versions, disagreeing type headers, bodies that do not fit their type, spoofed runs and tenants,
events on another subject than their own, foreign entity ids, impossible values (group sizes,
non-finite rewards and temperatures, token ids outside the vocabulary, prompts past the context,
future versions, arrays of the wrong dtype, shape or length, references to missing payloads,
log references whose dotted path leads nowhere, to something else or into another event) and
oversized lists, always mixed with good events. A generation or a group of rollouts is one
event: the hostile value sits in one sample or rollout of an otherwise good one, or a group's
rollouts come in events of their own (as a multi-turn environment's do) beside the hostile one.
Each is published raw (nats-py) to the run's stream; the consumer, one instance per test running
across all examples, works until its durable consumers have nothing pending or unacked (bounded
by a deadline, never unbounded). Then, per event:

* a bad one has exactly one DeadLettered from the consumer (its id is the consumer's derived
  dead-letter id for the original's stream sequence, so a dead letter a tenant forged does not
  count), with a non-empty reason among those expected, and had no effect;
* a good one was processed (inference: one CompletionsGenerated with every sample of the task;
  trainer: each of its rollouts in exactly one StepCompleted, whole groups; scorer: one
  RolloutsScored of the task's group, its arrays referred to at their samples; recorder: its
  rows in the store, one per sample or rollout) and was not dead-lettered;
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
import sys
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
from jetrl.bus.streams import payload_bucket, stream_name
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
    trains: int | None = None  # (trainer, good) rollouts trained from it; None: all of them


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
            | st.sampled_from(["taskSubmitted", "TaskSubmitted ", "", "RolloutScored", "GenerationCompleted"])
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
    return kind, draw(st.integers(0, 7))


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
        forged_generation("modsum.acme.900", "modsum", np.zeros(2, np.int32), indexes=(0, 1)),
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
    # An entity id of the event, or of one of its samples or rollouts (the others good), made
    # another tenant's.
    b = base.body
    entity = ("task_id", "group_id", "generation_id", "rollout_id")
    members: list[Any] = list(getattr(b, "samples", None) or getattr(b, "rollouts", None) or [])
    where: list[tuple[str, int | None]] = [(n, None) for n in entity if hasattr(b, n)]
    where += [(n, k) for k, m in enumerate(members) for n in entity if hasattr(m, n)]
    name, at = where[param % len(where)]

    def foreign(value: str) -> str:
        env, _, rest = value.partition(".")
        _, _, rest = rest.partition(".")
        return f"{env}.globex.{rest}"

    if at is None:
        body = msgspec.structs.replace(b, **{name: foreign(getattr(b, name))})
    else:
        members[at] = msgspec.structs.replace(members[at], **{name: foreign(getattr(members[at], name))})
        body = msgspec.structs.replace(b, **{"samples" if hasattr(b, "samples") else "rollouts": members})
    e = fresh(base, body=body)
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
        # The first example that failed: hypothesis runs it again to report it, but the one
        # consumer has moved on by then (that example's events are in its log), so the
        # second run's failure may be another, caused by the first.
        self.first_failure: BaseException | None = None

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
        else:
            if not self.task.done():  # unsettled at the guard: where each task of the loop waits
                print(f"the {self.name} did not settle in {SETTLE_S:.0f} s; the loop's tasks:")
                for task in asyncio.all_tasks():
                    task.print_stack(limit=12, file=sys.stdout)
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
            try:
                lt.run(one(), SETTLE_S + 60)
            except BaseException as exc:
                fz.first_failure = fz.first_failure or exc
                raise fz.first_failure from None
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
        # task event id -> the sample indexes of each CompletionsGenerated that answered it
        self.generations: dict[str, list[list[int]]] = {}

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
            if isinstance(out.body, ev.CompletionsGenerated) and out.causation_id:
                indexes = [s.sample_index for s in out.body.samples]
                self.generations.setdefault(out.causation_id, []).append(indexes)
        return e.event_id in self.generations

    async def run_case(self, items: list[Item]) -> None:
        await super().run_case(items)
        for it in items:
            e = it.event
            if e is None or not isinstance(e.body, ev.TaskSubmitted) or e.event_id not in self.generations:
                continue
            # One event for the task, with every sample it asked for, each once.
            assert self.generations[e.event_id] == [list(range(e.body.group_size))], (it.kind, it.seq)


def test_fuzz_inference_worker(nats_server: EmbeddedServer) -> None:
    drive(nats_server, InferenceFuzz, mixed(inference_good(), inference_bad()), examples=150)


# ----------------------------------------------------------------------------- the scorer


def arr(values: Any, dtype: str) -> ev.InlineArray:
    return inline_array(np.asarray(values, dtype=dtype))


@st.composite
def scorer_good(draw: st.DrawFn) -> tuple[str, Any]:
    kind = draw(st.sampled_from(["good_generation", "good_generation", "good_odd_values"]))
    return kind, (
        draw(st.permutations([0, 1])),  # the samples' order in the event
        draw(st.integers(0, 1)),  # the odd sample
        draw(st.integers(-5, 10**6)),
    )


SCORER_BAD = ("unknown_task", "bad_samples", "missing_payload", "short_bytes", "bad_dtype", "log_ref")


@st.composite
def scorer_bad(draw: st.DrawFn) -> tuple[str, Any]:
    if draw(st.booleans()):
        return draw(edge_params())
    kind = draw(st.sampled_from(SCORER_BAD))
    return kind, draw(st.integers(0, 2**31))


class ScorerFuzz(Fuzz):
    name = "scorer"
    durables = ("scorer-acme-modsum",)

    def __init__(self, bus: Bus, run_id: str) -> None:
        super().__init__(bus, run_id)
        part = ProducerPart(env=EnvSettings(name="modsum", tenant="acme", group_size=2))
        self.producer = EnvProducer(bus, run_id, part)
        self.n = 0
        self.scored: dict[str, ev.RolloutsScored] = {}  # generation event id -> what scored it

    async def start_consumer(self) -> Awaitable[Any]:
        self.producer.payloads = Payloads(await ObjectStorePayloads.for_run(self.bus.js, self.run_id))
        return self.producer.score_loop(self.stop)

    def generation(
        self,
        *,
        known: bool = True,
        order: tuple[int, ...] = (0, 1),
        samples: dict[int, dict[str, Any]] | None = None,
        **over: Any,
    ) -> ev.Event:
        """The task's generation: its samples (indexes ``order``, in that order), ``samples``
        changes to the sample at a position, ``over`` to the event."""
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
        smps = [
            ev.Completion(
                generation_id=ids.generation_id(tid, i),
                sample_index=i,
                completion_tokens=arr(completion, "int32"),
                logprobs=arr([-0.1] * len(completion), "float32"),
            )
            for i in order
        ]
        for k, change in (samples or {}).items():
            smps[k] = msgspec.structs.replace(smps[k], **change)
        fields: dict[str, Any] = {
            "task_id": tid,
            "env": "modsum",
            "prompt_tokens": arr(TOK.encode(f"{a}+{b}="), "int32"),
            "samples": smps,
            "policy_version_start": 0,
            "policy_version_end": 0,
            "worker_id": "inf-0",
        }
        fields.update(over)
        return ev.new_event(ev.CompletionsGenerated(**fields), run_id=self.run_id, tenant="acme")

    async def build(self, recipe: tuple[str, Any]) -> list[Item]:
        kind, p = recipe
        if kind == "good_generation":
            order, _, _ = p
            return [good_item(kind, self.generation(order=tuple(order)))]
        if kind == "good_odd_values":
            # Values only the trainer judges (it refuses them) in one sample: the scorer scores
            # what it can read.
            order, k, token = p
            odd = {
                "completion_tokens": arr([token, TOK.eos_id], "int32"),
                "logprobs": arr([math.nan, -1.0], "float32"),
            }
            return [good_item(kind, self.generation(order=tuple(order), samples={k: odd}))]
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
        if kind == "bad_samples":  # not the task's group: a sample missing, repeated, extra or none
            order = [(0,), (1,), (0, 0), (1, 0, 1), (0, 1, 2), (-1, 0), (0, 2**31), ()][p % 8]
            return [dead_item(kind, self.generation(order=order), "invalid")]
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
            field_ = ["samples.0.completion_tokens", "samples.1.completion_tokens", "prompt_tokens"][p % 3]
            bad = ev.LogArray(seq=p, field=field_, dtype="int32", shape=(2,))
        # One sample unreadable, the other good: the whole generation is refused.
        return [dead_item(kind, self.generation(samples={p % 2: {"completion_tokens": bad}}), "unreadable")]

    def processed(self, item: Item) -> bool:
        while self.outputs:
            _, out = self.outputs.pop()
            if isinstance(out.body, ev.RolloutsScored) and out.causation_id:
                self.scored[out.causation_id] = out.body
        return item.event is not None and item.event.event_id in self.scored

    async def run_case(self, items: list[Item]) -> None:
        await super().run_case(items)
        for it in items:
            e = it.event
            if e is None or e.event_id not in self.scored or not isinstance(e.body, ev.CompletionsGenerated):
                continue
            # The task's group in one event, each rollout's arrays at its own sample in the
            # generation (referred to, not copied), its prompt the generation's.
            g, b = e.body, self.scored[e.event_id]
            assert (b.group_id, b.task_id, b.group_size) == (g.task_id, g.task_id, 2), it.kind
            assert b.generation_event_id == e.event_id and b.prompt_tokens == g.prompt_tokens
            assert sorted(r.sample_index for r in b.rollouts) == [0, 1]
            for r in b.rollouts:
                (k,) = [k for k, smp in enumerate(g.samples) if smp.sample_index == r.sample_index]
                assert r.rollout_id == ids.rollout_id(g.task_id, r.sample_index)
                assert r.completion_tokens == log_array(
                    it.seq, f"samples.{k}.completion_tokens", g.samples[k].completion_tokens
                )
                assert r.logprobs == log_array(it.seq, f"samples.{k}.logprobs", g.samples[k].logprobs)


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
            body = ev.CompletionsGenerated(
                task_id=tid,
                env="modsum",
                prompt_tokens=ev.LogArray(seq=max(1, n), field="prompt_tokens", dtype="int32", shape=(n,)),
                samples=[
                    ev.Completion(
                        generation_id=ids.generation_id(tid, i),
                        sample_index=i,
                        completion_tokens=z,
                        logprobs=arr([0.0, 0.0], "float32"),
                        finish_reason=("stop", "length")[i],
                    )
                    for i in (1, 0)
                ],
                policy_version_start=0,
                policy_version_end=0,
                worker_id="inf-0",
            )
        else:
            odd = kind == "odd_rollout"  # what the trainer refuses is still a fact to record
            good = [
                ev.ScoredRollout(
                    rollout_id=ids.rollout_id(tid, i),
                    sample_index=i,
                    reward=0.5,
                    completion_tokens=ev.LogArray(
                        seq=7, field=f"samples.{i}.completion_tokens", dtype="int32", shape=(2,)
                    ),
                    logprobs=arr([0.0, 0.0], "float32"),
                    policy_version_start=0,
                    policy_version_end=0,
                )
                for i in (0, 1)
            ]
            strange = [  # a sample index out of the group, twice under one id; odd arrays
                ev.ScoredRollout(
                    rollout_id=f"{tid}--1",
                    sample_index=-1,
                    reward=reward,
                    reward_parts={"x": reward},
                    completion_tokens=ev.LogArray(
                        seq=10**9, field="samples.-1.__class__", dtype="int32", shape=(n,)
                    ),
                    logprobs=arr([0.0], "int32"),
                    policy_version_start=5,
                    policy_version_end=n,
                )
            ] * 2
            body = ev.RolloutsScored(
                generation_event_id=uuid.uuid4().hex,
                task_id=tid,
                env="modsum",
                group_id=tid,
                group_size=0 if odd else 2,
                prompt_tokens=ev.LogArray(seq=10**9, field="x", dtype="int32", shape=(n,)) if odd else z,
                rollouts=[good[0], *strange] if odd else good,
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
        # Its rows: a task's; one per sample of a generation; one per rollout of a group.
        keys: list[str]
        if isinstance(b, ev.TaskSubmitted):
            table, key, col, keys = "tasks", "task_id", "seq", [b.task_id]
        elif isinstance(b, ev.CompletionsGenerated):
            table, key, col, keys = (
                "generations",
                "generation_id",
                "seq",
                [x.generation_id for x in b.samples],
            )
        elif isinstance(b, ev.RolloutsScored):
            table, key, col, keys = "rollouts", "rollout_id", "scored_seq", [x.rollout_id for x in b.rollouts]
        else:
            return False
        if not keys:
            return False
        with self.store.read() as conn:
            for value in keys:
                row = conn.execute(
                    sa.text(f"SELECT {col} FROM {table} WHERE run_id = :r AND {key} = :k"),
                    {"r": self.run_id, "k": value},
                ).first()
                if row is None or row[0] != item.seq:
                    return False
            if isinstance(b, ev.CompletionsGenerated):  # each sample's row says which it is
                rows = conn.execute(
                    sa.text(
                        "SELECT generation_id, sample_index, finish_reason, event_id FROM generations"
                        " WHERE run_id = :r AND seq = :s"
                    ),
                    {"r": self.run_id, "s": item.seq},
                ).all()
                want = {(x.generation_id, x.sample_index, x.finish_reason, e.event_id) for x in b.samples}
                assert set(map(tuple, rows)) == want, (rows, want)
        return True


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


def routing(rng: np.random.Generator, rows: int) -> np.ndarray:
    trace = np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(rows * MOE_LAYERS)])
    return trace.reshape(rows, MOE_LAYERS, TOP_K).astype(np.uint8)


def member(
    rng: np.random.Generator, plen: int, clen: int, tokens: str = "int32", lp: str = "float32"
) -> Member:
    return Member(
        prompt=rng.integers(0, VOCAB, plen).astype(tokens),
        completion=rng.integers(0, VOCAB, clen).astype(tokens),
        # Near a fresh tiny model's own (-ln 64): the step's importance ratios keep the tokens,
        # so steps change the weights.
        logprobs=rng.uniform(-4.6, -3.7, clen).astype(lp),
        trace=routing(rng, plen + clen - 1),
    )


def group_members(
    rng: np.random.Generator, size: int, plen: int, clen: int, tokens: str = "int32", lp: str = "float32"
) -> list[Member]:
    """A group's members: one prompt (the task's), a completion each."""
    members = [member(rng, plen, clen, tokens, lp) for _ in range(size)]
    for m in members[1:]:
        m.prompt = members[0].prompt
    return members


def with_prompt(rng: np.random.Generator, m: Member, prompt: np.ndarray) -> Member:
    """``m`` under another prompt, its routing trace as long as the tokens it covers."""
    return Member(prompt, m.completion, m.logprobs, routing(rng, len(prompt) + len(m.completion) - 1), m.mask)


# How a group's rollouts come: all in one event (a single-turn task's group), each in its own
# (a multi-turn environment's episodes), or two together and the rest alone (a multi-turn
# environment whose first turn ended some samples at once).
SHAPES = ("whole", "whole", "split", "pair")


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
        "dup": draw(st.sampled_from([-1, -1, 0, 1])),  # an event published twice
        "odd": draw(st.integers(0, 5)),
        "shape": draw(st.sampled_from(SHAPES)),
        "overlap": draw(st.booleans()),  # (split) the last event brings one rollout held already
    }


@st.composite
def trainer_bad(draw: st.DrawFn) -> tuple[str, Any]:
    if draw(st.integers(0, 3)) == 0:
        return draw(edge_params())
    # The kinds with most variants, more often.
    kind = draw(
        st.sampled_from([*TRAINER_BAD, *READ_TIME, "unreadable", "unreadable", "bad_arrays", "bad_arrays"])
    )
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
        # The hostile value in one rollout of a group's one event (its other rollouts good),
        # else the hostile rollout in an event of its own and its mates in others.
        "whole": draw(st.booleans()),
        "partner": draw(st.booleans()),  # (not whole) its mates come too
        "together": draw(st.booleans()),  # (not whole) the mates in one event
        "first": draw(st.booleans()),  # the bad event before its mates
        "big": draw(st.integers(1, 2**62) | st.sampled_from([1, 2, 10**9])),
        "seq": draw(st.integers(-(2**63), 2**64 - 1) | st.sampled_from([0, -1, 10**9, 2**63 - 1, 2**64 - 1])),
        "nonfinite": draw(st.sampled_from([NAN, INF, -INF])),
        "huge": draw(st.floats(1.000001e9, 1e308)),
        "oov": draw(oov),
        "text": draw(st.text(max_size=12)),
    }


# A change whose value depends on where the event's own generation lies (its stream sequence).
AtGeneration = Callable[[int], ev.ArrayRef]


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
        self.gen_seq = 0  # a CompletionsGenerated in the log
        self.other_task_seq = 0  # another group's TaskSubmitted
        self.by_seq: dict[int, Item] = {}
        self.trained_seqs: Counter[int] = Counter()  # stream seq -> rollouts trained from it
        self.trained_ids: Counter[str] = Counter()
        self.trained_at: list[tuple[str, int]] = []  # (rollout id, the seq its step recorded)
        self.withheld_of: dict[str, list[str]] = {}  # causation (the rollouts' event id) -> reasons
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
        other = ev.TaskSubmitted(
            task_id="math.acme.other-task", env="math", group_size=2, prompt_tokens=[1, 2, 3]
        )
        self.other_task_seq = await self.publish_task(other, "acme")
        return self.trainer.run(self.stop)

    # ------------------------------------------------------------ building rollouts

    def group_id(self, tenant: str, env: str, tag: str = "g") -> str:
        self.n += 1
        return f"{env}.{tenant}.{tag}{self.n}"

    async def publish_task(self, body: ev.TaskSubmitted, tenant: str) -> int:
        """A task in the log, under the event id the trainer expects its group's prompt in."""
        e = ev.new_event(
            body, run_id=self.run_id, tenant=tenant, event_id=ids.task_event_id(self.run_id, body.task_id)
        )
        return int((await self.bus.publish(e)).seq)

    async def prompt_ref(
        self, gid: str, tenant: str, env: str, size: int, prompt: np.ndarray, mode: str
    ) -> ev.ArrayRef:
        """The group's prompt inline, in the object store or (``log``) where a worker refers to
        it: its task's list of token ids."""
        assert self.payloads is not None
        if mode == "log":
            tokens = [int(t) for t in prompt]
            seq = await self.publish_task(
                ev.TaskSubmitted(task_id=gid, env=env, group_size=size, prompt_tokens=tokens), tenant
            )
            wide = prompt.dtype == np.int64 or any(not -(2**31) <= t < 2**31 for t in tokens)
            return ev.LogArray(
                seq=seq, field="prompt_tokens", dtype="int64" if wide else "int32", shape=(len(tokens),)
            )
        if mode == "store":
            return await self.payloads.put_array(
                f"{gid}-prompt-{uuid.uuid4().hex[:6]}", prompt, inline_threshold=0
            )
        return inline_array(prompt)

    async def scored(
        self,
        gid: str,
        members: list[tuple[int, Member]],
        *,
        tenant: str,
        env: str,
        size: int,
        rewards: dict[int, float] | None = None,
        modes: dict[int, str] | None = None,
        prompt_mode: str = "inline",
        versions: dict[int, tuple[int, int]] | None = None,
        member_changes: dict[int, dict[str, Any]] | None = None,
        **changes: Any,
    ) -> ev.Event:
        """One RolloutsScored of group ``gid``: ``members`` (sample index, arrays) in that order,
        each rollout's arrays inline, in the object store or (``log``) in the event's own
        generation, published first; then ``member_changes`` to the rollout at a position
        (values that are functions are given the generation's sequence) and ``changes`` to the
        event."""
        payloads = self.payloads
        assert payloads is not None
        rewards, modes, versions = rewards or {}, modes or {}, versions or {}
        member_changes = member_changes or {}
        version = self.trainer.version
        start = min((versions.get(i, (version, version))[0] for i, _ in members), default=version)
        end = max((versions.get(i, (version, version))[1] for i, _ in members), default=version)
        gen_id = uuid.uuid4().hex  # the generation's event id (its arrays lie there in "log" mode)
        gen_seq = 0
        needs_gen = any(modes.get(i) == "log" for i, _ in members) or any(
            callable(v) for c in (*member_changes.values(), changes) for v in c.values()
        )
        if needs_gen:
            gen = ev.CompletionsGenerated(
                task_id=gid,
                env=env,
                prompt_tokens=inline_array(members[0][1].prompt),
                samples=[
                    ev.Completion(
                        generation_id=ids.generation_id(gid, i),
                        sample_index=i,
                        completion_tokens=inline_array(m.completion),
                        logprobs=inline_array(m.logprobs),
                        routing_trace=inline_array(m.trace),
                    )
                    for i, m in members
                ],
                policy_version_start=start,
                policy_version_end=end,
                worker_id="inf-0",
            )
            gen_event = ev.new_event(gen, run_id=self.run_id, tenant=tenant, event_id=gen_id)
            gen_seq = (await self.bus.publish(gen_event)).seq
            self.gen_seq = gen_seq
        rollouts = []
        for k, (i, m) in enumerate(members):
            mode = modes.get(i, "inline")

            async def ref(
                a: np.ndarray, field_: str, k: int = k, i: int = i, mode: str = mode
            ) -> ev.ArrayRef:
                if mode == "log":
                    return log_array(gen_seq, f"samples.{k}.{field_}", inline_array(a))
                if mode == "store":
                    return await payloads.put_array(
                        f"{gid}-{i}-{field_}-{uuid.uuid4().hex[:6]}", a, inline_threshold=0
                    )
                return inline_array(a)

            s, e = versions.get(i, (version, version))
            r = ev.ScoredRollout(
                rollout_id=ids.rollout_id(gid, i),
                sample_index=i,
                reward=rewards.get(i, 0.0),
                reward_parts={"correct": rewards.get(i, 0.0)},
                completion_tokens=await ref(m.completion, "completion_tokens"),
                logprobs=await ref(m.logprobs, "logprobs"),
                routing_trace=await ref(m.trace, "routing_trace"),
                completion_mask=None if m.mask is None else inline_array(m.mask),
                policy_version_start=s,
                policy_version_end=e,
            )
            change = {n: v(gen_seq) if callable(v) else v for n, v in member_changes.get(k, {}).items()}
            if change:
                r = msgspec.structs.replace(r, **change)
            rollouts.append(r)
        prompt = await self.prompt_ref(
            gid, tenant, env, size, members[0][1].prompt if members else np.zeros(1, np.int32), prompt_mode
        )
        b = ev.RolloutsScored(
            generation_event_id=gen_id,
            task_id=gid,
            env=env,
            group_id=gid,
            group_size=size,
            prompt_tokens=prompt,
            rollouts=rollouts,
        )
        if changes:
            b = msgspec.structs.replace(
                b, **{n: v(gen_seq) if callable(v) else v for n, v in changes.items()}
            )
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
        members = group_members(rng, size, plen, clen, p["tokens"], p["lp"])
        for m in members:
            if p["mask"] or odd == 3:
                m.mask = np.zeros(clen, np.uint8) if odd == 3 else rng.integers(0, 2, clen).astype(np.uint8)
            if odd == 4:  # the vocabulary's ends
                m.prompt[:] = 0
                m.completion[:] = VOCAB - 1
        modes = ["inline", "log", "store"]
        refs = kind == "good_refs"
        order = [int(i) for i in rng.permutation(size)]
        events: list[list[int]] = {
            "whole": [order],
            "split": [[i] for i in order],
            "pair": [order[:2], *([i] for i in order[2:])],
        }[p["shape"]]
        trains = [len(idx) for idx in events]
        if p["shape"] == "split" and p["overlap"]:  # the last brings the one before it again
            events[-1] = [events[-2][0], *events[-1]]
        items = []
        for idx, n in zip(events, trains, strict=True):
            e = await self.scored(
                gid,
                [(i, members[i]) for i in idx],
                tenant=tenant,
                env=env,
                size=size,
                rewards={i: rewards[i] for i in idx},
                modes={i: modes[(p["seed"] + i) % 3] if refs else "inline" for i in idx},
                prompt_mode=modes[p["seed"] % 3] if refs else "inline",
                versions={i: (start, int(rng.integers(start, version + 1))) for i in idx},
            )
            it = good_item(kind, e)
            it.trains = n
            items.append(it)
        if p["dup"] >= 0:  # an event again (a producer's retry): its rollouts are kept once
            at = p["dup"] % len(items)
            e = items[at].event
            assert e is not None
            copy = fresh(e)
            items.insert(
                int(rng.integers(at + 1, len(items) + 1)),
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
        members = group_members(rng, size, plen, clen)
        mates: list[int] = [i for i in range(size) if i != bad_i]
        whole = p["whole"]
        reasons = (TRAINER_REASON.get(kind, kind),)
        mate_expect = "withheld"
        changes: dict[str, Any] = {}  # to the bad rollout
        group_changes: dict[str, Any] = {}  # to the bad event
        mode = "inline"
        prompt_mode = "inline"
        bad_prompt: np.ndarray | None = None  # the bad event's prompt, when it is not the group's
        m = members[bad_i]
        twice = False  # the bad rollout twice in its event
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
            if v % 4 == 0:  # the event's group size
                group_changes["group_size"] = [1, 0, -1, size + 1, size - 1, 4097, 2**62, -(2**62)][
                    v // 4 % 8
                ]
                if group_changes["group_size"] == size:
                    group_changes["group_size"] = 1
            elif v % 4 == 1:  # a sample outside the group
                index = [size, size + 1, -1, 2**62, -(2**40)][v // 4 % 5]
                changes.update(sample_index=index, rollout_id=ids.rollout_id(gid, index))
            elif v % 4 == 2:  # one sample twice in the event (under one id, or a mate's)
                twice = True
            else:  # no rollouts at all
                group_changes["rollouts"] = []
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
            if v % 2:  # the event's prompt
                bad_prompt = rng.integers(0, VOCAB, CONTEXT - clen + 1 + p["big"] % 3000).astype(np.int32)
            else:  # the bad rollout's completion
                long = member(rng, plen, CONTEXT - plen + 1 + p["big"] % 3000)
                members[bad_i] = m = with_prompt(rng, long, m.prompt)
        elif kind == "bad_arrays":
            option = self.bad_arrays(v, m, p)
            if "prompt_tokens" in option:
                group_changes.update(option)
            else:
                changes.update(option)
        elif kind == "bad_tokens":
            dtype, value = p["oov"]
            prompt = members[0].prompt.astype(dtype)
            for x in members:
                x.prompt, x.completion = prompt, x.completion.astype(dtype)
            if v % 2:  # in the event's prompt
                bad_prompt = prompt.copy()
                bad_prompt[int(rng.integers(0, len(bad_prompt)))] = value
                prompt_mode = ["inline", "log", "store"][v // 2 % 3]
            else:
                m.completion[int(rng.integers(0, len(m.completion)))] = value
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
            where, unread = await self.unreadable(v, m, p, gid, tenant, env, size)
            if where == "prompt":
                group_changes["prompt_tokens"] = unread
            else:
                changes["completion_tokens"] = unread
                mode = "log"  # the bad rollout's arrays in its own generation, where paths lead
        rewards = {i: float(rng.normal()) for i in range(size)}
        rewards[bad_i] = changes.pop("reward", rewards[bad_i])
        if whole:
            # The group's one event, its rollouts in any order, the hostile value in one of them.
            idx = [int(i) for i in rng.permutation(size)]
            if twice:
                idx.insert(int(rng.integers(0, size + 1)), bad_i)
            bad_members = [(i, members[i]) for i in idx]
            at = idx.index(bad_i)
        else:
            bad_members = [(bad_i, m), (bad_i, m)] if twice else [(bad_i, m)]
            at = 0
        if bad_prompt is not None:
            bad_members = [(i, with_prompt(rng, x, bad_prompt)) for i, x in bad_members]
        bad = await self.scored(
            gid,
            bad_members,
            tenant=tenant,
            env=env,
            size=size,
            rewards=rewards,
            modes={i: mode for i, _ in bad_members} if whole else {bad_i: mode},
            prompt_mode=prompt_mode,
            member_changes={at: changes},
            **group_changes,
        )
        items = [dead_item(kind, bad, *reasons)]
        if whole:
            return items
        # Read-time reasons show only once the group is complete: its mates always come.
        with_mates = p["partner"] or kind in READ_TIME
        if kind == "bad_ids" and p["partner"]:
            mates = list(range(size))  # the real members, the squatted one included
        batches = [mates] if p["together"] else [[i] for i in mates]
        for idx in batches if with_mates and mates else []:
            e = await self.scored(
                gid,
                [(i, members[i]) for i in idx],
                tenant=tenant,
                env=env,
                size=size,
                rewards={i: float(i) for i in idx},
                modes=dict.fromkeys(idx, mode),
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
        c, plen = len(m.completion), len(m.prompt)
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
                    seq=self.gen_seq, field="samples.0.completion_tokens", dtype="float32", shape=(c,)
                )
            },
            {"completion_tokens": msgspec.structs.replace(ref, dtype="int32", shape=(c,), size=4 * c + 1)},
            {
                "logprobs": ev.LogArray(
                    seq=self.gen_seq, field="samples.0.logprobs", dtype="float32", shape=(c, 1)
                )
            },
            {
                "prompt_tokens": ev.LogArray(
                    seq=self.other_task_seq, field="prompt_tokens", dtype="float32", shape=(plen,)
                )
            },
            {
                "prompt_tokens": ev.LogArray(
                    seq=self.other_task_seq, field="prompt_tokens", dtype="int32", shape=(0,)
                )
            },
            {
                "prompt_tokens": ev.LogArray(
                    seq=self.other_task_seq, field="prompt_tokens", dtype="int32", shape=(plen, 1)
                )
            },
        ]
        return options[v % len(options)]

    async def unreadable(
        self, v: int, m: Member, p: dict[str, Any], gid: str, tenant: str, env: str, size: int
    ) -> tuple[str, ev.ArrayRef | AtGeneration]:
        """References admission accepts that cannot be read, or read what they do not declare:
        ("completion", a reference or a function of the event's own generation's sequence) or
        ("prompt", a reference)."""
        assert self.payloads is not None
        c = m.completion
        dtype, shape = c.dtype.name, tuple(c.shape)
        plen = len(m.prompt)
        # Another group's generation, whose completion is one token longer than the declared shape.
        other = member(np.random.default_rng(v), 2, len(c) + 1)
        gen_body = ev.CompletionsGenerated(
            task_id="math.acme.other",
            env="math",
            prompt_tokens=inline_array(other.prompt),
            samples=[
                ev.Completion(
                    generation_id="math.acme.other-0",
                    sample_index=0,
                    completion_tokens=inline_array(other.completion),
                    logprobs=inline_array(other.logprobs),
                )
            ],
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
        field_ = ["env", "policy_version_start", "timings", "worker_id", "nope", p["text"]][v // 16 % 6]

        def at(path: str, dt: str = dtype, sh: tuple[int, ...] = shape) -> AtGeneration:
            return lambda gen_seq: ev.LogArray(seq=gen_seq, field=path, dtype=dt, shape=sh)

        # Paths into the rollout's own generation that lead to no array of its declared kind.
        paths = [
            "samples.99.completion_tokens",
            f"samples.{size + 1}.completion_tokens",
            "samples.-1.completion_tokens",
            "samples.x.completion_tokens",
            "samples..completion_tokens",
            "__class__",
            "samples.0.__class__",
            "samples.0.__struct_fields__",
            "samples.0",
            "samples",
            "samples.0.completion_tokens.data",
            "samples.0.completion_tokens.shape",
            "samples.0.generation_id",
            "task_id",
            "",
            p["text"],
            field_,
        ]
        options: list[tuple[str, ev.ArrayRef | AtGeneration]] = [
            (
                "completion",
                ev.LogArray(seq=seq, field="completion_tokens", dtype=dtype, shape=shape),
            ),  # nothing there
            (
                "completion",
                ev.LogArray(seq=10**12 + v, field="samples.0.completion_tokens", dtype=dtype, shape=shape),
            ),
            (
                "completion",
                ev.LogArray(
                    seq=self.garbage_seq, field="samples.0.completion_tokens", dtype=dtype, shape=shape
                ),
            ),
            ("completion", ev.LogArray(seq=gen, field=field_, dtype=dtype, shape=shape)),  # not an array
            # another group's generation: the right path, but not its own (nor of that shape)
            (
                "completion",
                ev.LogArray(seq=gen, field="samples.0.completion_tokens", dtype=dtype, shape=shape),
            ),
            (
                "completion",
                ev.LogArray(seq=1, field="completion_tokens", dtype=dtype, shape=shape),
            ),  # the run's first event
            ("completion", msgspec.structs.replace(ok, name=f"tokens-missing-{v}")),
            ("completion", msgspec.structs.replace(ok, sha256="0" * 64)),
            (
                "completion",
                msgspec.structs.replace(ok, store=["file", "mooncake", "none", p["text"]][v // 16 % 4]),
            ),
            (
                "completion",
                msgspec.structs.replace(
                    ok,
                    name=["", " ", "*", ">", "a.b", "../x", "x" * 300, "\0", "\u2603", p["text"]][
                        v // 16 % 10
                    ],
                ),
            ),
            ("completion", msgspec.structs.replace(ok, name="weights-v0")),  # another object, other bytes
            ("completion", at(paths[v // 16 % len(paths)])),
            ("completion", at("samples.0.logprobs")),  # floats there, declared as tokens
            # The prompt: another group's task (another tenant could name its own this way),
            # another group's generation, its own generation's instead of its task's.
            (
                "prompt",
                ev.LogArray(seq=self.other_task_seq, field="prompt_tokens", dtype="int32", shape=(plen,)),
            ),
            ("prompt", ev.LogArray(seq=gen, field="prompt_tokens", dtype="int32", shape=(plen,))),
            ("prompt", at("prompt_tokens", "int32", (plen,))),
        ]
        # Its own task's, holding more tokens, one past int32, or none where the path leads.
        own = [
            ([1] * (plen + 1), "prompt_tokens"),
            ([1] * (plen - 1) + [2**31 + v], "prompt_tokens"),
            ([1] * plen, field_),
            ([1] * plen, "prompt_tokens.0"),
        ]
        k = v % (len(options) + len(own))
        if k < len(options):
            return options[k]
        tokens, path = own[k - len(options)]
        task = ev.TaskSubmitted(task_id=gid, env=env, group_size=size, prompt_tokens=tokens)
        return "prompt", ev.LogArray(
            seq=await self.publish_task(task, tenant), field=path, dtype="int32", shape=(plen,)
        )

    async def build(self, recipe: tuple[str, Any]) -> list[Item]:
        kind, p = recipe
        if kind.startswith("good"):
            items = await self.good_group(kind, p)
        elif kind in EDGE_KINDS:
            # A group's event: one rollout of two (its mate never comes), or both.
            rng = np.random.default_rng(self.n)
            members = group_members(rng, 2, 3, 2)
            both = self.n % 2 == 0
            base = await self.scored(
                self.group_id("acme", "math", "x"),
                [(0, members[0]), (1, members[1])] if both else [(0, members[0])],
                tenant="acme",
                env="math",
                size=2,
            )
            it = edge_item(kind, p, base, subjects.rollout_subject(self.run_id, "acme", "code"))
            if kind == "foreign_type" and ev.decode_event(it.data, it.headers).type == "RolloutWithheld":
                # On the rollout subject, where the trainer writes its own: skipped, not refused.
                it.expect, it.reasons = "ignored", None
            items = [it]
        elif kind in ("replay_trained", "replay_withheld"):
            # An event again under a new event id (a producer's retry, or a hostile copy with
            # other values in one rollout): the trainer has its rollouts already and settles it
            # silently.
            done = self.trained_items if kind == "replay_trained" else self.withheld_items
            if not done:
                return []
            old = done[p["variant"] % len(done)].event
            assert old is not None and isinstance(old.body, ev.RolloutsScored)
            body = old.body
            if p["partner"]:
                rollouts = list(body.rollouts)
                rollouts[-1] = msgspec.structs.replace(rollouts[-1], reward=p["nonfinite"])
                body = msgspec.structs.replace(body, rollouts=rollouts)
            e = fresh(old, body=body)
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
                self.trained_at.extend(zip(b.rollout_ids, b.rollout_seqs, strict=True))
                self.nonfinite_metrics.update(k for k, x in b.metrics.items() if not math.isfinite(x))
            elif isinstance(b, ev.RolloutWithheld) and out.causation_id:
                self.withheld_of.setdefault(out.causation_id, []).append(b.reason)

    def processed(self, item: Item) -> bool:
        self.fold()
        return self.trained_seqs[item.seq] > 0

    def withheld(self, it: Item) -> bool:
        """Every rollout of the event withheld, as its group's were (incomplete_group)."""
        self.fold()
        e = it.event
        if e is None or not isinstance(e.body, ev.RolloutsScored):
            return False
        reasons = self.withheld_of.get(e.event_id, [])
        return len(reasons) == len(e.body.rollouts) and set(reasons) == {"incomplete_group"}

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
            if it.expect == "good":  # its rollouts trained, each from it (but one held already)
                assert it.event is not None and isinstance(it.event.body, ev.RolloutsScored)
                want = len(it.event.body.rollouts) if it.trains is None else it.trains
                assert self.trained_seqs[it.seq] == want, (it.kind, it.seq, self.trained_seqs[it.seq], want)
        twice = [r for r, k in self.trained_ids.items() if k > 1]
        assert not twice, f"trained twice: {twice}"
        for rid, seq in self.trained_at:
            got = self.by_seq.get(seq)
            if got is None:  # not a case's event: say what the log holds there
                raw = await self.bus.js.get_msg(stream_name(self.run_id), seq)
                held = (raw.subject, (raw.headers or {}).get(ev.HEADER_TYPE), seq in self.own)
                raise AssertionError(f"{rid} trained from seq {seq}, no case's event: {held}")
            assert got.expect in ("good", "either"), f"trained, not good: {got}"
            assert got.event is not None and isinstance(got.event.body, ev.RolloutsScored)
            assert rid in {r.rollout_id for r in got.event.body.rollouts}, (
                f"{rid} is not in the event at {seq}"
            )
        for seq, n in self.trained_seqs.items():
            body = self.by_seq[seq].event.body  # type: ignore[union-attr]
            assert isinstance(body, ev.RolloutsScored) and n <= len(body.rollouts)
        # Groups are trained whole: as many rollouts as their events say they have.
        trained_of = Counter(ids.group_of(rid) for rid in self.trained_ids)
        size_of: dict[str, set[int]] = {}
        for _, seq in self.trained_at:
            body = self.by_seq[seq].event.body  # type: ignore[union-attr]
            assert isinstance(body, ev.RolloutsScored)
            size_of.setdefault(body.group_id, set()).add(body.group_size)
        for gid, sizes in size_of.items():
            assert sizes == {trained_of[gid]}, (gid, sizes, trained_of[gid])
        assert not self.forged_dead
        await self.check_replay()

    async def check_replay(self) -> None:
        """What recovery would re-take (replay.read_rollouts at the sequences the steps
        recorded) is what was trained: each rollout, in the event it was trained from."""
        by_id: dict[str, tuple[int, ev.RolloutsScored, ev.ScoredRollout]] = {}
        for rid, seq in self.trained_at:
            e = self.by_seq[seq].event
            assert e is not None and isinstance(e.body, ev.RolloutsScored)
            r = next(r for r in e.body.rollouts if r.rollout_id == rid)
            by_id[rid] = (seq, e.body, r)
        new = set(by_id) - self.replay_checked
        if not new:
            return
        # As a restarted trainer reads them: at the sequences the steps recorded.
        scored, _ = await read_rollouts(self.bus, self.run_id, new, {rid: by_id[rid][0] for rid in new})
        for rid in sorted(new):
            self.replay_checked.add(rid)
            view = scored[rid]
            _, body, r = by_id[rid]
            assert view.prompt_owner == ids.task_event_id(self.run_id, body.task_id)
            if (view.body, view.rollout) != (body, r):
                first = min(
                    (
                        it
                        for it in self.by_seq.values()
                        if it.event is not None
                        and isinstance(it.event.body, ev.RolloutsScored)
                        and rid in {x.rollout_id for x in it.event.body.rollouts}
                    ),
                    key=lambda it: it.seq,
                )
                self.replay_mismatch.append((rid, first.kind))

    def report(self) -> str:
        lines = [
            super().report(),
            f"  steps {self.steps}, trained rollouts {len(self.trained_ids)}, "
            f"withheld {sum(len(r) for r in self.withheld_of.values())}, "
            f"held in partial groups {self.held()}",
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
