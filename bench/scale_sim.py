"""Scale: the seed run's traffic on paper, then its shape replayed on loopback.

The seed run (docs/scale.md): a GLM-5-class MoE (744B parameters, 75 MoE layers, 256 routed
experts, top-8), 256 rollouts a step of 131,072-token multi-turn agentic episodes, a step every
300 s. On paper (``--paper``, no server): every event and array one step of that run puts on
jetrl, built with jetrl's own event bodies and payload codec (an array above the inline threshold
becomes a PayloadRef; sizes are ``encode_event``'s), then per subject and per byte class the rate
the run needs.

The replay: the same code builds a scaled-down step (fewer, shorter rollouts: ``--rollouts``,
``--tokens``, ``--turns``) and publishes it on a private nats-server from ``--publishers``
concurrent group publishers, arrays through the chosen payload store (``--store``): tasks,
every turn's generation (tokens, logprobs and routing trace, put first), each episode's scored
rollout, heartbeats, then the trainer's step, policy version and weights. A scorer reads the
generations and a trainer the rollouts through durable pull consumers, each fetching what the
real one reads from the store. Then three short probes measure each path alone: the log's event
rate, payload put and payload get. Headroom is a measured rate over the seed's required rate:
the step's (sustained in the scaled shape) and each path's alone (the probes; the weights are
their put plus every worker's get through the same store, payload put and get the other
arrays). The lowest of the paths' headrooms names what saturates first, with the next, and the
step's CPU says whether this machine's cores were the bound.

    python bench/scale_sim.py [--paper] [--store objstore,file|mooncake|all] [--rollouts 8]
        [--tokens 16384] [--turns 8] [--publishers 4] [--budget-s 60] [--load N]

Never crashes on a slow machine: a stage past its budget is measured on what it finished, and a
figure with nothing finished reads "too slow to measure".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import os
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from load import cpu_load

from jetrl.bus import events as ev
from jetrl.bus import ids, subjects
from jetrl.bus.client import Bus
from jetrl.bus.consumer import ConsumerSpec
from jetrl.bus.log import configure
from jetrl.bus.payloads import (
    DEFAULT_INLINE_THRESHOLD,
    Buffer,
    FilePayloads,
    ObjectStorePayloads,
    PayloadMissing,
    Payloads,
    PayloadStore,
)
from jetrl.bus.publisher import BusError, Publisher
from jetrl.bus.server import EmbeddedServer
from jetrl.bus.streams import GiB, StreamLimits, payload_bucket

MB = 1e6
SUBJECTS = ("task", "generation", "rollout", "step", "policy", "weights", "worker")
TARGET = "(target >= 1x)"
LIMITS = StreamLimits(max_bytes=8 * GiB, payload_max_bytes=8 * GiB)
TENANT = "acme"
CPU_BOUND = 0.9  # of a core (the bench's one Python process) or of all cores: "CPU-bound"


# --------------------------------------------------------------------------- the traffic shape


@dataclass(frozen=True)
class Shape:
    """One step's traffic. The defaults are the seed run's (docs/scale.md names the sources;
    turns, prompt, model share and the node split are assumed)."""

    rollouts: int = 256  # scored rollouts a step
    group_size: int = 8  # samples of one first prompt (GRPO group)
    tokens: int = 131_072  # one rollout: first prompt + every model turn and environment reply
    prompt: int = 8_192  # the first prompt (assumed)
    turns: int = 32  # model turns per rollout (assumed)
    model_share: float = 0.5  # of the tokens after the first prompt, the model's (assumed)
    moe_layers: int = 75
    top_k: int = 8
    experts: int = 256
    vocab: int = 154_880
    step_s: float = 300.0
    weights_bytes: int = 744 * 10**9 * 2  # bf16, one full export per version
    inference_workers: int = 16  # one 8-GPU engine per inference node (assumed: 16 of 28 nodes)
    heartbeat_s: float = 2.0  # [inference] heartbeat_s
    inline_threshold: int = DEFAULT_INLINE_THRESHOLD

    def check(self) -> None:
        if self.rollouts < 1 or self.group_size < 1 or self.rollouts % self.group_size:
            raise ValueError(f"{self.rollouts} rollouts are not whole groups of {self.group_size}")
        if self.turns < 1 or self.prompt < 1 or self.tokens < self.prompt + 2 * self.turns:
            raise ValueError(
                f"{self.tokens} tokens do not hold a {self.prompt}-token prompt and {self.turns} turns"
            )
        if not 0.0 < self.model_share <= 1.0 or self.step_s <= 0:
            raise ValueError("model_share must be in (0, 1] and step_s positive")

    @property
    def groups(self) -> int:
        return self.rollouts // self.group_size

    @property
    def trace_itemsize(self) -> int:
        """policy/routing.py: uint8 up to 256 experts, uint16 past."""
        return 1 if self.experts <= 256 else 2

    @property
    def heartbeats(self) -> int:
        return round(self.inference_workers * self.step_s / self.heartbeat_s)


SEED = Shape()


@dataclass(frozen=True)
class Turn:
    history: int  # tokens of this turn's prompt: the first prompt and every turn before
    completion: int  # tokens the model writes
    reply: int  # the environment's tokens after it (0 after the last turn)


def turn_plan(shape: Shape) -> list[Turn]:
    """Each model turn of one rollout; the last one ends at exactly ``shape.tokens``."""
    shape.check()
    per = (shape.tokens - shape.prompt) / shape.turns
    model = max(1, round(per * shape.model_share))
    reply = max(0, round(per) - model)
    plan, history = [], shape.prompt
    for k in range(shape.turns):
        last = k == shape.turns - 1
        completion = shape.tokens - history if last else model
        plan.append(Turn(history, completion, 0 if last else reply))
        history += completion + (0 if last else reply)
    return plan


def trace_bytes(shape: Shape, rows: int) -> int:
    """A routing trace ``[rows, moe_layers, top_k]`` (policy/routing.py)."""
    return rows * shape.moe_layers * shape.top_k * shape.trace_itemsize


def final_trace_bytes(shape: Shape) -> int:
    """The trace the trainer replays: every token fed forward, all but the last."""
    return trace_bytes(shape, shape.tokens - 1)


# --------------------------------------------------------------------------- one step's traffic


@dataclass
class Traffic:
    """What one step puts on jetrl: events and their encoded bytes per subject, payload bytes
    put and read per class."""

    events: Counter[str] = field(default_factory=Counter)
    log_bytes: Counter[str] = field(default_factory=Counter)
    put: Counter[str] = field(default_factory=Counter)
    get: Counter[str] = field(default_factory=Counter)
    largest: Counter[str] = field(default_factory=Counter)  # the largest event, per subject

    def add(self, other: Traffic, times: int = 1) -> None:
        for mine, theirs in (
            (self.events, other.events),
            (self.log_bytes, other.log_bytes),
            (self.put, other.put),
            (self.get, other.get),
        ):
            for k, v in theirs.items():
                mine[k] += v * times
        for k, v in other.largest.items():
            self.largest[k] = max(self.largest[k], v)


def subject_kind(event: ev.Event) -> str:
    return subjects.subject_for(event).split(".")[2]


def stored(refs: list[ev.ArrayRef | None]) -> list[ev.PayloadRef]:
    return [r for r in refs if isinstance(r, ev.PayloadRef)]


def scorer_reads(g: ev.CompletionsGenerated, shape: Shape) -> list[ev.PayloadRef]:
    """What the producer's scorer reads of a generation (producers/producer.py): each sample's
    completion, and its logprobs in a multi-turn episode (the prompt is the task's, which the
    producer holds)."""
    refs: list[ev.ArrayRef | None] = []
    for smp in g.samples:
        refs.append(smp.completion_tokens)
        if shape.turns > 1:
            refs.append(smp.logprobs)
    return stored(refs)


def trainer_reads(b: ev.RolloutsScored) -> list[ev.PayloadRef]:
    """What the trainer reads of a group's scored rollouts (consumers/trainer/trainer.py vet)."""
    refs: list[ev.ArrayRef | None] = [b.prompt_tokens]
    for r in b.rollouts:
        refs += [r.completion_tokens, r.logprobs, r.completion_mask, r.routing_trace]
    return stored(refs)


