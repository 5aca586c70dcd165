"""FSDP2's knobs on every configuration, and the engine a job runs

Every table that stores a configuration gets FSDP2's three knobs (autobyte.fsdp) beside the
scheduler's: forward_prefetch and backward_prefetch (prefetch depths) and reshard_after_forward,
all nullable (NULL: as the user set it), so every row written before reads as the configuration it
was. The samples table gets them too (its configuration columns are Config's fields). `jobs.engine`
says which engine's knobs a job's configurations set; every job stored before is "scheduler".

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-06 02:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

TABLES = ("jobs", "step_metrics", "decisions", "configurations", "tuner_states", "tuner_windows")
COLUMNS = (
    ("forward_prefetch", sa.Integer),
    ("backward_prefetch", sa.Integer),
    ("reshard_after_forward", sa.Boolean),
)


def upgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            for name, kind in COLUMNS:
                batch_op.add_column(sa.Column(name, kind(), nullable=True))
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("engine", sa.String(16), nullable=False, server_default="scheduler")
        )


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("engine")
    for table in reversed(TABLES):
        with op.batch_alter_table(table, schema=None) as batch_op:
            for name, _ in reversed(COLUMNS):
                batch_op.drop_column(name)
