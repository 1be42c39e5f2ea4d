"""Child runs (``DAG.run_dag``): a node that starts a DAG and waits for it as a row.

``orc_runs`` gains the child's lineage (``parent_run_id``, ``parent_key``, ``parent_attempt``: the
parent run, node and attempt that started it; null on every run an earlier release writes) and
``orc_tasks`` the child run a node's current attempt started (``child_run_id``). Partial indexes:
``ix_orc_tasks_child_waiting`` (child-run nodes WAITING: the child pass), ``ix_orc_runs_parent``
(a run's children) and ``ix_orc_runs_child_running`` (running children: the parent-end policy).
``orc_wait_text_v1`` changed in place: a wait of kind ``child`` is said "its child run" (it said
"its time"); every other kind is said as before. No row is rewritten.

Revision ID: 0031
Revises: 0030
"""

import importlib
import re

import sqlalchemy as sa
from alembic import op

revision = "0031"
down_revision = "0030"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("orc_runs", sa.Column("parent_run_id", sa.String(32), nullable=True))
    op.add_column("orc_runs", sa.Column("parent_key", sa.String(200), nullable=True))
    op.add_column("orc_runs", sa.Column("parent_attempt", sa.Integer, nullable=True))
    op.add_column("orc_tasks", sa.Column("child_run_id", sa.String(32), nullable=True))
    op.create_index(
        "ix_orc_tasks_child_waiting", "orc_tasks", ["run_id", "key"],
        postgresql_where=sa.text("state = 'WAITING' AND task_name = 'orchestrator.run_dag'"),
    )  # fmt: skip
    op.create_index(
        "ix_orc_runs_parent", "orc_runs", ["parent_run_id"], postgresql_where=sa.text("parent_run_id IS NOT NULL")
    )
    op.create_index(
        "ix_orc_runs_child_running", "orc_runs", ["parent_run_id"],
        postgresql_where=sa.text("parent_run_id IS NOT NULL AND state = 'RUNNING'"),
    )  # fmt: skip
    op.execute(SQL)


def downgrade() -> None:
    # orc_wait_text_v1 as 0015 installed it (no revision between changed it)
    text = importlib.import_module("orchestrator.store.migrations.versions.0015_waits_and_events").SQL
    found = re.search(r"CREATE OR REPLACE FUNCTION orc_wait_text_v1\(.*?\n\$\$;\n", text, re.S)
    assert found is not None, "0015 defines orc_wait_text_v1"
    op.execute(found.group(0))
    op.drop_index("ix_orc_runs_child_running", table_name="orc_runs")
    op.drop_index("ix_orc_runs_parent", table_name="orc_runs")
    op.drop_index("ix_orc_tasks_child_waiting", table_name="orc_tasks")
    op.drop_column("orc_tasks", "child_run_id")
    op.drop_column("orc_runs", "parent_attempt")
    op.drop_column("orc_runs", "parent_key")
    op.drop_column("orc_runs", "parent_run_id")


#: orc_wait_text_v1 of store/sql/wait.sql as this revision installs it (frozen: a later change
#: is a later migration)
SQL = r"""
-- orc_wait_text_v1: what a wait waits for, as the ledger and explain say it (a child-run node,
-- kind child: its child run, started by the engine's child pass once the node waits).

CREATE OR REPLACE FUNCTION orc_wait_text_v1(p_kind text, p_event text, p_match jsonb, p_until timestamptz,
    p_deadline timestamptz)
 RETURNS text
 LANGUAGE sql
 IMMUTABLE
AS $$
    SELECT CASE p_kind
               WHEN 'event' THEN 'event ' || p_event || coalesce(' matching ' || p_match::text, '')
               WHEN 'approval' THEN 'an approval (orchestrator approve | reject)'
               WHEN 'sensor' THEN 'its next check'
               WHEN 'child' THEN 'its child run'
               WHEN 'defer' THEN coalesce('event ' || p_event || coalesce(' matching ' || p_match::text, ''),
                                          'its time')
               ELSE 'its time' END
           || coalesce(' until ' || p_until::text, '')
           || coalesce(' (deadline ' || p_deadline::text || ')', '')
$$;
"""
