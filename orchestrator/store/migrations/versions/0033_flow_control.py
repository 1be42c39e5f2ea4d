"""Keyed flow control (issue 34): ``submit(..., concurrency_key="customer:42", max_concurrent=1,
on_busy=..., throttle="10/minute", debounce=30, max_wait=300)``.

New nullable columns of ``orc_runs``: ``flow_key`` (the key, per tenant), ``flow`` (the run's
options), ``held`` (why a run is held: ``concurrency``, ``throttle`` or ``debounce``; null: its
roots started), ``held_until``, ``flow_first_at``, ``flow_admitted_at``; and the partial index
``ix_orc_runs_flow_key`` (tenant, key, state) over runs that have a key. A held run is a RUNNING
run whose roots have not started (every task PENDING), released by a compare-and-set on ``held``
(``store/flow.py``): no server function changed, the hot path never reads these columns, so a
worker of the previous release is served as before (a release's worker does not release held
runs: the reconciler of this release does).

Revision ID: 0033
Revises: 0032
"""

import sqlalchemy as sa
from alembic import op

revision = "0033"
down_revision = "0032"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.add_column("orc_runs", sa.Column("flow_key", sa.String(200), nullable=True))
    op.add_column("orc_runs", sa.Column("flow", sa.JSON, nullable=True))
    op.add_column("orc_runs", sa.Column("held", sa.String(16), nullable=True))
    op.add_column("orc_runs", sa.Column("held_until", TS, nullable=True))
    op.add_column("orc_runs", sa.Column("flow_first_at", TS, nullable=True))
    op.add_column("orc_runs", sa.Column("flow_admitted_at", TS, nullable=True))
    op.create_index(
        "ix_orc_runs_flow_key",
        "orc_runs",
        ["tenant", "flow_key", "state"],
        postgresql_where=sa.text("flow_key IS NOT NULL"),
    )


def downgrade() -> None:
    # held runs would never start without these columns: a downgrade leaves them RUNNING, PENDING
    op.drop_index("ix_orc_runs_flow_key", table_name="orc_runs")
    for column in ("flow_admitted_at", "flow_first_at", "held_until", "held", "flow", "flow_key"):
        op.drop_column("orc_runs", column)
