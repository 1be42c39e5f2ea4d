"""Runs, task instances, edges and the task event ledger.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "orc_runs",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("dag_name", sa.String(200), nullable=False),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("priority", sa.String(16), nullable=False),
        sa.Column("idempotency_key", sa.String(200), nullable=True),
        sa.Column("logical_date", sa.String(64), nullable=True),
        sa.Column("params", sa.JSON, nullable=False),
        sa.Column("dag_snapshot", sa.JSON, nullable=False),
        sa.Column("task_count", sa.Integer, nullable=False),
        sa.Column("open_tasks", sa.Integer, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("finished_at", TS, nullable=True),
        sa.UniqueConstraint("dag_name", "tenant", "idempotency_key", name="uq_orc_runs_idempotency"),
    )
    op.create_index("ix_orc_runs_created", "orc_runs", ["created_at"])
    op.create_table(
        "orc_tasks",
        sa.Column("run_id", sa.String(32), sa.ForeignKey("orc_runs.id"), primary_key=True),
        sa.Column("key", sa.String(200), primary_key=True),
        sa.Column("task_name", sa.String(255), nullable=False),
        sa.Column("args", sa.JSON, nullable=False),
        sa.Column("kwargs", sa.JSON, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("max_attempts", sa.Integer, nullable=False),
        sa.Column("backoff", sa.JSON, nullable=False),
        sa.Column("trigger_rule", sa.String(16), nullable=False),
        sa.Column("n_upstream", sa.Integer, nullable=False),
        sa.Column("n_done", sa.Integer, nullable=False),
        sa.Column("n_succeeded", sa.Integer, nullable=False),
        sa.Column("n_failed", sa.Integer, nullable=False),
        sa.Column("n_skipped", sa.Integer, nullable=False),
        sa.Column("wants_upstream", sa.Boolean, nullable=False),
        sa.Column("queue", sa.String(200), nullable=False),
        sa.Column("priority", sa.String(16), nullable=False),
        sa.Column("priority_rank", sa.SmallInteger, nullable=False),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("soft_time_limit", sa.Float, nullable=True),
        sa.Column("time_limit", sa.Float, nullable=True),
        sa.Column("not_before", TS, nullable=True),
        sa.Column("ready_at", TS, nullable=True),
        sa.Column("dispatched_at", TS, nullable=True),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("heartbeat_at", TS, nullable=True),
        sa.Column("lease_expires_at", TS, nullable=True),
        sa.Column("finished_at", TS, nullable=True),
        sa.Column("worker", sa.String(255), nullable=True),
        sa.Column("result", sa.JSON, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("fingerprint", sa.String(64), nullable=True),
    )
    op.create_index("ix_orc_tasks_state", "orc_tasks", ["state", "priority_rank", "ready_at"])
    op.create_table(
        "orc_edges",
        sa.Column("run_id", sa.String(32), sa.ForeignKey("orc_runs.id"), primary_key=True),
        sa.Column("parent_key", sa.String(200), primary_key=True),
        sa.Column("child_key", sa.String(200), primary_key=True),
    )
    op.create_index("ix_orc_edges_child", "orc_edges", ["run_id", "child_key"])
    op.create_table(
        "orc_task_events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(32), nullable=False),
        sa.Column("key", sa.String(200), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("from_state", sa.String(16), nullable=True),
        sa.Column("to_state", sa.String(16), nullable=False),
        sa.Column("actor", sa.String(32), nullable=False),
        sa.Column("reason", sa.Text, nullable=True),
        sa.Column("accepted", sa.Boolean, nullable=False),
        sa.Column("at", TS, nullable=False),
    )
    op.create_index("ix_orc_task_events_run", "orc_task_events", ["run_id", "key"])


def downgrade() -> None:
    op.drop_table("orc_task_events")
    op.drop_table("orc_edges")
    op.drop_table("orc_tasks")
    op.drop_table("orc_runs")
