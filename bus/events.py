"""The event catalog: one envelope, typed and versioned bodies, a strict codec.

Wire format (documented in docs/events.md): a msgpack map
``{event_id, type, schema_version, run_id, tenant, time, causation_id, body}``; the type and
type also travels as a NATS header (``Jetrl-Type``) so a reader can route without decoding.

Decoding is strict: an unknown ``type`` or a ``schema_version`` newer than this code knows is
rejected with a clear error instead of being mis-read. Older versions of a body decode as long as
every field added since has a default (the rule for evolving a body).
"""

from __future__ import annotations

import time as _time
import uuid
from typing import Any, ClassVar, Literal, TypeVar

import msgspec

__all__ = [
    "CATALOG",
    "AlertRaised",
    "ArrayRef",
    "Completion",
    "CompletionsGenerated",
    "DeadLettered",
    "EvaluationReported",
    "Event",
    "EventBody",
    "EventDecodeError",
    "GenerationTimings",
    "InlineArray",
    "MalformedEvent",
    "PayloadRef",
    "PolicyVersionPublished",
    "RolloutWithheld",
    "RolloutsScored",
    "RunFinished",
    "RunResumed",
    "RunStarted",
    "ScoredRollout",
    "StepCompleted",
    "TaskSubmitted",
    "UnknownEventType",
    "UnsupportedSchemaVersion",
    "WeightsLoaded",
    "WeightsReady",
    "WorkerHeartbeat",
    "decode_event",
    "encode_event",
    "event_headers",
    "new_event",
]

HEADER_TYPE = "Jetrl-Type"
HEADER_MSG_ID = "Nats-Msg-Id"


class EventDecodeError(ValueError):
    """Raised for any message that cannot be read as a jetrl event. ``reason`` is a short slug
    (used in dead-letter subjects), the message says what exactly was wrong."""

    reason = "malformed"


class MalformedEvent(EventDecodeError):
    reason = "malformed"


class UnknownEventType(EventDecodeError):
    reason = "unknown_type"


class UnsupportedSchemaVersion(EventDecodeError):
    reason = "unsupported_schema"


# ----------------------------------------------------------------------------- arrays


# Every struct of an event is ``gc=False``: events are trees of data, never cycles, so the
# garbage collector need not track them. A process that holds many decoded events (the
# trainer's window of the log, the monitor's read model) otherwise walks them all at each full
# collection, and decoding allocates enough to start collections often: a RolloutsScored of the
# demo decoded in 114 us beside 1.8 M tracked objects, in 23 us untracked.
class InlineArray(msgspec.Struct, gc=False, frozen=True, tag="inline"):
    """A small array carried inside the event: raw little-endian bytes plus dtype and shape."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


class PayloadRef(msgspec.Struct, gc=False, frozen=True, tag="ref"):
    """A claim-check: where a large blob lives and how to check it.

    ``store`` names the payload store kind ("objstore", "file", "mooncake"), ``bucket`` and
    ``name`` locate it there. ``dtype``/``shape`` are set when the blob is an array."""

    store: str
    bucket: str
    name: str
    size: int
    sha256: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None


class LogArray(msgspec.Struct, gc=False, frozen=True, tag="log"):
    """An array already in this run's log: at ``field`` of the body of the event at stream
    sequence ``seq``, an inline array, or a list of token ids read as ``dtype``. ``field`` is a
    dotted path into the body: ``prompt_tokens`` (a task's), ``samples.3.logprobs`` (a sample
    of a CompletionsGenerated). Scored rollouts refer to their generation's arrays this way,
    and generations to their task's prompt, instead of carrying copies; ``dtype`` and
    ``shape`` are the array's, as there."""

    seq: int
    field: str
    dtype: str
    shape: tuple[int, ...]


ArrayRef = InlineArray | PayloadRef | LogArray


# ----------------------------------------------------------------------------- bodies


class EventBody(msgspec.Struct, gc=False, frozen=True, kw_only=True, omit_defaults=True):
    """Base of all bodies. ``TYPE`` is the wire name, ``SCHEMA_VERSION`` its current version.

    Subclasses restate ``frozen=True``: msgspec inherits it, but type checkers read each class's
    own keywords."""

    TYPE: ClassVar[str]
    SCHEMA_VERSION: ClassVar[int] = 1


class RunStarted(EventBody, frozen=True):
    TYPE: ClassVar[str] = "RunStarted"
    config: dict[str, Any]
    code_version: str
    host: str = ""
    library_versions: dict[str, str] = {}


class RunResumed(EventBody, frozen=True):
    """``jetrl resume``: the run goes on (after a RunFinished, or a coordinator that died) with
    this config, the recorded one with the resume's overrides. Parts read the newest of
    RunStarted and RunResumed; RunStarted stays the run's origin."""

    TYPE: ClassVar[str] = "RunResumed"
    config: dict[str, Any]
    code_version: str
    host: str = ""
    library_versions: dict[str, str] = {}
    overrides: list[str] = []


