"""tail_bytes: the tail window, a third scheduling dimension, on every configuration

Every table that stores a configuration gets a nullable tail_bytes beside partition_bytes and
credit_bytes; NULL is "no tail window", so every row written before reads as the configuration it
was (nothing is rewritten).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 15:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

TABLES = ("jobs", "step_metrics", "decisions", "configurations", "tuner_states", "tuner_windows")


def upgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column("tail_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    for table in reversed(TABLES):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column("tail_bytes")
