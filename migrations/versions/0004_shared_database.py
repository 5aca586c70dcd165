"""shared database: leases, 64-bit sample and decision ids, (job, id) index of decisions

Several daemons on one PostgreSQL: a lease row per piece of work that one daemon at a time does
(tuning a job), 64-bit row ids where rows grow without bound (an int4 serial runs out after 2^31
samples), and the index that lets every daemon poll a job's newest decision cheaply.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 03:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "leases",
        sa.Column("name", sa.String(length=300), nullable=False),
        sa.Column("holder", sa.String(length=255), nullable=False),
        sa.Column("acquired_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_index("ix_decisions_job_id_id", "decisions", ["job_id", "id"], unique=False)
    op.drop_index("ix_decisions_job_id", table_name="decisions")
    if op.get_bind().dialect.name == "postgresql":
        # SQLite's INTEGER PRIMARY KEY is 64-bit already; PostgreSQL's serial is not (nor its sequence).
        for table in ("step_metrics", "decisions"):
            op.alter_column(
                table,
                "id",
                type_=sa.BigInteger(),
                existing_type=sa.Integer(),
                existing_nullable=False,
            )
            op.execute(f"ALTER SEQUENCE {table}_id_seq AS bigint")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for table in ("step_metrics", "decisions"):
            op.execute(f"ALTER SEQUENCE {table}_id_seq AS integer")
            op.alter_column(
                table,
                "id",
                type_=sa.Integer(),
                existing_type=sa.BigInteger(),
                existing_nullable=False,
            )
    op.create_index("ix_decisions_job_id", "decisions", ["job_id"], unique=False)
    op.drop_index("ix_decisions_job_id_id", table_name="decisions")
    op.drop_table("leases")
