"""Each rank's most queued link

`step_metrics.link_queue_s` and `step_metrics.link_peer`: the queueing delay of the rank's most
delayed collective socket over the last second and 1 + the rank at its far end
(autobyte/tcplinks.py); the tuner names a straggler link from them (autobyted/tuner/stragglers.py).
0: unknown (every sample stored before, a client before it).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07 15:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # ADD COLUMN with a constant default: no batch mode needed (as 0003's host_load)
    op.add_column(
        "step_metrics", sa.Column("link_queue_s", sa.Float(), server_default="0", nullable=False)
    )
    op.add_column(
        "step_metrics", sa.Column("link_peer", sa.Integer(), server_default="0", nullable=False)
    )


def downgrade() -> None:
    op.drop_column("step_metrics", "link_peer")
    op.drop_column("step_metrics", "link_queue_s")
