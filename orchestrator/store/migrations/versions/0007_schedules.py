"""Schedules: ``orc_schedules`` (cron or interval, zone, DST policy, catch-up, overlap, what to
run), ``orc_schedule_firings`` (every instant decided: fired, skipped with a reason, pending),
and a run's ``schedule`` with one run per (schedule, logical date), enforced by a UNIQUE
constraint.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("orc_runs") as batch:
        batch.add_column(sa.Column("schedule", sa.String(200), nullable=True))
        batch.create_unique_constraint("uq_orc_runs_schedule_instant", ["schedule", "logical_date"])
    op.create_index("ix_orc_runs_schedule_state", "orc_runs", ["schedule", "state"])
    op.create_table(
        "orc_schedules",
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("cron", sa.String(200), nullable=True),
        sa.Column("every_seconds", sa.Float, nullable=True),
        sa.Column("timezone", sa.String(64), nullable=False),
        sa.Column("dst_gap", sa.String(8), nullable=False),
        sa.Column("dst_fold", sa.String(8), nullable=False),
        sa.Column("catchup", sa.String(8), nullable=False),
        sa.Column("max_catchup", sa.Integer, nullable=False),
        sa.Column("overlap", sa.String(16), nullable=False),
        sa.Column("max_active_runs", sa.Integer, nullable=True),
        sa.Column("spec", sa.JSON, nullable=True),
        sa.Column("spec_hash", sa.String(64), nullable=True),
        sa.Column("factory", sa.String(255), nullable=True),
        sa.Column("params", sa.JSON, nullable=False),
        sa.Column("paused", sa.Boolean, nullable=False),
        sa.Column("next_at", TS, nullable=False),
        sa.Column("last_at", TS, nullable=True),
        sa.Column("buffered_at", TS, nullable=True),
        sa.Column("last_run_id", sa.String(32), nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("last_error_at", TS, nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
    )
    op.create_index("ix_orc_schedules_due", "orc_schedules", ["paused", "next_at"])
    op.create_table(
        "orc_schedule_firings",
        sa.Column("schedule", sa.String(200), primary_key=True),
        sa.Column("logical_date", TS, primary_key=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("run_id", sa.String(32), nullable=True),
        sa.Column("reason", sa.Text, nullable=True),
        sa.Column("at", TS, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("orc_schedule_firings")
    op.drop_index("ix_orc_schedules_due", "orc_schedules")
    op.drop_table("orc_schedules")
    op.drop_index("ix_orc_runs_schedule_state", "orc_runs")
    with op.batch_alter_table("orc_runs") as batch:
        batch.drop_constraint("uq_orc_runs_schedule_instant", type_="unique")
        batch.drop_column("schedule")