def trace_class(name: str) -> str:
    return name.split("-", 1)[0]


class Sink:
    """Where a simulated step's events and arrays go: counted, and (in the replay) published
    and stored."""

    def __init__(
        self,
        run_id: str,
        shape: Shape,
        payloads: Payloads,
        send: Callable[[str, bytes, dict[str, str]], Awaitable[None]] | None = None,
    ) -> None:
        self.run_id, self.shape, self.payloads, self.send = run_id, shape, payloads, send
        self.traffic = Traffic()
        self.kept: list[ev.Event] | None = None  # on paper: the events, to count their reads
        self.prefix = uuid.uuid4().hex[:8]
        rng = np.random.default_rng(0)
        self.token_pool = rng.integers(0, shape.vocab, shape.tokens, dtype=np.int32)
        self.logprob_pool = -rng.random(shape.tokens, dtype=np.float32)

    async def emit(self, event: ev.Event) -> None:
        data = ev.encode_event(event)
        kind = subject_kind(event)
        self.traffic.events[kind] += 1
        self.traffic.log_bytes[kind] += len(data)
        self.traffic.largest[kind] = max(self.traffic.largest[kind], len(data))
        if self.kept is not None:
            self.kept.append(event)
        if self.send is not None:
            await self.send(subjects.subject_for(event), data, ev.event_headers(event))

    async def array(self, name: str, arr: np.ndarray) -> ev.ArrayRef:
        full = f"{trace_class(name)}-{self.prefix}-{name}"
        ref: ev.ArrayRef
        if isinstance(self.payloads.default, CountingStore) and arr.nbytes > self.payloads.inline_threshold:
            # On paper a large array is only its size: no bytes are made or copied.
            ref = ev.PayloadRef(
                store="objstore", bucket="paper", name=full, size=arr.nbytes, sha256="0" * 64,
                dtype=arr.dtype.name, shape=tuple(int(d) for d in arr.shape),
            )  # fmt: skip
        else:
            ref = await self.payloads.put_array(full, arr)
        if isinstance(ref, ev.PayloadRef):
            self.traffic.put[trace_class(name)] += ref.size
        return ref

    def tokens(self, n: int) -> np.ndarray:
        return self.token_pool[:n]

    def logprobs(self, n: int) -> np.ndarray:
        return self.logprob_pool[:n]


def task_of(gid: str, i: int, k: int) -> str:
    """The task of turn ``k`` of sample ``i`` (producers/producer.py next_turn)."""
    return gid if k == 0 else ids.turn_task_id(generation_of(gid, i, k - 1), k)


def generation_of(gid: str, i: int, k: int) -> str:
    return ids.generation_id(gid, i) if k == 0 else ids.generation_id(task_of(gid, i, k), 0)


