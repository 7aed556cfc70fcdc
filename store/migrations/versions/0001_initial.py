"""initial step-history schema

Revision ID: 0001
Revises:

The tables of docs/store.md: runs, tasks, generations, rollouts, step_rollouts, steps,
policy_versions, workers, dead_letters and the consumer_offsets tracking table.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

# JSONB on PostgreSQL, JSON text elsewhere (as jetrl.store.schema.Json).
JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "consumer_offsets",
        sa.Column("stream", sa.String(length=128), nullable=False),
        sa.Column("consumer", sa.String(length=128), nullable=False),
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("last_seq", sa.BigInteger(), nullable=False),
        sa.Column("last_event_at", sa.Double(), nullable=True),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("stream", "consumer", name=op.f("pk_consumer_offsets")),
    )
    op.create_table(
        "dead_letters",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("event_id", sa.String(length=128), nullable=False),
        sa.Column("reason", sa.String(length=64), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column("consumer", sa.String(length=128), nullable=False),
        sa.Column("original_subject", sa.String(length=512), nullable=False),
        sa.Column("original_seq", sa.BigInteger(), nullable=False),
        sa.Column("original_type", sa.String(length=64), nullable=True),
        sa.Column("original_event_id", sa.String(length=128), nullable=True),
        sa.Column("delivery_count", sa.Integer(), nullable=False),
        sa.Column("original_size", sa.Integer(), nullable=False),
        sa.Column("original_data", sa.LargeBinary(), nullable=False),
        sa.Column("dead_lettered_at", sa.Double(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "event_id", name=op.f("pk_dead_letters")),
    )
    op.create_table(
        "generations",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("event_id", sa.String(length=128), nullable=False),
        sa.Column("generation_id", sa.String(length=128), nullable=False),
        sa.Column("task_id", sa.String(length=128), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("env", sa.String(length=64), nullable=False),
        sa.Column("group_id", sa.String(length=128), nullable=False),
        sa.Column("sample_index", sa.Integer(), nullable=False),
        sa.Column("worker_id", sa.String(length=64), nullable=False),
        sa.Column("finish_reason", sa.String(length=16), nullable=False),
        sa.Column("policy_version_start", sa.Integer(), nullable=False),
        sa.Column("policy_version_end", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("queued_s", sa.Double(), nullable=False),
        sa.Column("generate_s", sa.Double(), nullable=False),
        sa.Column("load_wait_s", sa.Double(), nullable=False),
        sa.Column("episode_id", sa.String(length=128), nullable=False),
        sa.Column("turn", sa.Integer(), nullable=False),
        sa.Column("completed_at", sa.Double(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "event_id", name=op.f("pk_generations")),
    )
    with op.batch_alter_table("generations", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_generations_run_id_task_id"), ["run_id", "task_id"], unique=False
        )

    op.create_table(
        "policy_versions",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("weights_checksum", sa.String(length=128), nullable=True),
        sa.Column("parent_version", sa.Integer(), nullable=True),
        sa.Column("published_at", sa.Double(), nullable=True),
        sa.Column("published_seq", sa.BigInteger(), nullable=True),
        sa.Column("location", JSON, nullable=True),
        sa.Column("location_store", sa.String(length=32), nullable=True),
        sa.Column("location_uri", sa.Text(), nullable=True),
        sa.Column("size", sa.BigInteger(), nullable=True),
        sa.Column("sha256", sa.String(length=64), nullable=True),
        sa.Column("format", sa.String(length=32), nullable=True),
        sa.Column("ready_checksum", sa.String(length=128), nullable=True),
        sa.Column("ready_at", sa.Double(), nullable=True),
        sa.Column("ready_seq", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("run_id", "version", name=op.f("pk_policy_versions")),
    )
    op.create_table(
        "rollouts",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("rollout_id", sa.String(length=128), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=True),
        sa.Column("env", sa.String(length=64), nullable=True),
        sa.Column("group_id", sa.String(length=128), nullable=True),
        sa.Column("task_id", sa.String(length=128), nullable=True),
        sa.Column("generation_event_id", sa.String(length=128), nullable=True),
        sa.Column("sample_index", sa.Integer(), nullable=True),
        sa.Column("group_size", sa.Integer(), nullable=True),
        sa.Column("reward", sa.Double(), nullable=True),
        sa.Column("reward_parts", JSON, nullable=True),
        sa.Column("policy_version_start", sa.Integer(), nullable=True),
        sa.Column("policy_version_end", sa.Integer(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("payloads", JSON, nullable=True),
        sa.Column("scored_at", sa.Double(), nullable=True),
        sa.Column("scored_event_id", sa.String(length=128), nullable=True),
        sa.Column("scored_seq", sa.BigInteger(), nullable=True),
        sa.Column("withheld_reason", sa.String(length=32), nullable=True),
        sa.Column("withheld_detail", sa.Text(), nullable=True),
        sa.Column("withheld_step", sa.Integer(), nullable=True),
        sa.Column("withheld_policy_version", sa.Integer(), nullable=True),
        sa.Column("withheld_staleness", sa.Integer(), nullable=True),
        sa.Column("withheld_at", sa.Double(), nullable=True),
        sa.Column("withheld_seq", sa.BigInteger(), nullable=True),
        sa.Column("trained_step", sa.Integer(), nullable=True),
        sa.Column("train_position", sa.Integer(), nullable=True),
        sa.Column("trained_seq", sa.BigInteger(), nullable=True),
        sa.Column("staleness", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("run_id", "rollout_id", name=op.f("pk_rollouts")),
    )
    with op.batch_alter_table("rollouts", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_rollouts_run_id_tenant_env"), ["run_id", "tenant", "env"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_rollouts_run_id_trained_step_train_position"),
            ["run_id", "trained_step", "train_position"],
            unique=False,
        )

    op.create_table(
        "runs",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=True),
        sa.Column("config", JSON, nullable=True),
        sa.Column("code_version", sa.String(length=128), nullable=True),
        sa.Column("host", sa.String(length=256), nullable=True),
        sa.Column("library_versions", JSON, nullable=True),
        sa.Column("started_at", sa.Double(), nullable=True),
        sa.Column("started_event_id", sa.String(length=128), nullable=True),
        sa.Column("started_seq", sa.BigInteger(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=True),
        sa.Column("finish_reason", sa.Text(), nullable=True),
        sa.Column("finished_at", sa.Double(), nullable=True),
        sa.Column("finished_seq", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_runs")),
    )
    op.create_table(
        "step_rollouts",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("rollout_id", sa.String(length=128), nullable=False),
        sa.Column("rollout_seq", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("run_id", "step", "position", name=op.f("pk_step_rollouts")),
    )
    op.create_table(
        "steps",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("num_rollouts", sa.Integer(), nullable=False),
        sa.Column("metrics", JSON, nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("duration_s", sa.Double(), nullable=False),
        sa.Column("completed_at", sa.Double(), nullable=False),
        sa.Column("event_id", sa.String(length=128), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "step", name=op.f("pk_steps")),
    )
    op.create_table(
        "tasks",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("task_id", sa.String(length=128), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("env", sa.String(length=64), nullable=False),
        sa.Column("group_size", sa.Integer(), nullable=False),
        sa.Column("prompt_len", sa.Integer(), nullable=False),
        sa.Column("prompt_text", sa.Text(), nullable=False),
        sa.Column("max_tokens", sa.Integer(), nullable=False),
        sa.Column("episode_id", sa.String(length=128), nullable=False),
        sa.Column("turn", sa.Integer(), nullable=False),
        sa.Column("info", JSON, nullable=False),
        sa.Column("submitted_at", sa.Double(), nullable=False),
        sa.Column("event_id", sa.String(length=128), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "task_id", name=op.f("pk_tasks")),
    )
    op.create_table(
        "workers",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("worker_id", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=True),
        sa.Column("inflight", sa.Integer(), nullable=True),
        sa.Column("stats", JSON, nullable=True),
        sa.Column("last_heartbeat_at", sa.Double(), nullable=True),
        sa.Column("heartbeat_seq", sa.BigInteger(), nullable=True),
        sa.Column("loaded_version", sa.Integer(), nullable=True),
        sa.Column("loaded_at", sa.Double(), nullable=True),
        sa.Column("loaded_seq", sa.BigInteger(), nullable=True),
        sa.Column("last_load_s", sa.Double(), nullable=True),
        sa.Column("checksum_verified", sa.Boolean(), nullable=True),
        sa.Column("load_seq", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("run_id", "worker_id", name=op.f("pk_workers")),
    )


def downgrade() -> None:
    op.drop_table("workers")
    op.drop_table("tasks")
    op.drop_table("steps")
    op.drop_table("step_rollouts")
    op.drop_table("runs")
    with op.batch_alter_table("rollouts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_rollouts_run_id_trained_step_train_position"))
        batch_op.drop_index(batch_op.f("ix_rollouts_run_id_tenant_env"))

    op.drop_table("rollouts")
    op.drop_table("policy_versions")
    with op.batch_alter_table("generations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_generations_run_id_task_id"))

    op.drop_table("generations")
    op.drop_table("dead_letters")
    op.drop_table("consumer_offsets")
