"""rollouts.group_late: the samples a group closed on its quorum left out

RolloutsScored.late_samples: a group closed on its quorum ([[envs]] group_quorum) lists its
generation's samples scored too late; each of the group's rollout rows records how many, so
that the store accounts for every sample generated (group_size + group_late of them). Null for
rows written before, 0 for a group that waited for every sample.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("rollouts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("group_late", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("rollouts", schema=None) as batch_op:
        batch_op.drop_column("group_late")