RunStatus = Literal["completed", "failed", "cancelled"]


class RunFinished(EventBody, frozen=True):
    TYPE: ClassVar[str] = "RunFinished"
    status: RunStatus
    steps: int
    reason: str = ""


# Why a scored rollout was not trained: too stale for max_off_policy_steps, refused, part of a
# group that never completed, or still waiting when the run ended.
WithheldReason = Literal["stale", "invalid", "incomplete_group", "run_finished"]


class EpisodeState(msgspec.Struct, gc=False, frozen=True, kw_only=True):
    """A multi-turn episode so far, carried by the task of its next model turn so that a
    restarted producer finds it in the log. ``completion`` holds every turn after the first
    prompt (model and environment alike); ``mask`` is 1 where the model wrote the token;
    ``logprobs`` are the sampled tokens' (0.0 on the environment's); ``version_start`` is the
    oldest policy version among the episode's turns."""

    group_id: str
    sample_index: int
    group_size: int
    task_id: str  # the first turn's
    prompt: list[int]
    completion: list[int]
    mask: list[int]
    logprobs: list[float]
    version_start: int
    max_tokens: int


class TaskSubmitted(EventBody, frozen=True):
    """A task handed out for generation: one prompt, ``group_size`` samples wanted, with a
    policy version at least ``min_policy_version`` (how the producer bounds staleness and makes
    the synchronous mode exact)."""

    TYPE: ClassVar[str] = "TaskSubmitted"
    task_id: str
    env: str
    group_size: int
    prompt_tokens: list[int]
    prompt_text: str = ""
    max_tokens: int = 0
    episode_id: str = ""
    turn: int = 0
    info: dict[str, Any] = {}
    min_policy_version: int = 0
    temperature: float = 1.0
    episode: EpisodeState | None = None  # later turns of a multi-turn episode
    # Later turns: the worker that served the turn before, whose prefix cache holds the history;
    # other workers leave the task to it for a delivery or two ([inference] affinity_deliveries).
    worker_hint: str = ""


class GenerationTimings(msgspec.Struct, gc=False, frozen=True, omit_defaults=True):
    queued_s: float = 0.0
    generate_s: float = 0.0
    load_wait_s: float = 0.0


class Completion(msgspec.Struct, gc=False, frozen=True, kw_only=True, omit_defaults=True):
    """One sample of a task: its completion token ids (int32), the inference logprobs of the
    sampled tokens (float32, one per completion token, under the distribution they were drawn
    from) and, for MoE models, its Router Replay trace ``[prompt + completion - 1, moe_layers,
    top_k]`` (uint8, uint16 past 256 experts)."""

    generation_id: str
    sample_index: int
    completion_tokens: ArrayRef
    logprobs: ArrayRef
    finish_reason: Literal["stop", "length", "error"] = "stop"
    routing_trace: ArrayRef | None = None


class CompletionsGenerated(EventBody, frozen=True):
    """A task's samples, generated together under one policy version: one event per task, as
    the task asked for them (``group_size`` samples of a first turn; one of an episode's later
    turn). ``prompt_tokens`` is the task's prompt, usually referred to where it lies in the log
    (its TaskSubmitted's ``prompt_tokens``), so the log holds it once."""

    TYPE: ClassVar[str] = "CompletionsGenerated"
    task_id: str
    env: str
    prompt_tokens: ArrayRef
    samples: list[Completion]
    policy_version_start: int
    policy_version_end: int
    worker_id: str
    timings: GenerationTimings = GenerationTimings()
    episode_id: str = ""
    turn: int = 0


class ScoredRollout(msgspec.Struct, gc=False, frozen=True, kw_only=True, omit_defaults=True):
    """One scored rollout of a :class:`RolloutsScored`. A multi-turn episode is one rollout:
    ``completion_tokens`` holds every model turn and the environment's replies in order,
    ``completion_mask`` (uint8, 1 = model token) tells them apart, and ``logprobs`` is 0 on
    environment tokens."""

    rollout_id: str
    sample_index: int
    reward: float
    completion_tokens: ArrayRef
    logprobs: ArrayRef
    policy_version_start: int
    policy_version_end: int
    reward_parts: dict[str, float] = {}
    routing_trace: ArrayRef | None = None
    completion_mask: ArrayRef | None = None
    turns: int = 1


