"""steps.micro_batches: how a streaming trainer's step took its rollouts

StepCompleted.micro_batches: the rollouts of each micro-batch, in training order, when the
trainer took the step's groups as they came (``[trainer] stream_groups``); null for a step taken
in one piece. Replay needs it to take such a step again the same way.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None

# JSONB on PostgreSQL, JSON text elsewhere (as jetrl.store.schema.Json).
JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("steps", schema=None) as batch_op:
        batch_op.add_column(sa.Column("micro_batches", JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("steps", schema=None) as batch_op:
        batch_op.drop_column("micro_batches")
