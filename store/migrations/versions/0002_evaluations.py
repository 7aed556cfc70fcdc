"""evaluations: EvaluationReported, a policy version's pass@1/pass@k on a held-out split

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None

# JSONB on PostgreSQL, JSON text elsewhere (as jetrl.store.schema.Json).
JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "evaluations",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("env", sa.String(length=64), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("n_tasks", sa.Integer(), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("pass_at_1", sa.Double(), nullable=False),
        sa.Column("pass_at_k", sa.Double(), nullable=False),
        sa.Column("reward_mean", sa.Double(), nullable=False),
        sa.Column("version_min", sa.Integer(), nullable=False),
        sa.Column("version_max", sa.Integer(), nullable=False),
        sa.Column("temperature", sa.Double(), nullable=False),
        sa.Column("successes", JSON, nullable=False),
        sa.Column("reported_at", sa.Double(), nullable=False),
        sa.Column("event_id", sa.String(length=128), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "tenant", "env", "policy_version", name=op.f("pk_evaluations")),
    )


def downgrade() -> None:
    op.drop_table("evaluations")
