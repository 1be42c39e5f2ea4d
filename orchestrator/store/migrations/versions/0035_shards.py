"""The control plane sharded with epochs (issue 35): the reconciler's shards.

Three new tables and one nullable column, no row rewritten:
``orc_shard_config`` (one row: K, the deployment's number of logical shards, written by the first
reconciler started with ``ORCHESTRATOR_RECONCILER_SHARDS`` and fixed afterwards), ``orc_shards``
(per shard: owner, epoch, lease, claimed/renewed times), ``orc_reconcilers`` (the live instances'
heartbeats) and ``orc_runs.shard`` (``hash(id) mod K``, set at submit once K is stored; null on
older runs, whose shard the same SQL expression computes where it is read). A worker of the
previous release submits runs with a null shard, which is served the same way.

``orc_wake_due_v2`` added (``orc_wake_due_v1`` with a shard filter: ``p_mine`` NULL wakes every wait
due, as before; the sharded reconciler passes its shards), and ``orc_wake_due_v1`` becomes its
shim in ``legacy.sql``.

Revision ID: 0035
Revises: 0034
"""

import importlib
import re

import sqlalchemy as sa
from alembic import op

revision = "0035"
down_revision = "0034"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.add_column("orc_runs", sa.Column("shard", sa.Integer, nullable=True))
    op.create_table(
        "orc_shard_config",
        sa.Column("id", sa.SmallInteger, primary_key=True, autoincrement=False),
        sa.Column("shards", sa.Integer, nullable=False),
        sa.Column("created_at", TS, nullable=False, server_default=sa.func.now()),
        sa.CheckConstraint("id = 1", name="ck_orc_shard_config_one_row"),
        sa.CheckConstraint("shards BETWEEN 1 AND 4096", name="ck_orc_shard_config_shards"),
    )
    op.create_table(
        "orc_shards",
        sa.Column("shard", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("owner", sa.String(255), nullable=True),
        sa.Column("epoch", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("lease_expires_at", TS, nullable=True),
        sa.Column("claimed_at", TS, nullable=True),
        sa.Column("renewed_at", TS, nullable=True),
        sa.Column("previous_owner", sa.String(255), nullable=True),
    )
    op.create_table(
        "orc_reconcilers",
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("seen_at", TS, nullable=False),
        sa.Column("expires_at", TS, nullable=False),
    )
    op.execute(SQL)


def downgrade() -> None:
    # orc_wake_due_v1 as 0015 installed it (no revision between changed it)
    text = importlib.import_module("orchestrator.store.migrations.versions.0015_waits_and_events").SQL
    found = re.search(r"CREATE OR REPLACE FUNCTION orc_wake_due_v1\(.*?\n\$\$;\n", text, re.S)
    assert found is not None, "0015 defines orc_wake_due_v1"
    op.execute(found.group(0))
    op.execute("DROP FUNCTION IF EXISTS orc_wake_due_v2(integer, text, integer, integer[])")
    op.drop_table("orc_reconcilers")
    op.drop_table("orc_shards")
    op.drop_table("orc_shard_config")
    op.drop_column("orc_runs", "shard")


#: orc_wake_due_v2 of store/sql/wait.sql and the orc_wake_due_v1 shim of store/sql/legacy.sql as
#: this revision installs them (frozen: a later change is a later migration)
SQL = r"""
-- orc_wake_due_v2: the reconciler's pass over waits whose instant or deadline has passed (the
-- partial index ix_orc_tasks_wake_due, oldest first, at most p_limit, rows other passes hold
-- skipped): a wait whose instant came first is due (a sleep ends, a deferred body or a sensor is
-- called again), else it timed out. Returns {"woken", "readied"}. With p_mine (the sharded
-- reconciler): only the waits of runs whose shard, the first 32 bits of md5(run id) mod
-- p_shards (store/shards.py's shard_of), is one of p_mine; NULL: every wait.

CREATE OR REPLACE FUNCTION orc_wake_due_v2(p_limit integer, p_actor text, p_shards integer, p_mine integer[])
 RETURNS json
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    w record;
    until timestamptz;
    deadline timestamptz;
    how text;
    woken int := 0;
    readied int := 0;
    n int;
BEGIN
    FOR w IN SELECT t.run_id, t.key, t.attempt, t.waiting FROM orc_tasks t
             WHERE t.state = 'WAITING' AND t.wake_at IS NOT NULL AND t.wake_at <= now()
               AND (p_mine IS NULL
                    OR mod(('x' || substr(md5(t.run_id), 1, 8))::bit(32)::bigint, p_shards)::int = ANY (p_mine))
             ORDER BY t.wake_at LIMIT p_limit FOR UPDATE SKIP LOCKED LOOP
        until := (w.waiting->>'until')::timestamptz;
        deadline := (w.waiting->>'deadline')::timestamptz;
        how := CASE WHEN until IS NOT NULL AND until <= now() AND (deadline IS NULL OR until <= deadline)
                    THEN 'due' ELSE 'timeout' END;
        n := orc_wake_v1(w.run_id, w.key, w.attempt, how, NULL, p_actor, NULL,
                         CASE how WHEN 'due' THEN 'its time came (' || until || ')'
                                  ELSE 'its deadline passed (' || deadline || ')' END);
        IF n >= 0 THEN
            woken := woken + 1;
            readied := readied + n;
        END IF;
    END LOOP;
    RETURN json_build_object('woken', woken, 'readied', readied);
END
$$;

CREATE OR REPLACE FUNCTION orc_wake_due_v1(p_limit integer, p_actor text)
 RETURNS json
 LANGUAGE sql
AS $$
SELECT orc_wake_due_v2(p_limit, p_actor, NULL, NULL)
$$;
"""
