"""Celery-native runs: a run keeps its submitter's trace context (``orc_runs.trace_context``) and
may be pinned to a code version (``orc_runs.code_version``); a worker advertises its code version
(``orc_workers.code_version``); an attempt's latest ``update_state`` progress lives in
``orc_progress``. No server function changed.

Revision ID: 0024
Revises: 0023
"""

import sqlalchemy as sa
from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.add_column("orc_runs", sa.Column("trace_context", sa.JSON, nullable=True))
    op.add_column("orc_runs", sa.Column("code_version", sa.String(64), nullable=True))
    op.add_column("orc_workers", sa.Column("code_version", sa.String(64), nullable=True))
    op.create_table(
        "orc_progress",
        sa.Column("run_id", sa.String(32), primary_key=True),
        sa.Column("key", sa.String(200), primary_key=True),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("state", sa.String(64), nullable=False),
        sa.Column("meta", sa.JSON, nullable=True),
        sa.Column("updated_at", TS, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("orc_progress")
    op.drop_column("orc_workers", "code_version")
    op.drop_column("orc_runs", "code_version")
    op.drop_column("orc_runs", "trace_context")
