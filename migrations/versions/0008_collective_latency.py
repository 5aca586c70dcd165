"""The job's per-collective cost

`jobs.collective_latency_s`: one small all-reduce (4 KB of fp32) on the job's data-parallel group, as
rank 0 measured it when its scheduler was built (autobyte.scheduler.start.measure_latency), from
its registration; the predictor reads it (autobyted/tuner/features.py). NULL: not measured (every
job stored before, an FSDP2 job, a client before it).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07 13:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("collective_latency_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("collective_latency_s")
