"""An FSDP2 job's memory budget on the job

`jobs.memory_budget_bytes` (NULL: no budget) and `jobs.over_budget` (a JSON list of the FSDP2
configurations the job's ranks predict over it; autobyte.records.MemoryLimits), from rank 0's
registration: the daemon never decides one of them. Every job stored before has no budget.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06 10:20:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("memory_budget_bytes", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("over_budget", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("over_budget")
        batch_op.drop_column("memory_budget_bytes")
