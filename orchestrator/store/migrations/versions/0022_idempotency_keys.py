"""Idempotency keys outlive ``db clean``: ``orc_idempotency_keys`` keeps the key of each run
``db clean`` removes (with the run's id, final state and creation time, and when it was
removed), so that a submit with that key is refused naming the removed run instead of making a
second one; ``db clean --keep-keys`` forgets them after their retention. No server function
changed.

Revision ID: 0022
Revises: 0021
"""

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "orc_idempotency_keys",
        sa.Column("dag_name", sa.String(200), primary_key=True),
        sa.Column("tenant", sa.String(64), primary_key=True),
        sa.Column("idempotency_key", sa.String(200), primary_key=True),
        sa.Column("run_id", sa.String(32), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("removed_at", TS, nullable=False),
    )
    op.create_index("ix_orc_idempotency_keys_removed", "orc_idempotency_keys", ["removed_at"])


def downgrade() -> None:
    op.drop_index("ix_orc_idempotency_keys_removed", table_name="orc_idempotency_keys")
    op.drop_table("orc_idempotency_keys")
