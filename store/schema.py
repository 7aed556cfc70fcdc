"""The step-history schema: a projection of a run's event log (docs/store.md).

Every table is keyed by ``run_id`` plus the natural key of the fact it holds, so one database
can hold many runs and every projection write is an idempotent upsert on that key.

Columns are owned by the event type that writes them (a rollout row is filled by
RolloutsScored, RolloutWithheld and StepCompleted, each writing its own columns). Each group of
columns keeps the stream sequence of the event that wrote it (``*_seq``): that makes the final
row independent of the order in which groups are applied, and lets a group be written "first
fact wins" (facts) or "last write wins" (state such as a worker's heartbeat).

Times are epoch seconds as doubles (the envelope's ``time``): exact on both backends and cheap
to compare when the projection is rebuilt.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# JSONB on PostgreSQL (queryable); JSON text elsewhere.
Json = sa.JSON().with_variant(JSONB(), "postgresql")
Float: sa.Double[float] = sa.Double()
RunId = sa.String(64)
Id = sa.String(128)


class Base(DeclarativeBase):
    metadata = sa.MetaData(
        naming_convention={
            "ix": "ix_%(table_name)s_%(column_0_N_name)s",
            "uq": "uq_%(table_name)s_%(column_0_N_name)s",
            "pk": "pk_%(table_name)s",
        }
    )


class Run(Base):
    __tablename__ = "runs"

    run_id: Mapped[str] = mapped_column(RunId, primary_key=True)
    tenant: Mapped[str | None] = mapped_column(sa.String(64))
    # RunStarted (first wins)
    config: Mapped[dict[str, Any] | None] = mapped_column(Json)
    code_version: Mapped[str | None] = mapped_column(sa.String(128))
    host: Mapped[str | None] = mapped_column(sa.String(256))
    library_versions: Mapped[dict[str, str] | None] = mapped_column(Json)
    started_at: Mapped[float | None] = mapped_column(Float)
    started_event_id: Mapped[str | None] = mapped_column(Id)
    started_seq: Mapped[int | None] = mapped_column(sa.BigInteger)
    # RunFinished (last wins); "running" until then, and again after a RunResumed
    status: Mapped[str] = mapped_column(sa.String(16))
    steps: Mapped[int | None] = mapped_column(sa.Integer)
    finish_reason: Mapped[str | None] = mapped_column(sa.Text)
    finished_at: Mapped[float | None] = mapped_column(Float)
    finished_seq: Mapped[int | None] = mapped_column(sa.BigInteger)


class Task(Base):
    __tablename__ = "tasks"

    run_id: Mapped[str] = mapped_column(RunId, primary_key=True)
    task_id: Mapped[str] = mapped_column(Id, primary_key=True)
    tenant: Mapped[str] = mapped_column(sa.String(64))
    env: Mapped[str] = mapped_column(sa.String(64))
    group_size: Mapped[int] = mapped_column(sa.Integer)
    prompt_len: Mapped[int] = mapped_column(sa.Integer)
    prompt_text: Mapped[str] = mapped_column(sa.Text)
    max_tokens: Mapped[int] = mapped_column(sa.Integer)
    episode_id: Mapped[str] = mapped_column(sa.String(128))
    turn: Mapped[int] = mapped_column(sa.Integer)
    info: Mapped[dict[str, Any]] = mapped_column(Json)
    submitted_at: Mapped[float] = mapped_column(Float)
    event_id: Mapped[str] = mapped_column(Id)
    seq: Mapped[int] = mapped_column(sa.BigInteger)


class Generation(Base):
    """One sample of a CompletionsGenerated (``event_id``, which a RolloutsScored points at)."""

    __tablename__ = "generations"

    run_id: Mapped[str] = mapped_column(RunId, primary_key=True)
    generation_id: Mapped[str] = mapped_column(Id, primary_key=True)
    event_id: Mapped[str] = mapped_column(Id)
    task_id: Mapped[str] = mapped_column(Id)
    tenant: Mapped[str] = mapped_column(sa.String(64))
    env: Mapped[str] = mapped_column(sa.String(64))
    group_id: Mapped[str] = mapped_column(Id)
    sample_index: Mapped[int] = mapped_column(sa.Integer)
    worker_id: Mapped[str] = mapped_column(sa.String(64))
    finish_reason: Mapped[str] = mapped_column(sa.String(16))
    policy_version_start: Mapped[int] = mapped_column(sa.Integer)
    policy_version_end: Mapped[int] = mapped_column(sa.Integer)
    prompt_tokens: Mapped[int | None] = mapped_column(sa.Integer)
    completion_tokens: Mapped[int | None] = mapped_column(sa.Integer)
    queued_s: Mapped[float] = mapped_column(Float)
    generate_s: Mapped[float] = mapped_column(Float)
    load_wait_s: Mapped[float] = mapped_column(Float)
    episode_id: Mapped[str] = mapped_column(sa.String(128))
    turn: Mapped[int] = mapped_column(sa.Integer)
    completed_at: Mapped[float] = mapped_column(Float)
    seq: Mapped[int] = mapped_column(sa.BigInteger)

    __table_args__ = (sa.Index(None, "run_id", "task_id"), sa.Index(None, "run_id", "event_id"))


class Rollout(Base):
    __tablename__ = "rollouts"

    run_id: Mapped[str] = mapped_column(RunId, primary_key=True)
    rollout_id: Mapped[str] = mapped_column(Id, primary_key=True)
    # Written on insert by whichever event comes first, then owned by RolloutsScored.
    tenant: Mapped[str | None] = mapped_column(sa.String(64))
    env: Mapped[str | None] = mapped_column(sa.String(64))
    group_id: Mapped[str | None] = mapped_column(Id)
    # RolloutsScored (first wins)
    task_id: Mapped[str | None] = mapped_column(Id)
    generation_event_id: Mapped[str | None] = mapped_column(Id)
    sample_index: Mapped[int | None] = mapped_column(sa.Integer)
    group_size: Mapped[int | None] = mapped_column(sa.Integer)
    group_late: Mapped[int | None] = mapped_column(sa.Integer)  # late samples (group_quorum)
    reward: Mapped[float | None] = mapped_column(Float)
    reward_parts: Mapped[dict[str, float] | None] = mapped_column(Json)
    policy_version_start: Mapped[int | None] = mapped_column(sa.Integer)
    policy_version_end: Mapped[int | None] = mapped_column(sa.Integer)
    prompt_tokens: Mapped[int | None] = mapped_column(sa.Integer)
    completion_tokens: Mapped[int | None] = mapped_column(sa.Integer)
    payloads: Mapped[dict[str, Any] | None] = mapped_column(Json)
    scored_at: Mapped[float | None] = mapped_column(Float)
    scored_event_id: Mapped[str | None] = mapped_column(Id)
    scored_seq: Mapped[int | None] = mapped_column(sa.BigInteger)
    # RolloutWithheld (first wins)
    withheld_reason: Mapped[str | None] = mapped_column(sa.String(32))
    withheld_detail: Mapped[str | None] = mapped_column(sa.Text)
    withheld_step: Mapped[int | None] = mapped_column(sa.Integer)
    withheld_policy_version: Mapped[int | None] = mapped_column(sa.Integer)
    withheld_staleness: Mapped[int | None] = mapped_column(sa.Integer)
    withheld_at: Mapped[float | None] = mapped_column(Float)
    withheld_seq: Mapped[int | None] = mapped_column(sa.BigInteger)
    # StepCompleted (first wins): the step that trained on it and its place in the batch
    trained_step: Mapped[int | None] = mapped_column(sa.Integer)
    train_position: Mapped[int | None] = mapped_column(sa.Integer)
    trained_seq: Mapped[int | None] = mapped_column(sa.BigInteger)
    # trained_step - policy_version_start once both are known, else the withheld event's value
    staleness: Mapped[int | None] = mapped_column(sa.Integer)

    __table_args__ = (
        sa.Index(None, "run_id", "trained_step", "train_position"),
        sa.Index(None, "run_id", "tenant", "env"),
    )


class StepRollout(Base):
    """StepCompleted.rollout_ids exactly, in training order (what replay needs)."""

    __tablename__ = "step_rollouts"

    run_id: Mapped[str] = mapped_column(RunId, primary_key=True)
    step: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
    position: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
    rollout_id: Mapped[str] = mapped_column(Id)
    rollout_seq: Mapped[int | None] = mapped_column(sa.BigInteger)


class Step(Base):
    __tablename__ = "steps"

    run_id: Mapped[str] = mapped_column(RunId, primary_key=True)
    step: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
    policy_version: Mapped[int] = mapped_column(sa.Integer)
    num_rollouts: Mapped[int] = mapped_column(sa.Integer)
    metrics: Mapped[dict[str, float]] = mapped_column(Json)
    tokens: Mapped[int] = mapped_column(sa.BigInteger)
    duration_s: Mapped[float] = mapped_column(Float)
    completed_at: Mapped[float] = mapped_column(Float)
    event_id: Mapped[str] = mapped_column(Id)
    seq: Mapped[int] = mapped_column(sa.BigInteger)
    # StepCompleted.micro_batches (a streaming step's); null: the step took its rollouts at once
    micro_batches: Mapped[list[int] | None] = mapped_column(Json, nullable=True)


class PolicyVersion(Base):
    __tablename__ = "policy_versions"

    run_id: Mapped[str] = mapped_column(RunId, primary_key=True)
    version: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
    # PolicyVersionPublished (first wins)
    step: Mapped[int | None] = mapped_column(sa.Integer)
    weights_checksum: Mapped[str | None] = mapped_column(sa.String(128))
    parent_version: Mapped[int | None] = mapped_column(sa.Integer)
    published_at: Mapped[float | None] = mapped_column(Float)
    published_seq: Mapped[int | None] = mapped_column(sa.BigInteger)
    # WeightsReady (first wins)
    location: Mapped[dict[str, Any] | None] = mapped_column(Json)
    location_store: Mapped[str | None] = mapped_column(sa.String(32))
    location_uri: Mapped[str | None] = mapped_column(sa.Text)
    size: Mapped[int | None] = mapped_column(sa.BigInteger)
    sha256: Mapped[str | None] = mapped_column(sa.String(64))
    format: Mapped[str | None] = mapped_column(sa.String(32))
    ready_checksum: Mapped[str | None] = mapped_column(sa.String(128))
    blake3: Mapped[str | None] = mapped_column(sa.String(64))  # WeightsReady's transfer digest
    ready_at: Mapped[float | None] = mapped_column(Float)
    ready_seq: Mapped[int | None] = mapped_column(sa.BigInteger)


class Worker(Base):
    __tablename__ = "workers"

    run_id: Mapped[str] = mapped_column(RunId, primary_key=True)
    worker_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(sa.String(32))
    # WorkerHeartbeat (last wins)
    status: Mapped[str | None] = mapped_column(sa.String(16))
    inflight: Mapped[int | None] = mapped_column(sa.Integer)
    stats: Mapped[dict[str, float] | None] = mapped_column(Json)
    last_heartbeat_at: Mapped[float | None] = mapped_column(Float)
    heartbeat_seq: Mapped[int | None] = mapped_column(sa.BigInteger)
    # loaded version: WeightsLoaded or a heartbeat that reports one (last wins)
    loaded_version: Mapped[int | None] = mapped_column(sa.Integer)
    loaded_at: Mapped[float | None] = mapped_column(Float)
    loaded_seq: Mapped[int | None] = mapped_column(sa.BigInteger)
    # WeightsLoaded only (last wins)
    last_load_s: Mapped[float | None] = mapped_column(Float)
    checksum_verified: Mapped[bool | None] = mapped_column(sa.Boolean)
    load_seq: Mapped[int | None] = mapped_column(sa.BigInteger)


class DeadLetter(Base):
    __tablename__ = "dead_letters"

    run_id: Mapped[str] = mapped_column(RunId, primary_key=True)
    event_id: Mapped[str] = mapped_column(Id, primary_key=True)
    reason: Mapped[str] = mapped_column(sa.String(64))
    detail: Mapped[str] = mapped_column(sa.Text)
    consumer: Mapped[str] = mapped_column(sa.String(128))
    original_subject: Mapped[str] = mapped_column(sa.String(512))
    original_seq: Mapped[int] = mapped_column(sa.BigInteger)
    original_type: Mapped[str | None] = mapped_column(sa.String(64))
    original_event_id: Mapped[str | None] = mapped_column(Id)
    delivery_count: Mapped[int] = mapped_column(sa.Integer)
    original_size: Mapped[int] = mapped_column(sa.Integer)
    original_data: Mapped[bytes] = mapped_column(sa.LargeBinary)
    dead_lettered_at: Mapped[float] = mapped_column(Float)
    seq: Mapped[int] = mapped_column(sa.BigInteger)


class Evaluation(Base):
    """EvaluationReported: one environment producer's evaluation of a policy version on its
    held-out split (first fact wins). Keyed by tenant too: two producers may share an env name."""

    __tablename__ = "evaluations"

    run_id: Mapped[str] = mapped_column(RunId, primary_key=True)
    tenant: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    env: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    policy_version: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
    n_tasks: Mapped[int] = mapped_column(sa.Integer)
    samples: Mapped[int] = mapped_column(sa.Integer)
    pass_at_1: Mapped[float] = mapped_column(Float)
    pass_at_k: Mapped[float] = mapped_column(Float)
    reward_mean: Mapped[float] = mapped_column(Float)
    version_min: Mapped[int] = mapped_column(sa.Integer)
    version_max: Mapped[int] = mapped_column(sa.Integer)
    temperature: Mapped[float] = mapped_column(Float)
    successes: Mapped[list[int]] = mapped_column(Json)
    reported_at: Mapped[float] = mapped_column(Float)
    event_id: Mapped[str] = mapped_column(Id)
    seq: Mapped[int] = mapped_column(sa.BigInteger)


class Alert(Base):
    """AlertRaised: a monitor's alert ``rule`` firing or resolving for ``key`` at a trainer
    step, one row per event (first fact wins). ``value`` and ``threshold`` are NULL where the
    event's was NaN (SQLite cannot hold one)."""

    __tablename__ = "alerts"

    run_id: Mapped[str] = mapped_column(RunId, primary_key=True)
    event_id: Mapped[str] = mapped_column(Id, primary_key=True)
    rule: Mapped[str] = mapped_column(sa.String(64))
    key: Mapped[str] = mapped_column(sa.String(128))
    state: Mapped[str] = mapped_column(sa.String(16))
    severity: Mapped[str] = mapped_column(sa.String(16))
    message: Mapped[str] = mapped_column(sa.Text)
    step: Mapped[int] = mapped_column(sa.Integer)
    value: Mapped[float | None] = mapped_column(Float)
    threshold: Mapped[float | None] = mapped_column(Float)
    raised_at: Mapped[float] = mapped_column(Float)
    seq: Mapped[int] = mapped_column(sa.BigInteger)


class ConsumerOffset(Base):
    """How far a projection has applied a stream; written in the same transaction as the rows."""

    __tablename__ = "consumer_offsets"

    stream: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    consumer: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    run_id: Mapped[str] = mapped_column(RunId)
    last_seq: Mapped[int] = mapped_column(sa.BigInteger)
    last_event_at: Mapped[float | None] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


def table_of(model: type[Base]) -> sa.Table:
    """A mapped class's table (typed as any FromClause by SQLAlchemy; ours are all tables)."""
    table = model.__table__
    assert isinstance(table, sa.Table)
    return table


# Tables holding a run's projection, in dependency-free dump order.
PROJECTION_TABLES: tuple[sa.Table, ...] = tuple(
    table_of(m)
    for m in (
        Run,
        Task,
        Generation,
        Rollout,
        StepRollout,
        Step,
        PolicyVersion,
        Worker,
        DeadLetter,
        Evaluation,
        Alert,
    )
)
OFFSETS: sa.Table = table_of(ConsumerOffset)
