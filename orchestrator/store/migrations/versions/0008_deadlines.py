"""Deadlines: a run's and a task's ``deadline_seconds`` / ``deadline_at`` (when it falls due),
the run's ``on_deadline`` (``alert`` or ``cancel``), the reconciler's verdict
(``deadline_checked_at``: the compare-and-set that makes a miss recorded once) and the miss
(``deadline_missed_at``), with partial indexes of the deadlines not judged yet; and the ledger's
``kind`` column, which marks an annotation event (``deadline_missed``) apart from transitions;
and indexes for the runs list filtered by tenant, DAG or state.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)
#: the predicate of both "deadline due" indexes (as in orchestrator/schema.py)
DEADLINE_PENDING = "deadline_at IS NOT NULL AND deadline_checked_at IS NULL"


def upgrade() -> None:
    # nullable columns without a default: on Postgres each ADD COLUMN changes the catalog only
    for table in ("orc_runs", "orc_tasks"):
        op.add_column(table, sa.Column("deadline_seconds", sa.Float, nullable=True))
        op.add_column(table, sa.Column("deadline_at", TS, nullable=True))
        if table == "orc_runs":
            op.add_column(table, sa.Column("on_deadline", sa.String(8), nullable=True))
        op.add_column(table, sa.Column("deadline_checked_at", TS, nullable=True))
        op.add_column(table, sa.Column("deadline_missed_at", TS, nullable=True))
    op.add_column("orc_task_events", sa.Column("kind", sa.String(32), nullable=True))
    where = sa.text(DEADLINE_PENDING)
    op.create_index("ix_orc_runs_deadline_due", "orc_runs", ["deadline_at"], postgresql_where=where, sqlite_where=where)
    op.create_index(
        "ix_orc_tasks_deadline_due", "orc_tasks", ["deadline_at"], postgresql_where=where, sqlite_where=where
    )
    # the runs list filtered by tenant, DAG or state, newest first (orc_runs: one row per run)
    for name, column in (("tenant", "tenant"), ("dag", "dag_name"), ("state", "state")):
        op.create_index(f"ix_orc_runs_{name}_created", "orc_runs", [column, "created_at"])
    annotations = sa.text("kind IS NOT NULL")
    op.create_index(
        "ix_orc_task_events_kind",
        "orc_task_events",
        ["kind", "at"],
        postgresql_where=annotations,
        sqlite_where=annotations,
    )


def downgrade() -> None:
    for name in ("tenant", "dag", "state"):
        op.drop_index(f"ix_orc_runs_{name}_created", "orc_runs")
    op.drop_index("ix_orc_task_events_kind", "orc_task_events")
    op.drop_index("ix_orc_tasks_deadline_due", "orc_tasks")
    op.drop_index("ix_orc_runs_deadline_due", "orc_runs")
    with op.batch_alter_table("orc_task_events") as batch:
        batch.drop_column("kind")
    with op.batch_alter_table("orc_tasks") as batch:
        for column in ("deadline_missed_at", "deadline_checked_at", "deadline_at", "deadline_seconds"):
            batch.drop_column(column)
    with op.batch_alter_table("orc_runs") as batch:
        for column in ("deadline_missed_at", "deadline_checked_at", "on_deadline", "deadline_at", "deadline_seconds"):
            batch.drop_column(column)