async def simulate_group(
    sink: Sink, g: int, on_generation: Callable[[], Awaitable[None]] | None = None
) -> None:
    """One group's rollouts, every turn, in the order jetrl's parts publish them."""
    shape, run = sink.shape, sink.run_id
    plan = turn_plan(shape)
    first = plan[0]
    gid = ids.task_id("swe", TENANT, g)
    task0 = ev.TaskSubmitted(
        task_id=gid,
        env="swe",
        group_size=shape.group_size,
        prompt_tokens=sink.tokens(first.history).tolist(),
        max_tokens=shape.tokens,
    )
    await sink.emit(ev.new_event(task0, run_id=run, tenant=TENANT))
    last_trace: dict[int, ev.ArrayRef | None] = {}
    first_prompt = sink.tokens(shape.prompt).tolist()
    mask: list[int] = []
    for k, turn in enumerate(plan):
        if k > 0:  # the episode so far, the same for every sample here (their sizes are)
            before = plan[k - 1]
            mask += [1] * before.completion + [0] * before.reply
            done = turn.history - shape.prompt
            lps = sink.logprobs(done).astype(np.float64)
            lps[np.asarray(mask, np.uint8) == 0] = 0.0
            history = sink.tokens(turn.history).tolist()
            completion, logprobs = history[shape.prompt :], lps.tolist()
        for i in range(shape.group_size):
            if k > 0:  # later turns: one task per sample, the episode so far inline
                episode = ev.EpisodeState(
                    group_id=gid,
                    sample_index=i,
                    group_size=shape.group_size,
                    task_id=gid,
                    prompt=first_prompt,
                    completion=completion,
                    mask=mask,
                    logprobs=logprobs,
                    version_start=0,
                    max_tokens=shape.tokens,
                )
                task = ev.TaskSubmitted(
                    task_id=task_of(gid, i, k),
                    env="swe",
                    group_size=1,
                    prompt_tokens=history,
                    max_tokens=turn.completion,
                    episode=episode,
                    episode_id=gid,
                    turn=k,
                    worker_hint="inf-0",
                )
                await sink.emit(ev.new_event(task, run_id=run, tenant=TENANT))
        # consumers/inference/worker.py: one CompletionsGenerated a task (the group's G samples
        # on the first turn, one sample on each episode's later turn), the prompt by reference.
        samples: dict[int, ev.Completion] = {}
        for i in range(shape.group_size):
            name = f"{gid}-{i}-{k}"
            rows = turn.history + turn.completion - 1
            dtype = np.uint8 if shape.trace_itemsize == 1 else np.uint16
            # A view of one zero: no memory until a store needs the bytes.
            zeros = np.broadcast_to(np.zeros(1, dtype), (rows, shape.moe_layers, shape.top_k))
            trace = await sink.array(f"trace-{name}", zeros)
            last_trace[i] = trace
            samples[i] = ev.Completion(
                generation_id=generation_of(gid, i, k),
                sample_index=i if k == 0 else 0,
                completion_tokens=await sink.array(f"tokens-{name}", sink.tokens(turn.completion)),
                logprobs=await sink.array(f"logprobs-{name}", sink.logprobs(turn.completion)),
                routing_trace=trace,
            )
        per_task = [list(samples.values())] if k == 0 else [[samples[i]] for i in range(shape.group_size)]
        for i, group in enumerate(per_task):
            body = ev.CompletionsGenerated(
                task_id=task_of(gid, i, k),
                env="swe",
                prompt_tokens=ev.LogArray(seq=1, field="prompt_tokens", dtype="int32", shape=(turn.history,)),
                samples=group,
                policy_version_start=0,
                policy_version_end=0,
                worker_id="inf-0",
                timings=ev.GenerationTimings(queued_s=0.1, generate_s=30.0),
                episode_id=gid if shape.turns > 1 else "",
                turn=k,
            )
            await sink.emit(ev.new_event(body, run_id=run, tenant=TENANT))
            if on_generation is not None:
                await on_generation()
    # producers/producer.py: one RolloutsScored for a single-turn group, one per episode else.
    if shape.turns == 1:
        await sink.emit(
            ev.new_event(
                await rollouts_body(sink, gid, list(range(shape.group_size)), plan, last_trace),
                run_id=run,
                tenant=TENANT,
            )
        )
    else:
        for i in range(shape.group_size):
            await sink.emit(
                ev.new_event(await rollouts_body(sink, gid, [i], plan, last_trace), run_id=run, tenant=TENANT)
            )


async def rollouts_body(
    sink: Sink, gid: str, members: list[int], plan: list[Turn], traces: dict[int, ev.ArrayRef | None]
) -> ev.RolloutsScored:
    shape = sink.shape
    completion = shape.tokens - shape.prompt
    prompt_ref: ev.ArrayRef = ev.LogArray(seq=1, field="prompt_tokens", dtype="int32", shape=(shape.prompt,))
    rollouts = []
    for i in members:
        name = f"{gid}-{i}"
        common: dict[str, Any] = dict(
            rollout_id=ids.rollout_id(gid, i),
            sample_index=i,
            reward=1.0,
            reward_parts={"tests": 1.0},
            routing_trace=traces[i],  # the last turn's, copied (its prompt is the whole history)
            policy_version_start=0,
            policy_version_end=0,
        )
        if shape.turns == 1:  # its generation's arrays (LogArray in jetrl; inline copies here)
            rollouts.append(
                ev.ScoredRollout(
                    completion_tokens=await sink.array(f"tokens-r{name}", sink.tokens(completion)),
                    logprobs=await sink.array(f"logprobs-r{name}", sink.logprobs(completion)),
                    **common,
                )
            )
            continue
        # producers/producer.py episode_rollout: the whole episode, stored again.
        prompt_ref = await sink.array(f"episode-prompt-{name}", sink.tokens(shape.prompt))
        rollouts.append(
            ev.ScoredRollout(
                completion_tokens=await sink.array(f"episode-tokens-{name}", sink.tokens(completion)),
                logprobs=await sink.array(f"episode-logprobs-{name}", sink.logprobs(completion)),
                completion_mask=await sink.array(f"episode-mask-{name}", np.ones(completion, np.uint8)),
                turns=len(plan),
                **common,
            )
        )
    return ev.RolloutsScored(
        generation_event_id=ev.new_event_id(),
        task_id=gid,
        env="swe",
        group_id=gid,
        group_size=shape.group_size,
        prompt_tokens=prompt_ref,
        rollouts=rollouts,
    )