class RolloutsScored(EventBody, frozen=True):
    """Scored rollouts of one group: the unit the trainer consumes. A single-turn task's samples
    are scored together, so one event holds its whole group; an episode of a multi-turn
    environment ends on its own (one rollout an event). The arrays are the generation's: an
    inline one is referred to where it lies in the log (:class:`LogArray`), a payload reference
    is copied, so the log holds each array once."""

    TYPE: ClassVar[str] = "RolloutsScored"
    generation_event_id: str  # the CompletionsGenerated scored (an episode's: its last turn's)
    task_id: str  # the group's first task
    env: str
    group_id: str
    group_size: int
    prompt_tokens: ArrayRef  # the group's (an episode's: its first prompt)
    rollouts: list[ScoredRollout]
    # The generation's samples left out of the group, scored too late for its quorum
    # ([[envs]] group_quorum): the group is the rollouts here, ``group_size`` of them.
    late_samples: list[int] = []


class RolloutWithheld(EventBody, frozen=True):
    """A rollout the trainer will not train on, and why: never dropped in silence."""

    TYPE: ClassVar[str] = "RolloutWithheld"
    rollout_id: str
    group_id: str
    env: str
    reason: WithheldReason
    trainer_step: int
    policy_version: int
    staleness: int = 0
    detail: str = ""


class StepCompleted(EventBody, frozen=True):
    """One optimizer step and exactly the rollouts it consumed, in training order."""

    TYPE: ClassVar[str] = "StepCompleted"
    step: int
    policy_version: int
    rollout_ids: list[str]
    rollout_seqs: list[int] = []
    metrics: dict[str, float] = {}
    tokens: int = 0
    duration_s: float = 0.0
    # Per completion token of the step's rollouts, in training order: float32 ``[tokens, 2]``,
    # the trainer's log-probability of the token and how many MoE layers the trainer's own
    # router would have sent it elsewhere than the replayed routes (0 for a dense model). What
    # the monitor's rollout inspector colours tokens by; absent when not recorded.
    token_stats: ArrayRef | None = None
    # How the trainer took the rollouts when it took them as they came (``[trainer]
    # stream_groups``): each micro-batch's count, in training order, one backward each before
    # the optimizer step; empty when the step took them in one piece. Replay takes it the same way.
    micro_batches: list[int] = []
    # The trainer's last step: its goal (max_steps, stop_at_reward) is reached and it stops, so
    # a run whose trainer is on another machine knows it is done.
    final: bool = False


class PolicyVersionPublished(EventBody, frozen=True):
    TYPE: ClassVar[str] = "PolicyVersionPublished"
    version: int
    step: int
    weights_checksum: str
    parent_version: int | None = None


class WeightsReady(EventBody, frozen=True):
    """The bytes of a policy version are readable at ``location``; ``weights_checksum`` is the
    content checksum of the tensors (layout independent). ``blake3`` (schema 2) is the bytes'
    transfer digest, taken by the trainer as it wrote them, and the check a reader makes of
    them (docs/events.md); ``location.sha256`` is then empty unless the store hashed the bytes
    anyway (the object store). Without it (schema 1), ``location.sha256`` is the bytes' check."""

    TYPE: ClassVar[str] = "WeightsReady"
    SCHEMA_VERSION: ClassVar[int] = 2  # 2: blake3
    version: int
    location: PayloadRef
    weights_checksum: str
    # "safetensors": jetrl's tensors (torchtitan names, grouped experts); "safetensors-hf":
    # Hugging Face names and per-expert tensors. The checksum is the canonical tensors' in both.
    format: str = "safetensors"
    blake3: str | None = None


class WeightsLoaded(EventBody, frozen=True):
    TYPE: ClassVar[str] = "WeightsLoaded"
    version: int
    worker_id: str
    load_s: float = 0.0
    checksum_verified: bool = True


class WorkerHeartbeat(EventBody, frozen=True):
    TYPE: ClassVar[str] = "WorkerHeartbeat"
    worker_id: str
    kind: str
    status: Literal["starting", "ready", "busy", "stopping"] = "ready"
    loaded_version: int | None = None
    inflight: int = 0
    stats: dict[str, float] = {}


class EvaluationReported(EventBody, frozen=True):
    """One evaluation of a policy version on an environment's held-out split, by its producer
    (producers/evaluation.py). ``policy_version`` is the version it was asked for (its tasks'
    ``min_policy_version``); ``version_min``/``version_max`` are the versions that generated
    its samples. A sample succeeds when its score's ``exact`` part is 1.0, or, without one,
    when its reward is at least 1.0; ``pass_at_k`` is the unbiased estimator with ``n = k =
    samples`` averaged over tasks. ``successes`` holds each task's count when there are at
    most 64 tasks."""

    TYPE: ClassVar[str] = "EvaluationReported"
    env: str
    policy_version: int
    n_tasks: int
    samples: int
    pass_at_1: float
    pass_at_k: float
    reward_mean: float
    version_min: int
    version_max: int
    temperature: float = 1.0
    successes: list[int] = []


AlertState = Literal["firing", "resolved"]


