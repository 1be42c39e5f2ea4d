"""A complete ledger: run transitions (events with a null key), who acted (``by``); probe
instrumentation leaves the product schema.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("orc_task_events") as batch:
        batch.alter_column("key", existing_type=sa.String(200), nullable=True)
        batch.add_column(sa.Column("by", sa.String(255), nullable=True))
    op.drop_index("ix_orc_probe_effects_run", "orc_probe_effects", if_exists=True)
    op.drop_table("orc_probe_effects", if_exists=True)


def downgrade() -> None:
    # back to 0002's schema, which still had the probe table
    op.create_table(
        "orc_probe_effects",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(32), nullable=False),
        sa.Column("key", sa.String(200), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_orc_probe_effects_run", "orc_probe_effects", ["run_id", "key"])
    op.execute("DELETE FROM orc_task_events WHERE key IS NULL")
    with op.batch_alter_table("orc_task_events") as batch:
        batch.drop_column("by")
        batch.alter_column("key", existing_type=sa.String(200), nullable=False)