def step_body(shape: Shape, token_stats: ev.ArrayRef | None) -> ev.StepCompleted:
    return ev.StepCompleted(
        step=1,
        policy_version=1,
        rollout_ids=[
            ids.rollout_id(ids.task_id("swe", TENANT, g), i)
            for g in range(shape.groups)
            for i in range(shape.group_size)
        ],
        rollout_seqs=list(range(10**6, 10**6 + shape.rollouts)),
        metrics={f"metric_{m}": 0.5 for m in range(32)},
        tokens=shape.rollouts * shape.tokens,
        duration_s=shape.step_s,
        token_stats=token_stats,
    )


async def step_tail(sink: Sink, weights: Callable[[], Awaitable[ev.PayloadRef]]) -> ev.PayloadRef:
    """The trainer's step: StepCompleted (token stats stored), the version, its weights."""
    shape, run = sink.shape, sink.run_id
    tokens = shape.rollouts * (shape.tokens - shape.prompt)
    stats = await sink.array("stats-step", np.broadcast_to(np.zeros(1, np.float32), (tokens, 2)))
    await sink.emit(ev.new_event(step_body(shape, stats), run_id=run))
    await sink.emit(
        ev.new_event(
            ev.PolicyVersionPublished(version=1, step=1, weights_checksum="0" * 64, parent_version=0),
            run_id=run,
        )
    )
    ref = await weights()
    sink.traffic.put["weights"] += ref.size
    await sink.emit(
        ev.new_event(ev.WeightsReady(version=1, location=ref, weights_checksum="0" * 64), run_id=run)
    )
    return ref


def worker_events(shape: Shape, run_id: str) -> list[ev.Event]:
    """A step's heartbeats and weight loads of every inference worker."""
    out = [
        ev.new_event(
            ev.WorkerHeartbeat(
                worker_id=f"inf-{n % shape.inference_workers}",
                kind="inference",
                status="busy",
                loaded_version=1,
                inflight=64,
                stats={"samples": 1e4, "tokens": 1e8, "tasks": 1e3, "generate_s": 1e4, "weight_loads": 9.0},
            ),
            run_id=run_id,
        )
        for n in range(shape.heartbeats)
    ]
    out += [
        ev.new_event(ev.WeightsLoaded(version=1, worker_id=f"inf-{w}", load_s=30.0), run_id=run_id)
        for w in range(shape.inference_workers)
    ]
    return out


# --------------------------------------------------------------------------- on paper


class CountingStore:
    """A payload store that keeps nothing: sizing one step on paper."""

    kind = "objstore"
    held_by_writer = False
    bucket = "paper"

    async def put(
        self, name: str, data: Buffer, *, sha256: bool = True, durable: bool = True
    ) -> ev.PayloadRef:
        size = data.nbytes if isinstance(data, memoryview) else len(data)
        return ev.PayloadRef(store=self.kind, bucket=self.bucket, name=name, size=size, sha256="0" * 64)

    async def get_bytes(self, ref: ev.PayloadRef) -> bytes:
        raise NotImplementedError("on paper nothing is read back")

    async def read_into(self, ref: ev.PayloadRef, out: memoryview, progress: Callable[[int], None]) -> bool:
        raise NotImplementedError("on paper nothing is read back")

    async def discard(self, name: str) -> None:
        return None  # on paper nothing is held


async def paper_traffic(shape: Shape, run_id: str = "seed") -> Traffic:
    """One step of ``shape``: one group simulated and counted, times the groups, then the
    trainer's step and every worker's heartbeats and weight loads; what the scorer and the
    trainer read, from the events themselves."""
    shape.check()
    sink = Sink(run_id, shape, Payloads(CountingStore(), inline_threshold=shape.inline_threshold))
    sink.kept = []
    await simulate_group(sink, 0)
    for e in sink.kept:
        if isinstance(e.body, ev.CompletionsGenerated):
            sink.traffic.get["scorer"] += sum(r.size for r in scorer_reads(e.body, shape))
        elif isinstance(e.body, ev.RolloutsScored):
            sink.traffic.get["trainer"] += sum(r.size for r in trainer_reads(e.body))
    total = Traffic()
    total.add(sink.traffic, shape.groups)
    tail = Sink(run_id, shape, sink.payloads)

    async def weights() -> ev.PayloadRef:
        return ev.PayloadRef(
            store="objstore", bucket="paper", name="weights-v1", size=shape.weights_bytes, sha256="0" * 64
        )

    await step_tail(tail, weights)
    for e in worker_events(shape, run_id):
        await tail.emit(e)
    tail.traffic.get["weights"] = shape.weights_bytes * shape.inference_workers
    total.add(tail.traffic)
    return total


@dataclass(frozen=True)
class Rates:
    """Per second: events and log bytes per subject, payload bytes per class."""

    events: dict[str, float]
    log_bytes: dict[str, float]
    put: dict[str, float]
    get: dict[str, float]

    @property
    def events_total(self) -> float:
        return sum(self.events.values())

    @property
    def log_total(self) -> float:
        return sum(self.log_bytes.values())

    @property
    def put_total(self) -> float:
        return sum(self.put.values())

    @property
    def get_total(self) -> float:
        return sum(self.get.values())

    @property
    def put_arrays(self) -> float:
        """Payload bytes put but the weights (tokens, logprobs, traces, episodes, stats)."""
        return self.put_total - self.put.get("weights", 0.0)

    @property
    def get_arrays(self) -> float:
        return self.get_total - self.get.get("weights", 0.0)

    @property
    def weights(self) -> float:
        return self.put.get("weights", 0.0) + self.get.get("weights", 0.0)


def rates(t: Traffic, seconds: float) -> Rates:
    """``t`` spread over ``seconds`` (a zero or negative time moves nothing: all rates 0)."""
    per = 1.0 / seconds if seconds > 0 else 0.0
    return Rates(
        events={k: v * per for k, v in t.events.items()},
        log_bytes={k: v * per for k, v in t.log_bytes.items()},
        put={k: v * per for k, v in t.put.items()},
        get={k: v * per for k, v in t.get.items()},
    )


