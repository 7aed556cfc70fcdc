"""generations: one row per sample, keyed by its generation id; policy_versions.blake3

A generation event (CompletionsGenerated) carries every sample of its task, so a row is a
sample: the key is (run_id, generation_id), and event_id (what a rollout's
generation_event_id names) is indexed. The table is a projection of the log: it is made anew
empty, and `jetrl rebuild` fills it from a run's log. A policy version keeps its WeightsReady's
transfer digest (blake3), which readers check the weights' bytes with.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None


def _columns() -> list[sa.Column[object]]:
    return [
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
    ]


def _create(key: str) -> None:
    op.create_table(
        "generations", *_columns(), sa.PrimaryKeyConstraint("run_id", key, name=op.f("pk_generations"))
    )
    with op.batch_alter_table("generations", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_generations_run_id_task_id"), ["run_id", "task_id"], unique=False
        )
        if key == "generation_id":
            batch_op.create_index(
                batch_op.f("ix_generations_run_id_event_id"), ["run_id", "event_id"], unique=False
            )


def upgrade() -> None:
    op.drop_table("generations")
    _create("generation_id")
    with op.batch_alter_table("policy_versions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("blake3", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("policy_versions", schema=None) as batch_op:
        batch_op.drop_column("blake3")
    op.drop_table("generations")
    _create("event_id")