class AlertRaised(EventBody, frozen=True):
    """A monitor's alert on the run (consumers/monitor/alerts.py): ``rule`` fired (or resolved)
    for ``key`` (a worker id, an env, or the rule's own name), at trainer step ``step``, with
    the measured ``value`` against the rule's ``threshold``."""

    TYPE: ClassVar[str] = "AlertRaised"
    rule: str
    key: str
    state: AlertState
    severity: Literal["warning", "critical"]
    message: str
    step: int
    value: float = 0.0
    threshold: float = 0.0


class DeadLettered(EventBody, frozen=True):
    """A message that could never be processed, kept whole: its original bytes and headers."""

    TYPE: ClassVar[str] = "DeadLettered"
    reason: str
    detail: str
    consumer: str
    original_subject: str
    original_stream_seq: int
    delivery_count: int = 1
    original_event_id: str | None = None
    original_type: str | None = None
    original_headers: dict[str, str] = {}
    original_data: bytes = b""


CATALOG: dict[str, type[EventBody]] = {
    cls.TYPE: cls
    for cls in (
        RunStarted,
        RunResumed,
        RunFinished,
        TaskSubmitted,
        CompletionsGenerated,
        RolloutsScored,
        RolloutWithheld,
        StepCompleted,
        PolicyVersionPublished,
        WeightsReady,
        WeightsLoaded,
        WorkerHeartbeat,
        DeadLettered,
        EvaluationReported,
        AlertRaised,
    )
}

# ----------------------------------------------------------------------------- envelope

B = TypeVar("B", bound=EventBody)


class Event(msgspec.Struct, gc=False, frozen=True, kw_only=True):
    """Envelope + body. ``event_id`` is also the NATS message id (publish deduplication)."""

    event_id: str
    type: str
    schema_version: int
    run_id: str
    tenant: str
    time: float
    causation_id: str | None = None
    body: EventBody


class _WireEnvelope(msgspec.Struct, gc=False, kw_only=True):
    # Body stays raw until type and version are checked, so a newer body is never mis-read.
    event_id: str
    type: str
    schema_version: int
    run_id: str
    tenant: str
    time: float
    causation_id: str | None = None
    body: msgspec.Raw


def new_event_id() -> str:
    return uuid.uuid4().hex


def new_event(
    body: EventBody,
    *,
    run_id: str,
    tenant: str = "default",
    causation_id: str | None = None,
    event_id: str | None = None,
    time: float | None = None,
) -> Event:
    """Wrap a body in a fresh envelope. Pass ``event_id`` to make a reaction idempotent: the
    same id published twice is stored once."""
    if type(body).TYPE not in CATALOG:
        raise TypeError(f"{type(body).__name__} is not in the event catalog")
    return Event(
        event_id=event_id or new_event_id(),
        type=type(body).TYPE,
        schema_version=type(body).SCHEMA_VERSION,
        run_id=run_id,
        tenant=tenant,
        time=_time.time() if time is None else time,
        causation_id=causation_id,
        body=body,
    )


_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(_WireEnvelope)
_body_decoders: dict[str, msgspec.msgpack.Decoder[Any]] = {
    name: msgspec.msgpack.Decoder(cls) for name, cls in CATALOG.items()
}


def encode_event(event: Event) -> bytes:
    return _encoder.encode(event)


def event_headers(event: Event) -> dict[str, str]:
    return {
        HEADER_MSG_ID: event.event_id,
        HEADER_TYPE: event.type,
    }


def decode_event(data: bytes | memoryview, headers: dict[str, str] | None = None) -> Event:
    """Decode and validate one event; raises a subclass of :class:`EventDecodeError`."""
    try:
        env = _envelope_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedEvent(f"not a jetrl event envelope: {exc}") from None
    cls = CATALOG.get(env.type)
    if cls is None:
        raise UnknownEventType(
            f"unknown event type {env.type!r} (this code knows {len(CATALOG)} types; "
            "is the reader older than the writer?)"
        )
    if env.schema_version > cls.SCHEMA_VERSION or env.schema_version < 1:
        raise UnsupportedSchemaVersion(
            f"{env.type} schema_version {env.schema_version} is not supported "
            f"(this code reads 1..{cls.SCHEMA_VERSION}); upgrade the reader"
        )
    if headers:
        htype = headers.get(HEADER_TYPE)
        if htype is not None and htype != env.type:
            raise MalformedEvent(f"header type {htype!r} disagrees with envelope type {env.type!r}")
    try:
        body = _body_decoders[env.type].decode(env.body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedEvent(f"invalid {env.type} body: {exc}") from None
    return Event(
        event_id=env.event_id,
        type=env.type,
        schema_version=env.schema_version,
        run_id=env.run_id,
        tenant=env.tenant,
        time=env.time,
        causation_id=env.causation_id,
        body=body,
    )
