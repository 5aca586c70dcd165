"""An FSDP2 job's groups

`jobs.shard_layout`: each FSDP2 group's gathered parameter bytes in forward order, the root's own
and whether the job's all-gathers leave the training thread (autobyte.records.ShardLayout as
JSON), from rank 0's registration; the daemon's model of the job's schedule predicts each
configuration from it (autobyted/tuner/shard_schedule.py). NULL: a scheduler job, every job
stored before, a client before it.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-08 01:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("shard_layout", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("shard_layout")
