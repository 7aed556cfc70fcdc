"""One JetStream stream per run (its log) and one object-store bucket (its payloads).

Limits are explicit (docs/events.md, "Limits"): the log is never trimmed behind a consumer's
back. When a limit is reached JetStream refuses new publishes (discard=new) and the publisher
raises, instead of silently deleting the oldest facts of the run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import nats.js.errors
from nats.js import JetStreamContext, api
from nats.js.object_store import ObjectStore

from jetrl.bus import subjects
from jetrl.bus.log import get_logger
from jetrl.bus.retry import RETRYABLE

log = get_logger(__name__)

GiB = 1024**3
AUTO_REPLICAS = 3  # a JetStream cluster's usual quorum: survives the loss of one node


@dataclass(frozen=True)
class StreamLimits:
    """Per-run limits. JetStream reserves ``max_bytes`` up front, so they must fit the server's
    store. Defaults hold a days-long run on one machine: at ~1 KiB per event 8 GiB is ~8 M
    events (the demo writes ~50 k); payloads (tokens, traces, weights) have their own bucket.
    Raise both for a cluster run (``[bus]`` section of the run config)."""

    max_bytes: int = 8 * GiB
    max_msgs: int = -1
    max_age_s: float = 0.0  # 0 = keep forever
    max_msg_size: int = 8 * 1024 * 1024
    duplicate_window_s: float = 120.0
    payload_max_bytes: int = 32 * GiB
    replicas: int = 1  # 0: as many as the server's cluster holds, up to 3 (resolve_replicas)

    def resolve_replicas(self, cluster_size: int) -> StreamLimits:
        """These limits with a definite replica count for a server in a cluster of
        ``cluster_size`` nodes (1: a single server)."""
        if self.replicas:
            return self
        return dataclasses.replace(self, replicas=max(1, min(AUTO_REPLICAS, cluster_size)))

    def stream_config(self, run_id: str) -> api.StreamConfig:
        return api.StreamConfig(
            name=stream_name(run_id),
            description=f"jetrl event log of run {run_id}",
            subjects=[subjects.all_subjects(run_id)],
            retention=api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE,
            discard=api.DiscardPolicy.NEW,
            max_bytes=self.max_bytes,
            max_msgs=self.max_msgs,
            max_age=self.max_age_s,
            max_msg_size=self.max_msg_size,
            duplicate_window=self.duplicate_window_s,
            num_replicas=self.replicas,
            allow_direct=True,
        )


class StreamSetupError(RuntimeError):
    def __init__(self, name: str, max_bytes: int, exc: Exception) -> None:
        hint = ""
        if getattr(exc, "err_code", None) == 10047:
            hint = (
                f" The server cannot reserve {max_bytes / GiB:.1f} GiB: lower the run's bus limits "
                "(max_bytes, payload_max_bytes) or raise the server's jetstream max_file_store."
            )
        super().__init__(f"cannot create stream {name}: {exc}.{hint}")


def stream_name(run_id: str) -> str:
    return f"JETRL_{subjects.check_token(run_id, 'run id')}"


async def stored_message(js: JetStreamContext, stream: str, seq: int) -> api.RawStreamMsg:
    """The message at ``seq`` of ``stream``. A direct get may be answered by any replica, and a
    replica that is catching up (a restarted node of a cluster) has not yet stored what the
    leader acknowledged: its "no message" is asked again of the leader, whose answer is final
    (it raises ``NotFoundError`` when the stream holds no such message)."""
    try:
        return await js.get_msg(stream, seq=seq, direct=True)
    except nats.js.errors.NotFoundError:
        return await js.get_msg(stream, seq=seq)


def payload_bucket(run_id: str) -> str:
    return f"jetrl_{subjects.check_token(run_id, 'run id')}_payloads"


async def ensure_run_stream(
    js: JetStreamContext, run_id: str, limits: StreamLimits | None = None
) -> api.StreamInfo:
    """Create the run's stream, or check the existing one. Idempotent; limits of an existing
    stream are updated (raising them is always safe, lowering them is JetStream's call)."""
    limits = limits or StreamLimits()
    cfg = limits.stream_config(run_id)
    name = stream_name(run_id)  # the name cfg carries
    try:
        info = await js.stream_info(name)
    except nats.js.errors.NotFoundError:
        try:
            info = await js.add_stream(cfg)
        except RETRYABLE:
            raise  # a 503 is an APIError too, but one that heals: the caller retries it
        except nats.js.errors.APIError as exc:
            raise StreamSetupError(name, limits.max_bytes, exc) from exc
        log.info("stream_created", run_id=run_id, stream=name, max_bytes=limits.max_bytes)
        return info
    current = info.config
    if (
        current.max_bytes != cfg.max_bytes
        or current.max_msgs != cfg.max_msgs
        or current.max_msg_size != cfg.max_msg_size
        or current.duplicate_window != cfg.duplicate_window
    ):
        info = await js.update_stream(cfg)
        log.info("stream_limits_updated", run_id=run_id, stream=name)
    return info


async def ensure_payload_bucket(
    js: JetStreamContext, run_id: str, limits: StreamLimits | None = None
) -> ObjectStore:
    limits = limits or StreamLimits()
    bucket = payload_bucket(run_id)
    try:
        return await js.object_store(bucket)
    except nats.js.errors.BucketNotFoundError:
        pass
    try:
        return await js.create_object_store(
            bucket,
            config=api.ObjectStoreConfig(
                description=f"jetrl payloads of run {run_id}",
                storage=api.StorageType.FILE,
                max_bytes=limits.payload_max_bytes,
                replicas=limits.replicas,
            ),
        )
    except RETRYABLE:
        raise
    except nats.js.errors.APIError as exc:
        raise StreamSetupError(bucket, limits.payload_max_bytes, exc) from exc


# What a tenant's view holds of the run's log: its own subjects, and the steps (the trainer's
# version and which rollouts it trained; run-wide facts, no other tenant's tasks or rollouts).
VIEW_KINDS = ("task", "generation", "rollout", "eval", "dlq")


def view_stream_name(run_id: str, tenant: str) -> str:
    """The stream holding tenant ``tenant``'s view of run ``run_id`` (lengths keep the name
    unambiguous: run and tenant tokens may both contain ``_``)."""
    run = subjects.check_token(run_id, "run id")
    return f"JETRLT_{len(run)}_{run}_{subjects.check_token(tenant, 'tenant')}"


def view_sources(run_id: str, tenant: str) -> list[str]:
    return [
        *(f"{subjects.run_prefix(run_id)}.{kind}.{tenant}.*" for kind in VIEW_KINDS),
        subjects.step_subject(run_id),
    ]


async def ensure_tenant_view(
    js: JetStreamContext, run_id: str, tenant: str, limits: StreamLimits | None = None
) -> api.StreamInfo:
    """Create (or keep) tenant ``tenant``'s view of the run: a stream sourcing only the
    tenant's own subjects (and the steps) from the run's log. A tenant reads the run through
    it, with consumers of its own, and so never holds a consumer on the run's stream nor sees
    another tenant's events. Messages keep their subjects; their sequence in the run's log is
    in the ``Nats-Stream-Source`` header (:func:`origin_seq` in bus/consumer.py)."""
    limits = limits or StreamLimits()
    name = view_stream_name(run_id, tenant)
    try:
        return await js.stream_info(name)
    except nats.js.errors.NotFoundError:
        pass
    origin = stream_name(run_id)
    # A view is as replicated as the log it sources ("auto" limits: take the log's count).
    replicas = limits.replicas or (await js.stream_info(origin)).config.num_replicas or 1
    cfg = api.StreamConfig(
        name=name,
        description=f"tenant {tenant}'s view of jetrl run {run_id}",
        sources=[api.StreamSource(name=origin, filter_subject=f) for f in view_sources(run_id, tenant)],
        retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE,
        discard=api.DiscardPolicy.NEW,
        max_bytes=limits.max_bytes,
        max_msg_size=limits.max_msg_size,
        num_replicas=replicas,
        allow_direct=True,
    )
    try:
        info = await js.add_stream(cfg)
    except nats.js.errors.APIError as exc:
        raise StreamSetupError(name, limits.max_bytes, exc) from exc
    log.info("tenant_view_created", run_id=run_id, tenant=tenant, stream=name)
    return info


@dataclass(frozen=True)
class Usage:
    """How full one of a run's streams is: the log, or the payload bucket's."""

    stream: str
    bytes: int
    max_bytes: int

    @property
    def fraction(self) -> float:
        return self.bytes / self.max_bytes if self.max_bytes > 0 else 0.0


async def run_usage(js: JetStreamContext, run_id: str) -> list[Usage]:
    """The run's log and payload bucket against their limits (a full one refuses publishes:
    ``discard: new``)."""
    out = []
    for name in (stream_name(run_id), f"OBJ_{payload_bucket(run_id)}"):
        try:
            info = await js.stream_info(name)
        except nats.js.errors.NotFoundError:
            continue
        out.append(Usage(name, int(info.state.bytes), int(info.config.max_bytes or -1)))
    return out
