"""What fact of the run each event of the log states, once for every reader.

One fact type per event body (``OF`` names it). Each carries the event's place in the log
(``seq``) and time (``t``), then what the run's folds read (the monitor's series, replay's steps
and weights), then the rest of what the store keeps of it, with defaults so that a fact made by
hand (in tests) states only what matters. Bulk arrays are not facts: a fact says where they lie
(``payloads``) and how long they are.

Facts are msgspec structs like the events: frozen, and cheap to make (the recorder makes one per
event it writes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, TypeAlias, TypeVar

import msgspec

from jetrl.bus import events as ev

__all__ = [
    "FACT_OF",
    "Alerted",
    "Beat",
    "Dead",
    "Evaluated",
    "Fact",
    "Finished",
    "Generated",
    "GeneratedSample",
    "Loaded",
    "Ready",
    "Resumed",
    "Scored",
    "ScoredOne",
    "Started",
    "Stepped",
    "Tasked",
    "Versioned",
    "Withheld",
    "array_json",
    "array_length",
    "fact_of",
    "worker_kind",
]


# Facts are gc=False like the events they come from (bus/events.py says why).
class Started(msgspec.Struct, frozen=True, gc=False):
    """The run began with this config (RunStarted)."""

    OF: ClassVar[type[ev.EventBody]] = ev.RunStarted
    seq: int
    t: float
    config: dict[str, Any]
    library_versions: dict[str, str] = {}
    tenant: str = ""
    event_id: str = ""
    code_version: str = ""
    host: str = ""


class Resumed(msgspec.Struct, frozen=True, gc=False):
    """The run goes on, with this config (a resume's overrides in it): it is running again."""

    OF: ClassVar[type[ev.EventBody]] = ev.RunResumed
    seq: int
    t: float
    config: dict[str, Any]
    tenant: str = ""


class Finished(msgspec.Struct, frozen=True, gc=False):
    OF: ClassVar[type[ev.EventBody]] = ev.RunFinished
    seq: int
    t: float
    status: str
    steps: int
    reason: str = ""
    tenant: str = ""


class Tasked(msgspec.Struct, frozen=True, gc=False):
    """A task asked for ``samples`` completions of one prompt."""

    OF: ClassVar[type[ev.EventBody]] = ev.TaskSubmitted
    seq: int
    t: float
    tenant: str
    env: str
    samples: int
    task_id: str = ""
    event_id: str = ""
    prompt_len: int = 0
    prompt_text: str = ""
    max_tokens: int = 0
    episode_id: str = ""
    turn: int = 0
    info: dict[str, Any] = {}


class GeneratedSample(msgspec.Struct, frozen=True, gc=False):
    """One sample of a generation (``length``: its completion tokens, None when unknown)."""

    generation_id: str
    sample_index: int
    finish_reason: str
    length: int | None


class Generated(msgspec.Struct, frozen=True, gc=False):
    """A task's samples, by a worker, in sample order."""

    OF: ClassVar[type[ev.EventBody]] = ev.CompletionsGenerated
    seq: int
    t: float
    event_id: str
    worker_id: str
    samples: tuple[GeneratedSample, ...]
    load_wait_s: float
    generate_s: float
    task_id: str = ""
    tenant: str = ""
    env: str = ""
    version_start: int = 0
    version_end: int = 0
    prompt_length: int | None = None
    queued_s: float = 0.0
    episode_id: str = ""
    turn: int = 0

    def finish_reason(self, rollout_id: str) -> str | None:
        """The finish reason of the sample a rollout came from: its own (a single-turn rollout's
        id is its generation's), or the one sample of an episode's last turn."""
        for smp in self.samples:
            if smp.generation_id == rollout_id:
                return smp.finish_reason
        return self.samples[0].finish_reason if len(self.samples) == 1 else None


class ScoredOne(msgspec.Struct, frozen=True, gc=False):
    """One rollout of a scored group: its reward and the policy versions it came from."""

    rollout_id: str
    reward: float
    version_start: int
    length: int | None
    sample_index: int = 0
    version_end: int = 0
    reward_parts: dict[str, float] = {}
    # Where each array lies (array_json), by field: the store keeps these, not the bytes.
    payloads: dict[str, dict[str, Any] | None] = {}


class Scored(msgspec.Struct, frozen=True, gc=False):
    """Rollouts of one group ready to train on (a group's, or an episode's), in sample order."""

    OF: ClassVar[type[ev.EventBody]] = ev.RolloutsScored
    seq: int
    t: float
    tenant: str
    env: str
    generation_event_id: str
    rollouts: tuple[ScoredOne, ...]
    event_id: str = ""
    task_id: str = ""
    group_id: str = ""
    group_size: int = 0
    prompt_length: int | None = None
    late: int = 0  # the generation's samples left out, scored after the group's quorum


class Withheld(msgspec.Struct, frozen=True, gc=False):
    """A rollout the trainer will never train on, and why."""

    OF: ClassVar[type[ev.EventBody]] = ev.RolloutWithheld
    seq: int
    t: float
    rollout_id: str
    reason: str
    tenant: str = ""
    env: str = ""
    group_id: str = ""
    step: int = 0
    policy_version: int = 0
    staleness: int = 0
    detail: str = ""


class Stepped(msgspec.Struct, frozen=True, gc=False):
    """A training step: exactly these rollouts, in this order, made policy ``version``."""

    OF: ClassVar[type[ev.EventBody]] = ev.StepCompleted
    seq: int
    t: float
    step: int
    version: int
    tokens: int
    metrics: dict[str, float]
    rollout_ids: tuple[str, ...]
    # Where each rollout lies in the log; empty for steps logged before the trainer said so.
    rollout_seqs: tuple[int, ...] = ()
    duration_s: float = 0.0
    event_id: str = ""
    micro_batches: tuple[int, ...] = ()  # a streaming step's (StepCompleted.micro_batches)


class Versioned(msgspec.Struct, frozen=True, gc=False):
    """Policy ``version`` exists (made by ``step``) and its weights have this checksum."""

    OF: ClassVar[type[ev.EventBody]] = ev.PolicyVersionPublished
    seq: int
    t: float
    version: int
    step: int
    weights_checksum: str
    parent_version: int | None = None


class Ready(msgspec.Struct, frozen=True, gc=False):
    """The weights of policy ``version`` can be read at ``location``."""

    OF: ClassVar[type[ev.EventBody]] = ev.WeightsReady
    seq: int
    t: float
    version: int
    location: ev.PayloadRef
    weights_checksum: str
    format: str = "safetensors"
    blake3: str | None = None  # the transfer digest (absent in announcements of schema 1)


class Beat(msgspec.Struct, frozen=True, gc=False):
    """A worker is alive, in this state (and, when it says so, serving ``loaded_version``)."""

    OF: ClassVar[type[ev.EventBody]] = ev.WorkerHeartbeat
    seq: int
    t: float
    worker_id: str
    kind: str
    status: str
    loaded_version: int | None
    inflight: int
    stats: dict[str, float] = {}


class Loaded(msgspec.Struct, frozen=True, gc=False):
    OF: ClassVar[type[ev.EventBody]] = ev.WeightsLoaded
    seq: int
    t: float
    worker_id: str
    version: int
    kind: str = "inference"
    load_s: float = 0.0
    checksum_verified: bool = True


class Dead(msgspec.Struct, frozen=True, gc=False):
    """A message no consumer could take, set aside with its reason (and its bytes)."""

    OF: ClassVar[type[ev.EventBody]] = ev.DeadLettered
    seq: int
    t: float
    tenant: str
    reason: str
    event_id: str = ""
    detail: str = ""
    consumer: str = ""
    original_subject: str = ""
    original_seq: int = 0
    original_type: str | None = None
    original_event_id: str | None = None
    delivery_count: int = 1
    original_data: bytes = b""


class Evaluated(msgspec.Struct, frozen=True, gc=False):
    """Policy ``policy_version`` measured on an env's held-out split (its pass@1 and pass@k)."""

    OF: ClassVar[type[ev.EventBody]] = ev.EvaluationReported
    seq: int
    t: float
    tenant: str
    env: str
    policy_version: int
    samples: int
    pass_at_1: float
    pass_at_k: float
    n_tasks: int = 0
    reward_mean: float = 0.0
    version_min: int = 0
    version_max: int = 0
    temperature: float = 1.0
    successes: tuple[int, ...] = ()
    event_id: str = ""


class Alerted(msgspec.Struct, frozen=True, gc=False):
    """A monitor's alert changed state (a transition, not a level)."""

    OF: ClassVar[type[ev.EventBody]] = ev.AlertRaised
    seq: int
    t: float
    rule: str
    key: str
    state: str
    severity: str
    message: str
    step: int
    value: float = 0.0
    threshold: float = 0.0
    event_id: str = ""


Fact: TypeAlias = (
    Started
    | Resumed
    | Finished
    | Tasked
    | Generated
    | Scored
    | Withheld
    | Stepped
    | Versioned
    | Ready
    | Beat
    | Loaded
    | Dead
    | Evaluated
    | Alerted
)


# ----------------------------------------------------------------------------- arrays

_ITEMSIZE = {
    "uint8": 1,
    "uint16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
}


def array_length(a: ev.ArrayRef) -> int | None:
    """How many rows an array has: its shape's first, else (a reference to bytes of a known
    dtype) its size over the item size; None when neither says."""
    shape = a.shape
    if shape:
        return int(shape[0])
    if isinstance(a, ev.PayloadRef) and a.dtype in _ITEMSIZE:
        return a.size // _ITEMSIZE[a.dtype]
    return None


def array_json(a: ev.ArrayRef | None) -> dict[str, Any] | None:
    """Where an array lies, as JSON: a payload reference, or its place in the log."""
    if a is None:
        return None
    if isinstance(a, ev.InlineArray):
        # The bytes stay in the log (the event's seq finds them); the store keeps the shape.
        return {"inline": True, "dtype": a.dtype, "shape": list(a.shape), "size": len(a.data)}
    if isinstance(a, ev.LogArray):
        # Another event's inline array (a rollout's is its generation's): where it lies.
        return {"log_seq": a.seq, "field": a.field, "dtype": a.dtype, "shape": list(a.shape)}
    out: dict[str, Any] = {
        "store": a.store,
        "bucket": a.bucket,
        "name": a.name,
        "size": a.size,
        "sha256": a.sha256,
    }
    if a.dtype is not None:
        out["dtype"] = a.dtype
    if a.shape is not None:
        out["shape"] = list(a.shape)
    return out


def worker_kind(subject: str) -> str:
    """The worker kind of a ``jetrl.<run>.worker.<kind>.<id>`` subject: WeightsLoaded carries
    none of its own."""
    parts = subject.split(".")
    return parts[3] if len(parts) == 5 and parts[2] == "worker" else "inference"


# ----------------------------------------------------------------------------- events → facts


def _started(seq: int, subject: str, e: ev.Event, b: ev.RunStarted) -> Started:
    return Started(
        seq,
        e.time,
        b.config,
        b.library_versions,
        tenant=e.tenant,
        event_id=e.event_id,
        code_version=b.code_version,
        host=b.host,
    )


def _resumed(seq: int, subject: str, e: ev.Event, b: ev.RunResumed) -> Resumed:
    return Resumed(seq, e.time, b.config, tenant=e.tenant)


def _finished(seq: int, subject: str, e: ev.Event, b: ev.RunFinished) -> Finished:
    return Finished(seq, e.time, b.status, b.steps, reason=b.reason, tenant=e.tenant)


def _tasked(seq: int, subject: str, e: ev.Event, b: ev.TaskSubmitted) -> Tasked:
    return Tasked(
        seq,
        e.time,
        e.tenant,
        b.env,
        b.group_size,
        task_id=b.task_id,
        event_id=e.event_id,
        prompt_len=len(b.prompt_tokens),
        prompt_text=b.prompt_text,
        max_tokens=b.max_tokens,
        episode_id=b.episode_id,
        turn=b.turn,
        info=b.info,
    )


def _generated(seq: int, subject: str, e: ev.Event, b: ev.CompletionsGenerated) -> Generated:
    timings = b.timings
    return Generated(
        seq,
        e.time,
        e.event_id,
        b.worker_id,
        tuple(
            GeneratedSample(
                x.generation_id, x.sample_index, x.finish_reason, array_length(x.completion_tokens)
            )
            for x in sorted(b.samples, key=lambda x: x.sample_index)
        ),
        timings.load_wait_s,
        timings.generate_s,
        task_id=b.task_id,
        tenant=e.tenant,
        env=b.env,
        version_start=b.policy_version_start,
        version_end=b.policy_version_end,
        prompt_length=array_length(b.prompt_tokens),
        queued_s=timings.queued_s,
        episode_id=b.episode_id,
        turn=b.turn,
    )


def _scored(seq: int, subject: str, e: ev.Event, b: ev.RolloutsScored, payloads: bool = True) -> Scored:
    prompt = array_json(b.prompt_tokens) if payloads else None
    return Scored(
        seq,
        e.time,
        e.tenant,
        b.env,
        b.generation_event_id,
        tuple(
            ScoredOne(
                r.rollout_id,
                r.reward,
                r.policy_version_start,
                array_length(r.completion_tokens),
                sample_index=r.sample_index,
                version_end=r.policy_version_end,
                reward_parts=r.reward_parts,
                payloads={
                    "prompt_tokens": prompt,
                    "completion_tokens": array_json(r.completion_tokens),
                    "logprobs": array_json(r.logprobs),
                    "routing_trace": array_json(r.routing_trace),
                }
                if payloads
                else {},
            )
            for r in sorted(b.rollouts, key=lambda r: r.sample_index)
        ),
        event_id=e.event_id,
        task_id=b.task_id,
        group_id=b.group_id,
        group_size=b.group_size,
        prompt_length=array_length(b.prompt_tokens),
        late=len(b.late_samples),
    )


def _withheld(seq: int, subject: str, e: ev.Event, b: ev.RolloutWithheld) -> Withheld:
    return Withheld(
        seq,
        e.time,
        b.rollout_id,
        b.reason,
        tenant=e.tenant,
        env=b.env,
        group_id=b.group_id,
        step=b.trainer_step,
        policy_version=b.policy_version,
        staleness=b.staleness,
        detail=b.detail,
    )


def _stepped(seq: int, subject: str, e: ev.Event, b: ev.StepCompleted) -> Stepped:
    return Stepped(
        seq,
        e.time,
        b.step,
        b.policy_version,
        b.tokens,
        b.metrics,
        tuple(b.rollout_ids),
        tuple(b.rollout_seqs),
        duration_s=b.duration_s,
        event_id=e.event_id,
        micro_batches=tuple(b.micro_batches),
    )


def _versioned(seq: int, subject: str, e: ev.Event, b: ev.PolicyVersionPublished) -> Versioned:
    return Versioned(seq, e.time, b.version, b.step, b.weights_checksum, b.parent_version)


def _ready(seq: int, subject: str, e: ev.Event, b: ev.WeightsReady) -> Ready:
    return Ready(seq, e.time, b.version, b.location, b.weights_checksum, b.format, b.blake3)


def _beat(seq: int, subject: str, e: ev.Event, b: ev.WorkerHeartbeat) -> Beat:
    return Beat(seq, e.time, b.worker_id, b.kind, b.status, b.loaded_version, b.inflight, b.stats)


def _loaded(seq: int, subject: str, e: ev.Event, b: ev.WeightsLoaded) -> Loaded:
    return Loaded(seq, e.time, b.worker_id, b.version, worker_kind(subject), b.load_s, b.checksum_verified)


def _dead(seq: int, subject: str, e: ev.Event, b: ev.DeadLettered) -> Dead:
    return Dead(
        seq,
        e.time,
        e.tenant,
        b.reason,
        event_id=e.event_id,
        detail=b.detail,
        consumer=b.consumer,
        original_subject=b.original_subject,
        original_seq=b.original_stream_seq,
        original_type=b.original_type,
        original_event_id=b.original_event_id,
        delivery_count=b.delivery_count,
        original_data=bytes(b.original_data),
    )


def _evaluated(seq: int, subject: str, e: ev.Event, b: ev.EvaluationReported) -> Evaluated:
    return Evaluated(
        seq,
        e.time,
        e.tenant,
        b.env,
        b.policy_version,
        b.samples,
        b.pass_at_1,
        b.pass_at_k,
        n_tasks=b.n_tasks,
        reward_mean=b.reward_mean,
        version_min=b.version_min,
        version_max=b.version_max,
        temperature=b.temperature,
        successes=tuple(b.successes),
        event_id=e.event_id,
    )


def _alerted(seq: int, subject: str, e: ev.Event, b: ev.AlertRaised) -> Alerted:
    return Alerted(
        seq,
        e.time,
        b.rule,
        b.key,
        b.state,
        b.severity,
        b.message,
        b.step,
        value=b.value,
        threshold=b.threshold,
        event_id=e.event_id,
    )


F = TypeVar("F", bound=Fact)
Reader: TypeAlias = Callable[[int, str, ev.Event, Any], Fact]


def _entry(fact: type[F], read: Callable[[int, str, ev.Event, Any], F]) -> tuple[type[ev.EventBody], Reader]:
    # Filed under the body its fact names (the lookup is by the body's exact type). The reader
    # is typed to make that fact; that it reads that body, tests/store/test_readmodel.py
    # checks by reading one event of each.
    return fact.OF, read


# A dict lookup by body class: the recorder reads every event of the log through it.
FACT_OF: dict[type[ev.EventBody], Reader] = dict(
    [
        _entry(Started, _started),
        _entry(Resumed, _resumed),
        _entry(Finished, _finished),
        _entry(Tasked, _tasked),
        _entry(Generated, _generated),
        _entry(Scored, _scored),
        _entry(Withheld, _withheld),
        _entry(Stepped, _stepped),
        _entry(Versioned, _versioned),
        _entry(Ready, _ready),
        _entry(Beat, _beat),
        _entry(Loaded, _loaded),
        _entry(Dead, _dead),
        _entry(Evaluated, _evaluated),
        _entry(Alerted, _alerted),
    ]
)


def fact_of(seq: int, subject: str, event: ev.Event, *, payloads: bool = True) -> Fact | None:
    """The fact one event of the log states (None for a body this code does not read).
    ``payloads=False``: a scored rollout's ``payloads`` (where its arrays lie, what the store
    keeps) left empty, for a reader that never looks at them (the monitor's series: building
    them was a quarter of its CPU)."""
    body = event.body
    if not payloads and type(body) is ev.RolloutsScored:
        return _scored(seq, subject, event, body, payloads=False)
    read = FACT_OF.get(type(body))
    return read(seq, subject, event, body) if read is not None else None