def required(shape: Shape, t: Traffic) -> Rates:
    """What a run of ``shape`` needs: its step's traffic every ``step_s``."""
    return rates(t, shape.step_s)


def human(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def paper_table(shape: Shape, t: Traffic) -> list[str]:
    """The step's traffic per subject and per payload class, and the rates it needs."""
    r = required(shape, t)
    lines = [
        f"step: {shape.rollouts} rollouts x {shape.tokens:,} tokens"
        f" ({shape.turns} turns, prompt {shape.prompt:,}),"
        f" one step per {shape.step_s:.0f} s; final trace {human(final_trace_bytes(shape))} per rollout",
        f"  {'log subject':<14}{'events/step':>12}{'bytes/step':>12}{'events/s':>10}{'bytes/s':>11}"
        f"{'largest':>11}",
    ]
    for k in SUBJECTS:
        lines.append(
            f"  {k:<14}{t.events[k]:>12,}{human(t.log_bytes[k]):>12}{r.events.get(k, 0.0):>10.2f}"
            f"{human(r.log_bytes.get(k, 0.0)) + '/s':>11}{human(t.largest[k]):>11}"
        )
    lines.append(
        f"  {'log, all':<14}{sum(t.events.values()):>12,}{human(sum(t.log_bytes.values())):>12}"
        f"{r.events_total:>10.2f}{human(r.log_total) + '/s':>11}"
    )
    lines.append(f"  {'payload put':<14}{'':>12}{'bytes/step':>12}{'':>10}{'bytes/s':>11}")
    for k, v in sorted(t.put.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {k:<14}{'':>12}{human(v):>12}{'':>10}{human(r.put[k]) + '/s':>11}")
    lines.append(f"  {'payload get':<14}")
    for k, v in sorted(t.get.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {k:<14}{'':>12}{human(v):>12}{'':>10}{human(r.get[k]) + '/s':>11}")
    return lines


# --------------------------------------------------------------------------- headroom


def headroom(measured: float | None, needed: float) -> float | None:
    """Measured over needed; None when nothing is needed or nothing was measured."""
    if measured is None or needed <= 0:
        return None
    return max(0.0, measured) / needed


def fmt_x(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}x"
    if x >= 1:
        return f"{x:.1f}x"
    return f"{x:.2g}x"


def headroom_line(name: str, measured: float | None, needed: float, why: str = "") -> str:
    """``scale headroom <name> <x>x seed (target >= 1x)``, or why there is no figure."""
    head = f"scale headroom {name}"
    if needed <= 0:
        return f"{head}: not needed by the seed run {TARGET}"
    if measured is None:
        return f"{head}: not measured ({why or 'not run'}) {TARGET}"
    if measured <= 0:
        return f"{head}: too slow to measure ({why or 'nothing finished within the budget'}) {TARGET}"
    x = headroom(measured, needed)
    assert x is not None
    return f"{head} {fmt_x(x)} seed {TARGET}"


def shared_headroom(loads: list[tuple[float, float | None]]) -> float | None:
    """Headroom of one path doing several things in turn: each ``(needed, capacity)`` takes
    ``needed / capacity`` of its time (the weights: one put, then every worker's get)."""
    busy = 0.0
    for needed, capacity in loads:
        if capacity is None:
            return None
        if needed > 0:
            if capacity <= 0:
                return 0.0
            busy += needed / capacity
    return 1.0 / busy if busy > 0 else None


def first_to_saturate(paths: dict[str, float | None], cpu: str = "") -> str:
    """The path with the lowest headroom, and the next; ``cpu``: the step's CPU figure when
    it was the bound."""
    measured = sorted(((v, k) for k, v in paths.items() if v is not None), key=lambda vk: vk[0])
    if not measured:
        return "scale first to saturate: not measured (no path was measured)"
    (x, name), rest = measured[0], measured[1:]
    then = f", then {rest[0][1]} ({fmt_x(rest[0][0])} seed)" if rest else ""
    tail = f"; CPU-bound: {cpu}" if cpu else ""
    unmeasured = [k for k, v in paths.items() if v is None]
    tail += f"; not measured: {', '.join(unmeasured)}" if unmeasured else ""
    return f"scale first to saturate: {name} ({fmt_x(x)} seed{then}{tail})"


# --------------------------------------------------------------------------- CPU


def server_cpu_s(pid: int | None) -> float | None:
    """User + system seconds of process ``pid`` (Linux /proc), else None."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class Cpu:
    client: float  # cores the bench's process used, on average
    server: float | None  # cores nats-server used

    def bound(self, cores: int) -> str:
        """Why the step was CPU-bound, or "" when it was not."""
        total = self.client + (self.server or 0.0)
        if self.client >= CPU_BOUND or total >= CPU_BOUND * cores:
            server = f", nats-server {self.server:.0%} of a core" if self.server is not None else ""
            return f"client {self.client:.0%} of a core{server}, {cores} cores"
        return ""


# --------------------------------------------------------------------------- the replay


@dataclass
class StepRun:
    traffic: Traffic
    seconds: float
    complete: bool
    consumed: Counter[str]
    cpu: Cpu | None
    note: str = ""


async def open_store(kind: str, bus: Bus, run_id: str, tmp: str) -> tuple[PayloadStore | None, str]:
    """The payload store ``kind``, or None and why not."""
    if kind == "objstore":
        return await ObjectStorePayloads.for_run(bus.js, run_id), ""
    if kind == "file":
        return FilePayloads(Path(tmp) / "payloads", payload_bucket(run_id)), ""
    try:
        mod = importlib.import_module("jetrl.bus.mooncake")
    except ImportError as exc:
        return None, f"jetrl.bus.mooncake is not in this checkout ({exc})"
    cls = next(
        (v for v in vars(mod).values() if isinstance(v, type) and getattr(v, "kind", None) == "mooncake"),
        None,
    )
    if cls is None:
        return None, "jetrl.bus.mooncake has no store of kind 'mooncake'"
    try:
        for_run = getattr(cls, "for_run", None)
        store = await for_run(bus.js, run_id) if for_run is not None else cls(bucket=payload_bucket(run_id))
    except Exception as exc:  # no transfer engine, no RDMA device, no metadata server here
        return None, f"could not open a Mooncake store here: {type(exc).__name__}: {exc}"
    return store, ""


async def consume(
    bus: Bus,
    run_id: str,
    durable: str,
    subject: str,
    n: int,
    deadline: float,
    on: Callable[[ev.Event], Awaitable[None]],
    counter: Counter[str],
) -> None:
    c = await bus.consumer(
        ConsumerSpec(
            run_id=run_id, durable=durable, filter_subjects=[subject], max_ack_pending=4096, ack_wait=120
        )
    )
    try:
        while counter[durable] < n and time.monotonic() < deadline:
            for d in await c.fetch(64, timeout=min(2.0, max(0.1, deadline - time.monotonic()))):
                await on(d.event)
                await d.ack()
                counter[durable] += 1
    finally:
        with contextlib.suppress(Exception):
            await c.unsubscribe()


async def replay_step(
    bus: Bus,
    run_id: str,
    shape: Shape,
    payloads: Payloads,
    publishers: int,
    budget_s: float,
    server_pid: int | None,
) -> StepRun:
    """One scaled step through the bus and the store, consumed as the scorer and trainer do."""
    pubs: list[Publisher] = []
    sinks: list[Sink] = []
    consumed: Counter[str] = Counter()
    read = Traffic()
    t0 = time.monotonic()
    deadline = t0 + budget_s
    cpu0, srv0, wall0 = time.process_time(), server_cpu_s(server_pid), time.perf_counter()

    async def scorer(e: ev.Event) -> None:
        if isinstance(e.body, ev.CompletionsGenerated):
            for r in scorer_reads(e.body, shape):
                read.get["scorer"] += len(await payloads.get_bytes(r))

    async def trainer(e: ev.Event) -> None:
        if isinstance(e.body, ev.RolloutsScored):
            for r in trainer_reads(e.body):
                read.get["trainer"] += len(await payloads.get_bytes(r))

    def new_sink() -> Sink:
        pub = bus.publisher(max_inflight=256, ack_timeout=30.0)
        pubs.append(pub)
        s = Sink(run_id, shape, payloads, pub.publish_encoded)
        sinks.append(s)
        return s

    gens = shape.rollouts * shape.turns
    consumers = [
        asyncio.create_task(
            consume(
                bus,
                run_id,
                "sim-scorer",
                subjects.generation_subject(run_id),
                gens,
                deadline,
                scorer,
                consumed,
            )
        ),
        asyncio.create_task(
            consume(
                bus,
                run_id,
                "sim-trainer",
                subjects.rollout_subject(run_id),
                shape.rollouts,
                deadline,
                trainer,
                consumed,
            )
        ),
    ]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for g in range(shape.groups):
        queue.put_nowait(g)
    progress = Counter[str]()

    async def tick() -> None:
        progress["generations"] += 1
        if progress["generations"] % max(1, gens // 4) == 0:
            print(
                f"    {progress['generations']}/{gens} generations published, {time.monotonic() - t0:.1f} s",
                flush=True,
            )

    async def publisher() -> None:
        sink = new_sink()
        while not queue.empty():
            await simulate_group(sink, queue.get_nowait(), tick)

    async def heartbeats() -> None:
        sink = new_sink()
        for e in worker_events(shape, run_id)[: shape.heartbeats]:
            await sink.emit(e)
            await asyncio.sleep(0)

    note = ""
    work = [asyncio.create_task(publisher()) for _ in range(max(1, publishers))] + [
        asyncio.create_task(heartbeats())
    ]
    try:
        await asyncio.wait_for(asyncio.gather(*work), max(0.1, deadline - time.monotonic()))
        for p in pubs:
            await p.flush(timeout=max(1.0, deadline - time.monotonic()))
        await asyncio.wait_for(asyncio.gather(*consumers), max(0.1, deadline - time.monotonic()) + 5)
        tail = new_sink()

        async def put_weights() -> ev.PayloadRef:
            blob = bytearray(shape.weights_bytes)
            return await payloads.default.put(f"weights-{tail.prefix}-v1", blob)

        ref = await asyncio.wait_for(step_tail(tail, put_weights), max(0.1, deadline - time.monotonic()))
        for e in worker_events(shape, run_id)[shape.heartbeats :]:
            await tail.emit(e)
        loads = [payloads.get_bytes(ref) for _ in range(shape.inference_workers)]
        for got in await asyncio.wait_for(asyncio.gather(*loads), max(0.1, deadline - time.monotonic())):
            read.get["weights"] += len(got)
        for p in pubs:
            await p.flush(timeout=max(1.0, deadline - time.monotonic()))
    except (TimeoutError, BusError):
        note = f"past its {budget_s:.0f} s budget: measured on what it finished"
    finally:
        for t in [*work, *consumers]:
            t.cancel()
        await asyncio.gather(*work, *consumers, return_exceptions=True)
    seconds = time.perf_counter() - wall0
    total = Traffic()
    for s in sinks:
        total.add(s.traffic)
    total.get = read.get
    srv1 = server_cpu_s(server_pid)
    cpu = Cpu(
        client=(time.process_time() - cpu0) / max(seconds, 1e-9),
        server=None if srv0 is None or srv1 is None else (srv1 - srv0) / max(seconds, 1e-9),
    )
    complete = not note and consumed["sim-trainer"] >= shape.rollouts
    return StepRun(total, seconds, complete, consumed, cpu, note)


# --------------------------------------------------------------------------- probes


@dataclass(frozen=True)
class Probe:
    """One path alone: how much moved, in how long (``rate`` per second; 0 when nothing did)."""

    amount: float
    seconds: float

    @property
    def rate(self) -> float:
        return self.amount / self.seconds if self.seconds > 0 else 0.0


async def probe_log(bus: Bus, run_id: str, shape: Shape, seconds: float) -> tuple[Probe, Probe]:
    """Events with payload references (a generation's shape) published through a window and
    read back by a durable pull consumer: events/s each way."""
    ref = ev.PayloadRef(
        store="objstore", bucket="b", name="trace-x", size=final_trace_bytes(shape), sha256="0" * 64
    )
    task = ids.task_id("swe", "probe", 0)
    body = ev.CompletionsGenerated(
        task_id=task, env="swe", prompt_tokens=ref,
        samples=[
            ev.Completion(
                generation_id=ids.generation_id(task, 0), sample_index=0,
                completion_tokens=ref, logprobs=ref, routing_trace=ref,
            )
        ],
        policy_version_start=0, policy_version_end=0, worker_id="inf-0",
    )  # fmt: skip
    pub = bus.publisher(max_inflight=256)
    sent, t0 = 0, time.perf_counter()
    end = t0 + seconds
    while time.perf_counter() < end:
        for _ in range(256):
            await pub.publish(ev.new_event(body, run_id=run_id, tenant="probe"))
            sent += 1
    with contextlib.suppress(Exception):
        await pub.flush(timeout=30.0)
    put = Probe(sent, time.perf_counter() - t0)
    counter: Counter[str] = Counter()

    async def nothing(e: ev.Event) -> None:
        return None

    t1 = time.perf_counter()
    await consume(
        bus,
        run_id,
        "probe-log",
        subjects.generation_subject(run_id, "probe"),
        sent,
        t1 + seconds,
        nothing,
        counter,
    )
    return put, Probe(counter["probe-log"], time.perf_counter() - t1)


async def probe_store(
    payloads: Payloads, size: int, seconds: float, parallel: int = 4
) -> tuple[Probe, Probe]:
    """Objects of ``size`` bytes put, then read back (hash-checked), ``parallel`` at a time."""
    blob = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes()
    refs: list[ev.PayloadRef] = []
    prefix = uuid.uuid4().hex[:8]

    async def putter(w: int, end: float) -> None:
        n = 0
        while time.perf_counter() < end:
            refs.append(await payloads.default.put(f"probe-{prefix}-{w}-{n}", blob))
            n += 1

    t0 = time.perf_counter()
    with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
        await asyncio.wait_for(
            asyncio.gather(*(putter(w, t0 + seconds) for w in range(parallel))), seconds * 4
        )
    put = Probe(len(refs) * size, time.perf_counter() - t0)
    got, missing = 0, 0

    async def getter(mine: list[ev.PayloadRef], end: float) -> None:
        nonlocal got, missing
        for r in mine:
            if time.perf_counter() >= end:
                return
            try:
                got += len(await payloads.get_bytes(r))
            except PayloadMissing:  # a store that evicts (Mooncake's segment) lost the older ones
                missing += 1

    newest = refs[::-1]  # the last put first: what a store that evicts still holds
    t1 = time.perf_counter()
    with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
        await asyncio.wait_for(
            asyncio.gather(*(getter(newest[w::parallel], t1 + seconds) for w in range(parallel))), seconds * 4
        )
    if missing:
        print(f"  get probe: {missing} of the {len(refs)} objects put were gone (evicted)")
    return put, Probe(got, time.perf_counter() - t1)


# --------------------------------------------------------------------------- report


def step_lines(run: StepRun, seed: Rates) -> list[str]:
    measured = rates(run.traffic, run.seconds)
    lines = [
        f"  step: {run.seconds:.1f} s, {sum(run.traffic.events.values()):,} events,"
        f" {human(sum(run.traffic.log_bytes.values()))} of log, {human(sum(run.traffic.put.values()))} put,"
        f" {human(sum(run.traffic.get.values()))} read"
        + (f" ({run.note})" if run.note else "")
        + ("" if run.complete else " [incomplete]"),
        f"  {'subject':<12}{'events/s':>10}{'seed ev/s':>11}{'headroom':>10}",
    ]
    for k in SUBJECTS:
        x = headroom(measured.events.get(k, 0.0), seed.events.get(k, 0.0))
        lines.append(
            f"  {k:<12}{measured.events.get(k, 0.0):>10.1f}{seed.events.get(k, 0.0):>11.2f}"
            f"{fmt_x(x) if x is not None else '-':>10}"
        )
    if run.cpu is not None:
        server = f", nats-server {run.cpu.server:.0%}" if run.cpu.server is not None else ""
        lines.append(f"  cpu: client {run.cpu.client:.0%} of a core{server}")
    return lines


def summary(
    store: str, run: StepRun | None, probes: dict[str, Probe], seed: Rates, why: str = ""
) -> list[str]:
    """The headline lines of one store: the step's sustained rates over the seed's, then the
    paths alone and what saturates first."""
    m = rates(run.traffic, run.seconds) if run is not None else None
    why = why or ("" if run is None or run.complete else run.note or "the step did not finish")

    def of(get: Callable[[Rates], float]) -> float | None:
        return None if m is None else get(m)

    lines = [
        headroom_line(f"events ({store})", of(lambda r: r.events_total), seed.events_total, why),
        headroom_line(f"log bytes ({store})", of(lambda r: r.log_total), seed.log_total, why),
        headroom_line(
            f"trace bytes ({store})", of(lambda r: r.put.get("trace", 0.0)), seed.put.get("trace", 0.0), why
        ),
        headroom_line(f"payload put ({store})", of(lambda r: r.put_arrays), seed.put_arrays, why),
        headroom_line(f"payload get ({store})", of(lambda r: r.get_arrays), seed.get_arrays, why),
        headroom_line(f"weights ({store})", of(lambda r: r.weights), seed.weights, why),
    ]
    paths: dict[str, float | None] = {
        "the log's event rate": headroom(
            min(probes["log publish"].rate, probes["log consume"].rate) if "log publish" in probes else None,
            seed.events_total,
        ),
        "payload put": headroom(probes["put"].rate if "put" in probes else None, seed.put_arrays),
        "payload get": headroom(probes["get"].rate if "get" in probes else None, seed.get_arrays),
        "weights": shared_headroom(
            [
                (seed.put.get("weights", 0.0), probes["put"].rate if "put" in probes else None),
                (seed.get.get("weights", 0.0), probes["get"].rate if "get" in probes else None),
            ]
        ),
    }
    for name, x in paths.items():
        lines.append(
            f"scale path {name} ({store}) alone: " + (f"{fmt_x(x)} seed" if x is not None else "not measured")
        )
    cpu = run.cpu.bound(os.cpu_count() or 1) if run is not None and run.cpu is not None else ""
    lines.append(first_to_saturate(paths, cpu).replace("saturate:", f"saturate ({store}):", 1))
    return lines


async def bench_store(
    kind: str,
    bus: Bus,
    run_id: str,
    shape: Shape,
    seed: Rates,
    args: argparse.Namespace,
    tmp: str,
    pid: int | None,
) -> list[str]:
    store, why = await open_store(kind, bus, run_id, tmp)
    if store is None:
        print(f"\nstore {kind}: skipped ({why})")
        return [f"scale store {kind}: skipped ({why})"]
    payloads = Payloads(store, inline_threshold=shape.inline_threshold)
    print(f"\nstore {kind}: replaying one step ({args.budget_s:.0f} s budget)", flush=True)
    run = await replay_step(bus, run_id, shape, payloads, args.publishers, args.budget_s, pid)
    for line in step_lines(run, seed):
        print(line)
    probes: dict[str, Probe] = {}
    print(f"  probes: {args.probe_s:.0f} s per path", flush=True)
    try:
        probes["log publish"], probes["log consume"] = await probe_log(bus, run_id, shape, args.probe_s)
    except Exception as exc:  # a probe that fails is reported, never the end of the report
        print(f"  log probe failed: {type(exc).__name__}: {exc}")
    try:
        size = max(1 << 20, min(final_trace_bytes(shape), 64 << 20))
        probes["put"], probes["get"] = await probe_store(payloads, size, args.probe_s)
    except Exception as exc:
        print(f"  store probe failed: {type(exc).__name__}: {exc}")
    for name, p in probes.items():
        unit = "events/s" if name.startswith("log") else "MB/s"
        value = p.rate if unit == "events/s" else p.rate / MB
        print(f"  {name:<12}{value:>12,.1f} {unit}")
    return summary(kind, run, probes, seed)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paper", action="store_true", help="the seed's traffic on paper only (no server)")
    ap.add_argument(
        "--store", default="objstore,file", help="objstore|file|mooncake, comma-separated, or all"
    )
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16_384, help="per rollout")
    ap.add_argument("--prompt", type=int, default=1_024, help="the first prompt's tokens")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--weights-mb", type=float, default=64.0, help="the scaled step's weights blob")
    ap.add_argument("--workers", type=int, default=2, help="inference workers reading the weights")
    ap.add_argument("--publishers", type=int, default=4, help="groups published concurrently")
    ap.add_argument("--budget-s", type=float, default=60.0, help="the replayed step's time limit, per store")
    ap.add_argument("--probe-s", type=float, default=6.0, help="each path alone, per store")
    ap.add_argument("--load", type=int, default=0, help="busy CPU processes running beside the bench")
    args = ap.parse_args()
    stores = (
        ["objstore", "file", "mooncake"] if args.store == "all" else [s for s in args.store.split(",") if s]
    )
    bad = [s for s in stores if s not in ("objstore", "file", "mooncake")]
    if bad:
        ap.error(f"unknown store {bad}: objstore, file, mooncake or all")
    scaled = dataclasses.replace(
        SEED,
        rollouts=args.rollouts,
        group_size=args.group_size,
        tokens=args.tokens,
        prompt=args.prompt,
        turns=args.turns,
        weights_bytes=int(args.weights_mb * MB),
        inference_workers=args.workers,
    )
    try:
        scaled.check()
    except ValueError as exc:
        ap.error(str(exc))
    configure(level="warning")
    print("the seed run on paper", flush=True)
    seed_traffic = await paper_traffic(SEED)
    for line in paper_table(SEED, seed_traffic):
        print(line)
    seed = required(SEED, seed_traffic)
    if args.paper:
        return
    print("\nthe replayed step on paper")
    for line in paper_table(scaled, await paper_traffic(scaled))[:1]:
        print(line)
    out: list[str] = []
    with tempfile.TemporaryDirectory() as tmp, EmbeddedServer(tmp) as srv, cpu_load(args.load):
        bus = await Bus.connect(srv.url, name="scale-sim", max_inflight=256)
        pid = srv.proc.pid if srv.proc is not None else None
        try:
            for n, kind in enumerate(stores):
                run_id = f"scale{n}"
                await bus.ensure_run(run_id, LIMITS)
                try:
                    out += await bench_store(kind, bus, run_id, scaled, seed, args, tmp, pid)
                except Exception as exc:  # one store failing leaves the others' figures
                    print(f"\nstore {kind}: failed ({type(exc).__name__}: {exc})")
                    out.append(f"scale store {kind}: not measured ({type(exc).__name__}: {exc})")
        finally:
            await bus.close()
    loaded = f" (load {args.load})" if args.load else ""
    print(f"\nsummary{loaded}")
    for line in out:
        print(line)


if __name__ == "__main__":
    asyncio.run(main())
