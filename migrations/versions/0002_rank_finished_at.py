"""ranks.finished_at: a rank's process said it was shutting down (status shows the job finished)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 21:45:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ranks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("finished_at", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ranks", schema=None) as batch_op:
        batch_op.drop_column("finished_at")
