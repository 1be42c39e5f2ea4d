"""Batches of events (issue 34): ``orchestrator on add NAME --event KEY --batch 100,5s`` (and
``submit(..., concurrency_key=K, batch=(100, "5s"))``).

One new nullable column, ``orc_triggers.batch`` (JSON ``[most events, window seconds]``; null: one
run per event, as before; no row rewritten). A batched run is a held run of keyed flow control
(``orc_runs.held = 'batch'``, its options in ``orc_runs.flow``, both from ``0033``); no server
function changed (the merge and the release are compare-and-sets in ``store/flow.py``), so a worker
of the previous release is served as before.

Revision ID: 0034
Revises: 0033
"""

import sqlalchemy as sa
from alembic import op

revision = "0034"
down_revision = "0033"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("orc_triggers", sa.Column("batch", sa.JSON, nullable=True))


def downgrade() -> None:
    op.drop_column("orc_triggers", "batch")
