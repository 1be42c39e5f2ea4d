"""Keyed flow control (issue 34): ``submit(..., concurrency_key="customer:42", max_concurrent=1,
on_busy=..., throttle="10/minute", debounce=30, max_wait=300)``.

New nullable columns of ``orc_runs``: ``flow_key`` (the key, per tenant), ``flow`` (the run's
options), ``held`` (why a run is held: ``concurrency``, ``throttle`` or ``debounce``; null: its
roots started), ``held_until``, ``flow_first_at``, ``flow_admitted_at``; and the partial index
``ix_orc_runs_flow_key`` (tenant, key, state) over runs that have a key, and
``ix_orc_runs_flow_held`` over the held runs (the reconciler's flow pass). A held run is a RUNNING
run whose roots have not started (every task PENDING), released by a compare-and-set on ``held``
(``store/flow.py``). One new server function, ``orc_flow_v1`` (``store/sql/flow.sql``): a key's
advisory lock and its runs read after it, in one round trip; no other function changed, the hot
path never reads these columns, so a worker of the previous release is served as before (it does
not release held runs: the reconciler of this release does).

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

SQL = r"""
-- orc_flow_v1: keyed flow control's read of a key (store/flow.py), under the key's lock.
--
-- Takes the key's advisory transaction lock (every decision about a key, a submit's or the
-- reconciler's release, is taken under it), then reads, with a snapshot taken after the lock
-- (a statement of its own: what a submit that held the lock committed is seen), the key's
-- RUNNING runs of the tenant other than p_exclude (open = true, oldest first) and, when p_since
-- is given, the key's runs admitted after it (open = false, newest first: the throttle's
-- window). One round trip for what a keyed submit reads.

CREATE OR REPLACE FUNCTION orc_flow_v1(p_tenant text, p_key text, p_exclude text, p_since timestamptz)
 RETURNS TABLE (
    open boolean, id text, held text, held_until timestamptz, flow_first_at timestamptz,
    created_at timestamptz, flow json, flow_admitted_at timestamptz
 )
 LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('orc_flow:' || p_tenant || '/' || p_key, 0));
    RETURN QUERY
    SELECT true, r.id::text, r.held::text, r.held_until, r.flow_first_at, r.created_at, r.flow, r.flow_admitted_at
    FROM orc_runs r
    WHERE r.tenant = p_tenant AND r.flow_key = p_key AND r.state = 'RUNNING'
      AND r.id IS DISTINCT FROM p_exclude
    ORDER BY r.created_at, r.id;
    IF p_since IS NOT NULL THEN
        RETURN QUERY
        SELECT false, r.id::text, r.held::text, r.held_until, r.flow_first_at, r.created_at, r.flow, r.flow_admitted_at
        FROM orc_runs r
        WHERE r.tenant = p_tenant AND r.flow_key = p_key AND r.flow_admitted_at > p_since
        ORDER BY r.flow_admitted_at DESC;
    END IF;
END;
$$;
"""


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
    op.create_index(
        "ix_orc_runs_flow_held",
        "orc_runs",
        ["created_at"],
        postgresql_where=sa.text("held IS NOT NULL AND state = 'RUNNING'"),
    )
    op.execute(SQL)


def downgrade() -> None:
    op.execute("DROP FUNCTION IF EXISTS orc_flow_v1(text, text, text, timestamptz)")
    # held runs would never start without these columns: a downgrade leaves them RUNNING, PENDING
    op.drop_index("ix_orc_runs_flow_held", table_name="orc_runs")
    op.drop_index("ix_orc_runs_flow_key", table_name="orc_runs")
    for column in ("flow_admitted_at", "flow_first_at", "held_until", "held", "flow", "flow_key"):
        op.drop_column("orc_runs", column)
