"""Recovery: child keys on the task row, retry_on/no_retry_on, poison counters, worker
capacity registry, probe effects.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("orc_tasks") as batch:
        batch.add_column(sa.Column("children", sa.JSON, nullable=True))
        batch.add_column(sa.Column("retry_on", sa.JSON, nullable=True))
        batch.add_column(sa.Column("no_retry_on", sa.JSON, nullable=True))
        batch.add_column(sa.Column("fingerprint_streak", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("lease_losses", sa.Integer, nullable=False, server_default="0"))
    op.create_index("ix_orc_tasks_queue_state", "orc_tasks", ["queue", "state"])
    op.create_table(
        "orc_workers",
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("queues", sa.JSON, nullable=False),
        sa.Column("concurrency", sa.Integer, nullable=False),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("seen_at", TS, nullable=False),
    )
    op.create_table(
        "orc_probe_effects",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(32), nullable=False),
        sa.Column("key", sa.String(200), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("at", TS, nullable=False),
    )
    op.create_index("ix_orc_probe_effects_run", "orc_probe_effects", ["run_id", "key"])


def downgrade() -> None:
    op.drop_table("orc_probe_effects")
    op.drop_table("orc_workers")
    op.drop_index("ix_orc_tasks_queue_state", "orc_tasks")
    with op.batch_alter_table("orc_tasks") as batch:
        batch.drop_column("lease_losses")
        batch.drop_column("fingerprint_streak")
        batch.drop_column("no_retry_on")
        batch.drop_column("retry_on")
        batch.drop_column("children")
